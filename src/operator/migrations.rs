//! `run --sharding namespace`: storage migrations (`engine/migrate.rs`) under a Lease of
//! their own. Sharded replicas have no leader, and each may write only the namespaces of
//! its share, while a migration rewrites the objects of every namespace. So each CRD's
//! migration has its own `coordination.k8s.io` Lease, `rulebook-migration-<CRD name>` in
//! the operator's Lease namespace, which any replica may take with the leader election's
//! code (`leader.rs`): one writer at a time, taken over a whole Lease duration after the
//! holder stopped renewing (or at once when it released it).
//!
//! The holder migrates through a client of its own, gated by that Lease alone: not by
//! the shard gate (which refuses writes outside the share), and closed by the Lease's
//! deadline two thirds into it, so a holder that stops renewing (cut off, stopped,
//! starved) stops writing before another may take over, and the rewrite task is aborted
//! when the election says the Lease is lost. A SIGKILLed holder loses nothing: the
//! migration's marker on the CRD lets the next holder resume.
//!
//! A replica contends only while the CRD has objects to migrate (a read of the CRD;
//! nothing is written at steady state), keeps contending across changes of its share,
//! and, while another holds the Lease, shows on `/status` who does and how far the
//! marker says it has come. Done, the holder gives the Lease up; a replica that takes it
//! after finds nothing to do and gives it up too.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::{Client, Config};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::engine::migrate::{self, LeasedRun, Live, Target};
use crate::engine::{EngineStatus, MigrationState, MigrationStatus};
use crate::leader::LeaderElection;
use crate::metrics::Metrics;
use crate::write::gate::LeaseGate;

/// What the migrations' Leases are made of (from the command line).
pub struct LeasedMigrations {
    inner: Arc<Inner>,
}

struct Inner {
    /// The client configuration the holder's gated client is built from.
    config: Config,
    metrics: Arc<Metrics>,
    /// Ungated, with a read timeout shorter than a renewal period: for the Lease and
    /// for reading the CRD.
    plain: Client,
    /// The Leases' namespace (`--lease-namespace`).
    namespace: String,
    identity: String,
    duration: Duration,
}

impl LeasedMigrations {
    pub fn new(
        config: &Config,
        metrics: Arc<Metrics>,
        namespace: &str,
        identity: &str,
        duration: Duration,
    ) -> Result<LeasedMigrations, kube::Error> {
        let mut lease_config = config.clone();
        lease_config.read_timeout = Some(duration.max(Duration::from_secs(3)) / 3);
        Ok(LeasedMigrations {
            inner: Arc::new(Inner {
                config: config.clone(),
                metrics,
                plain: Client::try_from(lease_config)?,
                namespace: namespace.to_string(),
                identity: identity.to_string(),
                duration,
            }),
        })
    }
}

impl LeasedRun for LeasedMigrations {
    fn run(
        &self,
        target: Target,
        status: Arc<EngineStatus>,
        stop: watch::Receiver<bool>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(run(self.inner.clone(), target, status, stop))
    }
}

/// The Lease of the migration of CRD `crd`: `rulebook-migration-<crd>`, shortened with a
/// hash of the whole name past the 253 characters an object name may have.
pub fn lease_name(crd: &str) -> String {
    const PREFIX: &str = "rulebook-migration-";
    const MAX: usize = 253;
    let full = format!("{PREFIX}{crd}");
    if full.len() <= MAX {
        return full;
    }
    let keep = crd.get(..MAX - PREFIX.len() - 17).unwrap_or("");
    format!(
        "{PREFIX}{}-{:016x}",
        keep.trim_end_matches(['.', '-']),
        crate::shard::fnv1a(crd)
    )
}

/// What the CRD says there is to do.
#[derive(Debug, PartialEq, Eq)]
enum Outlook {
    /// The CRD does not store in the rule's version yet (the replica that installs it
    /// has not applied it), or it cannot be read.
    NotYet,
    /// Objects may be stored in another version (or a marker is left): migrate.
    Work,
    /// Every object is stored in the storage version.
    Done,
}

fn outlook(live: &Live, t: &Target) -> Outlook {
    if live.storage != t.resource.version {
        Outlook::NotYet
    } else if live.stored.iter().all(|v| *v == live.storage) && live.marker.is_none() {
        Outlook::Done
    } else {
        Outlook::Work
    }
}

/// How [`contend`] ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The pass finished here, or the migration was seen done elsewhere.
    Finished,
    /// `stop` turned true.
    Stopped,
}

