//! The bounded use of the blocking pool by the webhook's handlers: every check, default
//! and conversion evaluates there, at most `permits` at once (beside the reconciles'
//! own), so a hostile object spends its rule's budgets there, never this runtime's worker
//! threads, and a burst of reviews waits for a permit (within the server's deadline)
//! instead of taking every blocking thread. A file of its own so that the handlers'
//! wiring (handlers.rs) and the admission handler (admission.rs) both use it without
//! importing each other.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Runs evaluations on the blocking pool, at most `permits` at once.
#[derive(Clone)]
pub struct Offload {
    permits: Arc<Semaphore>,
}

impl Offload {
    pub fn new(permits: usize) -> Offload {
        Offload {
            permits: Arc::new(Semaphore::new(permits.max(1))),
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
        let permit = self.permits.clone().acquire_owned().await.ok()?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .ok()
    }
}
