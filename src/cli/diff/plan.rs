//! The rollout plan in `rulebook diff` (docs/reference/rollout.md): for a rule with
//! `spec.rollout` whose version on disk is not the one its parents are on, which parents
//! would move in which batch if the rollout started now. The places come from the same
//! pure functions the coordinator runs ([`crate::rollout::RankKey`],
//! [`crate::rollout::batches`]) over the live parents, so the plan is what the operator
//! would do (a parent created, deleted or relabelled before then changes it).

use kube::ResourceExt;
use kube::api::DynamicObject;
use serde::Serialize;

use crate::reconcile::versions::status_version;
use crate::render::CompiledRule;
use crate::rollout::{Plan, RankKey, batches};

/// Names shown per batch in the text output; the JSON has them all.
const SHOWN: usize = 10;

/// The batches of a rollout, as `diff` prints them.
#[derive(Debug, Serialize)]
pub struct RolloutPlan {
    /// The version the parents would move to.
    pub to: String,
    /// Parents already on it (they do not move).
    pub already: usize,
    pub batches: Vec<PlanBatch>,
}

/// One batch: its step and the parents that would move in it, in the order they move.
#[derive(Debug, Serialize)]
pub struct PlanBatch {
    /// `parents: 1`, `percent: 10`: the step's target, in all.
    pub step: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause: Option<String>,
    /// `namespace/name` (or `name`) of each parent.
    pub parents: Vec<String>,
}

/// The plan for `rule` over its live `parents`; `None` without `spec.rollout` or when no
/// parent would change version.
pub fn plan(rule: &CompiledRule, parents: &[DynamicObject]) -> Option<RolloutPlan> {
    let spec = rule.rule.spec.rollout.as_ref()?;
    let program = rule.rollout.as_ref()?;
    if parents
        .iter()
        .all(|p| status_version(p) == Some(rule.version.as_str()))
    {
        return None;
    }
    let mut placed: Vec<(RankKey, &DynamicObject)> = parents
        .iter()
        .map(|p| {
            let first =
                program.has_order() && crate::cache::to_json(p).is_some_and(|j| program.first(&j));
            (
                RankKey::of(first, p.namespace().as_deref(), &p.name_any()),
                p,
            )
        })
        .collect();
    placed.sort_by_key(|(k, _)| *k);
    let keys: Vec<RankKey> = placed.iter().map(|(k, _)| *k).collect();
    let of = batches(&keys, &Plan::of(spec));
    let mut out: Vec<PlanBatch> = spec
        .steps
        .iter()
        .map(|s| PlanBatch {
            step: match (&s.parents, &s.percent) {
                (Some(n), _) => format!("parents: {}", n.value),
                (_, Some(p)) => format!("percent: {}", p.value),
                _ => String::new(),
            },
            pause: s.pause.as_ref().map(|p| p.value.clone()),
            parents: Vec::new(),
        })
        .collect();
    let mut already = 0;
    for ((_, p), b) in placed.iter().zip(of) {
        if status_version(p) == Some(rule.version.as_str()) {
            already += 1;
            continue;
        }
        let name = match p.namespace() {
            Some(ns) => format!("{ns}/{}", p.name_any()),
            None => p.name_any(),
        };
        if let Some(batch) = out.get_mut(b) {
            batch.parents.push(name);
        }
    }
    Some(RolloutPlan {
        to: rule.version.clone(),
        already,
        batches: out,
    })
}

/// The plan as text, one line per batch, at most [`SHOWN`] names each.
pub fn print(rule: &str, p: &RolloutPlan, out: &mut String) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "# rollout plan of rule {rule} to version {} ({} batches; {} parents already on it)",
        p.to,
        p.batches.len(),
        p.already
    );
    for (i, b) in p.batches.iter().enumerate() {
        let pause = b
            .pause
            .as_ref()
            .map(|d| format!(", pause {d}"))
            .unwrap_or_default();
        let shown: Vec<&str> = b.parents.iter().take(SHOWN).map(String::as_str).collect();
        let more = b.parents.len().saturating_sub(SHOWN);
        let _ = writeln!(
            out,
            "#   batch {} of {} ({}{pause}): {} parents: {}{}",
            i + 1,
            p.batches.len(),
            b.step,
            b.parents.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
}
