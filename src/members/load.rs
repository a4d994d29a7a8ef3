//! The coordinator's view of the load: how many parents each namespace holds, by
//! namespace hash. Counted with paged metadata-only lists (no cache is kept: only the
//! counts), a few times per rebalance period.

use std::collections::BTreeMap;
use std::time::Instant;

use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use tracing::debug;

use crate::shard::fnv1a;

/// The rule set a member runs: its fingerprint, and the parent kinds of its rules.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParentKinds {
    pub fingerprint: String,
    /// (apiVersion, kind) of each rule's parents.
    pub parents: Vec<(String, String)>,
}

#[derive(Default)]
pub(super) struct LoadCounter {
    counted: Option<(Instant, Vec<(String, String)>)>,
    points: Vec<(u64, u64)>,
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
            let Ok((ar, namespaced)) =
                crate::engine::resolve_kind(client, "parent", api_version, kind).await
            else {
                continue;
            };
            if !namespaced {
                continue;
            }
            let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &ar);
            let mut params = ListParams::default().limit(500);
            loop {
                match api.list_metadata(&params).await {
                    Ok(page) => {
                        for o in &page.items {
                            *per_ns.entry(o.namespace().unwrap_or_default()).or_default() += 1;
                        }
                        match page.metadata.continue_.filter(|c| !c.is_empty()) {
                            Some(c) => params = params.continue_token(&c),
                            None => break,
                        }
                    }
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
