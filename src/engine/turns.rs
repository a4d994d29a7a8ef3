//! Whose reconcile runs next: the namespaces take turns.
//!
//! A rule's reconciles share `--concurrency` workers, and kube-runtime starts them in
//! its queue's order (objects triggered together come out in an arbitrary order). One
//! tenant that creates thousands of parents at once — or whose parents an operator
//! restart lists together with everyone's — would make every other namespace's parents
//! wait behind the whole flood: a cross-tenant stall as long as the flood.
//!
//! So every trigger of a rule's reconciles (its parents' watch, its children's and
//! references' watches mapped to parents, relists, resync sweeps) comes here first, and
//! kube-runtime gets only what [`Turns::next`] hands out: at most `--concurrency` parents
//! at a time, each time the first waiting parent of the namespace after the last one
//! served, and a new one when one of them has finished (the controller's results call
//! [`Turns::done`]). Another namespace's parent therefore starts after at most one more
//! parent of each namespace ahead of it, however many a flooding one has waiting; with a
//! single namespace busy nothing changes.
//!
//! Triggers of a parent already waiting here merge into its one entry, as they did in
//! kube-runtime's queue; a trigger of one handed out and not finished yet queues it once
//! more after it finishes.
//!
//! A failed parent's retry comes here too when its backoff ends (`memory::Backoffs`), so
//! forty failing parents retried together take their namespace's turns rather than every
//! worker. Until then, a change of an object it references does not reconcile it
//! ([`Turns::mapped_unless_held`], with the rule's `held` predicate): the retry reads the
//! object. Otherwise every edit of one object that twenty failing parents select would
//! reconcile all twenty at once, each time (issue 41, F3). Such a trigger of a parent
//! still running is weighed when it finishes (after its failure has set its backoff),
//! and one of a waiting parent when its turn comes. A waiting parent costs its name in
//! two maps; kube-runtime itself never holds more than `--concurrency` of them (plus its
//! own timed requeues, `Action::requeue`, which do not pass here).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::controller::{self, Action};
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::{self, Metrics};
use crate::reconcile::memory::Backoffs;

/// A parent: `(namespace, name)`.
pub type Key = (Option<String>, String);

/// Whether a parent is held back from triggers that may wait (in error backoff).
pub type Held = Box<dyn Fn(&Key) -> bool + Send + Sync>;

/// The reconcile turns of one rule.
pub struct Turns {
    state: Mutex<State>,
    held: Held,
    /// The controller's side of [`Turns::next`], woken when a turn may be handed out.
    waker: AtomicWaker,
    /// `rulebook_reconciles_waiting{rule}`.
    gauge: Gauge,
}

/// Whether a parent handed out was triggered again meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Again {
    No,
    /// Only by triggers that a backoff holds back: queued unless it is held once done.
    UnlessHeld,
    Yes,
}

struct State {
    /// Parents handed out at once, at most.
    capacity: usize,
    /// Handed out and not finished, and whether triggered again meanwhile.
    running: HashMap<Key, Again>,
    /// Waiting parents (each in `by_namespace` once), and how they were triggered.
    waiting: HashMap<Key, Again>,
    by_namespace: HashMap<Option<String>, VecDeque<String>>,
    /// The namespaces with parents waiting, in the order of their turns.
    order: VecDeque<Option<String>>,
}

impl Turns {
    /// The turns of rule `rule`'s reconciles, counted in
    /// `rulebook_reconciles_waiting{rule}`; `backoffs` holds the parents in error backoff.
    pub fn new(
        concurrency: u16,
        metrics: &Metrics,
        rule: &str,
        backoffs: &Arc<Backoffs>,
    ) -> Arc<Turns> {
        let backoffs = backoffs.clone();
        Turns::with_gauge(
            concurrency.into(),
            metrics.waiting.get_or_create(&metrics::rule(rule)).clone(),
            Box::new(move |k| backoffs.holds(k, tokio::time::Instant::now())),
        )
    }

    fn with_gauge(concurrency: usize, gauge: Gauge, held: Held) -> Arc<Turns> {
        gauge.set(0);
        Arc::new(Turns {
            held,
            state: Mutex::new(State {
                capacity: concurrency.max(1),
                running: HashMap::new(),
                waiting: HashMap::new(),
                by_namespace: HashMap::new(),
                order: VecDeque::new(),
            }),
            waker: AtomicWaker::new(),
            gauge,
        })
    }

