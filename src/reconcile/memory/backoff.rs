//! Error backoff: the policy (how long a parent waits after failures in a row) and
//! [`Backoffs`], the parents in error backoff, by namespace and name, until when. A change
//! of an object such a parent references does not reconcile it before then
//! (`engine::turns`): its requeue reads the object at the end of the backoff.
//!
//! A [`Backoffs`] entry only ever delays a reconcile that a reference's change brings, to
//! the requeue its failure scheduled; a restart forgets them (each parent is reconciled
//! once at start) and so does a success.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

/// Tokio's clock: the retries sleep on it (and tests pause it).
type TokioInstant = tokio::time::Instant;

/// A parent: `(namespace, name)`.
pub type ParentKey = (Option<String>, String);

/// The parents in error backoff, until when (see the module comment), and their retries:
/// [`Backoffs::retries`] names each parent when its backoff ends, for the rule's turns to
/// reconcile it (a retry takes its namespace's turn like any other trigger: a flood of
/// failing parents retried together does not hold back other namespaces). An entry goes
/// with the parent's next success or its retry.
#[derive(Default)]
pub struct Backoffs {
    state: Mutex<BackoffState>,
    /// Woken when a backoff is set: the retries may be due earlier.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct BackoffState {
    until: HashMap<ParentKey, TokioInstant>,
    due: std::collections::BTreeSet<(TokioInstant, ParentKey)>,
}

impl Backoffs {
    /// Parent `key` failed, to be retried at `until`.
    pub fn failed(&self, key: ParentKey, until: TokioInstant) {
        let mut s = self.state.lock();
        if let Some(was) = s.until.insert(key.clone(), until) {
            s.due.remove(&(was, key.clone()));
        }
        s.due.insert((until, key));
        drop(s);
        self.changed.notify_one();
    }

    /// Parent `key` reconciled without error: no retry.
    pub fn succeeded(&self, key: &ParentKey) {
        let mut s = self.state.lock();
        if let Some(was) = s.until.remove(key) {
            s.due.remove(&(was, key.clone()));
        }
    }

    /// Whether parent `key` is in error backoff at `now`.
    pub fn holds(&self, key: &ParentKey, now: TokioInstant) -> bool {
        self.state.lock().until.get(key).is_some_and(|t| *t > now)
    }

    pub fn len(&self) -> usize {
        self.state.lock().until.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parent whose retry is due at `now`, taken out.
    fn take_due(&self, now: TokioInstant) -> Result<ParentKey, Option<TokioInstant>> {
        let mut s = self.state.lock();
        match s.due.first() {
            Some((at, _)) if *at <= now => {}
            Some((at, _)) => return Err(Some(*at)),
            None => return Err(None),
        }
        let (_, key) = s.due.pop_first().ok_or(None)?;
        s.until.remove(&key);
        Ok(key)
    }

    /// Each parent as its backoff ends.
    pub fn retries(self: Arc<Self>) -> impl futures::Stream<Item = ParentKey> + Send + 'static {
        futures::stream::unfold(self, |b| async move {
            loop {
                match b.take_due(TokioInstant::now()) {
                    Ok(key) => return Some((key, b)),
                    Err(Some(at)) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at) => {}
                            () = b.changed.notified() => {}
                        }
                    }
                    Err(None) => b.changed.notified().await,
                }
            }
        })
    }
}

/// Per-object exponential backoff after failures.
#[derive(Clone, Debug)]
pub struct BackoffPolicy {
    pub base: Duration,
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffPolicy {
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let d = self.base.saturating_mul(1u32 << exp);
        d.min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let p = BackoffPolicy::default();
        assert_eq!(p.delay(1), Duration::from_secs(1));
        assert_eq!(p.delay(2), Duration::from_secs(2));
        assert_eq!(p.delay(5), Duration::from_secs(16));
        assert_eq!(p.delay(30), Duration::from_secs(300));
    }
}
