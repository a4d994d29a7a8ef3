//! Membership of sharded replicas (`run --sharding namespace`): each replica renews a
//! Lease of its own; the live member with the smallest identity coordinates, publishing
//! the assignment of hash ranges (see [`crate::shard`]) in one more Lease, with a
//! compare-and-swap on its resourceVersion; every member applies its share and then
//! acknowledges the generation in its own Lease.
//!
//! Safety rests on three things, each checked where it is decided:
//! - a range is given to a member only when no live member held it in the current
//!   generation, and a new generation is published only once every live member has
//!   acknowledged the current one (the pure [`crate::shard::plan`]);
//! - a member acknowledges a generation only after its write gate has shrunk to its new
//!   share and its controllers have stopped (the operator does that before it answers);
//! - a member writes only until two thirds of its Lease after its last renewal
//!   ([`ShardGate::lease`]), while the others wait a whole Lease (on their own clocks,
//!   from when they saw its record change) before they count it dead.
//!
//! A member that leaves cleanly stops its controllers and then deletes its Lease, so its
//! ranges move at once; one that crashes is dead after one Lease duration.

mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::reconcile::shard_gate::ShardGate;
use crate::shard::{Assignment, Member, Ranges, plan};

pub use load::ParentKinds;

const GROUP_LABEL: &str = "rulebook.dev/shard-group";
const ROLE_LABEL: &str = "rulebook.dev/shard-role";
const RULES: &str = "rulebook.dev/rules";
const ACKED: &str = "rulebook.dev/acked";
const ASSIGNMENT: &str = "rulebook.dev/assignment";

/// This replica's share, as the membership hands it to the operator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Share {
    pub generation: u64,
    pub ranges: Ranges,
}

/// What `/status` shows of the sharding.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardStatus {
    pub mode: String,
    pub identity: String,
    pub coordinator: Option<String>,
    pub generation: u64,
    pub members: Vec<String>,
    pub ranges: String,
    pub percent_of_hash_space: f64,
    pub waiting_for: Vec<String>,
    /// Namespaces (by hash) too large for one member's fair share.
    pub oversized: Vec<String>,
}

#[derive(Serialize, Deserialize, Default)]
struct Stored {
    generation: u64,
    owners: BTreeMap<String, String>,
    target: BTreeMap<String, String>,
}

pub struct Membership {
    api: Api<Lease>,
    client: Client,
    group: String,
    identity: String,
    lease_name: String,
    duration: Duration,
    gate: Arc<ShardGate>,
    /// When each member's record was first seen as it is now (on this clock).
    seen: BTreeMap<String, (String, Instant)>,
    last_target_change: Option<Instant>,
    load: load::LoadCounter,
    /// Load alone moves ranges at most this often (membership changes move them at once).
    rebalance: Duration,
}

impl Membership {
    pub fn new(
        client: Client,
        gate: Arc<ShardGate>,
        namespace: &str,
        group: &str,
        identity: &str,
        duration: Duration,
        rebalance: Duration,
    ) -> Membership {
        Membership {
            api: Api::namespaced(client.clone(), namespace),
            client,
            group: group.to_string(),
            identity: identity.to_string(),
            lease_name: format!("{group}-member-{}", dns_safe(identity)),
            duration,
            gate,
            seen: BTreeMap::new(),
            last_target_change: None,
            load: load::LoadCounter::default(),
            rebalance,
        }
    }

