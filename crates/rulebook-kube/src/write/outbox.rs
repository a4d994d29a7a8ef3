//! Where events wait to be sent: one outbox per process, bounded in all and per
//! namespace, serving namespaces in turn.
//!
//! Like client-go's broadcaster queue, at most [`QUEUED_EVENTS`] events wait and
//! [`SENDING_EVENTS`] requests go at once; past that an event is dropped and counted
//! (`rulebook_events_dropped_total{reason}`). A reconcile never waits for an event, and a
//! slow or throttled API server cannot make the events that tenants' parents cause pile
//! up in memory, or take more than two of the API server's concurrent requests from the
//! writes that converge parents. Parents' authors are tenants: once three quarters of
//! the outbox wait, a namespace with [`QUEUED_PER_NAMESPACE`] events waiting may add no
//! more, and the namespaces take turns, so one tenant's burst (a thousand parents
//! failing at once) neither crowds out another namespace's events (a quarter of the
//! outbox stays for the others, a hundred each) nor holds them back for long: another
//! namespace's next event is taken after at most one more of the first's (two may be in
//! flight already). The share is per namespace, the unit of tenancy Kubernetes gives; a
//! tenant with several namespaces has a share in each. A busy namespace alone (500
//! parents failing at once, each with its Warning) still fits: a dropped Warning is
//! recorded again on the parent's next failure, so drops would make persistently
//! failing parents write again.
//! (client-go limits events per object for the same purpose; here the series cache and
//! the once-per-warning rule already keep one object's repeats down.)

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// The label of `rulebook_events_dropped_total` (the operator's metrics registry holds
/// the family and hands it to [`Outbox::new`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DroppedLabel {
    /// One of [`EVENTS_DROPPED_REASONS`].
    pub reason: String,
}

/// Why an event was dropped unsent ([`Dropped`]), as the metric's label reads it.
pub const EVENTS_DROPPED_REASONS: [&str; 2] = ["outbox_full", "namespace_share"];

/// Events waiting at most (client-go's broadcaster queues 1,000).
pub const QUEUED_EVENTS: usize = 1000;
/// Events waiting from one namespace at most, once three quarters of the outbox wait.
pub const QUEUED_PER_NAMESPACE: usize = 100;
/// Event requests in flight at once.
pub const SENDING_EVENTS: usize = 2;
/// Why an event was dropped before it was sent (the `reason` of
/// `rulebook_events_dropped_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// The outbox held [`QUEUED_EVENTS`] already.
    OutboxFull,
    /// Three quarters of the outbox waited and the event's namespace held its share.
    NamespaceShare,
}

impl Dropped {
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::OutboxFull => "outbox_full",
            Dropped::NamespaceShare => "namespace_share",
        }
    }
}

/// An event's send, waiting its turn.
type Pending = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// The events waiting, one queue per namespace, and whose turn is next.
#[derive(Default)]
struct Queues {
    by_namespace: HashMap<String, VecDeque<Pending>>,
    /// Namespaces with events waiting, in the order they are served.
    turns: VecDeque<String>,
    waiting: usize,
    senders: usize,
}

impl Queues {
    /// The next event to send: the first of the namespace whose turn it is, which then
    /// goes to the back of the line if it has more.
    fn next(&mut self) -> Option<Pending> {
        while let Some(namespace) = self.turns.pop_front() {
            // A namespace has a turn exactly while its queue holds events; one without
            // would be skipped rather than end the sender with events still waiting.
            let Some(queue) = self.by_namespace.get_mut(&namespace) else {
                continue;
            };
            let Some(send) = queue.pop_front() else {
                self.by_namespace.remove(&namespace);
                continue;
            };
            if queue.is_empty() {
                self.by_namespace.remove(&namespace);
            } else {
                self.turns.push_back(namespace);
            }
            self.waiting = self.waiting.saturating_sub(1);
            return Some(send);
        }
        None
    }
}

/// Where events wait for a sender: bounded in all and per namespace, served a namespace
/// at a time in turn, dropping (and counting) what does not fit. A namespace whose
/// parents fail in bulk fills its own queue, not the outbox, and waits its turn like
/// everyone else: an event is taken to be sent after at most one event of each other
/// namespace with events waiting ahead of it.
#[derive(Clone)]
pub struct Outbox {
    queues: Arc<Mutex<Queues>>,
    limits: OutboxLimits,
    dropped: Family<DroppedLabel, Counter>,
    /// Events posted and not yet sent (waiting or in flight).
    unsent: Gauge,
}

/// Takes one event off [`Outbox::unsent`] however its send ends: sent, failed, panicked,
/// or dropped unrun.
struct Unsent(Gauge);

