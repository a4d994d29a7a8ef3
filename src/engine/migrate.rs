//! Storage migration (issue 43): when a rule's CRD stores its objects in a new version,
//! every object still stored in an old one is rewritten once through the API (which
//! stores it in the storage version), then the old versions are dropped from the CRD's
//! `status.storedVersions`, so a later rule may stop serving them.
//!
//! Run by the writer that applies the CRD (`run --install-crds`, the leader), on the
//! engine's gated client, so a replica that loses the lease stops writing at once (and
//! the task is aborted with the engine's other work). Sharded replicas have no leader,
//! and a replica may write only its share of the namespaces while a migration needs them
//! all: there each CRD's migration has a Lease of its own that any replica may take, and
//! the holder migrates through a client gated by that Lease alone ([`LeasedRun`],
//! `operator/migrations.rs`: the lease code is of a layer above the engine's).
//!
//! Nothing is lost on a crash: a rewrite is a replace of the object as read, with its
//! `resourceVersion` (a conflict means somebody wrote it since, which stored it in the
//! storage version too), and `storedVersions` is trimmed only after a whole pass. A pass
//! is resumable: after each page the last key rewritten is recorded in the annotation
//! `rulebook.dev/storage-migration` of the CRD (`{"to", "after", "rewritten"}`); the API
//! server lists in key order, so the next leader lists again and skips the keys up to it
//! (every object created since is stored in the new version already). A list not in key
//! order is noticed, and the pass starts over without skipping.
//!
//! Progress is on `/status` (`rules.<name>.migration`: `crd`, `from`, `to`, `state`,
//! `rewritten`, `message`) and in the log.
//!
//! The rewrites are paced (`run --migration-rate`, objects per second, default 100): a
//! migration of a large kind is a stream of updates that each cost the API server a
//! conversion and an etcd write, and must not crowd out the reconciles and the tenants'
//! own writes. `tokio::time::interval` paces it (no rate-limiter crate needed for one
//! sequential writer).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::health::{EngineStatus, MigrationState, MigrationStatus};
use crate::render::{CompiledRule, RuleSet};
use crate::rules::crd::{crd_name, plural};

/// The CRD annotation recording how far a pass has come.
pub const MARKER: &str = "rulebook.dev/storage-migration";
/// The field manager of the marker and of `storedVersions`.
const MANAGER: &str = "rulebook-migration";
/// Objects per list page (and per marker write).
const PAGE: u32 = 100;
/// Rewrites of one object that meet a conflict before it counts as written by another.
const CONFLICT_RETRIES: usize = 3;

/// Why a pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("the API server listed {0} out of key order; starting over without resuming")]
    Unordered(String),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> MigrateError {
    let what = what.into();
    move |source| MigrateError::Api { what, source }
}

/// `rulebook.dev/storage-migration`: a pass to `to` has rewritten every object up to the
/// key `after` (`namespace/name`, or `name`), `rewritten` of them.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Marker {
    pub to: String,
    pub after: String,
    pub rewritten: u64,
}

/// One rule's kind, as the migration reaches it.
#[derive(Clone, Debug)]
pub struct Target {
    pub rule: String,
    pub crd: String,
    pub resource: ApiResource,
    /// Sharded: this replica's identity, shown on `/status` while it holds the Lease.
    pub holder: Option<String>,
    /// Rewrites per second at most (`None`: as fast as the API server answers).
    pub rate: Option<std::num::NonZeroU32>,
}

impl Target {
    /// A rule listing versions (the only CRDs whose storage version a rule changes).
    fn of(rule: &CompiledRule) -> Option<Target> {
        let crd = rule
            .rule
            .spec
            .crd
            .as_ref()
            .filter(|c| !c.versions.is_empty())?;
        let parent = &rule.rule.spec.parent;
        let (group, version) = parent.group_version();
        Some(Target {
            rule: rule.name.clone(),
            crd: crd_name(&rule.rule)?,
            resource: ApiResource {
                group: group.to_string(),
                version: version.to_string(),
                api_version: parent.api_version.value.clone(),
                kind: parent.kind.value.clone(),
                plural: plural(crd, &parent.kind),
            },
            holder: None,
            rate: None,
        })
    }
}

/// The migrations in flight, one per CRD.
#[derive(Default)]
pub struct Migrations {
    tasks: BTreeMap<String, Task>,
    /// Sharded: each migration runs under a Lease of its own.
    leased: Option<Arc<dyn LeasedRun>>,
    /// Rewrites per second at most, for every migration (`run --migration-rate`).
    rate: Option<std::num::NonZeroU32>,
}

