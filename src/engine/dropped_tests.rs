//! Unit tests of `dropped.rs`: which objects are a rule's children, the policy each is
//! let go of by, and which kinds a later version has again.
use super::*;
use serde_json::json;

/// A compiled rule over `App` whose children are `(name, apiVersion, kind, policy)`.
fn rule(children: &[(&str, &str, &str, &str)]) -> Arc<CompiledRule> {
    let mut text = String::from(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: r\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: App\n  children:\n",
    );
    for (name, api_version, kind, policy) in children {
        text += &format!(
            "    - name: {name}\n      apiVersion: {api_version}\n      kind: {kind}\n      template: t.yaml\n      deletionPolicy: {policy}\n"
        );
    }
    super::super::compiled_for_test("r", text)
}

fn meta(v: serde_json::Value) -> ObjectMeta {
    serde_json::from_value(v).unwrap_or_default()
}

fn child(name: &str, annotations: serde_json::Value) -> ObjectMeta {
    meta(json!({
        "name": "c", "annotations": annotations,
        "labels": {"rulebook.dev/owner": "u1", "rulebook.dev/child": name},
        "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "App",
                             "name": "p", "uid": "u1", "controller": true}]}))
}

#[test]
fn only_a_child_whose_controller_is_a_parent_of_the_rule_is_one() {
    let rule = rule(&[("data", "v1", "ConfigMap", "Delete")]);
    let real = child("data", json!({}));
    assert!(child_of_rule(&real, &rule));
    let mut other_uid = real.clone();
    other_uid
        .labels
        .get_or_insert_default()
        .insert(labels::OWNER.into(), "u2".into());
    assert!(!child_of_rule(&other_uid, &rule));
    for (field, value) in [("controller", json!(false)), ("kind", json!("Other"))] {
        let mut v = serde_json::to_value(&real).unwrap_or_default();
        v["ownerReferences"][0][field] = value;
        assert!(!child_of_rule(&meta(v), &rule), "{field}");
    }
}

const PVC: (&str, &str) = ("v1", "PersistentVolumeClaim");
const CM: (&str, &str) = ("v1", "ConfigMap");

#[test]
fn the_policy_is_the_old_rules_or_the_one_recorded_on_the_object() {
    let old = rule(&[
        ("data", "v1", "PersistentVolumeClaim", "Orphan"),
        ("cfg", "v1", "ConfigMap", "Delete"),
    ]);
    assert_eq!(
        policy(&child("data", json!({})), &old, PVC),
        DeletionPolicy::Orphan
    );
    assert_eq!(
        policy(&child("cfg", json!({})), &old, CM),
        DeletionPolicy::Delete
    );
    // A child an even older version had: what it recorded.
    let gone = child("older", json!({"rulebook.dev/deletion-policy": "Orphan"}));
    assert_eq!(policy(&gone, &old, CM), DeletionPolicy::Orphan);
    assert_eq!(
        policy(&child("older", json!({})), &old, CM),
        DeletionPolicy::Delete
    );
    // The old rule's word wins over the record.
    let forged = child("cfg", json!({"rulebook.dev/deletion-policy": "Orphan"}));
    assert_eq!(policy(&forged, &old, CM), DeletionPolicy::Delete);
    // A child name the rule gave to another kind: the record stands.
    let renamed = child("data", json!({"rulebook.dev/deletion-policy": "Orphan"}));
    assert_eq!(policy(&renamed, &old, CM), DeletionPolicy::Orphan);
}

#[test]
fn a_kind_the_rule_has_again_is_not_cleaned_up_after() {
    let v1 = rule(&[
        ("cfg", "v1", "ConfigMap", "Delete"),
        ("hpa", "autoscaling/v2", "HorizontalPodAutoscaler", "Delete"),
    ]);
    let v2 = rule(&[("cfg", "v1", "ConfigMap", "Delete")]);
    let dropped = dropped_kinds(&v1, &v2);
    assert_eq!(
        dropped,
        vec![("autoscaling/v2".into(), "HorizontalPodAutoscaler".into())]
    );
    // Back at another version of the same kind: the same objects, kept.
    let v3 = rule(&[
        ("cfg", "v1", "ConfigMap", "Delete"),
        ("hpa", "autoscaling/v1", "HorizontalPodAutoscaler", "Delete"),
    ]);
    assert!(still_dropped(&v3, dropped.clone()).is_empty());
    assert_eq!(still_dropped(&v2, dropped.clone()), dropped);
}

/// A rule named `name` over `parent_kind` with one child of each of `kinds`.
fn named(name: &str, parent_kind: &str, kinds: &[(&str, &str)]) -> Arc<CompiledRule> {
    let mut text = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: {parent_kind}\n  children:\n"
    );
    for (i, (api_version, kind)) in kinds.iter().enumerate() {
        text += &format!(
            "    - name: c{i}\n      apiVersion: {api_version}\n      kind: {kind}\n      template: t.yaml\n"
        );
    }
    super::super::compiled_for_test(name, text)
}

#[test]
fn a_removed_rule_leaves_the_kinds_another_rule_of_its_parent_kind_has() {
    let old = named("old", "App", &[CM, PVC, ("apps/v1", "Deployment")]);
    let set = RuleSet {
        rules: [
            // The rule renamed, at another version of the ConfigMap's group (the same
            // objects), and a rule of another parent kind with the PVC kind.
            (
                "new".to_string(),
                named("new", "App", &[("v1", "ConfigMap")]),
            ),
            ("x".to_string(), named("x", "Other", &[PVC])),
        ]
        .into(),
        warnings: Vec::new(),
        fingerprint: String::new(),
        skipped: Vec::new(),
    };
    let (pruned, kept) = removed_kinds(&old, &set);
    assert_eq!(
        pruned,
        vec![
            ("apps/v1".to_string(), "Deployment".to_string()),
            ("v1".to_string(), "PersistentVolumeClaim".to_string()),
        ]
    );
    assert_eq!(kept, vec![("v1".to_string(), "ConfigMap".to_string())]);
}