impl Drop for Unsent {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// How much an [`Outbox`] holds and sends at once.
#[derive(Clone, Copy, Debug)]
pub struct OutboxLimits {
    /// Events waiting, in all.
    pub queued: usize,
    /// Events waiting from one namespace, once three quarters of `queued` wait.
    pub per_namespace: usize,
    /// Requests in flight at once.
    pub sending: usize,
}

impl OutboxLimits {
    pub const DEFAULT: OutboxLimits = OutboxLimits {
        queued: QUEUED_EVENTS,
        per_namespace: QUEUED_PER_NAMESPACE,
        sending: SENDING_EVENTS,
    };
}

/// A sender's place, given back however its task ends.
struct Sender {
    queues: Arc<Mutex<Queues>>,
    given_back: bool,
}

impl Sender {
    /// The next event to send; when none waits, the place is given back under the same
    /// lock, so a post never finds a place taken by a sender that is leaving.
    fn next(&mut self) -> Option<Pending> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        let next = queues.next();
        if next.is_none() {
            queues.senders = queues.senders.saturating_sub(1);
            self.given_back = true;
        }
        next
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if !self.given_back {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            queues.senders = queues.senders.saturating_sub(1);
        }
    }
}

impl Outbox {
    pub fn new(limits: OutboxLimits, dropped: Family<DroppedLabel, Counter>) -> Outbox {
        Outbox {
            queues: Arc::default(),
            limits,
            dropped,
            unsent: Gauge::default(),
        }
    }

    /// Counts the events posted and not yet sent in `unsent` (a metric).
    pub fn counting(mut self, unsent: Gauge) -> Outbox {
        self.unsent = unsent;
        self
    }

