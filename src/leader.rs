//! Leader election with a `coordination.k8s.io/v1` Lease, the algorithm client-go uses:
//! the holder renews the lease every third of its duration; another instance takes over
//! when the record has not changed for a whole lease duration (measured on its own
//! clock, so clock skew between instances does not matter) or when the holder released
//! it. Every update carries the resourceVersion it read, so two instances can never both
//! win. Standbys also watch the Lease, so a release on shutdown is taken over at once.
//!
//! A leader that cannot renew stops leading two thirds of the way into its lease, before
//! anyone else may take over: there are never two writers.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tracing::{debug, info, warn};

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    /// The last record seen (holder, renew time) and when this instance first saw it.
    observed: Option<(Option<String>, Option<String>, Instant)>,
    /// When this instance last renewed successfully while holding the lease.
    renewed: Option<Instant>,
}

impl LeaderElection {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        LeaderElection {
            api: Api::namespaced(client, namespace),
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
        let lease = match self.api.get_opt(&self.name).await {
            Ok(l) => l,
            Err(e) => {
                debug!(error = %e, "cannot read the lease");
                return still_valid(self.renewed, self.duration);
            }
        };
        let Some(lease) = lease else {
            return self.create().await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let renew = spec.renew_time.as_ref().map(|t| format!("{:?}", t.0));
        match &self.observed {
            Some((h, r, _)) if *h == holder && *r == renew => {}
            _ => self.observed = Some((holder.clone(), renew.clone(), now)),
        }
        let observed_at = self.observed.as_ref().map(|o| o.2).unwrap_or(now);
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.duration);
        let ours = holder.as_deref() == Some(self.identity.as_str());
        let free = holder.is_none() || now.duration_since(observed_at) > duration;
        if !ours && !free {
            self.renewed = None;
            return false;
        }
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
        match self
            .api
            .replace(&self.name, &PostParams::default(), &updated)
            .await
        {
            Ok(_) => {
                if !ours {
                    info!(lease = %self.name, identity = %self.identity, "acquired the lease");
                }
                self.renewed = Some(now);
                true
            }
            Err(e) => {
                debug!(error = %e, "lease update lost");
                ours && still_valid(self.renewed, self.duration)
            }
        }
    }

    async fn create(&mut self) -> bool {
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
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(_) => {
                info!(lease = %self.name, identity = %self.identity, "created and acquired the lease");
                self.renewed = Some(Instant::now());
                true
            }
            Err(e) => {
                debug!(error = %e, "lease creation lost");
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
