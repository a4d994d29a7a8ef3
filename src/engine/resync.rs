//! Resyncs as one sweep per rule: every `resync`, each cached parent is reconciled once,
//! spread evenly over the period in small batches, one batch per tick (a second, or a
//! sixtieth of a shorter period).
//!
//! Before, every reconcile ended by asking kube-runtime's scheduler to come back after
//! `resync`, so the scheduler held an entry per parent at all times: two copies of the
//! parent's `ObjectRef`, each with a clone of the kind's `ApiResource` (five strings),
//! about 0.9 KB per parent (heaptrack, 3,000-parent converge). The sweep holds the
//! period's parents as one `namespace/name` string each, and the scheduler holds a parent
//! only from the moment its turn comes until its reconcile starts. A parent is still
//! reconciled at least once per period; one created less than a period before a period
//! starts waits for the next one (its creation reconciled it, and during a large
//! converge it may not even have settled yet: a 10,000-parent converge made 15 % more
//! reconciles when every parent listed was swept).
//!
//! Why ticks: paced one parent at a time, 1,000 parents at a 60 s resync woke the process
//! every 60 ms, and each wake (a timer, a parked worker unparked, the controller's queue)
//! cost more than the reconcile it brought, which at steady state stops at a lookup. At
//! one wake per tick the parents due by then are handed over back to back.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures::Stream;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};

/// The sweep's schedule, apart from clocks and stores (tested with plain instants).
struct Plan {
    every: Duration,
    /// The parents still due in this period, as `namespace/name` (`/name` when
    /// cluster-scoped: neither part can contain a `/`).
    due: VecDeque<Box<str>>,
    /// When the next one is due; the next period's start while `due` is empty.
    next: Instant,
    gap: Duration,
    /// Waits end on a tick counted from `anchor`, so parents due within one tick are
    /// handed over at one wake.
    anchor: Instant,
    tick: Duration,
}

enum Step {
    Wait(Instant),
    Resync(Box<str>),
}

impl Plan {
    /// The first period starts `every` after `now` (the first listing reconciles every
    /// parent anyway).
    fn new(now: Instant, every: Duration) -> Plan {
        let every = every.max(Duration::from_millis(100));
        Plan {
            every,
            due: VecDeque::new(),
            next: now + every,
            gap: Duration::ZERO,
            anchor: now,
            tick: (every / 60).min(Duration::from_secs(1)),
        }
    }

    /// The first tick at or after `t`.
    fn tick_at_or_after(&self, t: Instant) -> Instant {
        let since = t.saturating_duration_since(self.anchor).as_nanos();
        let tick = self.tick.as_nanos().max(1);
        u64::try_from(since.div_ceil(tick) * tick)
            .ok()
            .and_then(|n| self.anchor.checked_add(Duration::from_nanos(n)))
            .unwrap_or(t)
    }

    /// What to do at `now`; `parents` lists the parents when a period starts.
    fn step(&mut self, now: Instant, parents: impl FnOnce() -> VecDeque<Box<str>>) -> Step {
        if now < self.next {
            return Step::Wait(self.tick_at_or_after(self.next));
        }
        // A process that fell behind by a period (suspended, starved) starts a period
        // afresh rather than catching up in a burst.
        if now > self.next + self.every {
            self.due.clear();
            self.next = now;
        }
        if self.due.is_empty() {
            self.due = parents();
            if self.due.is_empty() {
                self.next += self.every;
                return Step::Wait(self.next);
            }
            self.gap = self.every / u32::try_from(self.due.len()).unwrap_or(u32::MAX);
        }
        match self.due.pop_front() {
            Some(k) => {
                self.next += self.gap;
                Step::Resync(k)
            }
            None => Step::Wait(self.next),
        }
    }
}

/// The parents of `store`, each once per `every`, spread evenly over it.
pub fn sweep(
    store: Store<DynamicObject>,
    ar: ApiResource,
    every: Duration,
) -> impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static {
    let plan = Plan::new(Instant::now(), every);
    futures::stream::unfold((plan, store, ar), move |(mut plan, store, ar)| async move {
        loop {
            let parents = || {
                let cutoff = jiff::Timestamp::now()
                    .checked_sub(jiff::SignedDuration::try_from(every).unwrap_or_default())
                    .unwrap_or_default();
                store
                    .state()
                    .iter()
                    .filter(|o| created_before(o, cutoff))
                    .filter_map(|o| key(o))
                    .collect()
            };
            match plan.step(Instant::now(), parents) {
                Step::Wait(at) => {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
                }
                Step::Resync(k) => {
                    if let Some(oref) = oref(&k, &ar) {
                        return Some((oref, (plan, store, ar)));
                    }
                }
            }
        }
    })
}

/// Whether the parent was created before `cutoff` (by the API server's clock); one
/// without a creation time counts as old.
fn created_before(o: &DynamicObject, cutoff: jiff::Timestamp) -> bool {
    o.metadata
        .creation_timestamp
        .as_ref()
        .is_none_or(|t| t.0 < cutoff)
}

fn key(o: &DynamicObject) -> Option<Box<str>> {
    let name = o.metadata.name.as_deref()?;
    let ns = o.metadata.namespace.as_deref().unwrap_or("");
    Some(format!("{ns}/{name}").into_boxed_str())
}

