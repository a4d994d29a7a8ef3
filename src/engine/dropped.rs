//! Children of kinds a rule no longer has: the new controller does not watch them, so
//! its pruning cannot see them. Kinds are compared by API group and kind — a child that
//! moves to another version of its kind is the same object — and only objects that are
//! verifiably a parent's of this rule are let go of, through the gated writer: deleted
//! (UID and resourceVersion preconditions) or, when their child's `deletionPolicy` was
//! `Orphan`, orphaned.
//!
//! The clean-up runs in the background and can take a while (a page of 25 objects at a
//! time), so a later edit may come first. A later version that has the kind again must
//! not see its objects deleted under it: each reload stops the rule's clean-up in flight
//! — waiting for the write it is making, so none lands after — and hands what it had left
//! to the next clean-up, less the kinds the rule has again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectMeta};
use kube::core::discovery::Scope as KubeScope;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::runner::discover;
use crate::cache::wire::{orphan_owner, remote_owner};
use crate::meta::{labels, split_api_version};
use crate::metrics::{self, Metrics};
use crate::reconcile::WriteGate;
use crate::reconcile::memory::{BackoffPolicy, OrphansPending};
use crate::reconcile::orphan_patch;
use crate::render::{CompiledRule, RuleSet};
use crate::rules::DeletionPolicy;
use crate::shard::gate::ShardGate;
use crate::write::writer::{Deleted, Patched, WriteError, Writer};

/// Objects listed a page at a time: a tenant may put lookalikes of any size in its
/// namespace, and only their metadata is read.
const PAGE: u32 = 25;
/// Attempts at reading a kind (discovery, a page) before the clean-up of that kind gives
/// up with a warning; the waits between them double up to [`MAX_WAIT`].
const ATTEMPTS: u32 = 10;
const MAX_WAIT: Duration = Duration::from_secs(30);
/// How long a reload waits for the clean-up in flight to stop.
const STOP_WAIT: Duration = Duration::from_secs(30);
/// A delete answered "changed since read" is read again and retried this many times.
const CHANGED_RETRIES: u32 = 3;

/// `(group, kind)` of every child of `rule`.
fn group_kinds(rule: &CompiledRule) -> BTreeSet<(String, String)> {
    rule.children()
        .iter()
        .map(|c| group_kind(&c.api_version.value, &c.kind.value))
        .collect()
}

fn group_kind(api_version: &str, kind: &str) -> (String, String) {
    (
        split_api_version(api_version).0.to_string(),
        kind.to_string(),
    )
}

/// `(apiVersion, kind)` of children the old version of a rule had and the new one has not,
/// compared by API group and kind: a child that moves to another version of its kind
/// (`autoscaling/v2` → `autoscaling/v1`, a CRD's `v1alpha1` → `v1`) is the same object
/// served at another version, and the new controller watches and keeps it.
pub(super) fn dropped_kinds(old: &CompiledRule, new: &CompiledRule) -> Vec<(String, String)> {
    still_dropped(new, all_kinds(old))
}

/// `(apiVersion, kind)` of a child kind.
pub(super) type KindRef = (String, String);

/// What a removed rule with a selector leaves to clean up: `(apiVersion, kind)` of its
/// children whose kind no rule of `set` on the same parent kind has (pruned), and of those
/// it shares with one (left: such a rule may render the same objects — the rule renamed —
/// and takes them over; a hot reload never deletes a child the new set still renders).
pub(super) fn removed_kinds(old: &CompiledRule, set: &RuleSet) -> (Vec<KindRef>, Vec<KindRef>) {
    let parent = |r: &CompiledRule| {
        let p = &r.rule.spec.parent;
        group_kind(&p.api_version.value, &p.kind.value)
    };
    let mut kinds = all_kinds(old);
    let mut kept = Vec::new();
    for r in set.rules.values().filter(|r| parent(r) == parent(old)) {
        let still = still_dropped(r, kinds.clone());
        kept.extend(kinds.into_iter().filter(|k| !still.contains(k)));
        kinds = still;
    }
    kept.sort();
    (kinds, kept)
}

