//! Leader election with a `coordination.k8s.io/v1` Lease, the algorithm client-go uses:
//! the holder renews the lease every third of its duration; another instance takes over
//! when the record has not changed for a whole lease duration (measured on its own
//! clock, so clock skew between instances does not matter) or when the holder released
//! it. Every update carries the resourceVersion it read, so two instances can never both
//! win. Standbys also watch the Lease, so a release on shutdown is taken over at once.
//!
//! A leader that cannot renew stops leading two thirds of the way into its lease, before
//! anyone else may take over: there are never two writers. That deadline lives in the
//! write gate itself ([`LeaseGate::grant_until`]), measured from the start of the renewal
//! that succeeded, on the monotonic clock: a process that is stopped or starved past it
//! finds its gate closed when it resumes, whatever its main loop has seen. Every request
//! of a renewal carries a deadline of a quarter lease, so a hung call cannot keep it going.
//!
//! Hand-written, not a crate: kube-runtime 5 has no lease module, and the two crates
//! re-examined (issue 42) both decide from wall-clock time on the Lease:
//! kube-lease-manager compares `renewTime + leaseDuration` with the local clock (so clock
//! skew between nodes decides who leads), its standbys sleep until expiry instead of
//! watching the Lease, and a holder cut off from the API server does not step down on its
//! own. kubert's `LeaseManager` (0.25, linkerd's) keeps a `Claim` whose expiry is the
//! Lease's `renewTime` plus its duration as a wall-clock time, requires the Lease to exist
//! before `init` (a 404 otherwise), and tells a holder it still leads by comparing that
//! expiry with the current time: nothing in it ends the right to write at a deadline
//! measured on this process's monotonic clock from the start of the last renewal that
//! succeeded, which is what the write gate needs ([`LeaseGate::grant_until`]) so that a
//! process stopped or starved past it cannot write when it resumes. Adopting it would
//! keep this file's deadline logic and add a second view of the same Lease.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::write::gate::LeaseGate;

pub struct LeaderElection {
    api: Api<Lease>,
    gate: std::sync::Arc<LeaseGate>,
    name: String,
    identity: String,
    duration: Duration,
    /// The last record seen and when this instance first saw it.
    observed: Option<Seen>,
    /// When this instance last renewed successfully while holding the lease.
    renewed: Option<Instant>,
}

impl LeaderElection {
    pub fn new(
        client: kube::Client,
        gate: std::sync::Arc<LeaseGate>,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        LeaderElection {
            api: Api::namespaced(client, namespace),
            gate,
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
            observed: None,
            renewed: None,
        }
    }

    /// Runs until `stop` turns true, publishing leadership on `leading`; releases the
    /// lease on the way out when it holds it.
    pub async fn run(mut self, leading: watch::Sender<bool>, mut stop: watch::Receiver<bool>) {
        // Backs off on errors (a missing permission must not become a request storm).
        let lease_watch = watcher(
            self.api.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", self.name)),
        )
        .default_backoff();
        let mut lease_changes = std::pin::pin!(lease_watch);
        loop {
            let now_leading = self.step().await;
            if !now_leading {
                self.gate.revoke();
            }
            leading.send_if_modified(|l| {
                let changed = *l != now_leading;
                *l = now_leading;
                changed
            });
            let wait = if now_leading {
                self.duration / 3
            } else {
                self.duration / 4
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                // Standbys react to the holder releasing the lease (or anything else) at once.
                Some(_) = lease_changes.next(), if !now_leading => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.gate.revoke();
        if *leading.borrow() {
            leading.send_replace(false);
            match self.release().await {
                Ok(()) => info!(lease = %self.name, "lease released"),
                Err(e) => warn!(lease = %self.name, error = %e, "could not release the lease"),
            }
        }
    }

    /// One round: create, renew or take over the lease. Returns whether this instance leads.
    async fn step(&mut self) -> bool {
        let now = Instant::now();
        let still_valid =
            |renewed: Option<Instant>, d: Duration| renewed.is_some_and(|r| now < r + d * 2 / 3);
        let deadline = self.duration / 4;
        let lease = match tokio::time::timeout(deadline, self.api.get_opt(&self.name)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                debug!(error = %e, "cannot read the lease");
                return still_valid(self.renewed, self.duration);
            }
            Err(_) => {
                debug!("reading the lease timed out");
                return still_valid(self.renewed, self.duration);
            }
        };
        let Some(lease) = lease else {
            return self.create().await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let record = Seen {
            holder: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            renew: spec.renew_time.as_ref().map(|t| format!("{:?}", t.0)),
            since: now,
        };
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.duration);
        let (decision, seen) = decide(
            &self.identity,
            record,
            duration,
            self.observed.as_ref(),
            now,
        );
        self.observed = Some(seen);
        if decision == Decision::Wait {
            // Tests wait for this line to know a standby has looked and stood by.
            debug!(lease = %self.name, holder = ?self.observed.as_ref().and_then(|s| s.holder.as_deref()), "standing by: the lease is held");
            self.renewed = None;
            return false;
        }
        let ours = decision == Decision::Renew;
        let mut updated = lease.clone();
        let mut spec = spec;
        let stamp = MicroTime(jiff::Timestamp::now());
        if !ours {
            spec.acquire_time = Some(stamp.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(self.duration.as_secs() as i32);
        spec.renew_time = Some(stamp);
        updated.spec = Some(spec);
        // The resourceVersion read above makes this a compare-and-swap.
        let replaced = tokio::time::timeout(
            deadline,
            self.api
                .replace(&self.name, &PostParams::default(), &updated),
        )
        .await;
        match replaced {
            Ok(Ok(_)) => {
                if !ours {
                    info!(lease = %self.name, identity = %self.identity, "acquired the lease");
                }
                self.renewed = Some(now);
                self.gate.grant_until(now + self.duration * 2 / 3);
                true
            }
            Ok(Err(e)) => {
                debug!(error = %e, "lease update lost");
                ours && still_valid(self.renewed, self.duration)
            }
            Err(_) => {
                debug!("lease update timed out");
                ours && still_valid(self.renewed, self.duration)
            }
        }
    }

    async fn create(&mut self) -> bool {
        let started = Instant::now();
        let stamp = MicroTime(jiff::Timestamp::now());
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(self.duration.as_secs() as i32),
                acquire_time: Some(stamp.clone()),
                renew_time: Some(stamp),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        let created = tokio::time::timeout(
            self.duration / 4,
            self.api.create(&PostParams::default(), &lease),
        )
        .await;
        match created {
            Ok(Ok(_)) => {
                info!(lease = %self.name, identity = %self.identity, "created and acquired the lease");
                self.renewed = Some(started);
                self.gate.grant_until(started + self.duration * 2 / 3);
                true
            }
            Ok(Err(e)) => {
                debug!(error = %e, "lease creation lost");
                false
            }
            Err(_) => {
                debug!("lease creation timed out");
                false
            }
        }
    }

    /// Gives the lease up so that a standby takes over without waiting for it to expire.
    async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        self.api
            .replace(&self.name, &PostParams::default(), &lease)
            .await?;
        Ok(())
    }
}

/// A Lease record as this instance saw it: holder, renew time, and when it first saw
/// exactly that record (on its own monotonic clock).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub holder: Option<String>,
    pub renew: Option<String>,
    pub since: Instant,
}

/// What an instance may do with the Lease it just read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It holds the lease: renew it.
    Renew,
    /// The lease is free (released, or unchanged for a whole lease duration): take it.
    Acquire,
    /// Someone else holds a live lease.
    Wait,
}