/// One CRD's migration: the storage version it migrates to, and its task; a leased one
/// also has a stop signal (it gives its Lease up on the way out).
struct Task {
    version: String,
    handle: JoinHandle<()>,
    stop: Option<watch::Sender<bool>>,
}

impl Task {
    /// Stops the task: a leased one is asked to (it releases its Lease) and aborted if
    /// it has not stopped within 5 s; any other is aborted.
    fn retire(self) {
        match self.stop {
            Some(stop) => {
                let _ = stop.send(true);
                let mut handle = self.handle;
                tokio::spawn(async move {
                    if tokio::time::timeout(Duration::from_secs(5), &mut handle)
                        .await
                        .is_err()
                    {
                        handle.abort();
                    }
                });
            }
            None => self.handle.abort(),
        }
    }
}

impl Migrations {
    /// No migration running yet; each rewrites at most `rate` objects per second.
    pub fn new(rate: Option<std::num::NonZeroU32>) -> Self {
        Migrations {
            rate,
            ..Migrations::default()
        }
    }

    /// Sharded: migrations run under a Lease per CRD, whatever this replica's share.
    pub fn set_leased(&mut self, runner: Arc<dyn LeasedRun>) {
        self.leased = Some(runner);
    }

    /// Whether migrations run under Leases of their own (sharded).
    pub fn leased(&self) -> bool {
        self.leased.is_some()
    }

    /// Starts a migration for every CRD of `set` that `mine` accepts and that has none
    /// running for its storage version (each finds out itself whether there is anything
    /// to do); stops those of CRDs no longer in the set or whose storage version changed.
    pub fn ensure(
        &mut self,
        client: &Client,
        set: &RuleSet,
        mine: &dyn Fn(&str) -> bool,
        status: &Arc<EngineStatus>,
    ) {
        let targets: BTreeMap<String, Target> = set
            .rules
            .values()
            .filter_map(|r| Target::of(r))
            .filter(|t| mine(&t.crd))
            .map(|t| (t.crd.clone(), t))
            .collect();
        for (crd, task) in std::mem::take(&mut self.tasks) {
            let keep = !task.handle.is_finished()
                && targets
                    .get(&crd)
                    .is_some_and(|t| t.resource.version == task.version);
            if keep {
                self.tasks.insert(crd, task);
            } else {
                task.retire();
            }
        }
        for (crd, mut t) in targets {
            if self.tasks.contains_key(&crd) {
                continue;
            }
            t.rate = self.rate;
            let version = t.resource.version.clone();
            let task = match &self.leased {
                Some(leased) => {
                    let (stop, stopped) = watch::channel(false);
                    let run = leased.run(t, status.clone(), stopped);
                    Task {
                        version,
                        handle: tokio::spawn(run),
                        stop: Some(stop),
                    }
                }
                None => Task {
                    version,
                    handle: tokio::spawn(run(client.clone(), t, status.clone())),
                    stop: None,
                },
            };
            self.tasks.insert(crd, task);
        }
    }

    /// Stops the migrations that run on the engine's client (this replica no longer
    /// writes); the next writer resumes. Those under a Lease of their own go on: their
    /// Lease, not the share, says whether this replica may write.
    pub fn stop(&mut self) {
        for (crd, task) in std::mem::take(&mut self.tasks) {
            if task.stop.is_some() {
                self.tasks.insert(crd, task);
            } else {
                task.handle.abort();
            }
        }
    }

    /// Stops every migration, giving up the Leases held (the process stops).
    pub async fn stop_all(&mut self) {
        let tasks = std::mem::take(&mut self.tasks);
        for task in tasks.values() {
            if let Some(stop) = &task.stop {
                let _ = stop.send(true);
            }
        }
        for (_, mut task) in tasks {
            if tokio::time::timeout(Duration::from_secs(5), &mut task.handle)
                .await
                .is_err()
            {
                task.handle.abort();
            }
        }
    }
}

