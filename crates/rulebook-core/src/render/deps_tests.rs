//! Inferred dependencies: found in templates, includes and expressions; a cycle refused
//! at its `file:line`; and what a render does with a child whose dependency is absent,
//! left out or back.

use serde_json::json;

use super::super::{CompiledRule, Observed, Scope};
use super::Why;

const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: {{ parent.metadata.name }}\nspec:\n  selector:\n    app: {{ children.deployment.metadata.name }}\n";
const DEPLOYMENT: &str = "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {{ parent.metadata.name ~ '-web' }}\nspec:\n  replicas: 1\n";

/// A rule with `children` (the YAML of `spec.children`' entries) over `templates`.
fn compile(
    children: &str,
    templates: &[(&str, &str)],
) -> Result<std::sync::Arc<CompiledRule>, Vec<String>> {
    let rule = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: p\nspec:\n  \
         parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: P\n  children:\n{children}"
    );
    super::super::testkit::compile_rule("p", &rule, templates)
}

fn child(name: &str, api: &str, kind: &str, template: &str, extra: &str) -> String {
    format!(
        "    - name: {name}\n      apiVersion: {api}\n      kind: {kind}\n      template: {template}\n{extra}"
    )
}

fn web(
    service_extra: &str,
    deployment_extra: &str,
) -> Result<std::sync::Arc<CompiledRule>, Vec<String>> {
    // The Service first: the order comes from the read, not from the rule's order.
    let children = child("service", "v1", "Service", "svc.yaml", service_extra)
        + &child(
            "deployment",
            "apps/v1",
            "Deployment",
            "dep.yaml",
            deployment_extra,
        );
    compile(
        &children,
        &[("svc.yaml", SERVICE), ("dep.yaml", DEPLOYMENT)],
    )
}

fn parent(spec: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "t.rulebook.dev/v1", "kind": "P",
           "metadata": {"name": "a", "namespace": "ns", "uid": "u1"}, "spec": spec})
}

fn live(name: &str, child: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "X", "metadata": {"name": name, "namespace": "ns",
           "labels": {"rulebook.dev/child": child}}})
}

fn names(r: &crate::render::Rendered) -> Vec<&str> {
    r.desired.iter().map(|d| d.name.as_str()).collect()
}

