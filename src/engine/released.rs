//! Parents a rule no longer tears down: when a rule whose parents carry Rulebook's
//! finalizer is removed from the rule set, nothing would ever take the finalizer off and
//! those parents could never be deleted (nor their namespaces). Removing the rule
//! therefore releases its finalizers at once, running no deletion step: the garbage
//! collector removes the children as it does for rules without `spec.deletion`. The
//! same release serves `rulebook release --rule NAME`, for an uninstall.

use std::sync::Arc;

use crate::write::recorder::Recorder;
use kube::api::{ApiResource, ListParams, ObjectMeta};
use kube::core::discovery::Scope as KubeScope;
use kube::runtime::events::{Event, EventType};
use kube::{Client, Resource};
use tracing::{info, warn};

use super::dropped::kind_api;
use super::runner::{SetupError, discover};
use crate::meta::FINALIZER;
use crate::metrics::Metrics;
use crate::reconcile::ReconcileError;
use crate::reconcile::WriteGate;
use crate::reconcile::teardown::finalizer_patch;
use crate::reconcile::teardown::places;
use crate::reconcile::teardown::recorded::{Kind, OrphansOf, orphan_children, recorded_in};
use crate::render::CompiledRule;
use crate::write::writer::{Patched, WriteError, Writer};

/// Patches of a parent that changed since it was read, before it counts as kept.
const RELEASE_RETRIES: usize = 5;

/// What a release did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Parents examined.
    pub parents: usize,
    /// Parents whose finalizer was removed.
    pub released: Vec<String>,
    /// Their children with `deletionPolicy: Orphan`, let go of first (`Kind ns/name`).
    pub orphaned: Vec<String>,
    /// Parents that keep the finalizer (`ns/name: why`): their `Orphan` children could
    /// not all be let go of, or the patch was refused or kept finding them changed.
    pub kept: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("listing {kind}: {source}")]
    List {
        kind: String,
        #[source]
        source: kube::Error,
    },
    #[error("writes are paused (not the leader)")]
    NotLeader,
}

/// Which parents a release is for: a kind, where, and (as the operator's `--selector`)
/// which of them.
#[derive(Clone, Debug)]
pub struct ParentsOf {
    pub api_version: String,
    pub kind: String,
    pub namespace: Option<String>,
    pub selector: Option<String>,
    /// Sharded: only the parents in these namespaces (by hash) are this replica's.
    pub share: Option<crate::shard::Ranges>,
    /// The kinds (`(apiVersion, kind)`) of the rule's children with `deletionPolicy:
    /// Orphan`, when the rule is known; with those recorded on each parent
    /// (`rulebook.dev/orphan-kinds`), where its `Orphan` children are looked for.
    pub orphan_kinds: Vec<Kind>,
}

