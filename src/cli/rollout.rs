//! `rulebook rollout status|pause|resume|promote|abort --rule NAME`: reads or changes a
//! rule's rollout state in the cluster (the ConfigMap `rulebook-rollout-<rule>` in the
//! operator's namespace; docs/operations.md), so it works wherever the operator runs.
//! A change is a patch at the resourceVersion read: one that raced the coordinator
//! fails and says so, rather than undoing a step.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};

use crate::engine::rollout::store;
use crate::rollout::{Phase, RolloutState};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RolloutAction {
    /// Print the rollout's phase, step, batch and message.
    Status,
    /// Hold the rollout where it is (no batch moves until `resume`).
    Pause,
    /// Let a held rollout go on (also one that `failWhen` paused).
    Resume,
    /// Move every parent to the new version now.
    Promote,
    /// Roll back: every moved parent goes back to the old version.
    Abort,
}

#[derive(Args, Debug)]
pub struct RolloutArgs {
    pub action: RolloutAction,
    /// The rule.
    #[arg(long)]
    pub rule: String,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The operator's namespace (its `--lease-namespace`), where rollouts are kept.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

/// The state after `action`, or why it does not apply.
pub fn apply(action: RolloutAction, s: &RolloutState) -> Result<RolloutState, String> {
    let mut s = s.clone();
    let active = s.active();
    match action {
        RolloutAction::Status => {}
        _ if !active => return Err(format!("the rollout is {:?}: nothing to change", s.phase)),
        RolloutAction::Pause => s.held = true,
        RolloutAction::Resume => {
            s.held = false;
            if s.phase == Phase::Paused {
                s.phase = Phase::Progressing;
                s.message = None;
            }
        }
        RolloutAction::Promote => {
            s.phase = Phase::Complete;
            s.ended = Some(crate::engine::rollout::now());
            s.message = Some("promoted by rulebook rollout promote".into());
        }
        RolloutAction::Abort => {
            s.phase = Phase::RolledBack;
            s.ended = Some(crate::engine::rollout::now());
            s.message = Some("aborted by rulebook rollout abort".into());
        }
    }
    Ok(s)
}

/// One line per fact of the state.
pub fn describe(rule: &str, s: &RolloutState) -> String {
    let mut out = format!(
        "rule {rule}: {:?}{}\nfrom {} to {}\nstep {} (started {}), {} of {} parents on {}\n",
        s.phase,
        if s.held { " (held)" } else { "" },
        s.from,
        s.to,
        s.step,
        jiff::Timestamp::from_second(s.step_started)
            .map_or_else(|_| s.step_started.to_string(), |t| t.to_string()),
        s.moved,
        s.parents,
        s.to
    );
    if let Some(m) = &s.message {
        out.push_str(&format!("message: {m}\n"));
    }
    out
}

/// Runs `rulebook rollout`. Exit code 0, or 1 when there is no rollout or the action
/// does not apply.
pub async fn rollout(args: &RolloutArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let config = crate::operator::client_config(args.kubeconfig.as_ref(), "rollout").await?;
    let client = kube::Client::try_from(config).context("cannot build a client")?;
    let api = kube::Api::namespaced(client, &args.namespace);
    let Some((state, rv)) = store::read_state(&api, &args.rule).await? else {
        writeln!(
            err,
            "no rollout state for rule '{}' in namespace {} (a rule with spec.rollout gets one once the operator runs it)",
            args.rule, args.namespace
        )?;
        return Ok(1);
    };
    let next = match apply(args.action, &state) {
        Ok(n) => n,
        Err(e) => {
            write!(out, "{}", describe(&args.rule, &state))?;
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    if next != state {
        if rv.is_none() {
            bail!("the rollout state has no resourceVersion");
        }
        store::write_state(&api, &args.rule, &next, rv).await?;
    }
    write!(out, "{}", describe(&args.rule, &next))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions() {
        let s = RolloutState::settled("a", 0).next("b", 0);
        assert!(apply(RolloutAction::Pause, &s).is_ok_and(|n| n.held));
        let held = RolloutState {
            held: true,
            ..s.clone()
        };
        assert!(apply(RolloutAction::Resume, &held).is_ok_and(|n| !n.held));
        assert!(apply(RolloutAction::Promote, &s).is_ok_and(|n| n.phase == Phase::Complete));
        assert!(apply(RolloutAction::Abort, &s).is_ok_and(|n| n.phase == Phase::RolledBack));
        let paused = RolloutState {
            phase: Phase::Paused,
            ..s.clone()
        };
        assert!(apply(RolloutAction::Resume, &paused).is_ok_and(|n| n.phase == Phase::Progressing));
        let done = apply(RolloutAction::Promote, &s).unwrap_or_else(|e| panic!("{e}"));
        assert!(apply(RolloutAction::Abort, &done).is_err());
        assert!(apply(RolloutAction::Status, &done).is_ok());
    }
}
