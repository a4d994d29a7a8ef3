//! `waitFor: [refs.<name>]`: a child waits for a reference's own `readyWhen`; while the
//! reference is absent or not ready the child is not created, a live one is held (never
//! pruned), and the status says what it waits for; `check` refuses a name that is no
//! reference, and a reference's `readyWhen` that reads `children`.

use serde_json::json;

use super::super::{CompiledRule, Observed, Rendered, Scope};

const BUCKET: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ '-bucket' }}\ndata:\n  number: {{ refs.project.status.number | default('none') | string }}\n";
const DB: &str =
    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ '-db' }}\n";

/// A rule with one reference (`project`, its keys `reference`) and `children`.
fn compile(reference: &str, children: &str) -> Result<std::sync::Arc<CompiledRule>, Vec<String>> {
    let rule = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: p\nspec:\n  \
         parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: P\n  references:\n    \
         - name: project\n      apiVersion: v1\n      kind: ConfigMap\n{reference}  \
         children:\n{children}"
    );
    super::super::testkit::compile_rule("p", &rule, &[("bucket.yaml", BUCKET), ("db.yaml", DB)])
}

const OPTIONAL: &str = "      objectName: \"'project'\"\n      optional: true\n      readyWhen: \"ref.status.number is defined\"\n";

fn bucket(wait_for: &str) -> String {
    format!(
        "    - name: bucket\n      apiVersion: v1\n      kind: ConfigMap\n      template: bucket.yaml\n      waitFor: {wait_for}\n"
    )
}

fn db(extra: &str) -> String {
    format!(
        "    - name: db\n      apiVersion: v1\n      kind: ConfigMap\n      template: db.yaml\n{extra}"
    )
}

fn parent() -> serde_json::Value {
    json!({"apiVersion": "t.rulebook.dev/v1", "kind": "P",
           "metadata": {"name": "a", "namespace": "ns", "uid": "u1"}, "spec": {}})
}

fn live(name: &str, child: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "ns",
           "labels": {"rulebook.dev/child": child}}})
}

fn observed(children: Vec<serde_json::Value>, project: Option<serde_json::Value>) -> Observed {
    let mut o = Observed::from_objects(children);
    if let Some(p) = project {
        o.refs.insert("project".into(), p);
    }
    o
}

fn project(status: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "project", "namespace": "ns"}, "status": status})
}

/// The render, and the `waiting` part of the status it leads to.
fn render(rule: &CompiledRule, o: &Observed) -> (Rendered, Vec<String>) {
    let p = parent();
    let r = rule
        .render_holding_within(&p, o, &|_| Scope::Namespaced, &mut rule.budget())
        .unwrap_or_else(|e| panic!("{e}"));
    let status = rule
        .status(&p, o, &r.desired)
        .unwrap_or_else(|e| panic!("{e}"));
    (r, status.readiness.waiting)
}

fn names(r: &Rendered) -> Vec<&str> {
    r.desired.iter().map(|d| d.name.as_str()).collect()
}

#[test]
fn a_child_waits_for_the_references_ready_when_and_is_held_never_pruned() {
    let rule = compile(OPTIONAL, &(bucket("[refs.project]") + &db("")))
        .unwrap_or_else(|d| panic!("{d:?}"));
    // Absent (optional, missing): not created; the other child is.
    let (r, waiting) = render(&rule, &observed(vec![], None));
    assert_eq!(names(&r), vec!["db"]);
    assert!(r.held.is_empty());
    assert_eq!(waiting, vec!["bucket (for refs.project)".to_string()]);
    // Found but its readyWhen false: still waits.
    let (r, waiting) = render(&rule, &observed(vec![], Some(project(json!({})))));
    assert_eq!(names(&r), vec!["db"]);
    assert_eq!(waiting, vec!["bucket (for refs.project)".to_string()]);
    // Ready: rendered from it.
    let ready = project(json!({"number": 42}));
    let (r, waiting) = render(&rule, &observed(vec![], Some(ready)));
    assert_eq!(names(&r), vec!["bucket", "db"]);
    assert_eq!(r.desired[0].object["data"]["number"], "42");
    assert!(waiting.is_empty(), "{waiting:?}");
    // Live, and the reference stops being ready (the field flaps): held as it is, not
    // rendered from the unready value and not pruned; the status says why.
    let children = vec![live("a-bucket", "bucket"), live("a-db", "db")];
    let (r, waiting) = render(&rule, &observed(children.clone(), Some(project(json!({})))));
    assert_eq!(names(&r), vec!["db"]);
    assert_eq!(r.held, vec!["bucket".to_string()]);
    assert_eq!(waiting, vec!["bucket (for refs.project)".to_string()]);
    // And gone altogether: held too.
    let (r, _) = render(&rule, &observed(children, None));
    assert_eq!(r.held, vec!["bucket".to_string()]);
}

