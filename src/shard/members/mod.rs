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

mod leases;
mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;
use tracing::{debug, info, warn};

pub use crate::shard::ShardStatus;
use crate::shard::gate::ShardGate;
use crate::shard::{Assignment, Member, Ranges, plan};

pub use load::{ParentKinds, ResolveKind};

const GROUP_LABEL: &str = "rulebook.dev/shard-group";
const ROLE_LABEL: &str = "rulebook.dev/shard-role";
const RULES: &str = "rulebook.dev/rules";
const ACKED: &str = "rulebook.dev/acked";
const ASSIGNMENT: &str = "rulebook.dev/assignment";
/// On a member Lease: it left cleanly (its controllers stopped).
const LEFT: &str = "rulebook.dev/left";

/// This replica's share, as the membership hands it to the operator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Share {
    pub generation: u64,
    pub ranges: Ranges,
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
    /// This process's identity; the member identity adds an incarnation after a fence.
    base_identity: String,
    incarnation: u32,
    identity: String,
    lease_name: String,
    /// Whether this incarnation's Lease has been created (so a missing one means fenced).
    has_lease: bool,
    next_renew: Instant,
    duration: Duration,
    gate: Arc<ShardGate>,
    /// Each member's record, when it was first seen as it is now (on this clock), and
    /// what it said. A member whose Lease vanished stays here (and alive) until a whole
    /// lease has passed since its record last changed: only a Lease marked as left
    /// frees its ranges at once.
    seen: BTreeMap<String, Seen>,
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
            base_identity: member_id(identity),
            incarnation: 0,
            identity: member_id(identity),
            lease_name: format!("{group}-member-{}", dns_safe(&member_id(identity))),
            has_lease: false,
            next_renew: Instant::now(),
            duration,
            gate,
            seen: BTreeMap::new(),
            last_target_change: None,
            load: load::LoadCounter::default(),
            rebalance,
        }
    }

    /// Counts the parents of the rules' kinds (for the coordinator's load-balanced cut)
    /// with `resolve` finding each kind; a member without it counts none.
    pub fn counting_parents_with(mut self, resolve: ResolveKind) -> Membership {
        self.load.resolve = Some(resolve);
        self
    }

    /// Runs until `stop`: renews this member's Lease (every third of a lease, ahead of
    /// anything else), coordinates when it is the smallest live member, and hands this member's share to `shares`. The operator
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
            if Instant::now() >= self.next_renew {
                self.next_renew = Instant::now() + self.duration / 3;
                let started = Instant::now();
                match self.renew(&kinds.fingerprint, acked).await {
                    Renewal::Renewed => {
                        self.gate
                            .lease()
                            .grant_until(started + self.duration * 2 / 3);
                    }
                    Renewal::Fenced => self.fence(&shares),
                    Renewal::Failed => {}
                }
            }
            // The round gives way to the renewal: a slow API server (or a slow count of
            // the parents) never delays it. Dropping a round midway is safe: it reads
            // before it writes, its writes (a fencing delete with a precondition, the
            // assignment's compare-and-swap) are whole or absent on the server, and the
            // next round reads everything again.
            let renew_at = self.next_renew;
            let round = tokio::select! {
                round = self.step(&kinds) => round,
                _ = tokio::time::sleep_until(renew_at.into()) => {
                    debug!("a coordination round outlasted a renewal period; renewing first");
                    continue;
                }
                _ = stop.wait_for(|s| *s) => break,
            };
            if let Some(state) = round {
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
                _ = tokio::time::sleep_until(self.next_renew.into()) => {}
                Some(_) = changes.next() => {}
                Ok(()) = applied.changed() => {}
                Ok(()) = rules.changed() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.gate.lease().revoke();
        // The operator stopped every controller before it stopped us: mark the Lease as
        // left, so the coordinator moves its ranges at once (and deletes it).
        let left = json!({"metadata": {"annotations": {LEFT: "true"}}});
        match self
            .api
            .patch(
                &self.lease_name,
                &PatchParams::default(),
                &Patch::Merge(&left),
            )
            .await
        {
            Ok(_) => info!(lease = %self.lease_name, "left the shard group"),
            Err(e) => warn!(error = %e, "could not mark the member Lease as left; it expires"),
        }
    }

    /// This member's Lease vanished: whatever it held may be another's now. Drop every
    /// claim at once, run nothing, and come back as a new member (a new incarnation,
    /// whose Lease and share start empty).
    fn fence(&mut self, shares: &watch::Sender<Share>) {
        warn!(lease = %self.lease_name, "the member Lease is gone (counted dead?): dropping every range and rejoining");
        // The share first, the gate second: see `Shards::switch`.
        shares.send_modify(|s| s.ranges = Ranges::none());
        self.gate.fence();
        self.incarnation += 1;
        self.identity = format!("{}.{}", self.base_identity, self.incarnation);
        self.lease_name = format!("{}-member-{}", self.group, dns_safe(&self.identity));
        self.has_lease = false;
        self.next_renew = Instant::now();
    }

    /// One round: renew, observe, coordinate. `None` when the API server could not be read.
    async fn step(&mut self, kinds: &ParentKinds) -> Option<Round> {
        let leases = self
            .api
            .list(&ListParams::default().labels(&format!("{GROUP_LABEL}={}", self.group)))
            .await
            .map_err(|e| debug!(error = %e, "cannot list the shard group's Leases"))
            .ok()?;
        let now = Instant::now();
        let (stored, present) = self.record_leases(leases.items, now);
        let (dead, live) = self.split_alive(&present, now);
        let max_acked = live.iter().map(|m| m.acked).max().unwrap_or(0);
        // Missing or unreadable while members have acted on one: nobody knows who holds
        // what, so the next generation revokes everything first (and counts on from the
        // highest generation any member applied: generations never go back).
        // (Acknowledgements reach the Leases up to a third of a lease late, so a member
        // may have applied generation `max_acked + 1` already: the revoke comes after it.)
        let usable = stored
            .as_ref()
            .and_then(|(_, s)| s.as_ref())
            .filter(|s| s.generation >= max_acked);
        let revoke = usable.is_none();
        let current = usable.map(decode).unwrap_or_default();
        let coordinator = live.first().map(|m| m.id.clone());
        let mut round = Round {
            current,
            coordinator: coordinator.clone(),
            live: live.clone(),
            waiting_for: Vec::new(),
            oversized: Vec::new(),
        };
        if coordinator.as_deref() != Some(self.identity.as_str()) || !self.fence_dead(&dead).await {
            return Some(round);
        }
        let stored = stored.map(|(l, _)| l);
        if revoke {
            let next = Assignment {
                generation: max_acked.saturating_add(2),
                ..Assignment::default()
            };
            warn!(
                generation = next.generation,
                "the shard assignment is missing or unreadable: revoking every range first"
            );
            if self.publish(stored, &next).await {
                round.current = next;
            }
            return Some(round);
        }
        self.rebalance_round(kinds, &live, stored, &mut round).await;
        Some(round)
    }

    /// Notes each member Lease (when its record last changed, what it says) in `seen`;
    /// returns the assignment Lease with its parsed content, and the members present.
    fn record_leases(
        &mut self,
        leases: Vec<Lease>,
        now: Instant,
    ) -> (Option<(Lease, Option<Stored>)>, Vec<String>) {
        let mut stored: Option<(Lease, Option<Stored>)> = None;
        let mut present = Vec::new();
        for l in leases {
            let labels = l.labels();
            if labels.get(ROLE_LABEL).map(String::as_str) == Some("assignment") {
                let parsed = l.annotations().get(ASSIGNMENT).and_then(|a| {
                    serde_json::from_str::<Stored>(a)
                        .map_err(|e| warn!(error = %e, "the shard assignment does not parse"))
                        .ok()
                });
                stored = Some((l, parsed));
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
            let member = Member {
                id: id.clone(),
                rules: l.annotations().get(RULES).cloned().unwrap_or_default(),
                acked: l
                    .annotations()
                    .get(ACKED)
                    .and_then(|a| a.parse().ok())
                    .unwrap_or(0),
            };
            let left = l.annotations().get(LEFT).is_some_and(|v| v == "true");
            let rv = l.resource_version();
            let entry = self.seen.entry(id).or_insert_with(|| Seen {
                record: record.clone(),
                since: now,
                member: member.clone(),
                left,
                lease: l.name_any(),
                resource_version: rv.clone(),
            });
            if entry.record != record {
                entry.record = record;
                entry.since = now;
            }
            entry.member = member;
            entry.left = left;
            entry.lease = l.name_any();
            entry.resource_version = rv;
        }
        (stored, present)
    }

    /// The dead members (id, Lease, its version, whether it is still there) and the live
    /// ones, by id. Alive: this member, and every other whose record changed within a
    /// lease and that has not left (a vanished Lease counts until its last record is that
    /// old). Members gone for two leases are forgotten.
    fn split_alive(&mut self, present: &[String], now: Instant) -> (Vec<Dead>, Vec<Member>) {
        let me = self.identity.clone();
        let alive = |id: &str, s: &Seen| {
            id == me || (!s.left && now.duration_since(s.since) < self.duration)
        };
        let dead: Vec<Dead> = self
            .seen
            .iter()
            .filter(|(id, s)| !alive(id, s))
            .map(|(id, s)| Dead {
                id: id.clone(),
                lease: s.lease.clone(),
                resource_version: s.resource_version.clone(),
                present: present.contains(id),
            })
            .collect();
        let mut live: Vec<Member> = self
            .seen
            .iter()
            .filter(|(id, s)| alive(id, s))
            .map(|(_, s)| s.member.clone())
            .collect();
        self.seen.retain(|id, s| {
            present.contains(id) || now.duration_since(s.since) < self.duration * 2
        });
        live.sort_by(|a, b| a.id.cmp(&b.id));
        (dead, live)
    }

    /// Fences the dead before their ranges are given away: deletes each one's Lease with
    /// a precondition on the version seen, so one that renewed meanwhile keeps it, and
    /// one that did not finds it gone and drops its claims before it could renew (see
    /// `fence`). `false`: this round publishes nothing (one renewed, or a delete failed).
    async fn fence_dead(&self, dead: &[Dead]) -> bool {
        for d in dead.iter().filter(|d| d.present) {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: d.resource_version.clone(),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match self.api.delete(&d.lease, &dp).await {
                Ok(_) => info!(member = %d.id, "removed a dead member's Lease"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    debug!(member = %d.id, "a dead member's Lease changed: it renewed; not publishing this round");
                    return false;
                }
                Err(e) => {
                    warn!(member = %d.id, error = %e, "cannot remove a dead member's Lease; not publishing this round");
                    return false;
                }
            }
        }
        true
    }

    /// The coordinator's plan from the parents' load, published when it moves anything.
    async fn rebalance_round(
        &mut self,
        kinds: &ParentKinds,
        live: &[Member],
        stored: Option<Lease>,
        round: &mut Round,
    ) {
        // Counted a few times per rebalance period (at most every 15 s), within a third
        // of a lease (the last counts stand otherwise).
        let every = (self.rebalance / 4).min(Duration::from_secs(15));
        let load = match tokio::time::timeout(
            self.duration / 3,
            self.load.count(&self.client, kinds, every),
        )
        .await
        {
            Ok(points) => points,
            Err(_) => self.load.last(),
        };
        let rebalance = self
            .last_target_change
            .is_none_or(|t| t.elapsed() >= self.rebalance);
        let p = plan(&round.current, live, &load, rebalance);
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
            if self.publish(stored, &next).await {
                info!(generation = next.generation, owners = ?next.owners.iter().map(|(k, v)| (k.clone(), v.encode())).collect::<Vec<_>>(), "published a shard assignment");
                round.current = next;
            }
        }
    }
}

/// A member counted dead, and what fencing it needs.
struct Dead {
    id: String,
    lease: String,
    resource_version: Option<String>,
    /// Its Lease is still there (one already gone needs no fencing).
    present: bool,
}

struct Seen {
    record: String,
    since: Instant,
    member: Member,
    left: bool,
    /// The Lease's name and resourceVersion, for a fencing delete.
    lease: String,
    resource_version: Option<String>,
}

/// What a renewal found.
enum Renewal {
    Renewed,
    /// This member's Lease is gone although it had one: the coordinator counted it dead
    /// (or someone deleted it). Its claims are void.
    Fenced,
    Failed,
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

/// A member identity: the process's identity and a part of its own, so a restarted
/// container (same pod name) never inherits what its previous process held.
fn member_id(identity: &str) -> String {
    use std::sync::OnceLock;
    static PART: OnceLock<String> = OnceLock::new();
    let part = PART.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("{:06x}", (nanos ^ std::process::id()) & 0xff_ffff)
    });
    format!("{identity}.{part}")
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