/// The takeover rule, as a pure function of the record just read (`record.since` = now),
/// the lease duration, what was seen before, and the time. Expiry is measured from when
/// this instance first saw the record unchanged — never from the record's own renew
/// time — so clocks that disagree between nodes cannot make two holders.
pub fn decide(
    identity: &str,
    record: Seen,
    duration: Duration,
    before: Option<&Seen>,
    now: Instant,
) -> (Decision, Seen) {
    let seen = match before {
        Some(b) if b.holder == record.holder && b.renew == record.renew => b.clone(),
        _ => record,
    };
    let decision = if seen.holder.as_deref() == Some(identity) {
        Decision::Renew
    } else if seen.holder.is_none() || now.duration_since(seen.since) > duration {
        Decision::Acquire
    } else {
        Decision::Wait
    };
    (decision, seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);

    fn record(holder: Option<&str>, renew: &str, at: Instant) -> Seen {
        Seen {
            holder: holder.map(str::to_string),
            renew: Some(renew.to_string()),
            since: at,
        }
    }

    #[test]
    fn a_renewing_holder_keeps_its_lease() {
        let t0 = Instant::now();
        let (d, seen) = decide("b", record(Some("a"), "r1", t0), D, None, t0);
        assert_eq!(d, Decision::Wait);
        // Each renewal changes the record: the clock starts again, however long it has been.
        let t1 = t0 + D * 2;
        let (d, seen) = decide("b", record(Some("a"), "r2", t1), D, Some(&seen), t1);
        assert_eq!((d, seen.since), (Decision::Wait, t1));
    }

    #[test]
    fn an_unchanged_record_expires_a_lease_duration_after_it_was_first_seen() {
        let t0 = Instant::now();
        let (_, seen) = decide("b", record(Some("a"), "r1", t0), D, None, t0);
        let almost = t0 + D;
        let (d, seen) = decide("b", record(Some("a"), "r1", almost), D, Some(&seen), almost);
        assert_eq!(d, Decision::Wait);
        let past = t0 + D + Duration::from_millis(1);
        let (d, _) = decide("b", record(Some("a"), "r1", past), D, Some(&seen), past);
        assert_eq!(d, Decision::Acquire);
    }

    #[test]
    fn a_released_lease_is_taken_at_once_and_a_held_one_renewed() {
        let t0 = Instant::now();
        let (d, _) = decide("b", record(None, "r1", t0), D, None, t0);
        assert_eq!(d, Decision::Acquire);
        let (d, _) = decide("b", record(Some("b"), "r1", t0), D, None, t0);
        assert_eq!(d, Decision::Renew);
    }
}