/// `(apiVersion, kind)` of every child of `rule`.
fn all_kinds(rule: &CompiledRule) -> Vec<(String, String)> {
    let mut kinds: Vec<(String, String)> = rule
        .children()
        .iter()
        .map(|c| (c.api_version.value.clone(), c.kind.value.clone()))
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

/// The kinds of `kinds` that `now` has no child of.
fn still_dropped(now: &CompiledRule, kinds: Vec<(String, String)>) -> Vec<(String, String)> {
    let kept = group_kinds(now);
    kinds
        .into_iter()
        .filter(|(v, k)| !kept.contains(&group_kind(v, k)))
        .collect()
}

/// Kinds an earlier version of a rule had, to clean up after: `old` says which objects
/// were its parents' children and what their policy was.
#[derive(Clone)]
pub(super) struct Dropped {
    pub old: Arc<CompiledRule>,
    pub kinds: Vec<(String, String)>,
}

/// What a clean-up needs besides its kinds.
pub(super) struct CleanupEnv {
    pub client: Client,
    pub namespace: Option<String>,
    pub metrics: Arc<Metrics>,
    pub gate: Arc<dyn WriteGate>,
    /// Sharded: the replica's gate and the ranges its rules run with.
    pub shard: Option<(Arc<ShardGate>, crate::shard::Ranges)>,
}

struct Cleanup {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    todo: Vec<Dropped>,
    /// Set until the task ends: the new version's parents keep their finalizer meanwhile.
    pending: Arc<OrphansPending>,
    /// Set when the task stopped because this process may no longer write (a lost lease,
    /// a share that moved): the rule's next start takes the clean-up up again.
    halted: Arc<std::sync::atomic::AtomicBool>,
    /// The share it runs over (sharded).
    share: Option<crate::shard::Ranges>,
}

/// Clears a clean-up's [`OrphansPending`] however its task ends (done, stopped, aborted).
struct ClearOnDrop(Arc<OrphansPending>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.clear();
    }
}

/// The clean-ups in flight, one per rule at most.
#[derive(Default)]
pub(super) struct Cleanups {
    by_rule: BTreeMap<String, Cleanup>,
}

impl Cleanups {
    /// Stops `rule`'s clean-up, waiting for the write it is making (so none lands after
    /// this returns), and returns what it had been given that `now` — the rule as it is
    /// now — still has no child of. Nothing when it had finished, or for a rule removed
    /// (`now` is `None`: a removed rule's children stay).
    pub async fn stop(&mut self, rule: &str, now: Option<&CompiledRule>) -> Vec<Dropped> {
        let Some(Cleanup {
            stop,
            mut task,
            todo,
            halted,
            ..
        }) = self.by_rule.remove(rule)
        else {
            return Vec::new();
        };
        if task.is_finished() && !halted.load(std::sync::atomic::Ordering::SeqCst) {
            return Vec::new();
        }
        let _ = stop.send(true);
        if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
            // A write already sent may still land; none is started after this.
            warn!(rule = %rule, "the clean-up of dropped child kinds did not stop in time: aborted");
            task.abort();
            let _ = task.await;
        }
        let Some(now) = now else {
            return Vec::new();
        };
        todo.into_iter()
            .filter_map(|d| {
                let kinds = still_dropped(now, d.kinds);
                (!kinds.is_empty()).then_some(Dropped { old: d.old, kinds })
            })
            .collect()
    }

    /// Starts cleaning up after `todo` for `rule` (after [`Cleanups::stop`], before the
    /// rule's new version starts).
    pub fn start(&mut self, rule: String, todo: Vec<Dropped>, env: CleanupEnv) {
        if todo.is_empty() {
            return;
        }
        // Any object of a dropped kind may be one to orphan (by the old rule, or by what
        // an even older version recorded on it).
        let pending = Arc::new(OrphansPending::new(true));
        let (stop, stopped) = watch::channel(false);
        let clear = ClearOnDrop(pending.clone());
        let work = todo.clone();
        let share = env.shard.as_ref().map(|(_, r)| r.clone());
        let cleaned = pending.clone();
        let halted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let halt = halted.clone();
        let task = tokio::spawn(async move {
            let _clear = clear;
            if prune_dropped_kinds(work, env, stopped, cleaned).await {
                halt.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        });
        self.by_rule.insert(
            rule,
            Cleanup {
                stop,
                task,
                todo,
                pending,
                halted,
                share,
            },
        );
    }

    /// Starts `rule`'s clean-up again with `env` as it is now, when it stopped because
    /// this process could no longer write, or is still running with what may be an old
    /// share (called as the rule starts: after a share moved, a lease was won again). It
    /// is stopped first, as for an edit. Kinds it had finished are looked at again, which
    /// finds nothing left.
    pub async fn resume(&mut self, rule: &CompiledRule, env: CleanupEnv) {
        let share = env.shard.as_ref().map(|(_, r)| r.clone());
        let again = self.by_rule.get(&rule.name).is_some_and(|c| {
            c.halted.load(std::sync::atomic::Ordering::SeqCst)
                || (!c.task.is_finished() && c.share != share)
        });
        if !again {
            return;
        }
        let todo = self.stop(&rule.name, Some(rule)).await;
        if !todo.is_empty() {
            info!(rule = %rule.name, "taking up the clean-up of dropped child kinds again");
            self.start(rule.name.clone(), todo, env);
        }
    }

    /// What the new version of `rule` is to know of its clean-up: set while it runs.
    pub fn orphans_pending(&self, rule: &str) -> Arc<OrphansPending> {
        self.by_rule
            .get(rule)
            .map(|c| c.pending.clone())
            .unwrap_or_default()
    }
}

