//! Where each `cel:` check of a rule is enforced ([`placements`]): the CRD's
//! `x-kubernetes-validations` when the rule defines the CRD and CRD validation can
//! express the check, a `ValidatingAdmissionPolicy` otherwise (policy.rs builds those).
//! A leaf of the rules module: the CRD (crd.rs) takes its validations from here, and the
//! policies (policy.rs) their checks, so neither needs the other for this.

use serde_json::{Value as Json, json};

use super::{Rule, ValidateRule};

/// Where one `cel:` check is enforced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The CRD's `x-kubernetes-validations`.
    Crd,
    /// A `ValidatingAdmissionPolicy`, and why not the CRD.
    Policy(String),
}

/// One `cel:` check, placed.
#[derive(Clone, Debug)]
pub struct Placed<'a> {
    /// Its index in `spec.admission.validate`.
    pub index: usize,
    pub check: &'a ValidateRule,
    pub cel: &'a str,
    /// It reads `oldSelf`: it runs on updates only.
    pub transition: bool,
    /// `CREATE`, `UPDATE` or both, as it runs.
    pub operations: Vec<&'static str>,
    pub placement: Placement,
}

/// What a CRD validation rule may read of `self.metadata`.
const CRD_METADATA: &[&str] = &["name", "generateName"];

/// The `cel:` checks of `rule`, each with where it is enforced. A check whose CEL does
/// not compile is left out (`rulebook check` reports it).
pub fn placements(rule: &Rule) -> Vec<Placed<'_>> {
    let Some(admission) = &rule.spec.admission else {
        return Vec::new();
    };
    let defines_crd = rule.spec.crd.is_some();
    let mut out = Vec::new();
    for (index, check) in admission.validate.iter().enumerate() {
        let Some(cel) = &check.cel else { continue };
        let Ok(expr) = crate::cel::compile(cel) else {
            continue;
        };
        let transition = expr.reads("oldSelf");
        let operations = operations(check, transition);
        let narrowed = if transition {
            operations != ["UPDATE"]
        } else {
            operations.len() != 2
        };
        let metadata: Vec<String> = expr
            .paths_from("self")
            .into_iter()
            .filter(|p| p.first().is_some_and(|f| f == "metadata"))
            .filter_map(|p| match p.get(1) {
                Some(f) if CRD_METADATA.contains(&f.as_str()) => None,
                Some(f) => Some(format!("self.metadata.{f}")),
                None => Some("self.metadata".to_string()),
            })
            .collect();
        let placement = if !defines_crd {
            Placement::Policy("the rule does not define the parent's CRD".into())
        } else if let Some(m) = metadata.first() {
            Placement::Policy(format!(
                "it reads {m}, and a CRD validation rule sees only metadata.name and metadata.generateName"
            ))
        } else if narrowed {
            Placement::Policy(format!(
                "its operations ({}) differ from those a CRD validation rule runs on",
                operations.join(", ")
            ))
        } else {
            Placement::Crd
        };
        out.push(Placed {
            index,
            check,
            cel,
            transition,
            operations,
            placement,
        });
    }
    out
}

/// The operations a check runs on: its `operations`, else updates for a transition
/// rule and both otherwise.
pub(super) fn operations(check: &ValidateRule, transition: bool) -> Vec<&'static str> {
    let mut ops: Vec<&'static str> = ["CREATE", "UPDATE"]
        .into_iter()
        .filter(|op| check.operations.iter().any(|o| o.as_str() == *op))
        .collect();
    if ops.is_empty() {
        ops = if transition {
            vec!["UPDATE"]
        } else {
            vec!["CREATE", "UPDATE"]
        };
    }
    if transition {
        ops.retain(|o| *o == "UPDATE");
    }
    ops
}

/// The `x-kubernetes-validations` of the CRD's root schema (empty: none).
pub fn crd_validations(rule: &Rule) -> Vec<Json> {
    placements(rule)
        .into_iter()
        .filter(|p| p.placement == Placement::Crd)
        .map(|p| {
            let mut v = json!({"rule": p.cel, "message": p.check.message.value});
            if let Some(f) = &p.check.field_path {
                v["fieldPath"] = json!(crd_field_path(f));
            }
            v
        })
        .collect()
}

/// `spec.replicas` → `.spec.replicas` (a CRD rule's `fieldPath` is a JSON path from the
/// schema node, here the root).
fn crd_field_path(f: &str) -> String {
    if f.starts_with('.') {
        f.to_string()
    } else {
        format!(".{f}")
    }
}

/// Puts the rule's CRD validation rules into every version of `crd` (a generated CRD).
pub fn add_crd_validations(rule: &Rule, crd: &mut Json) {
    let validations = crd_validations(rule);
    if validations.is_empty() {
        return;
    }
    if let Some(versions) = crd
        .pointer_mut("/spec/versions")
        .and_then(Json::as_array_mut)
    {
        for v in versions {
            if let Some(root) = v.pointer_mut("/schema/openAPIV3Schema") {
                root["x-kubernetes-validations"] = json!(validations);
            }
        }
    }
}
