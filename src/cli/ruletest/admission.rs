//! `rulebook test` steps that are admission requests (`admission: {operation: CREATE |
//! UPDATE, old: ...}`, issue 43): the step's parent is judged as the API server would
//! judge it on that request, offline, in the API server's order: defaults first (`cel:`
//! defaults by the offline CEL evaluator, then computed `expr:` defaults by
//! `CompiledRule::admit`), then the checks (`cel:` by the offline evaluator with `self`
//! and `oldSelf`, then `expr:` by `admit`). `expr:` keys see no references (`refs` is
//! empty: a test has no cluster). `expect` says `allowed: false` with a `message`
//! the denial contains, `allowed: true`, or the admitted (defaulted) `object`.
//!
//! Whatever the offline evaluator cannot judge (a CEL function it lacks, `admit` not
//! available) fails the step as *not judged offline*: it is never passed.

use serde_json::Value as Json;

use super::model::{AdmissionStep, Expect};
use super::{Failure, matching};
use crate::cel::Outcome as Cel;
use crate::cli::to_yaml;
use crate::render::CompiledRule;
use crate::render::admission::{AdmitRequest, Operation, Phase, Verdict};

/// The answer to one admission request.
#[derive(Debug)]
enum Answer {
    /// Admitted, as this object.
    Allowed(Json),
    /// Refused, with every message that refused it.
    Denied(Vec<String>),
    /// Not judged offline, and why.
    NotJudged(String),
}

/// The failures of an admission step on `object` (`before`: the parent before this
/// step's change, the old object of an UPDATE without `old:`).
pub fn run(
    rule: &CompiledRule,
    object: &Json,
    before: &Json,
    step: &AdmissionStep,
    expect: Option<&Expect>,
    at: u64,
) -> Vec<Failure> {
    let fail = |line, message| {
        vec![Failure {
            line,
            message,
            diff: None,
        }]
    };
    let op = match step.operation.as_str() {
        "CREATE" => Operation::Create,
        "UPDATE" => Operation::Update,
        other => {
            return fail(
                step.operation.line,
                format!("operation '{other}' is not CREATE or UPDATE"),
            );
        }
    };
    let old = match op {
        Operation::Create => None,
        Operation::Update => Some(step.old.as_ref().unwrap_or(before)),
    };
    let answer = judge(rule, op, object, old);
    let Some(expect) = expect else {
        return match answer {
            Answer::NotJudged(why) => fail(at, format!("not judged offline: {why}")),
            _ => fail(
                at,
                "an admission step needs expect (allowed, message or object)".into(),
            ),
        };
    };
    compare(&answer, expect, at)
}

/// Checks `answer` against `expect`.
fn compare(answer: &Answer, expect: &Expect, at: u64) -> Vec<Failure> {
    let fail = |line, message| {
        vec![Failure {
            line,
            message,
            diff: None,
        }]
    };
    let want_allowed = expect
        .allowed
        .as_ref()
        .map(|a| (a.value, a.line))
        .or_else(|| expect.object.as_ref().map(|o| (true, o.line)));
    match (answer, want_allowed) {
        (Answer::NotJudged(why), _) => fail(at, format!("not judged offline: {why}")),
        (_, None) => fail(
            at,
            "an admission step needs expect.allowed (or expect.object)".into(),
        ),
        (Answer::Denied(messages), Some((true, line))) => fail(
            line,
            format!(
                "expected the request allowed, but it is refused: {}",
                messages.join("; ")
            ),
        ),
        (Answer::Allowed(_), Some((false, line))) => fail(
            line,
            "expected the request refused, but it is allowed".into(),
        ),
        (Answer::Denied(messages), Some((false, _))) => match &expect.message {
            Some(want) if !messages.iter().any(|m| m.contains(&want.value)) => fail(
                want.line,
                format!(
                    "expected a denial containing {:?}, got: {}",
                    want.value,
                    messages.join("; ")
                ),
            ),
            _ => vec![],
        },
        (Answer::Allowed(got), Some((true, _))) => match &expect.object {
            None => vec![],
            Some(want) => {
                let problems = matching::mismatches(&want.value, got);
                if problems.is_empty() {
                    return vec![];
                }
                vec![Failure {
                    line: want.line,
                    message: format!("admitted object: {}", problems.join("; ")),
                    diff: Some(crate::cli::unified_diff(
                        "expected",
                        "actual",
                        &to_yaml(&want.value).unwrap_or_default(),
                        &to_yaml(&matching::project(&want.value, got)).unwrap_or_default(),
                    )),
                }]
            }
        },
    }
}

