//! The placement of `cel:` checks and the generated policies, from rule text.

use super::*;
use crate::rules::{Rule, parse_file};
use serde_json::json;

fn rule(defines: bool, admission: &str) -> Rule {
    let crd = if defines {
        "  crd:\n    specSchema:\n      type: object\n      properties:\n        replicas: {type: integer}\n        tier: {type: string}\n"
    } else {
        ""
    };
    let api = if defines { "example.com/v1" } else { "v1" };
    let kind = if defines { "App" } else { "ConfigMap" };
    let text = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: app\nspec:\n  parent:\n    apiVersion: {api}\n    kind: {kind}\n{crd}  admission:\n{admission}"
    );
    match parse_file("r.yaml", &text) {
        Ok(mut rules) => rules.remove(0).rule,
        Err(d) => panic!("{d:?}\n{text}"),
    }
}

const ISSUE: &str = "    validate:
      - cel: \"self.spec.replicas <= 10 || self.metadata.namespace.startsWith('prod-')\"
        message: more than 10 replicas only in prod- namespaces
      - cel: self.spec.tier == oldSelf.spec.tier
        message: tier is immutable
        fieldPath: spec.tier
      - cel: self.metadata.name.size() < 20
        message: short names
        operations: [CREATE]
";

#[test]
fn checks_go_to_the_crd_unless_it_cannot_express_them() {
    let r = rule(true, ISSUE);
    let placed = placements(&r);
    assert_eq!(placed.len(), 3);
    assert!(
        matches!(&placed[0].placement, Placement::Policy(why) if why.contains("self.metadata.namespace")),
        "{:?}",
        placed[0].placement
    );
    assert_eq!(placed[1].placement, Placement::Crd);
    assert!(placed[1].transition);
    assert_eq!(placed[1].operations, ["UPDATE"]);
    assert!(matches!(&placed[2].placement, Placement::Policy(why) if why.contains("CREATE")));
    let crd = crate::rules::crd::crd_for(&r).expect("crd");
    assert_eq!(
        crd.pointer("/spec/versions/0/schema/openAPIV3Schema/x-kubernetes-validations"),
        Some(&json!([{
            "rule": "self.spec.tier == oldSelf.spec.tier",
            "message": "tier is immutable",
            "fieldPath": ".spec.tier",
        }]))
    );
}

#[test]
fn the_rest_goes_to_validating_policies_by_operation() {
    let r = rule(true, ISSUE);
    let scope = Scope {
        installation: "inst".into(),
        namespace: Some("team-a".into()),
        selector: None,
    };
    let objs = validating_policies(&r, &Resource::of(&r), &scope);
    let names: Vec<(&str, &str)> = objs
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("ValidatingAdmissionPolicy", "rulebook-app"),
            ("ValidatingAdmissionPolicyBinding", "rulebook-app"),
            ("ValidatingAdmissionPolicy", "rulebook-app-create"),
            ("ValidatingAdmissionPolicyBinding", "rulebook-app-create"),
        ]
    );
    let vap = &objs[0];
    assert_eq!(
        vap["spec"]["validations"][0]["expression"],
        "object.spec.replicas <= 10 || object.metadata.namespace.startsWith('prod-')"
    );
    assert_eq!(
        vap["spec"]["matchConstraints"]["resourceRules"][0],
        json!({"apiGroups": ["example.com"], "apiVersions": ["v1"], "resources": ["apps"], "operations": ["CREATE", "UPDATE"]})
    );
    assert_eq!(vap["metadata"]["labels"][INSTALLATION_LABEL], "inst");
    let binding = &objs[1];
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert_eq!(
        binding["spec"]["matchResources"]["namespaceSelector"],
        json!({"matchLabels": {"kubernetes.io/metadata.name": "team-a"}})
    );
}

#[test]
fn built_in_parents_always_get_a_policy_with_transition_rules_on_update() {
    let r = rule(
        false,
        "    validate:
      - cel: \"self.data.tier == oldSelf.data.tier\"
        message: tier is immutable
",
    );
    assert!(crate::rules::crd::crd_for(&r).is_none());
    let objs = validating_policies(&r, &Resource::of(&r), &Scope::default());
    assert_eq!(objs[0]["metadata"]["name"], "rulebook-app-update");
    assert_eq!(
        objs[0]["spec"]["validations"][0]["expression"],
        "object.data.tier == oldObject.data.tier"
    );
    let rr = &objs[0]["spec"]["matchConstraints"]["resourceRules"][0];
    assert_eq!(rr["apiGroups"], json!([""]));
    assert_eq!(rr["resources"], json!(["configmaps"]));
    assert_eq!(rr["operations"], json!(["UPDATE"]));
}

#[test]
fn renaming_spares_strings_and_fields() {
    let r = |s: &str| rename(s, &[("self", "object"), ("oldSelf", "oldObject")]);
    assert_eq!(r("self.x == oldSelf.x"), "object.x == oldObject.x");
    assert_eq!(
        r("self.self == 'self' + \"oldSelf\""),
        "object.self == 'self' + \"oldSelf\""
    );
    assert_eq!(r("r'\\self' == self.a"), "r'\\self' == object.a");
    assert_eq!(r("'''it's self''' + self.b"), "'''it's self''' + object.b");
    assert_eq!(r("myself == selfish"), "myself == selfish");
    assert_eq!(
        r("self.items.all(i, i . self > 0)"),
        "object.items.all(i, i . self > 0)"
    );
}

#[test]
fn cel_defaults_become_a_mutating_policy_that_fills_absent_fields() {
    let r = rule(
        false,
        "    default:
      - path: data.image
        cel: \"'nginx:' + object.data.version\"
",
    );
    let objs = mutating_policies(&r, &Resource::of(&r), &Scope::default());
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[0]["kind"], "MutatingAdmissionPolicy");
    assert_eq!(
        objs[0]["spec"]["mutations"][0]["applyConfiguration"]["expression"],
        "has(object.data) && has(object.data.image) ? Object{} : Object{data: Object.data{image: ('nginx:' + object.data.version)}}"
    );
    assert_eq!(objs[1]["kind"], "MutatingAdmissionPolicyBinding");
    assert_eq!(objs[1]["spec"]["policyName"], "rulebook-app");
}

#[test]
fn a_crd_with_several_versions_gets_policies() {
    let mut r = rule(true, ISSUE);
    let crd = r.spec.crd.as_mut().expect("crd");
    let version = |name: &str, storage: bool| crate::rules::CrdVersion {
        name: crate::rules::Loc::new(name.to_string()),
        served: true,
        storage,
        deprecated: false,
        deprecation_warning: None,
        spec_schema: None,
        status_schema: None,
        printer_columns: Vec::new(),
    };
    crd.versions = vec![version("v1", true), version("v1alpha1", false)];
    assert!(placements(&r).iter().all(
        |p| matches!(&p.placement, Placement::Policy(why) if why.contains("several versions"))
    ));
    assert!(crd_validations(&r).is_empty());
}
