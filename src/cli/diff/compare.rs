//! What `rulebook diff` compares: an object as the API server holds it and as a server-side
//! dry-run apply of the rendered child would leave it, both cut down to what a reviewer
//! should see — no server bookkeeping (managedFields, resourceVersion, uid, timestamps,
//! status), no Rulebook annotations that change with every rule edit, no kubectl
//! last-applied copy, and Secret values shown as `<redacted>` (a changed key shows as
//! changed; the output as a whole is cleaned of values besides, [`super::clean`]). And the parent's status: the fields the rule writes and its `Ready`
//! condition, as they are and as Rulebook would write them.

use serde_json::{Map, Value as Json};

use super::clean::Redactor;
use crate::cli::{strip_annotations, to_yaml, unified_diff};
use crate::meta::labels;
use crate::reconcile::plan::plan_status;
use crate::render::status::ConditionState;
use crate::render::{CompiledRule, Observed};

/// The two sides of an object or a status, kept as values until the output is printed:
/// their strings are cleaned of Secret values before they become YAML (which may fold a
/// long string over lines, cutting a value into pieces too short to recognise).
#[derive(Debug, Default)]
pub struct Sides {
    /// The labels of the diff's two sides.
    pub from: String,
    pub to: String,
    pub before: Option<Json>,
    pub after: Option<Json>,
}

impl Sides {
    /// The unified diff of the two sides as YAML, cleaned by `clean`.
    pub fn diff(&self, clean: &Redactor) -> String {
        let text = |o: &Option<Json>| {
            o.as_ref()
                .and_then(|o| to_yaml(&clean.json(o.clone())).ok())
                .unwrap_or_default()
        };
        unified_diff(
            &self.from,
            &self.to,
            &text(&self.before),
            &text(&self.after),
        )
    }
}

/// Metadata the API server keeps for itself.
const SERVER_METADATA: &[&str] = &[
    "managedFields",
    "resourceVersion",
    "uid",
    "generation",
    "creationTimestamp",
    "selfLink",
];

/// kubectl's copy of the whole object (a Secret's values among them).
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// `o` as a reviewer should see it.
pub fn normalize(o: &Json) -> Json {
    let mut o = o.clone();
    if let Some(map) = o.as_object_mut() {
        map.remove("status");
        if let Some(meta) = map.get_mut("metadata").and_then(Json::as_object_mut) {
            for k in SERVER_METADATA {
                meta.remove(*k);
            }
        }
    }
    strip_annotations(&mut o, labels::PER_RULE_VERSION);
    strip_annotations(&mut o, &[LAST_APPLIED]);
    o
}

fn is_secret(o: &Json) -> bool {
    o.get("kind").and_then(Json::as_str) == Some("Secret")
        && o.get("apiVersion").and_then(Json::as_str) == Some("v1")
}

/// The values of a Secret's `data` and `stringData`, replaced: `<redacted>` on the live
/// side, and on the new side `<redacted>` when the value is the live one, else
/// `<redacted: changed>`. Other objects are returned as they are.
pub fn redact(live: Option<&Json>, new: Option<&Json>) -> (Option<Json>, Option<Json>) {
    let secret = live.or(new).is_some_and(is_secret);
    if !secret {
        return (live.cloned(), new.cloned());
    }
    let field = |o: Option<&Json>, k: &str| -> Map<String, Json> {
        o.and_then(|o| o.get(k))
            .and_then(Json::as_object)
            .cloned()
            .unwrap_or_default()
    };
    let mut live_out = live.cloned();
    let mut new_out = new.cloned();
    for k in ["data", "stringData"] {
        let (lv, nv) = (field(live, k), field(new, k));
        if let Some(o) = live_out
            .as_mut()
            .and_then(|o| o.get_mut(k))
            .and_then(Json::as_object_mut)
        {
            for v in o.values_mut() {
                *v = Json::from("<redacted>");
            }
        }
        if let Some(o) = new_out
            .as_mut()
            .and_then(|o| o.get_mut(k))
            .and_then(Json::as_object_mut)
        {
            for (key, v) in o.iter_mut() {
                let same = lv.get(key) == nv.get(key);
                *v = Json::from(if same {
                    "<redacted>"
                } else {
                    "<redacted: changed>"
                });
            }
        }
    }
    (live_out, new_out)
}