    /// Runs `send` in the background once a sender is free and it is the turn of
    /// `namespace` (`""` for cluster-scoped objects); `Err`, with `send` dropped unrun
    /// and counted, when the outbox or the namespace's share of it is full.
    pub fn post(
        &self,
        namespace: &str,
        send: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Dropped> {
        let start_sender = {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            let full = if queues.waiting >= self.limits.queued {
                Some(Dropped::OutboxFull)
            } else if queues.waiting >= self.limits.queued - self.limits.queued / 4
                && queues
                    .by_namespace
                    .get(namespace)
                    .is_some_and(|q| q.len() >= self.limits.per_namespace)
            {
                Some(Dropped::NamespaceShare)
            } else {
                None
            };
            if let Some(reason) = full {
                drop(queues);
                self.dropped
                    .get_or_create(&DroppedLabel {
                        reason: reason.as_str().to_string(),
                    })
                    .inc();
                return Err(reason);
            }
            self.unsent.inc();
            let unsent = Unsent(self.unsent.clone());
            let queue = queues
                .by_namespace
                .entry(namespace.to_string())
                .or_default();
            queue.push_back(Box::pin(async move {
                let _unsent = unsent;
                send.await
            }));
            if queue.len() == 1 {
                queues.turns.push_back(namespace.to_string());
            }
            queues.waiting += 1;
            let start = queues.senders < self.limits.sending;
            if start {
                queues.senders += 1;
            }
            start
        };
        if start_sender {
            let mut sender = Sender {
                queues: self.queues.clone(),
                given_back: false,
            };
            tokio::spawn(async move {
                // Each event is taken, and the lock released, before its send runs. A
                // send that panics loses its own event, not the sender.
                while let Some(send) = sender.next() {
                    let _ = AssertUnwindSafe(send).catch_unwind().await;
                }
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metric_knows_every_reason() {
        for reason in [Dropped::OutboxFull, Dropped::NamespaceShare] {
            assert!(EVENTS_DROPPED_REASONS.contains(&reason.as_str()));
        }
    }

    /// `f`'s output, or a failed test if it takes more than five seconds (a stranded
    /// event would hang the test instead).
    async fn within<T>(f: impl Future<Output = T>) -> T {
        match tokio::time::timeout(std::time::Duration::from_secs(5), f).await {
            Ok(out) => out,
            Err(_) => panic!("nothing after 5 s: an event is stranded"),
        }
    }

    fn count(dropped: &Family<DroppedLabel, Counter>, reason: Dropped) -> u64 {
        dropped
            .get_or_create(&DroppedLabel {
                reason: reason.as_str().to_string(),
            })
            .get()
    }

    /// The outbox holds what it may, runs it in order at the set concurrency, and drops
    /// and counts the rest.
    #[tokio::test]
    async fn the_outbox_is_bounded_ordered_and_counts_what_it_drops() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dropped = Family::<DroppedLabel, Counter>::default();
        let unsent = Gauge::default();
        let outbox = Outbox::new(
            OutboxLimits {
                queued: 3,
                per_namespace: 3,
                sending: 1,
            },
            dropped.clone(),
        )
        .counting(unsent.clone());
        let (open, gate) = tokio::sync::watch::channel(false);
        let order = Arc::new(Mutex::new(Vec::new()));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut posted = Vec::new();
        for i in 0..5 {
            let (order, running, most, done) = (
                order.clone(),
                running.clone(),
                most.clone(),
                done_tx.clone(),
            );
            let mut gate = gate.clone();
            posted.push(outbox.post("ns", async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let _ = gate.wait_for(|open| *open).await;
                order.lock().unwrap_or_else(|p| p.into_inner()).push(i);
                running.fetch_sub(1, Ordering::SeqCst);
                let _ = done.send(i);
            }));
        }
        let full = Err(Dropped::OutboxFull);
        assert_eq!(posted, [Ok(()), Ok(()), Ok(()), full, full]);
        assert_eq!(count(&dropped, Dropped::OutboxFull), 2);
        assert_eq!(unsent.get(), 3, "the events held, unsent");
        let _ = open.send(true);
        for _ in 0..3 {
            assert!(within(done_rx.recv()).await.is_some());
        }
        // Sent events are no longer unsent (`within` fails the test otherwise).
        within(async {
            while unsent.get() != 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert_eq!(*order.lock().unwrap_or_else(|p| p.into_inner()), [0, 1, 2]);
        assert_eq!(most.load(Ordering::SeqCst), 1);
        // Sent events free their places.
        let (done, mut again) = tokio::sync::mpsc::unbounded_channel();
        assert!(
            outbox
                .post("ns", async move {
                    let _ = done.send(());
                })
                .is_ok()
        );
        assert!(within(again.recv()).await.is_some());
        assert_eq!(count(&dropped, Dropped::OutboxFull), 2);
    }

    /// Past three quarters of the outbox, a namespace fills its own share, not the outbox, and the
    /// namespaces take turns: another namespace's event is posted and goes out after at
    /// most one more of the first's.
    #[tokio::test]
    async fn one_namespace_neither_crowds_out_nor_holds_back_another() {
        let dropped = Family::<DroppedLabel, Counter>::default();
        let outbox = Outbox::new(
            OutboxLimits {
                queued: 8,
                per_namespace: 2,
                sending: 1,
            },
            dropped.clone(),
        );
        let (open, gate) = tokio::sync::watch::channel(false);
        let (sent_tx, mut sent) = tokio::sync::mpsc::unbounded_channel();
        let post = |namespace: &'static str, name: &'static str| {
            let (mut gate, sent) = (gate.clone(), sent_tx.clone());
            outbox.post(namespace, async move {
                let _ = gate.wait_for(|open| *open).await;
                let _ = sent.send(name);
            })
        };
        // The sender takes the first event and waits in it; the rest wait in the outbox.
        assert!(post("hostile", "h0").is_ok());
        tokio::task::yield_now().await;
        // Below three quarters of the outbox (6) a namespace may exceed its share (2);
        // then not.
        let burst: Vec<_> = ["h1", "h2", "h3", "h4", "h5", "h6", "h7"]
            .into_iter()
            .map(|name| post("hostile", name))
            .collect();
        let (ok, share) = (Ok(()), Err(Dropped::NamespaceShare));
        assert_eq!(burst, [ok, ok, ok, ok, ok, ok, share]);
        assert!(post("quiet", "q0").is_ok());
        assert!(post("third", "t0").is_ok());
        assert_eq!(post("third", "t1"), Err(Dropped::OutboxFull));
        assert_eq!(count(&dropped, Dropped::NamespaceShare), 1);
        assert_eq!(count(&dropped, Dropped::OutboxFull), 1);
        let _ = open.send(true);
        let mut order = Vec::new();
        for _ in 0..9 {
            order.extend(within(sent.recv()).await);
        }
        assert_eq!(
            order,
            ["h0", "h1", "q0", "t0", "h2", "h3", "h4", "h5", "h6"]
        );
    }

    /// With two senders and many namespaces, every event posted is sent, and once all
    /// are the outbox holds nothing and its senders are gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_senders_send_everything_and_leave_nothing_behind() {
        let outbox = Outbox::new(OutboxLimits::DEFAULT, Family::default());
        let (sent_tx, mut sent) = tokio::sync::mpsc::unbounded_channel();
        let namespaces = ["a", "b", "c", "d", ""];
        for i in 0..200 {
            let sent = sent_tx.clone();
            let posted = outbox.post(namespaces[i % namespaces.len()], async move {
                tokio::task::yield_now().await;
                let _ = sent.send(i);
            });
            assert!(posted.is_ok());
            if i % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        let mut got = Vec::new();
        for _ in 0..200 {
            got.extend(within(sent.recv()).await);
        }
        got.sort_unstable();
        assert_eq!(got, (0..200).collect::<Vec<_>>());
        // The last sender leaves once it finds nothing more to send.
        within(async {
            while outbox
                .queues
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .senders
                > 0
            {
                tokio::task::yield_now().await;
            }
        })
        .await;
        let queues = outbox.queues.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(queues.waiting, 0);
        assert!(queues.by_namespace.is_empty());
        assert!(queues.turns.is_empty());
    }
}