    /// Runs until `stop`: renews this member's Lease, coordinates when it is the
    /// smallest live member, and hands this member's share to `shares`. The operator
    /// answers on `applied` with the generation it has applied; `rules` carries the
    /// rule set's fingerprint and parent kinds.
    pub async fn run(
        mut self,
        shares: watch::Sender<Share>,
        mut applied: watch::Receiver<u64>,
        mut rules: watch::Receiver<ParentKinds>,
        status: Arc<std::sync::RwLock<ShardStatus>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let changes = watcher(
            self.api.clone(),
            watcher::Config::default().labels(&format!("{GROUP_LABEL}={}", self.group)),
        )
        .default_backoff();
        let mut changes = std::pin::pin!(changes);
        loop {
            let kinds = rules.borrow().clone();
            let acked = *applied.borrow();
            if let Some(state) = self.step(&kinds, acked).await {
                let share = Share {
                    generation: state.current.generation,
                    ranges: state
                        .current
                        .owners
                        .get(&self.identity)
                        .cloned()
                        .unwrap_or_default(),
                };
                if let Ok(mut s) = status.write() {
                    s.identity = self.identity.clone();
                    s.coordinator = state.coordinator.clone();
                    s.generation = share.generation;
                    s.members = state.live.iter().map(|m| m.id.clone()).collect();
                    s.ranges = share.ranges.encode();
                    s.percent_of_hash_space = share.ranges.percent();
                    s.waiting_for = state.waiting_for.clone();
                    s.oversized = state.oversized.clone();
                }
                shares.send_if_modified(|s| {
                    let changed = s.generation < share.generation;
                    if changed {
                        *s = share;
                    }
                    changed
                });
            }
            tokio::select! {
                _ = tokio::time::sleep(self.duration / 3) => {}
                Some(_) = changes.next() => {}
                Ok(()) = applied.changed() => {}
                Ok(()) = rules.changed() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.gate.lease().revoke();
        // The operator stopped every controller before it stopped us: leave at once.
        match self
            .api
            .delete(&self.lease_name, &DeleteParams::default())
            .await
        {
            Ok(_) => info!(lease = %self.lease_name, "left the shard group"),
            Err(e) => warn!(error = %e, "could not delete the member Lease; it expires"),
        }
    }

    /// One round: renew, observe, coordinate. `None` when the API server could not be read.
    async fn step(&mut self, kinds: &ParentKinds, acked: u64) -> Option<Round> {
        let started = Instant::now();
        if self.renew(&kinds.fingerprint, acked).await {
            self.gate
                .lease()
                .grant_until(started + self.duration * 2 / 3);
        }
        let leases = self
            .api
            .list(&ListParams::default().labels(&format!("{GROUP_LABEL}={}", self.group)))
            .await
            .map_err(|e| debug!(error = %e, "cannot list the shard group's Leases"))
            .ok()?;
        let now = Instant::now();
        let mut live = Vec::new();
        let mut stored: Option<(Lease, Stored)> = None;
        let mut present = Vec::new();
        for l in leases.items {
            let labels = l.labels();
            if labels.get(ROLE_LABEL).map(String::as_str) == Some("assignment") {
                let s = l
                    .annotations()
                    .get(ASSIGNMENT)
                    .and_then(|a| serde_json::from_str::<Stored>(a).ok())
                    .unwrap_or_default();
                stored = Some((l, s));
                continue;
            }
            let spec = l.spec.clone().unwrap_or_default();
            let Some(id) = spec.holder_identity.clone() else {
                continue;
            };
            present.push(id.clone());
            let record = format!(
                "{:?}/{:?}",
                spec.renew_time.map(|t| t.0),
                l.resource_version()
            );
            let entry = self.seen.entry(id.clone()).or_insert((record.clone(), now));
            if entry.0 != record {
                *entry = (record, now);
            }
            let alive = id == self.identity || now.duration_since(entry.1) < self.duration;
            if alive {
                live.push(Member {
                    id,
                    rules: l.annotations().get(RULES).cloned().unwrap_or_default(),
                    acked: l
                        .annotations()
                        .get(ACKED)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                });
            }
        }
        self.seen.retain(|id, _| present.contains(id));
        live.sort_by(|a, b| a.id.cmp(&b.id));
        let current = stored.as_ref().map(|(_, s)| decode(s)).unwrap_or_default();
        let coordinator = live.first().map(|m| m.id.clone());
        let mut round = Round {
            current,
            coordinator: coordinator.clone(),
            live: live.clone(),
            waiting_for: Vec::new(),
            oversized: Vec::new(),
        };
        if coordinator.as_deref() != Some(self.identity.as_str()) {
            return Some(round);
        }
        // Counted a few times per rebalance period (at most every 15 s).
        let every = (self.rebalance / 4).min(Duration::from_secs(15));
        let load = self.load.count(&self.client, kinds, every).await;
        let rebalance = self
            .last_target_change
            .is_none_or(|t| t.elapsed() >= self.rebalance);
        let p = plan(&round.current, &live, &load, rebalance);
        round.waiting_for = p.waiting_for;
        round.oversized = p
            .oversized
            .iter()
            .map(|(h, n)| format!("0x{h:016x} ({n} parents)"))
            .collect();
        if let Some(next) = p.next {
            if next.target != round.current.target {
                self.last_target_change = Some(Instant::now());
            }
            if self.publish(stored.map(|(l, _)| l), &next).await {
                info!(generation = next.generation, owners = ?next.owners.iter().map(|(k, v)| (k.clone(), v.encode())).collect::<Vec<_>>(), "published a shard assignment");
                round.current = next;
            }
        }
        Some(round)
    }

    /// Creates or renews this member's Lease, with the generation it has applied.
    async fn renew(&self, fingerprint: &str, acked: u64) -> bool {
        let stamp = MicroTime(jiff::Timestamp::now());
        let mut annotations = BTreeMap::new();
        annotations.insert(RULES.to_string(), fingerprint.to_string());
        annotations.insert(ACKED.to_string(), acked.to_string());
        let existing = match self.api.get_opt(&self.lease_name).await {
            Ok(l) => l,
            Err(e) => {
                debug!(error = %e, "cannot read the member Lease");
                return false;
            }
        };
        let result = match existing {
            Some(mut l) => {
                l.metadata.annotations = Some(annotations);
                let spec = l.spec.get_or_insert_with(LeaseSpec::default);
                spec.holder_identity = Some(self.identity.clone());
                spec.lease_duration_seconds = Some(self.duration.as_secs() as i32);
                spec.renew_time = Some(stamp);
                self.api
                    .replace(&self.lease_name, &PostParams::default(), &l)
                    .await
                    .map(|_| ())
            }
            None => self
                .api
                .create(
                    &PostParams::default(),
                    &Lease {
                        metadata: ObjectMeta {
                            name: Some(self.lease_name.clone()),
                            labels: Some(self.labels("member")),
                            annotations: Some(annotations),
                            ..Default::default()
                        },
                        spec: Some(LeaseSpec {
                            holder_identity: Some(self.identity.clone()),
                            lease_duration_seconds: Some(self.duration.as_secs() as i32),
                            acquire_time: Some(stamp.clone()),
                            renew_time: Some(stamp),
                            ..Default::default()
                        }),
                    },
                )
                .await
                .map(|_| ()),
        };
        result
            .map_err(|e| debug!(error = %e, "member Lease renewal failed"))
            .is_ok()
    }

    /// Writes `next` over the assignment Lease as read (a compare-and-swap).
    async fn publish(&self, read: Option<Lease>, next: &Assignment) -> bool {
        let stored = Stored {
            generation: next.generation,
            owners: next
                .owners
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
            target: next
                .target
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
        };
        let Ok(text) = serde_json::to_string(&stored) else {
            return false;
        };
        let name = format!("{}-assignment", self.group);
        let result = match read {
            Some(mut l) => {
                l.annotations_mut().insert(ASSIGNMENT.to_string(), text);
                self.api.replace(&name, &PostParams::default(), &l).await
            }
            None => {
                let mut annotations = BTreeMap::new();
                annotations.insert(ASSIGNMENT.to_string(), text);
                self.api
                    .create(
                        &PostParams::default(),
                        &Lease {
                            metadata: ObjectMeta {
                                name: Some(name),
                                labels: Some(self.labels("assignment")),
                                annotations: Some(annotations),
                                ..Default::default()
                            },
                            spec: Some(LeaseSpec::default()),
                        },
                    )
                    .await
            }
        };
        result
            .map_err(
                |e| debug!(error = %e, "the assignment was not published (another coordinator?)"),
            )
            .is_ok()
    }

    fn labels(&self, role: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (GROUP_LABEL.to_string(), self.group.clone()),
            (ROLE_LABEL.to_string(), role.to_string()),
        ])
    }
}