#[test]
fn without_ready_when_a_reference_is_ready_once_found_and_a_selector_once_it_matches() {
    let rule = compile(
        "      objectName: \"'project'\"\n      optional: true\n",
        &bucket("[refs.project]"),
    )
    .unwrap_or_else(|d| panic!("{d:?}"));
    assert!(names(&render(&rule, &observed(vec![], None)).0).is_empty());
    let (r, _) = render(&rule, &observed(vec![], Some(project(json!({})))));
    assert_eq!(names(&r), vec!["bucket"]);
    // A selector: the list; empty is not ready, and readyWhen sees the list as `ref`.
    let rule = compile(
        "      selector: \"{'team': 'a'}\"\n      readyWhen: \"ref | length >= 2\"\n",
        &bucket("[refs.project]"),
    )
    .unwrap_or_else(|d| panic!("{d:?}"));
    let one = json!([project(json!({}))]);
    assert!(names(&render(&rule, &observed(vec![], Some(json!([])))).0).is_empty());
    assert!(names(&render(&rule, &observed(vec![], Some(one))).0).is_empty());
    let two = json!([project(json!({})), project(json!({}))]);
    assert_eq!(
        names(&render(&rule, &observed(vec![], Some(two))).0),
        vec!["bucket"]
    );
}

#[test]
fn a_mixed_list_waits_for_the_sibling_and_the_reference() {
    let rule = compile(
        OPTIONAL,
        &(bucket("[db, refs.project]") + &db("      readyWhen: \"child.data is defined\"\n")),
    )
    .unwrap_or_else(|d| panic!("{d:?}"));
    let (r, waiting) = render(&rule, &observed(vec![], None));
    assert_eq!(names(&r), vec!["db"]);
    assert_eq!(waiting, vec!["bucket (for db, refs.project)".to_string()]);
    // The reference ready, the sibling live but not ready: waits for the sibling only.
    let ready = Some(project(json!({"number": 1})));
    let (_, waiting) = render(&rule, &observed(vec![live("a-db", "db")], ready.clone()));
    assert_eq!(waiting, vec!["bucket (for db)".to_string()]);
    let mut ready_db = live("a-db", "db");
    ready_db["data"] = json!({});
    let (r, waiting) = render(&rule, &observed(vec![ready_db], ready));
    assert_eq!(names(&r), vec!["bucket", "db"]);
    assert!(waiting.is_empty(), "{waiting:?}");
}

#[test]
fn check_refuses_a_name_that_is_no_reference_and_a_ready_when_reading_children() {
    let Err(err) = compile(OPTIONAL, &(bucket("[db, refs.nope]") + &db(""))) else {
        panic!("refs.nope is no reference")
    };
    assert_eq!(
        err,
        vec![
            "rules/p.yaml:21:21: rule 'p': spec.children[0].waitFor[1]: 'refs.nope' names no \
             reference of this rule (spec.references: project)"
                .to_string()
        ]
    );
    let Err(err) = compile(
        "      objectName: \"'project'\"\n      readyWhen: \"children.db is defined\"\n",
        &(bucket("[refs.project]") + &db("")),
    ) else {
        panic!("a reference's readyWhen reading children")
    };
    assert!(
        err.len() == 1
            && err[0].starts_with("rules/p.yaml:14:18: rule 'p': spec.references[0].readyWhen: ")
            && err[0].contains("not children"),
        "{err:?}"
    );
    // `ready()` is no more allowed there than in a child's readyWhen.
    let Err(err) = compile(
        "      objectName: \"'project'\"\n      readyWhen: \"ready(ref)\"\n",
        &bucket("[refs.project]"),
    ) else {
        panic!("ready() in a readyWhen")
    };
    assert!(err[0].contains("readyWhen cannot call ready()"), "{err:?}");
}
