//! The offline evaluator on the expressions rules write: Kubernetes' own examples, the
//! issue's rules, errors, and what is not judged.

use super::*;
use serde_json::json;

fn eval(src: &str, this: Json, old: Option<Json>) -> Outcome {
    compile(src)
        .expect("compiles")
        .eval(&[("self", Some(&this)), ("oldSelf", old.as_ref())])
}

fn is(src: &str, this: Json) -> bool {
    match eval(src, this, None) {
        Outcome::Value(Json::Bool(b)) => b,
        other => panic!("{src}: {other:?}"),
    }
}

#[test]
fn the_issues_rules_judge_objects() {
    let rule = "self.spec.replicas <= 10 || self.metadata.namespace.startsWith('prod-')";
    let obj = |n: i64, ns: &str| json!({"metadata": {"namespace": ns}, "spec": {"replicas": n}});
    assert!(is(rule, obj(3, "dev")));
    assert!(!is(rule, obj(30, "dev")));
    assert!(is(rule, obj(30, "prod-eu")));
    let tier = "self.spec.tier == oldSelf.spec.tier";
    let t = |v: &str| json!({"spec": {"tier": v}});
    assert_eq!(
        eval(tier, t("gold"), Some(t("gold"))),
        Outcome::Value(json!(true))
    );
    assert_eq!(
        eval(tier, t("gold"), Some(t("silver"))),
        Outcome::Value(json!(false))
    );
}

#[test]
fn strings_lists_regex_and_macros() {
    let o = json!({"spec": {"name": "web-01", "ports": [80, 443], "tags": ["a", "b"]}});
    assert!(is("self.spec.name.matches('^[a-z]+-[0-9]+$')", o.clone()));
    assert!(is("self.spec.name.find('[0-9]+') == '01'", o.clone()));
    assert!(is(
        "self.spec.name.findAll('[a-z]') == ['w', 'e', 'b']",
        o.clone()
    ));
    assert!(is("self.spec.ports.all(p, p > 0 && p < 65536)", o.clone()));
    assert!(is(
        "self.spec.ports.isSorted() && self.spec.ports.sum() == 523",
        o.clone()
    ));
    assert!(is("self.spec.tags.exists_one(t, t == 'a')", o.clone()));
    assert!(is(
        "has(self.spec.name) && !has(self.spec.missing)",
        o.clone()
    ));
    assert!(is("self.spec.name.upperAscii() == 'WEB-01'", o.clone()));
    assert!(is("self.spec.tags.join(',') == 'a,b'", o.clone()));
    assert!(is("size(self.spec.tags) == 2", o.clone()));
    assert!(is("self.spec.name.split('-')[1] == '01'", o));
}

#[test]
fn quantities_compare_by_value() {
    let o = json!({"spec": {"memory": "1Gi", "cpu": "500m"}});
    assert!(is(
        "quantity(self.spec.memory) == quantity('1024Mi')",
        o.clone()
    ));
    assert!(is(
        "quantity(self.spec.memory).isLessThan(quantity('2Gi'))",
        o.clone()
    ));
    assert!(is(
        "quantity(self.spec.cpu).compareTo(quantity('1')) == -1",
        o.clone()
    ));
    assert!(is(
        "isQuantity(self.spec.cpu) && !isQuantity('x1')",
        o.clone()
    ));
    assert!(is("quantity('1k').add(24).asInteger() == 1024", o));
}

#[test]
fn errors_and_what_is_not_judged() {
    // A missing field is an error the API server meets too (the request is refused).
    assert!(matches!(
        eval("self.spec.missing > 1", json!({"spec": {}}), None),
        Outcome::Error(_)
    ));
    // A function the offline evaluator lacks: not judged, never a pass.
    assert!(matches!(
        eval(
            "url(self.spec.u).getHost() == 'x'",
            json!({"spec": {"u": "https://x"}}),
            None
        ),
        Outcome::NotJudged(_)
    ));
    // CEL's commutative logic: an error on one side of || does not matter when the
    // other side is true.
    assert!(is("self.spec.missing > 1 || true", json!({"spec": {}})));
    let e = compile("self.spec.replicas <=").expect_err("a syntax error");
    assert!(e.0.starts_with("at 1:") && !e.0.contains('\n'), "{e}");
    assert!(compile("self.spec.(").is_err());
}

#[test]
fn paths_and_variables_are_found() {
    let e = compile(
        "self.spec.replicas <= 10 || has(self.metadata.namespace) && \
         self.metadata.namespace.startsWith('prod-') || self.spec.items.all(i, i.x == oldSelf.spec.y)",
    )
    .expect("compiles");
    assert!(e.reads("oldSelf") && e.reads("self") && !e.reads("object"));
    let paths = e.paths_from("self");
    assert!(paths.contains(&vec!["metadata".to_string(), "namespace".to_string()]));
    assert!(paths.contains(&vec!["spec".to_string(), "replicas".to_string()]));
    assert!(paths.contains(&vec!["spec".to_string(), "items".to_string()]));
}