fn oref(key: &str, ar: &ApiResource) -> Option<ObjectRef<DynamicObject>> {
    let (ns, name) = key.split_once('/')?;
    let o = ObjectRef::new_with(name, ar.clone());
    Some(if ns.is_empty() { o } else { o.within(ns) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> VecDeque<Box<str>> {
        names.iter().map(|n| Box::from(*n)).collect()
    }

    fn at(plan: &mut Plan, now: Instant, parents: &[&str]) -> Result<String, Instant> {
        match plan.step(now, || keys(parents)) {
            Step::Resync(k) => Ok(k.to_string()),
            Step::Wait(t) => Err(t),
        }
    }

    #[test]
    fn every_parent_once_per_period_spread_over_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut p = Plan::new(t0, s(60));
        let three = ["a/x", "b/y", "/z"];
        // Nothing before the first period.
        assert_eq!(at(&mut p, t0, &three), Err(t0 + s(60)));
        // The period's three parents, 20 s apart; the list is taken once per period.
        assert_eq!(at(&mut p, t0 + s(60), &three).as_deref(), Ok("a/x"));
        assert_eq!(at(&mut p, t0 + s(61), &[]), Err(t0 + s(80)));
        assert_eq!(at(&mut p, t0 + s(80), &[]).as_deref(), Ok("b/y"));
        assert_eq!(at(&mut p, t0 + s(100), &[]).as_deref(), Ok("/z"));
        // The next period lists again: a parent deleted meanwhile is not in it.
        assert_eq!(at(&mut p, t0 + s(100), &[]), Err(t0 + s(120)));
        assert_eq!(
            at(&mut p, t0 + s(120), &["a/x", "/z"]).as_deref(),
            Ok("a/x")
        );
        assert_eq!(at(&mut p, t0 + s(150), &[]).as_deref(), Ok("/z"));
        // No parents: the next period, and nothing in between.
        assert_eq!(at(&mut p, t0 + s(180), &[]), Err(t0 + s(240)));
        // Far behind: starts afresh from now rather than in a burst.
        assert_eq!(
            at(&mut p, t0 + s(1000), &["a/x", "/z"]).as_deref(),
            Ok("a/x")
        );
        assert_eq!(at(&mut p, t0 + s(1000), &[]), Err(t0 + s(1030)));
        // Also in the middle of a period: what was left of it is dropped.
        assert_eq!(at(&mut p, t0 + s(2000), &["b/y"]).as_deref(), Ok("b/y"));
        assert_eq!(at(&mut p, t0 + s(2000), &[]), Err(t0 + s(2060)));
    }

    #[test]
    fn parents_due_within_a_tick_are_handed_over_at_one_wake() {
        let t0 = Instant::now();
        let mut p = Plan::new(t0, Duration::from_secs(60));
        let names: Vec<String> = (0..1000).map(|i| format!("ns/p{i}")).collect();
        let all: Vec<&str> = names.iter().map(String::as_str).collect();
        let start = t0 + Duration::from_secs(60);
        let mut now = start;
        let (mut wakes, mut handed, mut batch, mut largest) = (0, Vec::new(), 0, 0);
        while handed.len() < all.len() {
            match p.step(now, || keys(&all)) {
                Step::Resync(k) => {
                    // Never later than a tick after its turn (60 ms apart from the start).
                    let due = start + Duration::from_millis(60) * handed.len() as u32;
                    assert!(now <= due + Duration::from_secs(1), "{k} handed over late");
                    handed.push(k);
                    batch += 1;
                }
                Step::Wait(at) => {
                    assert!(at > now, "a wait ends later than it starts");
                    wakes += 1;
                    now = at;
                    largest = largest.max(batch);
                    batch = 0;
                }
            }
        }
        // Still spread over the period: a tick's worth (1 s / 60 ms) at a time.
        let largest = largest.max(batch);
        assert!(largest <= 17, "{largest} parents at one wake");
        // Every parent once, in order, over one period at one wake per second: 1,000
        // parents 60 ms apart would otherwise be 1,000 wakes.
        assert_eq!(handed.iter().map(|k| &**k).collect::<Vec<_>>(), all);
        assert!(wakes <= 60, "{wakes} wakes");
        assert!(now <= t0 + Duration::from_secs(120), "within the period");
        // Waits end on whole ticks from the start.
        assert_eq!((now - t0).subsec_nanos(), 0);
    }

    #[test]
    fn a_parent_younger_than_a_period_waits_for_the_next() {
        let o = |created: Option<&str>| -> DynamicObject {
            let mut o = DynamicObject::new(
                "p",
                &ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            );
            o.metadata.creation_timestamp = created
                .map(|t| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t.parse().unwrap()));
            o
        };
        let cutoff: jiff::Timestamp = "2026-11-25T12:00:00Z".parse().unwrap();
        assert!(created_before(&o(Some("2026-11-25T11:59:59Z")), cutoff));
        assert!(!created_before(&o(Some("2026-11-25T12:00:01Z")), cutoff));
        assert!(created_before(&o(None), cutoff));
    }

    #[test]
    fn keys_name_namespaced_and_cluster_scoped_parents() {
        let ar = ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        let o = oref("ns/a", &ar).unwrap();
        assert_eq!((o.namespace.as_deref(), o.name.as_str()), (Some("ns"), "a"));
        let o = oref("/a", &ar).unwrap();
        assert_eq!((o.namespace.as_deref(), o.name.as_str()), (None, "a"));
    }
}
