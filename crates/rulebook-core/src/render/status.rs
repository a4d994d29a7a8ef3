//! The parent's status: the rule's fields, `observedGeneration`, and conditions that
//! follow the Kubernetes API conventions (`type/status/reason/message/
//! lastTransitionTime/observedGeneration`).

use crate::meta::JsonAt;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

/// What [`CompiledRule::status`](super::CompiledRule::status) computed.
#[derive(Clone, Debug, PartialEq)]
pub struct StatusReport {
    /// `.status.<field>` values; absent fields are unset.
    pub fields: Map<String, Json>,
    pub readiness: Readiness,
}

/// Which desired children are missing or not ready yet.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readiness {
    pub missing: Vec<String>,
    pub not_ready: Vec<String>,
    /// Children not applied yet because of their `waitFor`: `app (for db)`.
    pub waiting: Vec<String>,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.missing.is_empty() && self.not_ready.is_empty() && self.waiting.is_empty()
    }

    /// The `Ready` condition for this readiness.
    pub fn condition(&self) -> ConditionState {
        if self.is_ready() {
            return ConditionState::new(true, "Ready", "all children are ready");
        }
        let mut parts = Vec::new();
        if !self.not_ready.is_empty() {
            parts.push(format!("not ready: {}", self.not_ready.join(", ")));
        }
        if !self.missing.is_empty() {
            parts.push(format!("missing: {}", self.missing.join(", ")));
        }
        if !self.waiting.is_empty() {
            parts.push(format!("waiting: {}", self.waiting.join(", ")));
        }
        ConditionState::new(false, "ChildrenNotReady", &parts.join("; "))
    }
}

/// A condition's content, before time and generation are stamped on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionState {
    pub status: bool,
    pub reason: String,
    pub message: String,
}

impl ConditionState {
    pub fn new(status: bool, reason: &str, message: &str) -> Self {
        ConditionState {
            status,
            reason: reason.to_string(),
            message: crate::meta::truncate(message, 1024),
        }
    }
}

/// One condition as stored in `.status.conditions`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The condition `type_` as it should now be: `lastTransitionTime` moves only when the
/// status flips; reason, message and generation follow the current state.
pub fn next_condition(
    previous: &[Condition],
    type_: &str,
    state: &ConditionState,
    generation: Option<i64>,
    now: &str,
) -> Condition {
    let status = if state.status { "True" } else { "False" };
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status && !c.last_transition_time.is_empty())
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.to_string());
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: state.reason.clone(),
        message: state.message.clone(),
        last_transition_time,
        observed_generation: generation,
    }
}

/// The conditions currently on a parent object.
pub fn conditions_of(parent: &Json) -> Vec<Condition> {
    parent
        .at(&["status", "conditions"])
        .and_then(|c| serde_json::from_value(c.clone()).ok())
        .unwrap_or_default()
}

/// The `.status` Rulebook applies to the parent: the rule's fields, `observedGeneration`
/// and its own `Ready` condition. Server-side apply leaves other writers' fields and
/// conditions alone (`conditions` is a list map keyed by `type` in Rulebook's CRDs).
pub fn desired_status(
    parent: &Json,
    fields: &Map<String, Json>,
    ready: &ConditionState,
    now: &str,
) -> Json {
    let generation = parent
        .at(&["metadata", "generation"])
        .and_then(Json::as_i64);
    let previous = conditions_of(parent);
    let ready = next_condition(&previous, "Ready", ready, generation, now);
    let mut status = fields.clone();
    if let Some(g) = generation {
        status.insert("observedGeneration".into(), Json::from(g));
    }
    status.insert(
        "conditions".into(),
        serde_json::to_value(vec![ready]).unwrap_or(Json::Array(vec![])),
    );
    Json::Object(status)
}

/// Whether the live `.status` already holds everything in `desired` (other fields and
/// other conditions are ignored), so that no write is needed.
pub fn status_matches(live: Option<&Json>, desired: &Json) -> bool {
    let (Some(live), Some(desired)) = (live.and_then(Json::as_object), desired.as_object()) else {
        return false;
    };
    desired.iter().all(|(k, v)| {
        if k == "conditions" {
            let live_conditions = live.get(k).and_then(Json::as_array);
            return v.as_array().is_some_and(|want| {
                want.iter().all(|c| {
                    live_conditions.is_some_and(|have| {
                        have.iter()
                            .any(|h| h.get("type") == c.get("type") && h == c)
                    })
                })
            });
        }
        live.get(k) == Some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let parent = json!({"metadata": {"generation": 3}, "status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "ChildrenNotReady", "message": "x",
             "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 2},
            {"type": "Other", "status": "True", "reason": "Mine", "message": "", "lastTransitionTime": "t0"}
        ]}});
        let still = desired_status(
            &parent,
            &Map::new(),
            &ConditionState::new(false, "ChildrenNotReady", "y"),
            "2026-02-02T00:00:00Z",
        );
        assert_eq!(
            still["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(still["conditions"][0]["message"], "y");
        assert_eq!(still["conditions"][0]["observedGeneration"], 3);
        assert_eq!(still["conditions"].as_array().map(Vec::len), Some(1));
        assert_eq!(still["observedGeneration"], 3);
        let flipped = desired_status(
            &parent,
            &Map::new(),
            &ConditionState::new(true, "Ready", "ok"),
            "2026-02-02T00:00:00Z",
        );
        assert_eq!(
            flipped["conditions"][0]["lastTransitionTime"],
            "2026-02-02T00:00:00Z"
        );
        assert_eq!(flipped["conditions"][0]["status"], "True");
    }

    #[test]
    fn matching_ignores_foreign_fields() {
        let desired = json!({"a": 1, "conditions": []});
        assert!(status_matches(
            Some(&json!({"a": 1, "conditions": [], "b": 2})),
            &desired
        ));
        assert!(!status_matches(
            Some(&json!({"a": 2, "conditions": []})),
            &desired
        ));
        assert!(!status_matches(None, &desired));
    }
}
