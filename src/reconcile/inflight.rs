//! The memory of reconcile inputs in flight, bounded for the whole process.
//!
//! Each parent's reconcile reads its inputs (the parent, its live children, the objects
//! its references select) into JSON and then into the template context, which costs a
//! few times their cached size while the render and status hold them. The per-parent
//! bounds (`parent_reference_bytes`, the render budget) bound one parent; but every rule
//! runs `--concurrency` reconciles, and one tenant's parents can each be just under
//! their bound: 20 parents selecting the same 15 MB of ConfigMaps, reconciled together
//! on every edit of one of them, took the operator past 700 MB (issue 41, F3).
//!
//! So a reconcile acquires the weight of its inputs — their size as cached, known before
//! any of them is read into JSON — from one [`InputBudget`] shared by every rule, and
//! holds it ([`InputPermit`]) until its render and status evaluation are done. A parent
//! whose inputs weigh more than one request may hold fails at once, without reading them.
//!
//! Fairness: a big request (more than [`InputBudget::small_max`]) waits in line behind
//! the big ones before it, and the big ones together never hold more than
//! [`InputBudget::big_max`], three quarters of the whole: the rest is kept for small
//! requests, which never queue behind a big one. While a big one waits, a small one
//! proceeds only within that reserve, so small ones cannot keep a big one waiting for
//! ever either. Nothing else waits here: health checks, lease renewal and watches hold
//! no permit, and a waiting reconcile is a parked future.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

pub use crate::metrics::InputMetrics;
use crate::render::budget::human_bytes;

/// Bytes of inputs in flight at once by default (`run --inputs-in-flight-mib`).
pub const DEFAULT_TOTAL: usize = 64 << 20;

/// A request for more than one request may hold.
#[derive(Debug, thiserror::Error)]
#[error(
    "the parent's inputs (parent, live children and referenced objects) weigh {}, more than the {} one reconcile may hold at once (run --inputs-in-flight-mib: {})",
    human_bytes(*.need),
    human_bytes(*.most),
    human_bytes(*.total)
)]
pub struct OverBudget {
    pub need: usize,
    pub most: usize,
    pub total: usize,
}

/// The process's budget of reconcile inputs in flight (see the module comment).
pub struct InputBudget {
    total: usize,
    state: Mutex<State>,
    /// Woken on every release and every big request that leaves the line.
    released: Notify,
    metrics: InputMetrics,
}

#[derive(Default)]
struct State {
    used: usize,
    /// What big requests hold.
    big_used: usize,
    /// The big requests waiting, by ticket, first come first.
    line: VecDeque<u64>,
    next_ticket: u64,
}

impl InputBudget {
    /// A budget of `total` bytes (at least 64 KiB), counted in `metrics`.
    pub fn new(total: usize, metrics: InputMetrics) -> Arc<InputBudget> {
        metrics.in_flight.set(0);
        Arc::new(InputBudget {
            total: total.max(64 << 10),
            state: Mutex::default(),
            released: Notify::new(),
            metrics,
        })
    }

    /// The whole budget.
    pub fn total(&self) -> usize {
        self.total
    }

    /// What big requests hold at most together, and one request at most.
    pub fn big_max(&self) -> usize {
        self.total - self.reserve()
    }

    /// A request of at most this many bytes is small: it never waits behind a big one.
    pub fn small_max(&self) -> usize {
        self.reserve() / 16
    }

    /// What only small requests may use: a quarter of the whole.
    fn reserve(&self) -> usize {
        self.total / 4
    }

    /// Bytes held now.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).used
    }

    /// `bytes`, held until the permit is dropped: at once when they fit, else when they
    /// do (a big request after the big ones before it). Refused when they never could.
    pub async fn acquire(self: &Arc<Self>, bytes: usize) -> Result<InputPermit, OverBudget> {
        let big = self.check(bytes)?;
        if let Some(p) = self.try_grant(bytes, big, None) {
            return Ok(p);
        }
        self.metrics.waits.inc();
        let ticket = big.then(|| Ticket::take(self));
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before looking, so a release in between is not missed.
            released.as_mut().enable();
            if let Some(p) = self.try_grant(bytes, big, ticket.as_ref().map(|t| t.number)) {
                // Served: out of the line (the next big one may fit too).
                drop(ticket);
                return Ok(p);
            }
            released.await;
        }
    }

    /// `bytes` if they fit now (a big request only when no big one waits).
    pub fn try_acquire(self: &Arc<Self>, bytes: usize) -> Result<Option<InputPermit>, OverBudget> {
        let big = self.check(bytes)?;
        Ok(self.try_grant(bytes, big, None))
    }

    /// Whether `bytes` is a big request; refused past [`Self::big_max`].
    fn check(&self, bytes: usize) -> Result<bool, OverBudget> {
        if bytes > self.big_max() {
            self.metrics.refused.inc();
            return Err(OverBudget {
                need: bytes,
                most: self.big_max(),
                total: self.total,
            });
        }
        Ok(bytes > self.small_max())
    }

    /// Grants `bytes` if the rules allow it now. A big request must be first in line
    /// (`ticket`; without one, the line must be empty) and stay within [`Self::big_max`]
    /// with the other big ones; a small one, while a big one waits, within the reserve
    /// with the other small ones.
    fn try_grant(
        self: &Arc<Self>,
        bytes: usize,
        big: bool,
        ticket: Option<u64>,
    ) -> Option<InputPermit> {
        let mut s = lock(&self.state);
        if s.used + bytes > self.total {
            return None;
        }
        if big {
            let first = s.line.front().copied() == ticket;
            if !first || s.big_used + bytes > self.big_max() {
                return None;
            }
            s.big_used += bytes;
        } else if !s.line.is_empty() && (s.used - s.big_used) + bytes > self.reserve() {
            return None;
        }
        s.used += bytes;
        self.publish(&s);
        Some(InputPermit {
            budget: self.clone(),
            bytes,
            big,
        })
    }

    fn release(&self, bytes: usize, big: bool) {
        let mut s = lock(&self.state);
        s.used -= bytes;
        if big {
            s.big_used -= bytes;
        }
        self.publish(&s);
        drop(s);
        self.released.notify_waiters();
    }

    fn publish(&self, s: &State) {
        self.metrics
            .in_flight
            .set(i64::try_from(s.used).unwrap_or(i64::MAX));
    }
}

/// A big request's place in line; leaves the line when served or dropped (a reconcile
/// cancelled while it waits).
struct Ticket<'a> {
    budget: &'a InputBudget,
    number: u64,
}

impl<'a> Ticket<'a> {
    fn take(budget: &'a InputBudget) -> Ticket<'a> {
        let mut s = lock(&budget.state);
        let number = s.next_ticket;
        s.next_ticket += 1;
        s.line.push_back(number);
        Ticket { budget, number }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.budget.state);
        s.line.retain(|t| *t != self.number);
        drop(s);
        // The next in line may fit now; and small ones may use more than the reserve.
        self.budget.released.notify_waiters();
    }
}

/// Bytes of the [`InputBudget`] held; given back when dropped.
pub struct InputPermit {
    budget: Arc<InputBudget>,
    bytes: usize,
    big: bool,
}

impl InputPermit {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for InputPermit {
    fn drop(&mut self) {
        self.budget.release(self.bytes, self.big);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
#[path = "inflight_tests.rs"]
mod tests;
