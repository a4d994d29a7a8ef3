//! The bounded use of the blocking pool by the webhook's handlers: every check, default
//! and conversion evaluates there, at most `permits` at once (beside the reconciles'
//! own), so a hostile object spends its rule's budgets there, never this runtime's worker
//! threads, and a burst of reviews waits for a permit (within the server's deadline)
//! instead of taking every blocking thread. A file of its own so that the handlers'
//! wiring (handlers.rs) and the admission handler (admission.rs) both use it without
//! importing each other.
//!
//! A review's handler runs its evaluations in its class's lane ([`Offload::in_lane`],
//! fair.rs): the lane's permit first, then the pool's, so a namespace that floods waits
//! in its own queue rather than in front of every other namespace's reviews.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Runs evaluations on the blocking pool, at most `permits` at once.
#[derive(Clone)]
pub struct Offload {
    permits: Arc<Semaphore>,
    /// The review's class's lane, when the server gave one.
    lane: Option<Arc<Semaphore>>,
}

/// A class's evaluation lane (`fair::Slot::lane`), if the review has one.
pub type Lane = Option<Arc<Semaphore>>;

impl Offload {
    pub fn new(permits: usize) -> Offload {
        Offload {
            permits: Arc::new(Semaphore::new(permits.max(1))),
            lane: None,
        }
    }

    /// The same pool, whose evaluations first take a permit of `lane`.
    pub fn in_lane(&self, lane: Lane) -> Offload {
        Offload {
            permits: self.permits.clone(),
            lane,
        }
    }

    /// `work` on the blocking pool once a permit is free; `None` when it could not
    /// run (the pool shut down, the work panicked). A caller that gives up (the
    /// server's deadline) leaves the evaluation to finish under its rule's budgets,
    /// still holding its permit, so abandoned work is bounded too.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let lane = match &self.lane {
            Some(l) => Some(l.clone().acquire_owned().await.ok()?),
            None => None,
        };
        let permit = self.permits.clone().acquire_owned().await.ok()?;
        tokio::task::spawn_blocking(move || {
            let _permits = (lane, permit);
            work()
        })
        .await
        .ok()
    }
}
