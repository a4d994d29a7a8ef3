//! Fights: someone else keeps changing fields Rulebook manages on a child. Each change is
//! drift and would be repaired at once, so two controllers (or a person and Rulebook)
//! could write in a hot loop. After [`FIGHT_LIMIT`] repairs within [`FIGHT_WINDOW`],
//! repairs of that child wait (16 s, 32 s, … the backoff cap) with a stable message, and a
//! fight with no repair for [`FIGHT_FORGET`] is forgotten.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::backoff::BackoffPolicy;
use crate::reconcile::error::ReconcileError;

/// Re-applies of one child because someone else changed its fields.
struct Fight {
    window_start: Instant,
    reapplies: u32,
    /// Repairs wait until then; `backoff` is how long that block is.
    blocked_until: Option<Instant>,
    backoff: Duration,
    strikes: u32,
    /// The last repair; a fight with no repair for [`FIGHT_FORGET`] is forgotten.
    last_repair: Instant,
}

/// More drift repairs than this within [`FIGHT_WINDOW`] is a fight: back off.
const FIGHT_LIMIT: u32 = 3;
const FIGHT_WINDOW: Duration = Duration::from_secs(60);
/// A fight with no repair for this long is over: a later one starts from scratch.
const FIGHT_FORGET: Duration = Duration::from_secs(600);

/// The fights of one rule's children, by child UID.
#[derive(Default)]
pub struct Fights(Mutex<HashMap<String, Fight>>);

impl Fights {
    /// Called before repairing drift of child `uid` (named `what`): `Ok` to repair now,
    /// or the [`ReconcileError::Fight`] to report while repairs of it wait. `by` names the
    /// other writers, for the message.
    pub fn before_repair(
        &self,
        uid: &str,
        what: &str,
        by: impl FnOnce() -> String,
        backoff: &BackoffPolicy,
        now: Instant,
    ) -> Result<(), ReconcileError> {
        let mut fights = self.0.lock();
        fights.retain(|_, f| {
            now.duration_since(f.last_repair) < FIGHT_FORGET
                || f.blocked_until.is_some_and(|u| u > now)
        });
        let f = fights.entry(uid.to_string()).or_insert(Fight {
            window_start: now,
            reapplies: 0,
            blocked_until: None,
            backoff: Duration::ZERO,
            strikes: 0,
            last_repair: now,
        });
        if let Some(until) = f.blocked_until
            && now < until
        {
            // The message stays the same for the whole block (no countdown), so the
            // reconciles the other side's writes trigger write no status and no event.
            let message = format!(
                "{what}: fields Rulebook manages keep being changed by {}; Rulebook backs off and repairs them {}s after the last repair",
                by(),
                f.backoff.as_secs()
            );
            return Err(ReconcileError::Fight {
                message,
                retry_in: until - now,
            });
        }
        f.last_repair = now;
        if now.duration_since(f.window_start) > FIGHT_WINDOW {
            f.window_start = now;
            f.reapplies = 0;
        }
        f.reapplies += 1;
        if f.reapplies > FIGHT_LIMIT {
            f.strikes = f.strikes.saturating_add(1);
            let wait = backoff.delay(f.strikes + 4); // 16 s, 32 s, … up to the cap
            f.blocked_until = Some(now + wait);
            f.backoff = wait;
            f.window_start = now;
            f.reapplies = 0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_repairs_back_off_with_a_stable_message() {
        let fights = Fights::default();
        let p = BackoffPolicy::default();
        let t0 = Instant::now();
        let by = || "field manager kubectl".to_string();
        // Four repairs in a minute: the fourth is allowed and starts a 16 s block.
        for i in 0..4 {
            let t = t0 + Duration::from_secs(i);
            assert!(fights.before_repair("u", "ConfigMap c", by, &p, t).is_ok());
        }
        let blocked = |t| match fights.before_repair("u", "ConfigMap c", by, &p, t) {
            Err(ReconcileError::Fight { message, retry_in }) => Some((message, retry_in)),
            _ => None,
        };
        let (m1, r1) = blocked(t0 + Duration::from_secs(5)).unwrap();
        let (m2, r2) = blocked(t0 + Duration::from_secs(10)).unwrap();
        assert_eq!(m1, m2);
        assert!(m1.contains("16s") && m1.contains("kubectl"), "{m1}");
        assert!(r2 < r1);
        // After the block, repairs go on; another child is not affected.
        assert!(blocked(t0 + Duration::from_secs(20)).is_none());
        assert!(fights.before_repair("v", "ConfigMap d", by, &p, t0).is_ok());
    }
}