    /// Parent `key` should be reconciled.
    pub fn trigger(&self, key: Key) {
        self.trigger_as(key, Again::Yes);
    }

    /// Parent `key` should be reconciled, unless it is held (in error backoff) now or,
    /// if it is running, once it is done.
    pub fn trigger_unless_held(&self, key: Key) {
        if (self.held)(&key) {
            return;
        }
        self.trigger_as(key, Again::UnlessHeld);
    }

    fn trigger_as(&self, key: Key, how: Again) {
        let mut s = lock(&self.state);
        if let Some(again) = s.running.get_mut(&key) {
            *again = (*again).max(how);
            return;
        }
        s.enqueue(key, how);
        self.publish(&s);
        drop(s);
        self.waker.wake();
    }

    /// A reconcile of `key` finished (or could not start: its parent is gone).
    pub fn done(&self, key: &Key) {
        let mut s = lock(&self.state);
        let Some(again) = s.running.remove(key) else {
            // Not one handed out here (a timed requeue of kube-runtime's own).
            return;
        };
        // Its failure, if it failed, has set its backoff by now (kube-runtime applies
        // the error policy before it reports the reconcile).
        if again == Again::Yes || (again == Again::UnlessHeld && !(self.held)(key)) {
            s.enqueue(key.clone(), again);
        }
        self.publish(&s);
        drop(s);
        self.waker.wake();
    }

    /// The parent whose turn it is, if one waits and fewer than the capacity run.
    fn take(&self) -> Option<Key> {
        let mut s = lock(&self.state);
        if s.running.len() >= s.capacity {
            return None;
        }
        while let Some(ns) = s.order.pop_front() {
            let Some(queue) = s.by_namespace.get_mut(&ns) else {
                continue;
            };
            let next = queue.pop_front();
            if queue.is_empty() {
                s.by_namespace.remove(&ns);
            } else {
                s.order.push_back(ns.clone());
            }
            let Some(name) = next else { continue };
            let key = (ns, name);
            // Queued only by triggers that a backoff holds back, and held by now (it
            // failed meanwhile, run by its own retry): its retry comes when it ends.
            if s.waiting.remove(&key) == Some(Again::UnlessHeld) && (self.held)(&key) {
                self.publish(&s);
                continue;
            }
            s.running.insert(key.clone(), Again::No);
            self.publish(&s);
            return Some(key);
        }
        None
    }