/// Whether `m` is a child that a parent of `rule` created: its owner label is the UID of
/// its controller reference, and that controller is of the rule's parent kind; or it is
/// an `Orphan` child, or one placed in another namespace than its namespaced parent's,
/// which have no ownerReference ([`orphan_owner`], [`remote_owner`]: only ever let go of
/// here, never deleted). Labels alone are public: anyone may put them on objects of their
/// own.
fn child_of_rule(m: &ObjectMeta, rule: &CompiledRule) -> bool {
    let parent = &rule.rule.spec.parent;
    let parent_group = split_api_version(&parent.api_version.value).0;
    let owner = m.labels.as_ref().and_then(|l| l.get(labels::OWNER));
    m.owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && owner == Some(&r.uid)
            && r.kind == parent.kind.value
            && split_api_version(&r.api_version).0 == parent_group
    }) || orphan_owner(m).is_some()
        || remote_owner(m).is_some()
}

/// The policy of a child of `old` of `kind` (`(apiVersion, kind)`): its child's in `old`
/// (the child of its name, of that kind), else the one recorded on it.
fn policy(m: &ObjectMeta, old: &CompiledRule, kind: (&str, &str)) -> DeletionPolicy {
    let get = |map: &Option<BTreeMap<String, String>>, key: &str| {
        map.as_ref().and_then(|m| m.get(key)).cloned()
    };
    let child = get(&m.labels, labels::CHILD);
    let of_kind = group_kind(kind.0, kind.1);
    old.children()
        .iter()
        .find(|c| {
            Some(&c.name.value) == child.as_ref()
                && group_kind(&c.api_version.value, &c.kind.value) == of_kind
        })
        .map(|c| c.deletion_policy)
        .unwrap_or_else(|| {
            DeletionPolicy::recorded(get(&m.annotations, labels::DELETION_POLICY).as_deref())
        })
}

/// Why a clean-up stopped before the end.
enum Halt {
    /// A reload stopped it.
    Stopped,
    /// This process may not write.
    NotLeader,
}

/// Waits before attempt `attempt` (from 1), or says the reload stopped the clean-up.
async fn pause(attempt: u32, stopped: &mut watch::Receiver<bool>) -> Result<(), Halt> {
    let wait = BackoffPolicy {
        base: Duration::from_secs(1),
        max: MAX_WAIT,
    }
    .delay(attempt);
    tokio::select! {
        _ = tokio::time::sleep(wait) => Ok(()),
        _ = stopped.wait_for(|s| *s) => Err(Halt::Stopped),
    }
}

