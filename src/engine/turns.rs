//! Whose reconcile runs next: the namespaces take turns.
//!
//! A rule's reconciles share `--concurrency` workers. kube-runtime starts them in the
//! order their objects were triggered, so one tenant that creates thousands of parents
//! at once (or whose parents an operator restart lists first: a listing comes in
//! namespace order) would make every other namespace's parents wait behind all of them —
//! a cross-tenant stall as long as the flood. So kube-runtime runs the rule's
//! controller without a bound of its own and every reconcile first waits here for a
//! turn: at most `concurrency` run at once, and when one ends the next turn goes to the
//! namespace after the last one served that has a reconcile waiting (within a namespace,
//! in the order they came). Another namespace's parent therefore starts after at most one
//! more reconcile of each namespace ahead of it, however many the flooding one has
//! waiting; with a single namespace busy nothing changes (no worker idles while a
//! reconcile waits).
//!
//! A reconcile waiting for its turn holds a small future (the reconcile's own state is
//! boxed once it starts) and its parent as cached; kube-runtime still runs at most one
//! reconcile per object and collects the triggers that arrive meanwhile into one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{oneshot, watch};

use crate::metrics::{self, Metrics};
use crate::reconcile::{self, ReconcileError, RuleContext};

/// The right to run one reconcile; the next turn is handed out when it is dropped.
pub struct Turn {
    turns: Option<Arc<Turns>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(t) = self.turns.take() {
            t.release();
        }
    }
}

/// The turns of one rule's reconciles.
pub struct Turns {
    state: Mutex<State>,
    /// `rulebook_reconciles_waiting{rule}`.
    gauge: Gauge,
}

#[derive(Default)]
struct State {
    /// Turns not handed out.
    free: usize,
    /// Reconciles waiting, by namespace (`None`: cluster-scoped parents).
    waiting: HashMap<Option<String>, VecDeque<oneshot::Sender<Turn>>>,
    /// The namespaces with reconciles waiting, in the order they get their turns.
    order: VecDeque<Option<String>>,
    /// Senders in `waiting`.
    queued: usize,
}

impl Turns {
    /// The turns of rule `rule`'s reconciles, counted in
    /// `rulebook_reconciles_waiting{rule}`.
    pub fn new(concurrency: usize, metrics: &Metrics, rule: &str) -> Arc<Turns> {
        Turns::with_gauge(
            concurrency,
            metrics.waiting.get_or_create(&metrics::rule(rule)).clone(),
        )
    }

    fn with_gauge(concurrency: usize, gauge: Gauge) -> Arc<Turns> {
        gauge.set(0);
        Arc::new(Turns {
            state: Mutex::new(State {
                free: concurrency.max(1),
                ..State::default()
            }),
            gauge,
        })
    }

    /// Waits for a turn to reconcile a parent in `namespace`.
    pub async fn take(self: &Arc<Self>, namespace: Option<String>) -> Turn {
        let rx = {
            let mut s = lock(&self.state);
            if s.free > 0 && s.order.is_empty() {
                s.free -= 1;
                return Turn {
                    turns: Some(self.clone()),
                };
            }
            let (tx, rx) = oneshot::channel();
            let queue = s.waiting.entry(namespace.clone()).or_default();
            queue.push_back(tx);
            if queue.len() == 1 {
                s.order.push_back(namespace);
            }
            s.queued += 1;
            self.gauge.set(s.queued as i64);
            rx
        };
        match rx.await {
            Ok(turn) => turn,
            // Not reachable while `self` lives (a sender is dropped only after its turn
            // was handed to it, or to the next waiter); run rather than wait forever.
            Err(_) => Turn { turns: None },
        }
    }

    /// A turn came back: hand it to the next namespace's first waiter still waiting.
    fn release(self: &Arc<Self>) {
        let mut s = lock(&self.state);
        while let Some(ns) = s.order.pop_front() {
            let Some(queue) = s.waiting.get_mut(&ns) else {
                continue;
            };
            let next = queue.pop_front();
            if queue.is_empty() {
                s.waiting.remove(&ns);
            } else {
                s.order.push_back(ns);
            }
            let Some(tx) = next else { continue };
            s.queued -= 1;
            self.gauge.set(s.queued as i64);
            let turn = Turn {
                turns: Some(self.clone()),
            };
            match tx.send(turn) {
                Ok(()) => return,
                // That reconcile was dropped while it waited (the rule stopped): the
                // turn stays with us for the next one, and is not released twice.
                Err(mut turn) => turn.turns = None,
            }
        }
        s.free += 1;
    }

    /// Reconciles waiting for a turn (also those dropped while they waited, until
    /// their turn comes).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        lock(&self.state).queued
    }
}

/// One reconcile of `parent`, once its namespace has its turn; nothing when the rule
/// stops first (a stopping rule does not start what still waits).
pub async fn in_turn(
    turns: Arc<Turns>,
    mut stopped: watch::Receiver<bool>,
    parent: Arc<DynamicObject>,
    ctx: Arc<RuleContext>,
) -> Result<Action, ReconcileError> {
    let turn = tokio::select! {
        t = turns.take(parent.namespace()) => t,
        _ = stopped.wait_for(|s| *s) => return Ok(Action::await_change()),
    };
    // Boxed: a waiting reconcile holds only this future, not the reconcile's state.
    let result = Box::pin(reconcile::reconcile(parent, ctx)).await;
    drop(turn);
    result
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ns(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    /// A namespace with many reconciles waiting does not hold back another's: the
    /// other's starts right after one more of the first's; a single busy namespace uses
    /// every turn; turns are never lost, also when a waiter is dropped.
    #[tokio::test]
    async fn namespaces_take_turns() {
        let turns = Turns::with_gauge(2, Gauge::default());
        let started = Arc::new(Mutex::new(Vec::new()));
        // Two running; a flood of ten in "flood", then one in "quiet".
        let a = turns.take(ns("flood")).await;
        let b = turns.take(ns("flood")).await;
        let mut tasks = Vec::new();
        let spawn = |ns_: &str, i: usize| {
            let turns = turns.clone();
            let started = started.clone();
            let name = format!("{ns_}{i}");
            let ns_ = ns_.to_string();
            tokio::spawn(async move {
                let t = turns.take(ns(&ns_)).await;
                lock(&started).push(name);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(t);
            })
        };
        for i in 0..10 {
            tasks.push(spawn("flood", i));
            tokio::task::yield_now().await;
        }
        // A waiter that goes away must not take a turn with it.
        let gone = tokio::spawn({
            let turns = turns.clone();
            async move {
                let _t = turns.take(ns("gone")).await;
            }
        });
        tokio::task::yield_now().await;
        tasks.push(spawn("quiet", 0));
        while turns.waiting() < 12 {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        assert_eq!(turns.waiting(), 12, "the dropped waiter is still queued");
        drop(a);
        drop(b);
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .expect("every waiter gets a turn")
                .expect("task");
        }
        let order = lock(&started).clone();
        let quiet = order.iter().position(|n| n == "quiet0");
        assert!(
            quiet.is_some_and(|i| i <= 1),
            "the quiet namespace waits for at most one more of the flood's: {order:?}"
        );
        assert_eq!(order.len(), 11);
        assert_eq!(turns.waiting(), 0);
        assert_eq!(turns.gauge.get(), 0);
        let s = lock(&turns.state);
        assert_eq!(s.free, 2, "every turn came back");
        assert!(s.order.is_empty() && s.waiting.is_empty());
    }
}