/// Waits for work (reading the CRD, 1 s doubling to 30 s), contends for the Lease
/// while there is some, until the CRD stores every object in the rule's version.
async fn run(s: Arc<Inner>, t: Target, status: Arc<EngineStatus>, mut stop: watch::Receiver<bool>) {
    let crds: Api<CustomResourceDefinition> = Api::all(s.plain.clone());
    let mut wait = Duration::from_secs(1);
    loop {
        let next = match migrate::live(&crds, &t.crd).await {
            Ok(live) => outlook(&live, &t),
            Err(e) => {
                debug!(crd = %t.crd, error = %e, "storage migration: cannot read the CRD");
                Outlook::NotYet
            }
        };
        match next {
            Outlook::Done => {
                status.update_migration(&t.rule, |m| {
                    m.state = MigrationState::Done;
                    m.message = None;
                });
                return;
            }
            Outlook::Work => {
                if contend(&s, &t, &status, &mut stop).await == Ended::Stopped {
                    return;
                }
                wait = Duration::from_secs(1);
            }
            Outlook::NotYet => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            () = stopped(&mut stop) => return,
        }
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Takes part in the Lease's election until the pass finishes here (or is seen done
/// elsewhere) or `stop`: migrates while holding it, shows the holder while not. Gives
/// the Lease up on the way out, after the rewrite task has ended.
async fn contend(
    s: &Inner,
    t: &Target,
    status: &Arc<EngineStatus>,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    let name = lease_name(&t.crd);
    let gate = Arc::new(LeaseGate::leased());
    let client =
        match super::client::gated_client(s.config.clone(), gate.clone(), s.metrics.clone()) {
            Ok(c) => c,
            Err(e) => {
                warn!(crd = %t.crd, error = %e, "storage migration: cannot build its client");
                return Ended::Finished;
            }
        };
    let election = LeaderElection::new(
        s.plain.clone(),
        gate,
        &s.namespace,
        &name,
        &s.identity,
        s.duration,
    );
    let (leading_tx, mut leading) = watch::channel(false);
    let (quit, quit_rx) = watch::channel(false);
    let election = tokio::spawn(election.run(leading_tx, quit_rx));
    let mut mine = t.clone();
    mine.holder = Some(s.identity.clone());
    let mut work: Option<JoinHandle<()>> = None;
    let mut look = tokio::time::interval(s.duration / 4);
    let ended = loop {
        tokio::select! {
            changed = leading.changed() => {
                if changed.is_err() {
                    break Ended::Finished;
                }
                let now = *leading.borrow_and_update();
                if now && work.is_none() {
                    info!(crd = %t.crd, lease = %name, "storage migration: holding its Lease; migrating every namespace");
                    work = Some(tokio::spawn(migrate::run(client.clone(), mine.clone(), status.clone())));
                } else if !now && let Some(w) = work.take() {
                    warn!(crd = %t.crd, lease = %name, "storage migration: lost its Lease; stopping (the next holder resumes)");
                    w.abort();
                }
            }
            _ = async { match work.as_mut() { Some(w) => { let _ = w.await; } None => std::future::pending().await } } => {
                break Ended::Finished;
            }
            _ = look.tick(), if work.is_none() => {
                if show_elsewhere(s, t, &name, status).await {
                    break Ended::Finished;
                }
            }
            () = stopped(stop) => break Ended::Stopped,
        }
    };
    // No rewrite outlives the Lease: the task ends before the Lease is given up.
    if let Some(w) = work.take() {
        w.abort();
        let _ = w.await;
    }
    let _ = quit.send(true);
    if tokio::time::timeout(Duration::from_secs(5), election)
        .await
        .is_err()
    {
        warn!(lease = %name, "could not give the migration's Lease up in time; it expires");
    }
    ended
}

/// A replica not holding the Lease: shows on `/status` who does (as the Lease says) and
/// how far the migration has come (as the CRD's marker says). Returns whether the
/// migration is done (then it says so).
async fn show_elsewhere(s: &Inner, t: &Target, lease: &str, status: &EngineStatus) -> bool {
    let crds: Api<CustomResourceDefinition> = Api::all(s.plain.clone());
    let Ok(live) = migrate::live(&crds, &t.crd).await else {
        return false;
    };
    let leases: Api<Lease> = Api::namespaced(s.plain.clone(), &s.namespace);
    let holder = match leases.get_opt(lease).await {
        Ok(l) => l
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty()),
        Err(_) => None,
    };
    let done = outlook(&live, t) == Outlook::Done;
    let rewritten = live
        .marker
        .as_ref()
        .filter(|m| m.to == live.storage)
        .map_or(0, |m| m.rewritten);
    let from: Vec<String> = live
        .stored
        .iter()
        .filter(|v| **v != live.storage)
        .cloned()
        .collect();
    // A replica that saw the migration run keeps its `from` once it is done.
    let previous = status.migration(&t.rule);
    status.set_migration(
        &t.rule,
        Some(MigrationStatus {
            crd: t.crd.clone(),
            from: if done {
                previous.map(|m| m.from).unwrap_or(from)
            } else {
                from
            },
            to: live.storage.clone(),
            state: if done {
                MigrationState::Done
            } else {
                MigrationState::Running
            },
            rewritten,
            message: None,
            holder,
        }),
    );
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_fit_an_object_name() {
        assert_eq!(
            lease_name("webapps.example.com"),
            "rulebook-migration-webapps.example.com"
        );
        let long = format!("{}.example.com", "a".repeat(240));
        let name = lease_name(&long);
        assert_eq!(name.len(), 253);
        assert!(name.starts_with("rulebook-migration-aaa"));
        assert_ne!(
            name,
            lease_name(&format!("{}.example.org", "a".repeat(240)))
        );
    }

    #[test]
    fn the_crd_says_what_is_left_to_do() {
        let t = Target {
            rule: "r".into(),
            crd: "webapps.example.com".into(),
            resource: kube::api::ApiResource {
                group: "example.com".into(),
                version: "v1".into(),
                api_version: "example.com/v1".into(),
                kind: "WebApp".into(),
                plural: "webapps".into(),
            },
            holder: None,
            rate: None,
        };
        let live = |storage: &str, stored: &[&str], marker: bool| Live {
            storage: storage.into(),
            stored: stored.iter().map(|v| v.to_string()).collect(),
            marker: marker.then(migrate::Marker::default),
            resource_version: None,
        };
        assert_eq!(
            outlook(&live("v1alpha1", &["v1alpha1"], false), &t),
            Outlook::NotYet
        );
        assert_eq!(
            outlook(&live("v1", &["v1alpha1", "v1"], false), &t),
            Outlook::Work
        );
        assert_eq!(outlook(&live("v1", &["v1"], true), &t), Outlook::Work);
        assert_eq!(outlook(&live("v1", &["v1"], false), &t), Outlook::Done);
    }
}