struct Round {
    current: Assignment,
    coordinator: Option<String>,
    live: Vec<Member>,
    waiting_for: Vec<String>,
    oversized: Vec<String>,
}

/// The stored assignment; a range that does not parse is dropped (and so not written).
fn decode(s: &Stored) -> Assignment {
    let ranges = |m: &BTreeMap<String, String>| {
        m.iter()
            .filter_map(|(k, v)| Ranges::decode(v).ok().map(|r| (k.clone(), r)))
            .collect()
    };
    Assignment {
        generation: s.generation,
        owners: ranges(&s.owners),
        target: ranges(&s.target),
    }
}

/// A Lease name part from an identity: lowercase alphanumerics and dashes.
fn dns_safe(identity: &str) -> String {
    let s: String = identity
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let s = s.trim_matches('-');
    let short: String = s.chars().take(40).collect();
    format!("{short}-{:08x}", crate::shard::fnv1a(identity) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_are_safe_and_distinct() {
        let a = dns_safe("Pod_A.1");
        assert!(a.starts_with("pod-a-1-"));
        assert_ne!(dns_safe("pod/a"), dns_safe("pod.a"));
    }

    #[test]
    fn the_stored_form_round_trips() {
        let mut a = Assignment {
            generation: 3,
            ..Default::default()
        };
        a.owners.insert("x".into(), Ranges::of([(0, 5)]));
        a.target.insert("x".into(), Ranges::of([(0, 9)]));
        let s = Stored {
            generation: 3,
            owners: a
                .owners
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
            target: a
                .target
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
        };
        assert_eq!(decode(&s), a);
    }
}