/// The admission of `object`: defaults, then checks.
fn judge(rule: &CompiledRule, op: Operation, object: &Json, old: Option<&Json>) -> Answer {
    let Some(admission) = &rule.rule.spec.admission else {
        return Answer::Allowed(object.clone());
    };
    let mut object = object.clone();
    for d in &admission.default {
        let Some(cel) = &d.cel else { continue };
        let path: Vec<&str> = d.path.split('.').collect();
        if lookup(&object, &path).is_some() {
            continue;
        }
        let expr = match crate::cel::compile(cel) {
            Ok(e) => e,
            Err(e) => {
                return Answer::NotJudged(format!("spec.admission.default {}: {e}", d.path.value));
            }
        };
        match expr.eval(&[("object", Some(&object)), ("oldObject", old)]) {
            Cel::Value(v) => set(&mut object, &path, v),
            Cel::Error(e) => return Answer::Denied(vec![format!("default {}: {e}", d.path.value)]),
            Cel::NotJudged(why) => {
                return Answer::NotJudged(format!("the cel default of {}: {why}", d.path.value));
            }
        }
    }
    let mutates = admission.default.iter().any(|d| d.expr.is_some());
    if mutates {
        match admit(rule, Phase::Mutate, op, &object, old) {
            Err(why) => return Answer::NotJudged(why),
            Ok(Verdict::Denied { message, .. }) => return Answer::Denied(vec![message]),
            Ok(Verdict::Allowed { patch }) => {
                if let Err(why) = apply_patch(&mut object, &patch) {
                    return Answer::NotJudged(why);
                }
            }
        }
    }
    let answer = judge_cel(rule, op, object, old);
    let validates = admission.validate.iter().any(|v| v.expr.is_some());
    match answer {
        Answer::Allowed(object) if validates => {
            match admit(rule, Phase::Validate, op, &object, old) {
                Err(why) => Answer::NotJudged(why),
                Ok(Verdict::Denied { message, .. }) => Answer::Denied(vec![message]),
                Ok(Verdict::Allowed { .. }) => Answer::Allowed(object),
            }
        }
        other => other,
    }
}

/// `CompiledRule::admit` in `phase`, with no references (a test has no cluster).
fn admit(
    rule: &CompiledRule,
    phase: Phase,
    op: Operation,
    object: &Json,
    old: Option<&Json>,
) -> Result<Verdict, String> {
    let refs = serde_json::Map::new();
    let request = AdmitRequest {
        phase,
        operation: op,
        object,
        old,
        refs: &refs,
    };
    rule.admit(&request)
        .map_err(|e| format!("the expr checks and defaults: {e}"))
}

/// The `cel:` checks on the (defaulted) object.
fn judge_cel(rule: &CompiledRule, op: Operation, object: Json, old: Option<&Json>) -> Answer {
    let mut denials = Vec::new();
    let op_name = match op {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
    };
    for p in crate::rules::policy::placements(&rule.rule) {
        if !p.operations.contains(&op_name) {
            continue;
        }
        let expr = match crate::cel::compile(p.cel) {
            Ok(e) => e,
            Err(e) => return Answer::NotJudged(e.to_string()),
        };
        match expr.eval(&[("self", Some(&object)), ("oldSelf", old)]) {
            Cel::Value(Json::Bool(true)) => {}
            Cel::Value(Json::Bool(false)) => denials.push(p.check.message.value.clone()),
            Cel::Value(other) => denials.push(format!(
                "spec.admission.validate[{}]: the rule gives {other}, not a bool",
                p.index
            )),
            Cel::Error(e) => denials.push(format!(
                "spec.admission.validate[{}]: {e} (evaluating {})",
                p.index, p.cel
            )),
            Cel::NotJudged(why) => {
                return Answer::NotJudged(format!("spec.admission.validate[{}]: {why}", p.index));
            }
        }
    }
    if denials.is_empty() {
        Answer::Allowed(object)
    } else {
        Answer::Denied(denials)
    }
}

fn lookup<'a>(o: &'a Json, path: &[&str]) -> Option<&'a Json> {
    path.iter().try_fold(o, |node, key| node.get(*key))
}

/// Sets `path` in `o`, creating the objects on the way; nothing when `o` is no object (a
/// test step's patch may have made the parent a number: indexing it would panic).
fn set(o: &mut Json, path: &[&str], value: Json) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    if !o.is_object() {
        return;
    }
    let mut node = o;
    for key in parents {
        if !node.get(*key).is_some_and(Json::is_object) {
            node[*key] = Json::Object(serde_json::Map::new());
        }
        node = &mut node[*key];
    }
    node[*last] = value;
}

/// Applies the `add`/`replace` operations of a JSON Patch (what `admit` returns).
fn apply_patch(o: &mut Json, patch: &[Json]) -> Result<(), String> {
    for op in patch {
        let kind = op["op"].as_str().unwrap_or("");
        let path = op["path"].as_str().unwrap_or("");
        if !matches!(kind, "add" | "replace") {
            return Err(format!(
                "a default's JSON patch operation '{kind}' is not applied offline"
            ));
        }
        let keys: Vec<String> = path
            .split('/')
            .skip(1)
            .map(|k| k.replace("~1", "/").replace("~0", "~"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        set(o, &keys, op["value"].clone());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_are_set_through_missing_objects_and_patches_applied() {
        let mut o = json!({"spec": {}});
        set(&mut o, &["spec", "a", "b"], json!(1));
        assert_eq!(o, json!({"spec": {"a": {"b": 1}}}));
        apply_patch(
            &mut o,
            &[json!({"op": "add", "path": "/spec/image", "value": "x"})],
        )
        .expect("applies");
        assert_eq!(o["spec"]["image"], "x");
        assert!(apply_patch(&mut o, &[json!({"op": "remove", "path": "/spec/a"})]).is_err());
    }

    #[test]
    fn a_parent_that_is_no_object_is_left_as_it_is() {
        for mut o in [json!(5), json!("x"), json!([1])] {
            let before = o.clone();
            set(&mut o, &["spec", "a"], json!(1));
            set(&mut o, &["a"], json!(1));
            assert_eq!(o, before);
        }
    }
}