/// How a sharded replica runs one CRD's migration under a Lease of its own: contends
/// for it, runs [`run`] through a client only that Lease opens while it holds it, shows
/// the holder and its progress on `/status` while it does not, and gives the Lease up
/// when done or when `stop` turns true.
pub trait LeasedRun: Send + Sync {
    fn run(
        &self,
        target: Target,
        status: Arc<EngineStatus>,
        stop: watch::Receiver<bool>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
}

/// Passes until one completes (or there is nothing to do), waiting longer after each
/// failure (2 s doubling, at most a minute).
pub async fn run(client: Client, target: Target, status: Arc<EngineStatus>) {
    let mut wait = Duration::from_secs(2);
    loop {
        match pass(&client, &target, &status).await {
            Ok(()) => return,
            Err(e) => {
                warn!(rule = %target.rule, crd = %target.crd, error = %e, "storage migration: pass failed; retrying in {}s", wait.as_secs());
                status.update_migration(&target.rule, |m| {
                    m.state = MigrationState::Failed;
                    m.message = Some(e.to_string());
                });
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(60));
            }
        }
    }
}

/// What the live CRD says: its storage version, the versions objects may be stored
/// in, and the marker.
pub struct Live {
    pub storage: String,
    pub stored: Vec<String>,
    pub marker: Option<Marker>,
    pub resource_version: Option<String>,
}

pub async fn live(crds: &Api<CustomResourceDefinition>, name: &str) -> Result<Live, MigrateError> {
    let crd = crds
        .get(name)
        .await
        .map_err(api_err(format!("CRD {name}")))?;
    let storage = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.clone())
        .unwrap_or_default();
    let stored = crd
        .status
        .as_ref()
        .and_then(|s| s.stored_versions.clone())
        .unwrap_or_default();
    let marker = crd
        .annotations()
        .get(MARKER)
        .and_then(|m| serde_json::from_str(m).ok());
    Ok(Live {
        storage,
        stored,
        marker,
        resource_version: crd.resource_version(),
    })
}

/// One pass: nothing when every stored version is the storage version; else every
/// object rewritten (after the marker's key, when it is for this storage version), then
/// `storedVersions` trimmed and the marker removed.
async fn pass(client: &Client, t: &Target, status: &EngineStatus) -> Result<(), MigrateError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let before = live(&crds, &t.crd).await?;
    // The CRD does not store in the rule's version (yet): its install failed or waits.
    if before.storage != t.resource.version {
        return Ok(());
    }
    if before.stored.iter().all(|v| *v == before.storage) {
        if before.marker.is_some() {
            set_marker(&crds, &t.crd, None).await?;
        }
        return Ok(());
    }
    let from: Vec<String> = before
        .stored
        .iter()
        .filter(|v| **v != before.storage)
        .cloned()
        .collect();
    let resume = before.marker.filter(|m| m.to == before.storage);
    info!(rule = %t.rule, crd = %t.crd, ?from, to = %before.storage, resume_after = ?resume.as_ref().map(|m| &m.after), "storage migration: rewriting every stored object");
    status.set_migration(
        &t.rule,
        Some(MigrationStatus {
            crd: t.crd.clone(),
            from: from.clone(),
            to: before.storage.clone(),
            state: MigrationState::Running,
            rewritten: resume.as_ref().map_or(0, |m| m.rewritten),
            message: None,
            holder: t.holder.clone(),
        }),
    );
    let rewritten = rewrite_all(client, &crds, t, resume, status).await?;
    // Trim storedVersions, if the CRD still stores in this version (a rule edit may
    // have changed it meanwhile: then the next pass starts over for the new one).
    let after = live(&crds, &t.crd).await?;
    if after.storage != before.storage {
        return Ok(());
    }
    let patch = json!({
        "metadata": {"resourceVersion": after.resource_version},
        "status": {"storedVersions": [after.storage]},
    });
    crds.patch_status(&t.crd, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api_err(format!("CRD {}: status.storedVersions", t.crd)))?;
    set_marker(&crds, &t.crd, None).await?;
    info!(rule = %t.rule, crd = %t.crd, ?from, to = %after.storage, rewritten, "storage migration: done; status.storedVersions is [{}]", after.storage);
    status.update_migration(&t.rule, |m| {
        m.state = MigrationState::Done;
        m.rewritten = rewritten;
        m.message = None;
    });
    Ok(())
}