/// Lets go of the children of kinds a rule no longer has: the new controller does not
/// watch them, so its pruning cannot see them. Only objects [`child_of_rule`] accepts,
/// and only while this process may write and no reload has stopped it.
async fn prune_dropped_kinds(
    todo: Vec<Dropped>,
    env: CleanupEnv,
    mut stopped: watch::Receiver<bool>,
    pending: Arc<OrphansPending>,
) -> bool {
    for d in &todo {
        // Sharded, the rule's own gate, as its reconciles write: a rule with
        // cluster-scoped parents is its owner's alone, whatever namespace its children
        // are in; a namespaced one's children are the replica's whose share holds their
        // namespace.
        let (gate, share) = match &env.shard {
            None => (env.gate.clone(), None),
            Some((shard, ranges)) => {
                let p = &d.old.rule.spec.parent;
                let mut attempt = 0;
                let cluster = loop {
                    match discover(&env.client, "parent", &p.api_version.value, &p.kind.value).await
                    {
                        Ok((_, caps)) => break caps.scope == KubeScope::Cluster,
                        Err(e) if attempt + 1 >= ATTEMPTS => {
                            warn!(rule = %d.old.name, error = %e, "cannot find the parent kind of a rule that dropped a child kind: not cleaning up");
                            return false;
                        }
                        Err(_) => {
                            attempt += 1;
                            if pause(attempt, &mut stopped).await.is_err() {
                                return false;
                            }
                        }
                    }
                };
                (
                    shard.for_rule(&d.old.name, cluster),
                    (!cluster).then(|| ranges.clone()),
                )
            }
        };
        let writer = Writer::new(gate, env.metrics.clone(), &d.old.name);
        for (api_version, kind) in &d.kinds {
            match prune_kind(
                &env,
                d,
                &writer,
                share.as_ref(),
                api_version,
                kind,
                &mut stopped,
            )
            .await
            {
                // Every child of the kind in this replica's share let go of: parents may
                // take it off their record (`reconcile::teardown::recorded`).
                Ok(true) => pending.cleaned(group_kind(api_version, kind), share.clone()),
                Ok(false) => {}
                Err(Halt::Stopped) => return false,
                Err(Halt::NotLeader) => {
                    warn!(rule = %d.old.name, %kind, "not pruning children of a dropped kind now: this process may not write (taken up again when the rule starts again)");
                    return true;
                }
            }
        }
    }
    false
}

async fn prune_kind(
    env: &CleanupEnv,
    d: &Dropped,
    writer: &Writer,
    share: Option<&crate::shard::Ranges>,
    api_version: &str,
    kind: &str,
    stopped: &mut watch::Receiver<bool>,
) -> Result<bool, Halt> {
    let name = &d.old.name;
    let mut attempt = 0;
    let (ar, caps) = loop {
        match discover(&env.client, "dropped child kind", api_version, kind).await {
            Ok(found) => break found,
            Err(e) if attempt + 1 >= ATTEMPTS => {
                warn!(rule = %name, %kind, error = %e, "cannot prune children of a kind the rule dropped: giving up");
                return Ok(false);
            }
            Err(e) => {
                warn!(rule = %name, %kind, error = %e, "cannot find a kind the rule dropped; trying again");
                attempt += 1;
                pause(attempt, stopped).await?;
            }
        }
    };
    let namespaced = caps.scope == KubeScope::Namespaced;
    let api = kind_api(&env.client, &ar, namespaced, env.namespace.as_deref());
    let selector = labels::child_selector(name);
    let mut token: Option<String> = None;
    let mut complete = true;
    attempt = 0;
    loop {
        if *stopped.borrow() {
            return Err(Halt::Stopped);
        }
        if !writer.may_write() {
            return Err(Halt::NotLeader);
        }
        let mut params = ListParams::default().labels(&selector).limit(PAGE);
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let page = match api.list_metadata(&params).await {
            Ok(page) => {
                attempt = 0;
                page
            }
            Err(e) if attempt + 1 >= ATTEMPTS => {
                warn!(rule = %name, %kind, error = %e, "cannot list children of a kind the rule dropped: giving up");
                return Ok(false);
            }
            Err(e) => {
                // An expired continue token (410) starts the list again.
                if matches!(&e, kube::Error::Api(s) if s.code == 410) {
                    token = None;
                }
                warn!(rule = %name, %kind, error = %e, "cannot list children of a kind the rule dropped; trying again");
                attempt += 1;
                pause(attempt, stopped).await?;
                continue;
            }
        };
        // Sharded, a namespaced rule: only the children in this replica's namespaces.
        let mine = |m: &ObjectMeta| {
            share.is_none_or(|r| {
                m.namespace
                    .as_deref()
                    .is_none_or(|ns| r.holds_namespace(ns))
            })
        };
        for o in page.items {
            if !child_of_rule(&o.metadata, &d.old) || !mine(&o.metadata) {
                continue;
            }
            if *stopped.borrow() {
                return Err(Halt::Stopped);
            }
            let api = kind_api(
                &env.client,
                &ar,
                namespaced,
                o.metadata.namespace.as_deref(),
            );
            complete &= let_go(env, d, writer, &api, o.metadata, (api_version, kind)).await?;
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(complete);
        }
    }
}

