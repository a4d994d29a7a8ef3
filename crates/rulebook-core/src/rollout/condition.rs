//! The `Rollout` condition of a parent (docs/reference/rollout.md): what the rollout of
//! its rule means for it — moved, paused, waiting, back on the old version — said in the
//! status write a reconcile makes anyway. A parent that moves, or goes back, gets a new
//! `status.ruleVersion`, so the condition rides on that write; it is never a reason to
//! write by itself (at 10,000 parents that would be 10,000 writes per batch). Pure: the
//! operator decides when to ask.

use super::{Phase, RolloutState};
use crate::render::status::ConditionState;

/// The condition type.
pub const TYPE: &str = "Rollout";

/// The `Rollout` condition of a parent about to be written with rule version `version`
/// during (or after) the rollout `state`, whose plan has `steps` steps. `recorded` is
/// the parent's `status.ruleVersion` before this write and `has_condition` whether it
/// already carries a `Rollout` condition. `None`: nothing new to say (what the parent
/// carries stays as it is).
pub fn condition(
    state: &RolloutState,
    steps: usize,
    version: &str,
    recorded: Option<&str>,
    has_condition: bool,
) -> Option<ConditionState> {
    if state.from == state.to {
        return None;
    }
    let n = steps.max(1);
    let batch = (state.step + 1).min(n);
    let why = state.message.as_deref().unwrap_or("");
    let paused = state.phase == Phase::Paused || state.held;
    if version == state.to {
        let (reason, message) = match state.phase {
            Phase::Complete => (
                "Complete",
                format!("on rule version {version}; its rollout is complete"),
            ),
            _ if paused => (
                "Paused",
                format!(
                    "on rule version {version}, batch {batch} of {n}; the rollout is paused{}",
                    suffix(why)
                ),
            ),
            Phase::Progressing | Phase::Paused => (
                "Moved",
                format!("on rule version {version}, batch {batch} of {n}"),
            ),
            Phase::RolledBack => return None,
        };
        return Some(ConditionState::new(true, reason, &message));
    }
    if version != state.from {
        return None;
    }
    match state.phase {
        // Only a parent that was on the new version (or said so) hears of the rollback.
        Phase::RolledBack if has_condition || recorded.is_some_and(|r| r != version) => {
            Some(ConditionState::new(
                false,
                "RolledBack",
                &format!(
                    "back on rule version {version}: the rollout to {} was rolled back{}",
                    state.to,
                    suffix(why)
                ),
            ))
        }
        Phase::Progressing | Phase::Paused => Some(ConditionState::new(
            false,
            "Pending",
            &format!(
                "on rule version {version}; the rollout to {} is at batch {batch} of {n}{}",
                state.to,
                if paused { ", paused" } else { "" }
            ),
        )),
        _ => None,
    }
}

fn suffix(why: &str) -> String {
    if why.is_empty() {
        String::new()
    } else {
        format!(": {why}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rolling() -> RolloutState {
        RolloutState::settled("old", 0).next("new", 0)
    }

    #[test]
    fn a_moved_parent_says_its_batch() {
        let mut s = rolling();
        s.step = 1;
        let c = condition(&s, 3, "new", Some("old"), false).expect("a condition");
        assert_eq!((c.status, c.reason.as_str()), (true, "Moved"));
        assert_eq!(c.message, "on rule version new, batch 2 of 3");
        // Past the plan's end (a plan edited shorter): the last batch.
        s.step = 7;
        let c = condition(&s, 3, "new", Some("new"), true).expect("a condition");
        assert!(c.message.ends_with("batch 3 of 3"), "{}", c.message);
    }

    #[test]
    fn paused_and_held_rollouts_say_so_on_moved_parents() {
        let mut s = rolling();
        s.phase = Phase::Paused;
        s.message = Some("failWhen held".into());
        let c = condition(&s, 2, "new", Some("new"), true).expect("a condition");
        assert_eq!(c.reason, "Paused");
        assert!(
            c.message.ends_with("paused: failWhen held"),
            "{}",
            c.message
        );
        let mut s = rolling();
        s.held = true;
        let c = condition(&s, 2, "new", Some("new"), true).expect("a condition");
        assert_eq!(c.reason, "Paused");
        let c = condition(&s, 2, "old", Some("old"), false).expect("a condition");
        assert_eq!((c.status, c.reason.as_str()), (false, "Pending"));
        assert!(c.message.ends_with(", paused"), "{}", c.message);
    }

    #[test]
    fn a_rollback_is_said_only_to_parents_that_had_moved() {
        let mut s = rolling();
        s.phase = Phase::RolledBack;
        s.message = Some("failWhen held at step 0".into());
        let c = condition(&s, 2, "old", Some("new"), false).expect("a condition");
        assert_eq!((c.status, c.reason.as_str()), (false, "RolledBack"));
        assert!(c.message.contains("failWhen held"), "{}", c.message);
        assert!(condition(&s, 2, "old", Some("new"), true).is_some());
        // Never moved, never told: nothing to say.
        assert_eq!(condition(&s, 2, "old", Some("old"), false), None);
    }

    #[test]
    fn a_settled_rule_or_another_version_says_nothing() {
        assert_eq!(
            condition(&RolloutState::settled("v", 0), 2, "v", None, false),
            None
        );
        assert_eq!(condition(&rolling(), 2, "other", None, false), None);
        let mut s = rolling();
        s.phase = Phase::Complete;
        let c = condition(&s, 2, "new", Some("new"), true).expect("a condition");
        assert_eq!((c.status, c.reason.as_str()), (true, "Complete"));
    }
}