/// Lists the kind page by page, rewriting each object not covered by `resume`, and
/// records the marker after each page. Returns how many objects the pass (with the one
/// it resumes) rewrote.
async fn rewrite_all(
    client: &Client,
    crds: &Api<CustomResourceDefinition>,
    t: &Target,
    resume: Option<Marker>,
    status: &EngineStatus,
) -> Result<u64, MigrateError> {
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &t.resource);
    let (mut rewritten, skip_to) = resume.map_or((0, None), |m| (m.rewritten, Some(m.after)));
    let mut last: Option<String> = None;
    let mut skipped = false;
    let mut token: Option<String> = None;
    let mut pace = t.rate.map(|r| {
        let mut i = tokio::time::interval(Duration::from_secs(1) / r.get());
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    loop {
        let mut lp = ListParams::default().limit(PAGE);
        if let Some(c) = &token {
            lp = lp.continue_token(c);
        }
        let page = all
            .list(&lp)
            .await
            .map_err(api_err(format!("listing {}", t.resource.plural)))?;
        for o in page.items {
            let key = key_of(&o);
            if last.as_ref().is_some_and(|l| *l >= key) {
                if skipped {
                    set_marker(crds, &t.crd, None).await?;
                }
                return Err(MigrateError::Unordered(t.resource.plural.clone()));
            }
            last = Some(key.clone());
            if skip_to.as_ref().is_some_and(|s| key <= *s) {
                skipped = true;
                continue;
            }
            if let Some(p) = pace.as_mut() {
                p.tick().await;
            }
            rewrite(client, &t.resource, o).await?;
            rewritten += 1;
        }
        if let Some(after) = &last {
            let marker = Marker {
                to: t.resource.version.clone(),
                after: after.clone(),
                rewritten,
            };
            set_marker(crds, &t.crd, Some(&marker)).await?;
            status.update_migration(&t.rule, |m| m.rewritten = rewritten);
        }
        token = page.metadata.continue_.filter(|c| !c.is_empty());
        if token.is_none() {
            return Ok(rewritten);
        }
    }
}

/// `namespace/name`, or `name`: the order the API server lists in.
fn key_of(o: &DynamicObject) -> String {
    match o.namespace() {
        Some(ns) => format!("{ns}/{}", o.name_any()),
        None => o.name_any(),
    }
}

/// Replaces `o` with itself, which stores it in the storage version. A conflict reads
/// it again and retries; after [`CONFLICT_RETRIES`], or when it is gone, it counts as
/// written (somebody else's write stored it in the storage version).
async fn rewrite(
    client: &Client,
    ar: &ApiResource,
    mut o: DynamicObject,
) -> Result<(), MigrateError> {
    let name = o.name_any();
    let api: Api<DynamicObject> = match o.namespace() {
        Some(ns) => Api::namespaced_with(client.clone(), &ns, ar),
        None => Api::all_with(client.clone(), ar),
    };
    for _ in 0..CONFLICT_RETRIES {
        match api.replace(&name, &PostParams::default(), &o).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(&name).await {
                Ok(Some(fresh)) => o = fresh,
                Ok(None) => return Ok(()),
                Err(e) => return Err(api_err(format!("{} {}", ar.kind, key_of(&o)))(e)),
            },
            Err(e) => return Err(api_err(format!("rewriting {} {}", ar.kind, key_of(&o)))(e)),
        }
    }
    Ok(())
}

/// Writes (or, with `None`, removes) the marker annotation of CRD `name`.
async fn set_marker(
    crds: &Api<CustomResourceDefinition>,
    name: &str,
    marker: Option<&Marker>,
) -> Result<(), MigrateError> {
    let value = marker.map_or(Json::Null, |m| {
        Json::String(serde_json::to_string(m).unwrap_or_default())
    });
    let patch = json!({"metadata": {"annotations": {MARKER: value}}});
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    crds.patch(name, &params, &Patch::Merge(&patch))
        .await
        .map_err(api_err(format!("CRD {name}: the {MARKER} annotation")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_reads_back() {
        let m = Marker {
            to: "v1".into(),
            after: "ns-a/web-7".into(),
            rewritten: 107,
        };
        let text = serde_json::to_string(&m).unwrap();
        assert_eq!(text, r#"{"to":"v1","after":"ns-a/web-7","rewritten":107}"#);
        assert_eq!(serde_json::from_str::<Marker>(&text).unwrap(), m);
    }

    #[test]
    fn keys_order_as_the_api_server_lists() {
        let o = |ns: Option<&str>, name: &str| {
            let mut d = DynamicObject::new(
                name,
                &ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            );
            d.metadata.namespace = ns.map(str::to_string);
            d
        };
        assert_eq!(key_of(&o(Some("a"), "x")), "a/x");
        assert_eq!(key_of(&o(None, "x")), "x");
        assert!(key_of(&o(Some("a"), "z")) < key_of(&o(Some("b"), "a")));
    }
}