/// Deletes or orphans one child of a dropped kind. One that changed since it was listed
/// is read again and let go of only while it is still a child of the rule.
async fn let_go(
    env: &CleanupEnv,
    d: &Dropped,
    writer: &Writer,
    api: &Api<DynamicObject>,
    mut m: ObjectMeta,
    (api_version, kind): (&str, &str),
) -> Result<bool, Halt> {
    let rule = &d.old.name;
    let child = m.name.clone().unwrap_or_default();
    for _ in 0..=CHANGED_RETRIES {
        // One without an ownerReference is let go of whatever the old rule said: nothing
        // but the labels anyone may write says it is a child.
        let orphan = policy(&m, &d.old, (api_version, kind)) == DeletionPolicy::Orphan
            || orphan_owner(&m).is_some()
            || remote_owner(&m).is_some();
        let done = if orphan {
            let owner = m
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::OWNER))
                .cloned()
                .unwrap_or_default();
            let obj = DynamicObject {
                types: None,
                metadata: m.clone(),
                data: serde_json::Value::Null,
            };
            writer
                .merge_patch(api, &child, &orphan_patch(&obj, &owner))
                .await
                .map(|p| match p {
                    Patched::Patched => Deleted::Deleted,
                    Patched::Stale => Deleted::Changed,
                })
        } else {
            writer
                .delete(api, &child, m.uid.clone(), m.resource_version.clone())
                .await
        };
        match done {
            Ok(Deleted::Deleted) => {
                if orphan {
                    info!(rule = %rule, %kind, %child, "orphaned: the rule no longer has this kind of child");
                } else {
                    env.metrics
                        .children_pruned
                        .get_or_create(&metrics::rule(rule))
                        .inc();
                    info!(rule = %rule, %kind, %child, "pruned: the rule no longer has this kind of child");
                }
                return Ok(true);
            }
            Ok(Deleted::Gone) => return Ok(true),
            Ok(Deleted::Changed) => match api.get_metadata_opt(&child).await {
                Ok(Some(fresh))
                    if fresh.metadata.uid == m.uid && child_of_rule(&fresh.metadata, &d.old) =>
                {
                    m = fresh.metadata;
                }
                // Gone, replaced, or no longer the rule's: not to be touched.
                Ok(_) => return Ok(true),
                Err(e) => {
                    warn!(rule = %rule, %kind, %child, error = %e, "cannot read a child of a dropped kind again");
                    return Ok(false);
                }
            },
            Err(WriteError::NotLeader) => return Err(Halt::NotLeader),
            Err(e) => {
                warn!(rule = %rule, %kind, %child, error = %e, "cannot prune");
                return Ok(false);
            }
        }
    }
    warn!(rule = %rule, %kind, %child, "not pruned: it kept changing while it was let go of");
    Ok(false)
}

/// The API of a kind: in `namespace` when the kind is namespaced and one is given.
pub fn kind_api(
    client: &Client,
    ar: &ApiResource,
    namespaced: bool,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match (namespace, namespaced) {
        (Some(ns), true) => Api::namespaced_with(client.clone(), ns, ar),
        _ => Api::all_with(client.clone(), ar),
    }
}

#[cfg(test)]
#[path = "dropped_tests.rs"]
mod tests;