    /// The parents to reconcile, as their turns come; for kube-runtime's `reconcile_on`.
    pub fn next(self: Arc<Self>) -> impl Stream<Item = Key> + Send + 'static {
        futures::stream::poll_fn(move |cx| {
            if let Some(k) = self.take() {
                return Poll::Ready(Some(k));
            }
            self.waker.register(cx.waker());
            // A trigger or a finish between the first look and the registration.
            match self.take() {
                Some(k) => Poll::Ready(Some(k)),
                None => Poll::Pending,
            }
        })
    }

    /// The parents to reconcile as kube-runtime names them (`reconcile_on`).
    pub fn handed_out(
        self: &Arc<Self>,
        parent: ApiResource,
    ) -> impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static {
        self.clone().next().map(move |(ns, name)| {
            let r = ObjectRef::new_with(&name, parent.clone());
            match ns {
                Some(ns) => r.within(&ns),
                None => r,
            }
        })
    }

    /// The parents' watch as the controller's own trigger: each object triggers here,
    /// the errors go on to the controller (which reports them).
    pub fn watched<E: Send + 'static>(
        self: &Arc<Self>,
        parents: impl Stream<Item = Result<DynamicObject, E>> + Send + 'static,
    ) -> impl Stream<Item = Result<DynamicObject, E>> + Send + 'static {
        let turns = self.clone();
        parents.filter_map(move |r| {
            futures::future::ready(match r {
                Ok(o) => {
                    turns.trigger((o.namespace(), o.name_any()));
                    None
                }
                Err(e) => Some(Err(e)),
            })
        })
    }

    /// A mapper of related objects to parents (`watches_stream_with`) that triggers here
    /// and gives kube-runtime nothing.
    pub fn mapped<T>(
        self: &Arc<Self>,
        to_parents: impl Fn(T) -> Vec<Key> + Send + Sync + 'static,
    ) -> impl Fn(T) -> Vec<ObjectRef<DynamicObject>> + Send + Sync + 'static {
        let turns = self.clone();
        move |o| {
            to_parents(o).into_iter().for_each(|k| turns.trigger(k));
            Vec::new()
        }
    }

    /// Like [`Turns::mapped`], for objects whose change may wait out a parent's error
    /// backoff ([`Turns::trigger_unless_held`]): referenced objects.
    pub fn mapped_unless_held<T>(
        self: &Arc<Self>,
        to_parents: impl Fn(T) -> Vec<Key> + Send + Sync + 'static,
    ) -> impl Fn(T) -> Vec<ObjectRef<DynamicObject>> + Send + Sync + 'static {
        let turns = self.clone();
        move |o| {
            to_parents(o)
                .into_iter()
                .for_each(|k| turns.trigger_unless_held(k));
            Vec::new()
        }
    }

    /// Triggers every cached parent for each item of `relists`; gives kube-runtime
    /// nothing (for `reconcile_on`, which also keeps polling it).
    pub fn all_on(
        self: &Arc<Self>,
        relists: impl Stream<Item = ()> + Send + 'static,
        parents: Store<DynamicObject>,
    ) -> impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static {
        let turns = self.clone();
        relists.filter_map(move |()| {
            for p in parents.state() {
                turns.trigger((p.namespace(), p.name_any()));
            }
            futures::future::ready(None)
        })
    }

    /// Triggers each parent `keys` names (retries after a backoff); gives kube-runtime
    /// nothing.
    pub fn keyed(
        self: &Arc<Self>,
        keys: impl Stream<Item = Key> + Send + 'static,
    ) -> impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static {
        let turns = self.clone();
        keys.filter_map(move |k| {
            turns.trigger(k);
            futures::future::ready(None)
        })
    }

    /// Triggers each parent `refs` names (a resync sweep); gives kube-runtime nothing.
    pub fn each_of(
        self: &Arc<Self>,
        refs: impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static,
    ) -> impl Stream<Item = ObjectRef<DynamicObject>> + Send + 'static {
        let turns = self.clone();
        refs.filter_map(move |r| {
            turns.trigger((r.namespace, r.name));
            futures::future::ready(None)
        })
    }

    /// Follows one of the controller's results: the reconcile it names has finished (or
    /// could not start, its parent gone).
    pub fn finished<E1, E2>(
        &self,
        result: &Result<(ObjectRef<DynamicObject>, Action), controller::Error<E1, E2>>,
    ) {
        let r = match result {
            Ok((r, _)) => r,
            Err(
                controller::Error::ReconcilerFailed(_, r) | controller::Error::ObjectNotFound(r),
            ) => &**r,
            Err(_) => return,
        };
        self.done(&(r.namespace.clone(), r.name.clone()));
    }

    fn publish(&self, s: &State) {
        self.gauge
            .set(i64::try_from(s.waiting.len()).unwrap_or(i64::MAX));
    }
}

impl State {
    fn enqueue(&mut self, key: Key, how: Again) {
        if let Some(was) = self.waiting.get_mut(&key) {
            *was = (*was).max(how);
            return;
        }
        self.waiting.insert(key.clone(), how);
        let (ns, name) = key;
        let queue = self.by_namespace.entry(ns.clone()).or_default();
        queue.push_back(name);
        if queue.len() == 1 {
            self.order.push_back(ns);
        }
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        // The rule stopped (removed, moved to another replica): nothing waits here.
        self.gauge.set(0);
    }
}

/// The controller's backoff of its trigger streams: none. kube-runtime pauses all of a
/// controller's trigger streams together after an error in any of them, and the turns
/// are one of those streams, so a watch error (a routine `410 Gone`) would stop parents
/// being handed out while reconciles finish. Every watch backs off by itself already
/// (`default_backoff`).
pub struct NoBackoff;

impl Iterator for NoBackoff {
    type Item = std::time::Duration;
    fn next(&mut self) -> Option<Self::Item> {
        Some(std::time::Duration::ZERO)
    }
}

impl kube::runtime::utils::Backoff for NoBackoff {
    fn reset(&mut self) {}
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn key(ns: &str, name: &str) -> Key {
        (Some(ns.to_string()), name.to_string())
    }