/// The kinds (`(apiVersion, kind)`) of `rule`'s children with `deletionPolicy: Orphan`.
pub fn orphan_kinds(rule: &CompiledRule) -> Vec<Kind> {
    let mut kinds: Vec<Kind> = rule
        .children()
        .iter()
        .filter(|c| c.deletion_policy == crate::rules::DeletionPolicy::Orphan)
        .map(|c| (c.api_version.value.clone(), c.kind.value.clone()))
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

/// Removes Rulebook's finalizer from every parent `of` selects, each patch conditional on
/// the parent as listed (one changed meanwhile is read again). With a `recorder`, each
/// released parent gets a Warning event saying `why`. A parent's children with
/// `deletionPolicy: Orphan` are let go of first — without the finalizer the garbage
/// collector would delete them with it — and a parent whose could not all be keeps its
/// finalizer (listed in [`Released::kept`]): the others are released all the same.
pub async fn release_parents(
    client: &Client,
    of: &ParentsOf,
    writer: &Writer,
    recorder: Option<&Recorder>,
    why: &str,
) -> Result<Released, ReleaseError> {
    let (ar, caps) = discover(client, "parent", &of.api_version, &of.kind).await?;
    let namespaced = caps.scope == KubeScope::Namespaced;
    let list_api = kind_api(client, &ar, namespaced, of.namespace.as_deref());
    let release = Release {
        client,
        of,
        writer,
        recorder,
        why,
        ar,
        namespaced,
    };
    let mut out = Released::default();
    let mut params = ListParams::default().limit(100);
    if let Some(selector) = &of.selector {
        params = params.labels(selector);
    }
    loop {
        let page = list_api
            .list_metadata(&params)
            .await
            .map_err(|source| ReleaseError::List {
                kind: release.ar.kind.clone(),
                source,
            })?;
        let mine = |ns: Option<&str>| {
            of.share
                .as_ref()
                .is_none_or(|r| ns.is_none_or(|ns| r.holds_namespace(ns)))
        };
        for item in page
            .items
            .iter()
            .filter(|i| mine(i.metadata.namespace.as_deref()))
        {
            out.parents += 1;
            release.parent(item.metadata.clone(), &mut out).await?;
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    Ok(out)
}

/// One [`release_parents`] under way: what the release of each of its parents reads.
struct Release<'a> {
    client: &'a Client,
    of: &'a ParentsOf,
    writer: &'a Writer,
    recorder: Option<&'a Recorder>,
    why: &'a str,
    /// The parents' kind, and whether it is namespaced.
    ar: ApiResource,
    namespaced: bool,
}

impl Release<'_> {
    /// Releases the parent `meta` (as listed), noting in `out` what it did: its `Orphan`
    /// children first, then its finalizer.
    async fn parent(&self, meta: ObjectMeta, out: &mut Released) -> Result<(), ReleaseError> {
        if meta.finalizers.iter().flatten().any(|f| f == FINALIZER) {
            match orphans_first(
                self.client,
                self.of,
                &self.ar,
                self.namespaced,
                &meta,
                self.writer,
            )
            .await
            {
                Ok(done) => out.orphaned.extend(done),
                Err(ReconcileError::NotLeader) => return Err(ReleaseError::NotLeader),
                Err(e) => {
                    out.kept.push(format!("{}: {e}", parent_name(&meta)));
                    return Ok(());
                }
            }
        }
        self.finalizer(meta, out).await
    }

    /// Takes Rulebook's finalizer off the parent `meta`, reading it again (up to
    /// [`RELEASE_RETRIES`] times) while it changed since it was read.
    async fn finalizer(
        &self,
        mut meta: ObjectMeta,
        out: &mut Released,
    ) -> Result<(), ReleaseError> {
        for attempt in 0..=RELEASE_RETRIES {
            if !meta.finalizers.iter().flatten().any(|f| f == FINALIZER) {
                break;
            }
            if attempt == RELEASE_RETRIES {
                // Kept changing: counted, so that the release is tried again.
                out.kept
                    .push(format!("{}: it kept changing", parent_name(&meta)));
                break;
            }
            let name = meta.name.clone().unwrap_or_default();
            let api = kind_api(
                self.client,
                &self.ar,
                self.namespaced,
                meta.namespace.as_deref(),
            );
            let obj = kube::api::DynamicObject {
                types: None,
                metadata: meta.clone(),
                data: serde_json::Value::Null,
            };
            match self
                .writer
                .merge_patch(&api, &name, &finalizer_patch(&obj, false))
                .await
            {
                Ok(Patched::Patched) => {
                    let what = parent_name(&meta);
                    info!(kind = %self.of.kind, parent = %what, "finalizer released");
                    self.released_event(&obj);
                    out.released.push(what);
                    break;
                }
                Ok(Patched::Stale) => match api.get_metadata_opt(&name).await {
                    Ok(Some(fresh)) if fresh.metadata.uid == meta.uid => meta = fresh.metadata,
                    _ => break, // gone, or replaced by another object
                },
                Err(WriteError::NotLeader) => return Err(ReleaseError::NotLeader),
                // One parent refused (say, by a webhook of its namespace) does not hold
                // the others' release.
                Err(WriteError::Api(source)) => {
                    out.kept.push(format!("{}: {source}", parent_name(&meta)));
                    break;
                }
            }
        }
        Ok(())
    }

    /// The Warning event on a released parent, with a recorder.
    fn released_event(&self, obj: &kube::api::DynamicObject) {
        let Some(recorder) = self.recorder else {
            return;
        };
        let why = self.why;
        let ev = Event {
            type_: EventType::Warning,
            reason: "FinalizerReleased".into(),
            note: Some(format!(
                "{FINALIZER} removed: {why}; no deletion step runs, the garbage collector removes the children (those with deletionPolicy Orphan were let go of first)"
            )),
            action: "Release".into(),
            secondary: None,
        };
        self.writer
            .publish(recorder, ev, obj.object_ref(&self.ar), || ());
    }
}

/// A parent as `ns/name` (`name` when cluster-scoped).
fn parent_name(m: &ObjectMeta) -> String {
    let name = m.name.as_deref().unwrap_or_default();
    match &m.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// Lets go of the `Orphan` children of the parent `meta`, of the rule's kinds and those
/// recorded on it.
async fn orphans_first(
    client: &Client,
    of: &ParentsOf,
    ar: &kube::api::ApiResource,
    namespaced: bool,
    meta: &ObjectMeta,
    writer: &Writer,
) -> Result<Vec<String>, ReconcileError> {
    let mut kinds = of.orphan_kinds.clone();
    kinds.extend(recorded_in(
        meta.annotations.as_ref().unwrap_or(&Default::default()),
    ));
    kinds.sort();
    kinds.dedup();
    let (Some(uid), Some(name)) = (meta.uid.as_deref(), meta.name.as_deref()) else {
        return Ok(Vec::new());
    };
    // A cluster-scoped parent's children: where it recorded placing them. A namespaced
    // parent's: in its namespace only (its record is its author's to write, and the
    // removed rule's list, which would bound it, is not at hand here): `Orphan` children
    // it placed elsewhere (`targetNamespaces`) are left as they are, still labelled.
    let recorded = (!namespaced)
        .then(|| places::recorded_in(meta.annotations.as_ref().unwrap_or(&Default::default())))
        .flatten();
    let parent = OrphansOf {
        client,
        writer,
        group: &ar.group,
        kind: &ar.kind,
        namespaced,
        name,
        namespace: meta.namespace.as_deref(),
        namespaces: recorded.as_ref(),
        uid,
        skip_rule: None,
        rule_policy: None,
    };
    let mut done = Vec::new();
    for kind in &kinds {
        orphan_children(&parent, kind, &mut done).await?;
    }
    Ok(done.into_iter().map(|o| o.what).collect())
}

/// [`release_parents`] for the parents of a rule the engine removed, in the background:
/// retried with backoff on errors for as long as the task lives (the engine aborts it
/// when a rule for the same parent kind starts).
pub(super) async fn release_removed_rule(
    client: Client,
    rule: Arc<CompiledRule>,
    of: ParentsOf,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
    recorder: Recorder,
) {
    let writer = Writer::new(gate, metrics, &rule.name);
    let why = format!("rule '{}' was removed from the rule set", rule.name);
    let mut delay = std::time::Duration::from_secs(1);
    loop {
        match release_parents(&client, &of, &writer, Some(&recorder), &why).await {
            Ok(r) if r.kept.is_empty() => {
                info!(rule = %rule.name, parents = r.parents, released = r.released.len(), "removed rule's finalizers released");
                return;
            }
            Ok(r) => {
                warn!(rule = %rule.name, kept = r.kept.len(), first = %r.kept[0], retry_in = ?delay, "parents of a removed rule keep the finalizer: their Orphan children are not all let go of yet")
            }
            Err(ReleaseError::NotLeader) => return, // the next leader's rule set decides
            // A rule without deletion steps or `Orphan` children only releases what an
            // earlier version left: when its parents cannot even be listed (the RBAC
            // went with the rule, the kind is gone), it says so once and stops.
            Err(e @ (ReleaseError::Setup(_) | ReleaseError::List { .. }))
                if !rule.rule.spec.needs_finalizer() =>
            {
                info!(rule = %rule.name, error = %e, "not releasing the parents of a removed rule without deletion steps: cannot list them (if an earlier version left finalizers on them, use rulebook release)");
                return;
            }
            Err(e) => {
                warn!(rule = %rule.name, error = %e, retry_in = ?delay, "cannot release the removed rule's finalizers yet")
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(std::time::Duration::from_secs(60));
    }
}
