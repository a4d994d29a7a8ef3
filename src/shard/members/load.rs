//! The coordinator's view of the load: how many parents each namespace holds, by
//! namespace hash. Counted with paged metadata-only lists (no cache is kept: only the
//! counts), a few times per rebalance period. A page is decoded into its items'
//! namespaces alone (everything else is skipped unparsed): the coordinator is the one
//! member that reads every parent, and typed metadata of a whole page (managedFields
//! included) made it the largest replica.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use kube::api::{ApiResource, ListParams};
use kube::{Client, Resource};
use serde::Deserialize;
use tracing::debug;

use crate::shard::fnv1a;

/// The rule set a member runs: its fingerprint, and the parent kinds of its rules.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParentKinds {
    pub fingerprint: String,
    /// (apiVersion, kind) of each rule's parents.
    pub parents: Vec<(String, String)>,
}

/// How the load count finds a parent kind (`apiVersion`, `kind`): its API resource and
/// whether it is namespaced, or `None` while discovery cannot tell (its CRD not installed
/// yet: the next count looks again). The engine's `resolve_kind`, handed in by the
/// operator ([`super::Membership::counting_parents_with`]): the membership sits below the
/// engine.
pub type ResolveKind = Arc<
    dyn Fn(Client, String, String) -> BoxFuture<'static, Option<(ApiResource, bool)>> + Send + Sync,
>;

/// Parents per page when counting.
const COUNT_PAGE: u32 = 100;

#[derive(Default)]
pub(super) struct LoadCounter {
    counted: Option<(Instant, Vec<(String, String)>)>,
    points: Vec<(u64, u64)>,
    /// Without one (a test's member) no parent kind is found, so none is counted.
    pub(super) resolve: Option<ResolveKind>,
}

impl LoadCounter {
    /// The last counts (when a recount took too long).
    pub(super) fn last(&self) -> Vec<(u64, u64)> {
        self.points.clone()
    }

    /// (namespace hash, parents) for every namespace holding parents of `kinds`'s
    /// namespaced parent kinds; recounted when stale or when the kinds changed.
    pub(super) async fn count(
        &mut self,
        client: &Client,
        kinds: &ParentKinds,
        every: std::time::Duration,
    ) -> Vec<(u64, u64)> {
        let fresh = self
            .counted
            .as_ref()
            .is_some_and(|(at, k)| at.elapsed() < every && *k == kinds.parents);
        if fresh {
            return self.points.clone();
        }
        let mut per_ns: BTreeMap<String, u64> = BTreeMap::new();
        for (api_version, kind) in &kinds.parents {
            let found = match &self.resolve {
                Some(resolve) => resolve(client.clone(), api_version.clone(), kind.clone()).await,
                None => None,
            };
            let Some((ar, namespaced)) = found else {
                continue;
            };
            if !namespaced {
                continue;
            }
            let url = kube::api::DynamicObject::url_path(&ar, None);
            // Small pages: a page's text is held whole while it is read, and the allocator
            // keeps the pages it freed for a while, so 500 parents' metadata a page kept the
            // coordinator 0.8-3.1 MiB above the other members (docs/benchmarks.md).
            let mut params = ListParams::default().limit(COUNT_PAGE);
            loop {
                match count_page(client, &url, &params, &mut per_ns).await {
                    Ok(Some(token)) => params = params.continue_token(&token),
                    Ok(None) => break,
                    Err(e) => {
                        debug!(error = %e, %kind, "cannot count parents");
                        break;
                    }
                }
            }
        }
        self.points = per_ns.iter().map(|(ns, n)| (fnv1a(ns), *n)).collect();
        self.counted = Some((Instant::now(), kinds.parents.clone()));
        self.points.clone()
    }
}

/// One page of a metadata-only list, as far as counting needs it.
#[derive(Deserialize)]
struct Page {
    #[serde(default)]
    metadata: PageMeta,
    /// Required (a body without it is not a list), `null` for an empty one.
    #[serde(deserialize_with = "null_as_empty")]
    items: Vec<Item>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Item>, D::Error> {
    Ok(Option::<Vec<Item>>::deserialize(d)?.unwrap_or_default())
}

#[derive(Default, Deserialize)]
struct PageMeta {
    #[serde(default, rename = "continue")]
    continue_: Option<String>,
}

#[derive(Deserialize)]
struct Item {
    #[serde(default)]
    metadata: ItemMeta,
}

#[derive(Default, Deserialize)]
struct ItemMeta {
    #[serde(default)]
    namespace: Option<String>,
}

/// Counts one page into `per_ns`; the continue token of the next page, if any.
async fn count_page(
    client: &Client,
    url: &str,
    params: &ListParams,
    per_ns: &mut BTreeMap<String, u64>,
) -> Result<Option<String>, kube::Error> {
    let request = kube::core::Request::new(url)
        .list_metadata(params)
        .map_err(kube::Error::BuildRequest)?;
    let page: Page = client.request(request).await?;
    for item in page.items {
        *per_ns
            .entry(item.metadata.namespace.unwrap_or_default())
            .or_default() += 1;
    }
    Ok(page.metadata.continue_.filter(|c| !c.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_needs_items_and_reads_null_as_none() {
        let empty: Page = serde_json::from_str(r#"{"metadata": {}, "items": null}"#).unwrap();
        assert!(empty.items.is_empty());
        let page: Page = serde_json::from_str(
            r#"{"metadata": {"continue": "t"}, "items": [{"metadata": {"namespace": "a", "name": "x"}}]}"#,
        )
        .unwrap();
        assert_eq!(page.items[0].metadata.namespace.as_deref(), Some("a"));
        assert_eq!(page.metadata.continue_.as_deref(), Some("t"));
        // A Status body is not a page.
        assert!(serde_json::from_str::<Page>(r#"{"kind": "Status", "code": 500}"#).is_err());
    }
}