/// The diff of the parent's status, when Rulebook would write a different one (compared
/// without `lastTransitionTime`, which only says when). `failure`: the condition of a
/// reconcile that would fail (a conflict), which the operator writes with the rule's
/// fields instead of the readiness.
pub(super) fn status_diff(
    rule: &CompiledRule,
    parent: &Json,
    observed: &Observed,
    desired: &[crate::render::DesiredChild],
    name: &str,
    failure: Option<&ConditionState>,
) -> Result<Option<Sides>, String> {
    let report = rule
        .status(parent, observed, desired)
        .map_err(|e| e.to_string())?;
    let managed: Vec<&str> = rule.rule.spec.status.keys().map(String::as_str).collect();
    let now = crate::reconcile::status_write::now_rfc3339();
    let condition = match failure {
        Some(c) => c.clone(),
        None => report.readiness.condition(),
    };
    let Some(want) = plan_status(parent, &managed, &report.fields, &condition, &now) else {
        return Ok(None);
    };
    let live = parent.get("status").cloned().unwrap_or(Json::Null);
    // Only the fields Rulebook writes, and Rulebook's own condition.
    let mut shown = serde_json::Map::new();
    if let Some(w) = want.as_object() {
        for k in w.keys() {
            if let Some(v) = live.get(k) {
                shown.insert(k.clone(), v.clone());
            }
        }
    }
    let strip = |v: &mut Json| {
        if let Some(list) = v.get_mut("conditions").and_then(Json::as_array_mut) {
            list.retain(|c| c.get("type").and_then(Json::as_str) == Some("Ready"));
            for c in list {
                if let Some(c) = c.as_object_mut() {
                    c.remove("lastTransitionTime");
                }
            }
        }
    };
    let mut before = Json::Object(shown);
    let mut after = want;
    strip(&mut before);
    strip(&mut after);
    if before == after {
        return Ok(None);
    }
    Ok(Some(Sides {
        from: format!("{name} status (live)"),
        to: format!("{name} status (rendered)"),
        before: Some(before),
        after: Some(after),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn secret_values_never_show_and_a_changed_key_does() {
        let live =
            json!({"apiVersion": "v1", "kind": "Secret", "data": {"a": "b2xk", "same": "eA=="}});
        let new =
            json!({"apiVersion": "v1", "kind": "Secret", "data": {"a": "bmV3", "same": "eA=="}});
        let (l, n) = redact(Some(&live), Some(&new));
        let text = format!("{l:?}{n:?}");
        assert!(
            !text.contains("b2xk") && !text.contains("bmV3") && !text.contains("eA=="),
            "{text}"
        );
        assert_eq!(
            n.unwrap()["data"],
            json!({"a": "<redacted: changed>", "same": "<redacted>"})
        );
        assert_eq!(
            l.unwrap()["data"],
            json!({"a": "<redacted>", "same": "<redacted>"})
        );
    }

    #[test]
    fn bookkeeping_and_rule_version_are_not_differences() {
        let a = json!({"metadata": {"name": "x", "resourceVersion": "1", "managedFields": [],
            "annotations": {"rulebook.dev/rule-version": "a", "keep": "1"}}, "status": {"x": 1}, "data": {"k": "v"}});
        let b = json!({"metadata": {"name": "x", "resourceVersion": "2",
            "annotations": {"rulebook.dev/rule-version": "b", "keep": "1"}}, "data": {"k": "v"}});
        assert_eq!(normalize(&a), normalize(&b));
    }
}
