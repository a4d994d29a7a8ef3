//! The structural checks of `spec.rollout` (docs/reference/rollout.md): at least one
//! step, each with exactly one of `parents` and `percent`, growing, the last one
//! `percent: 100` (a rollout ends with every parent moved), readable pauses, and
//! `onFailure` one of its two values. Its expressions are compiled with the rule's
//! (render/rollout.rs).

use super::{Diagnostic, Loc, Rollout, RolloutStep, Rule, parse_duration};

/// What `onFailure` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum OnFailure {
    /// Moved parents go back to the old version.
    Rollback,
    /// Every parent stays where it is until someone decides (`rulebook rollout`).
    Pause,
}

impl OnFailure {
    /// The value of `onFailure` (default `Rollback`); `None` for an unknown one.
    pub fn parse(v: Option<&Loc<String>>) -> Option<OnFailure> {
        match v.map(|v| v.as_str()) {
            None | Some("Rollback") => Some(OnFailure::Rollback),
            Some("Pause") => Some(OnFailure::Pause),
            Some(_) => None,
        }
    }
}

/// How far one step goes, in all (the batches before included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Parents(u64),
    Percent(u64),
}

impl Target {
    /// The target of a step, if it names exactly one valid amount.
    pub fn of(step: &RolloutStep) -> Option<Target> {
        match (&step.parents, &step.percent) {
            (Some(n), None) if n.value >= 1 => Some(Target::Parents(n.value)),
            (None, Some(p)) if (1..=100).contains(&p.value) => Some(Target::Percent(p.value)),
            _ => None,
        }
    }

    /// How many of `total` parents are moved once this step is reached.
    pub fn count(self, total: u64) -> u64 {
        match self {
            Target::Parents(n) => n.min(total),
            Target::Percent(p) => (total.saturating_mul(p)).div_ceil(100).min(total),
        }
    }
}

pub(super) fn check_rollout(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let Some(ro) = &r.spec.rollout else {
        return;
    };
    let at_kind = (r.spec.parent.kind.line, r.spec.parent.kind.col);
    if r.spec.crd.is_none() {
        err(
            at_kind,
            "spec.rollout",
            "needs spec.crd: a rollout reads each parent's status.ruleVersion, which only \
             the rule's own CRD keeps"
                .into(),
        );
    }
    check_spec(ro, at_kind, "spec.rollout", err);
}

/// The operator-wide default rollout (`--default-rollout FILE`): the file holds what a
/// rule's `spec.rollout` would (`steps`, `order`, `gate`, `onFailure`, `failWhen`), and is
/// checked as one, every problem at the file's `line:col`.
pub fn parse_default(file: &str, text: &str) -> Result<Rollout, Vec<Diagnostic>> {
    let ro = super::yaml::parse_document::<Rollout>(text).map_err(|(line, col, message)| {
        vec![Diagnostic::new(
            file,
            line,
            col,
            format!("default rollout: {message}"),
        )]
    })?;
    let mut diags = Vec::new();
    check_spec(&ro, (1, 1), "rollout", &mut |at, key, msg| {
        diags.push(Diagnostic::new(
            file,
            at.0,
            at.1,
            format!("default rollout: {key}: {msg}"),
        ))
    });
    if diags.is_empty() { Ok(ro) } else { Err(diags) }
}

/// The checks of one rollout block; `prefix` is its key (`spec.rollout`), `at_kind` where
/// a problem without a place of its own points.
fn check_spec(
    ro: &Rollout,
    at_kind: (u64, u64),
    prefix: &str,
    err: &mut impl FnMut((u64, u64), &str, String),
) {
    if ro.steps.is_empty() {
        err(
            at_kind,
            &format!("{prefix}.steps"),
            "needs at least one step".into(),
        );
    }
    let mut last_percent = 0;
    for (i, s) in ro.steps.iter().enumerate() {
        let key = format!("{prefix}.steps[{i}]");
        let at = s
            .parents
            .as_ref()
            .map(|l| (l.line, l.col))
            .or(s.percent.as_ref().map(|l| (l.line, l.col)))
            .or(s.pause.as_ref().map(|l| (l.line, l.col)))
            .unwrap_or(at_kind);
        match Target::of(s) {
            None if s.parents.is_some() == s.percent.is_some() => err(
                at,
                &key,
                "needs exactly one of `parents` (a count) and `percent` (1 to 100)".into(),
            ),
            None if s.parents.is_some() => {
                err(at, &format!("{key}.parents"), "must be at least 1".into())
            }
            None => err(
                at,
                &format!("{key}.percent"),
                "must be from 1 to 100".into(),
            ),
            Some(Target::Percent(p)) if p < last_percent => err(
                at,
                &format!("{key}.percent"),
                format!(
                    "{p} is less than an earlier step's {last_percent}: steps count in all, so they only grow"
                ),
            ),
            Some(Target::Percent(p)) => last_percent = p,
            Some(Target::Parents(_)) => {}
        }
        if let Some(p) = &s.pause
            && let Err(e) = parse_duration(p)
        {
            err((p.line, p.col), &format!("{key}.pause"), e.to_string());
        }
    }
    if let Some(last) = ro.steps.last()
        && Target::of(last) != Some(Target::Percent(100))
        && Target::of(last).is_some()
    {
        let at = last
            .parents
            .as_ref()
            .or(last.percent.as_ref())
            .map(|l| (l.line, l.col))
            .unwrap_or(at_kind);
        err(
            at,
            &format!("{prefix}.steps[{}]", ro.steps.len() - 1),
            "the last step is `percent: 100`: a rollout ends with every parent on the new version"
                .into(),
        );
    }
    if let Some(f) = &ro.on_failure
        && OnFailure::parse(Some(f)).is_none()
    {
        err(
            (f.line, f.col),
            &format!("{prefix}.onFailure"),
            format!("'{}' is neither Rollback nor Pause", f.value),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_up_and_never_pass_the_total() {
        assert_eq!(Target::Parents(1).count(50), 1);
        assert_eq!(Target::Parents(80).count(50), 50);
        assert_eq!(Target::Percent(10).count(50), 5);
        assert_eq!(Target::Percent(10).count(51), 6);
        assert_eq!(Target::Percent(100).count(7), 7);
        assert_eq!(Target::Percent(1).count(0), 0);
    }
}