fn render(
    rule: &CompiledRule,
    p: &serde_json::Value,
    objects: Vec<serde_json::Value>,
) -> crate::render::Rendered {
    let observed = Observed::from_objects(objects);
    rule.render_holding_within(p, &observed, &|_| Scope::Namespaced, &mut rule.budget())
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_read_of_a_sibling_is_a_dependency_with_its_place() {
    let rule = web("", "").unwrap_or_else(|d| panic!("{d:?}"));
    let deps = rule.dependencies();
    assert_eq!(
        deps[0].get(&1),
        Some(&Why::Reads {
            file: "templates/svc.yaml".into(),
            line: 7
        })
    );
    assert!(deps[1].is_empty());
    assert_eq!(rule.creation_order(), vec![1, 0]);
    assert_eq!(rule.wait_for_positions(), vec![vec![1], vec![]]);
}

/// A comment with characters of more than one byte before a subscript read: the read is
/// found at its own line, and compiling never panics (the comment was once blanked one
/// space per character, which put the read's offset inside `→`).
#[test]
fn a_read_after_a_comment_with_wide_characters_keeps_its_line() {
    let svc = "{# Config — for the café #}\napiVersion: v1\nkind: Service\nmetadata:\n  name: x\n  annotations:\n    db: \"→{{ children['deployment'].metadata.name }}\"\n";
    let children = child("service", "v1", "Service", "svc.yaml", "")
        + &child("deployment", "apps/v1", "Deployment", "deploy.yaml", "");
    let rule = compile(&children, &[("svc.yaml", svc), ("deploy.yaml", DEPLOYMENT)])
        .unwrap_or_else(|d| panic!("{d:?}"));
    assert_eq!(
        rule.dependencies()[0].get(&1),
        Some(&Why::Reads {
            file: "templates/svc.yaml".into(),
            line: 7
        })
    );
}

#[test]
fn subscripts_includes_and_expressions_are_reads_too_but_comments_and_itself_are_not() {
    let tpl = "{# children.deployment in a comment #}\nkind: Service\napiVersion: v1\nmetadata:\n  name: x\n  labels:\n    a: {{ children['cm'].metadata.name }}\n{% include 'inc.yaml' %}\n";
    let inc = "    b: {{ children.secret.metadata.name }}\n    c: {{ children.service.metadata.name | default('') }}\n";
    let children = child(
        "service",
        "v1",
        "Service",
        "svc.yaml",
        "      includeWhen: \"children.gate is defined\"\n",
    ) + &child("deployment", "apps/v1", "Deployment", "dep.yaml", "")
        + &child("cm", "v1", "ConfigMap", "dep.yaml", "")
        + &child("secret", "v1", "Secret", "dep.yaml", "")
        + &child("gate", "v1", "ConfigMap", "dep.yaml", "");
    let rule = compile(
        &children,
        &[
            ("svc.yaml", tpl),
            ("inc.yaml", inc),
            ("dep.yaml", DEPLOYMENT),
        ],
    )
    .unwrap_or_else(|d| panic!("{d:?}"));
    let on: Vec<usize> = rule.dependencies()[0].keys().copied().collect();
    assert_eq!(on, vec![2, 3, 4], "{:?}", rule.dependencies()[0]);
    assert_eq!(
        rule.dependencies()[0][&3],
        Why::Reads {
            file: "templates/inc.yaml".into(),
            line: 1
        }
    );
    assert!(
        matches!(&rule.dependencies()[0][&4], Why::Reads { file, line: 14 } if file == "rules/p.yaml")
    );
}

#[test]
fn a_cycle_through_a_read_is_refused_at_the_read() {
    let reads_service = "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: x\n  labels:\n    s: {{ children.service.metadata.name }}\n";
    let children = child("service", "v1", "Service", "svc.yaml", "")
        + &child("deployment", "apps/v1", "Deployment", "dep.yaml", "");
    let Err(err) = compile(
        &children,
        &[("svc.yaml", SERVICE), ("dep.yaml", reads_service)],
    ) else {
        panic!("a cycle")
    };
    assert_eq!(
        err,
        vec![
            "templates/dep.yaml:6: rule 'p': spec.children[1]: the children's dependencies make \
             a cycle: service -> deployment -> service (a child that reads children.<name> \
             waits for it, as with waitFor)"
                .to_string()
        ]
    );
    // A read and a waitFor against it: at the waitFor entry.
    let Err(err) = web("", "      waitFor: [service]\n") else {
        panic!("a cycle")
    };
    assert!(
        err.len() == 1 && err[0].starts_with("rules/p.yaml:18:17: rule 'p': spec.children[1]: "),
        "{err:?}"
    );
    // Explicit waitFor in the same direction is fine.
    assert!(web("      waitFor: [deployment]\n", "").is_ok());
}

#[test]
fn a_dependent_waits_is_held_while_its_dependency_is_gone_and_follows_it_back() {
    let rule = web("", "").unwrap_or_else(|d| panic!("{d:?}"));
    let p = parent(json!({}));
    // Nothing live: the Deployment is rendered, the Service waits (not an error).
    let r = render(&rule, &p, vec![]);
    assert_eq!(names(&r), vec!["deployment"]);
    assert!(r.held.is_empty());
    // The Deployment live: both.
    let r = render(&rule, &p, vec![live("a-web", "deployment")]);
    assert_eq!(names(&r), vec!["service", "deployment"]);
    let svc = &r.desired[0].object;
    assert_eq!(svc["spec"]["selector"]["app"], "a-web");
    // The Deployment deleted, the Service live: the Deployment again, the Service held.
    let r = render(&rule, &p, vec![live("a", "service")]);
    assert_eq!(names(&r), vec!["deployment"]);
    assert_eq!(r.held, vec!["service".to_string()]);
    // Its status says so.
    let status = rule
        .status(
            &p,
            &Observed::from_objects(vec![live("a", "service")]),
            &r.desired,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.readiness.waiting,
        vec!["service (for deployment)".to_string()]
    );
}

#[test]
fn a_child_whose_dependency_is_left_out_is_left_out_too() {
    let rule =
        web("", "      includeWhen: \"parent.spec.web\"\n").unwrap_or_else(|d| panic!("{d:?}"));
    let p = parent(json!({"web": false}));
    // Live Service and nothing else: it is neither rendered nor held (so pruned).
    let r = render(&rule, &p, vec![live("a", "service")]);
    assert!(r.desired.is_empty() && r.held.is_empty(), "{r:?}");
    let status = rule
        .status(&p, &Observed::default(), &r.desired)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        status.readiness.waiting.is_empty(),
        "{:?}",
        status.readiness
    );
    let r = render(&rule, &parent(json!({"web": true})), vec![]);
    assert_eq!(names(&r), vec!["deployment"]);
}

#[test]
fn explicit_wait_for_still_waits_for_readiness_before_creating() {
    let rule = compile(
        &(child(
            "service",
            "v1",
            "Service",
            "dep.yaml",
            "      waitFor: [deployment]\n",
        ) + &child(
            "deployment",
            "apps/v1",
            "Deployment",
            "dep.yaml",
            "      readyWhen: \"child.status is defined\"\n",
        )),
        &[(
            "dep.yaml",
            "apiVersion: v1\nkind: X\nmetadata:\n  name: {{ parent.metadata.name ~ '-x' }}\n",
        )],
    );
    // Two children rendering the same name are refused at render; only the order matters here.
    let rule = rule.unwrap_or_else(|d| panic!("{d:?}"));
    let p = parent(json!({}));
    let observed = Observed::from_objects(vec![live("other", "deployment")]);
    let (ctx, readiness) = rule
        .context_and_readiness(&p, &observed)
        .unwrap_or_else(|e| panic!("{e}"));
    let states = rule
        .child_states(&ctx, &observed, &readiness)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        states[0],
        super::super::ready::ChildState::Waits(vec!["deployment".into()])
    );
}