    /// At most the capacity runs; a namespace with many parents waiting does not hold
    /// back another's (it starts after one more of the first's); triggers of a waiting
    /// parent merge, one of a running parent queues it once more after it; a finish
    /// that was not handed out here changes nothing.
    #[tokio::test]
    async fn namespaces_take_turns() {
        let turns = Turns::with_gauge(2, Gauge::default(), Box::new(|_| false));
        for i in 0..10 {
            turns.trigger(key("flood", &format!("p{i}")));
        }
        turns.trigger(key("flood", "p3"));
        turns.trigger(key("quiet", "q"));
        assert_eq!(turns.gauge.get(), 11, "the repeated trigger merged");
        let mut next = turns.clone().next();
        let first = next.next().await;
        let second = next.next().await;
        assert_eq!(first, Some(key("flood", "p0")));
        assert_eq!(
            second,
            Some(key("quiet", "q")),
            "right after one of the flood's"
        );
        // Full: nothing more until one finishes.
        assert!(futures::poll!(next.next()).is_pending());
        turns.done(&key("elsewhere", "timer"));
        assert!(futures::poll!(next.next()).is_pending());
        // Triggered while running: queued once more when done, behind the flood.
        turns.trigger(key("quiet", "q"));
        turns.done(&key("quiet", "q"));
        let mut order = Vec::new();
        for _ in 0..10 {
            let k = tokio::time::timeout(std::time::Duration::from_secs(5), next.next())
                .await
                .expect("a turn comes")
                .expect("the stream goes on");
            turns.done(&k);
            order.push(k);
        }
        assert_eq!(
            order[..2],
            [key("flood", "p1"), key("quiet", "q")],
            "{order:?}"
        );
        assert!(futures::poll!(next.next()).is_pending());
        turns.done(&key("flood", "p0"));
        let s = lock(&turns.state);
        assert!(s.running.is_empty() && s.waiting.is_empty() && s.order.is_empty());
        assert_eq!(turns.gauge.get(), 0);
    }

    /// A parent in error backoff is not queued by a trigger that may wait (a reference's
    /// change), neither at once nor when its running reconcile finishes having failed;
    /// any other trigger still queues it, and one that is not held is queued as before.
    #[tokio::test]
    async fn a_held_parent_waits_out_its_backoff_on_reference_triggers() {
        use std::collections::HashSet;
        let held: Arc<Mutex<HashSet<Key>>> = Arc::default();
        let h = held.clone();
        let turns = Turns::with_gauge(4, Gauge::default(), Box::new(move |k| lock(&h).contains(k)));
        let mut next = turns.clone().next();
        lock(&held).insert(key("big", "p0"));
        turns.trigger_unless_held(key("big", "p0"));
        turns.trigger_unless_held(key("big", "p1"));
        assert_eq!(next.next().await, Some(key("big", "p1")));
        assert!(futures::poll!(next.next()).is_pending(), "p0 is held");
        // p1 fails while a reference changes: held once done, it is not queued again.
        turns.trigger_unless_held(key("big", "p1"));
        lock(&held).insert(key("big", "p1"));
        turns.done(&key("big", "p1"));
        assert!(futures::poll!(next.next()).is_pending(), "p1 is held");
        // Its own change (the parent's watch) still queues a held parent.
        turns.trigger(key("big", "p0"));
        assert_eq!(next.next().await, Some(key("big", "p0")));
        // A reference's change of a running parent not held queues it once more after
        // it succeeds.
        lock(&held).clear();
        turns.trigger_unless_held(key("big", "p0"));
        turns.done(&key("big", "p0"));
        let again = tokio::time::timeout(std::time::Duration::from_secs(5), next.next()).await;
        assert_eq!(again.ok().flatten(), Some(key("big", "p0")));
        turns.done(&key("big", "p0"));
        assert!(futures::poll!(next.next()).is_pending());
        // Queued by a reference's change, then held before its turn came (its own retry
        // ran and failed meanwhile): dropped when its turn comes.
        let mut full = Vec::new();
        for i in 0..4 {
            turns.trigger(key("other", &format!("q{i}")));
            full.push(next.next().await);
        }
        turns.trigger_unless_held(key("big", "p2"));
        turns.trigger(key("small", "s"));
        lock(&held).insert(key("big", "p2"));
        turns.done(&key("other", "q0"));
        assert_eq!(next.next().await, Some(key("small", "s")), "{full:?}");
        assert_eq!(turns.gauge.get(), 0, "p2 is no longer waiting");
    }
}
