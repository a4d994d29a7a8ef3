//! Status semantics: JSONPath results (singular or list, no match, default), expression
//! types, literal values, `cases`, readiness with `readyWhen` and `forEach` children, and
//! the `Ready` condition's reason and message.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::sync::Arc;

use rulebook::render::{CompiledRule, DesiredChild, Limits, Observed, Readiness, Scope};
use rulebook::rules::Sources;
use serde_json::{Map, Value as Json, json};

const RULE: &str = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: stat
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Stat
  children:
    - name: web
      apiVersion: apps/v1
      kind: Deployment
      template: web.yaml
      readyWhen: "child.status.readyReplicas | default(0) >= child.spec.replicas"
    - name: shards
      apiVersion: v1
      kind: ConfigMap
      template: shard.yaml
      forEach: "parent.spec.shards | default([])"
      readyWhen: "child.data.ready == 'yes' and index is number"
    - name: extra
      apiVersion: v1
      kind: ConfigMap
      template: extra.yaml
      includeWhen: "parent.spec.extra | default(false)"
  status:
    replicas: "$.children.web.status.readyReplicas"
    webName: "$['children']['web']['metadata']['name']"
    firstShard: "$.children.shards[0].metadata.name"
    shardNames: "$.children.shards[*].metadata.name"
    readyShards: "$.children.shards[?@.data.ready == 'yes'].metadata.name"
    uids: "$.children..uid"
    available:
      jsonPath: "$.children.web.status.availableReplicas"
      default: 0
    webConditions:
      jsonPath: "$.children.web.status.conditions"
      default: []
    shardCount:
      expr: "children.shards | length"
    parentName:
      expr: "parent.metadata.name"
    many:
      expr: "(parent.spec.shards | default([]) | length) > 2"
    half:
      expr: "(children.shards | length) / 2"
    quoted:
      expr: "'42'"
    summary:
      expr: "{'name': parent.metadata.name, 'shards': parent.spec.shards | default([])}"
    nothing:
      expr: "none"
    undefinedField:
      expr: "parent.spec.notThere"
    literal:
      value: {a: 1, b: [true, null, "x"]}
    phase:
      cases:
        - when: "children.web is not defined"
          value: Pending
        - when: "children.web.status.readyReplicas | default(0) < children.web.spec.replicas"
          expr: "'Scaling ' ~ (children.web.status.readyReplicas | default(0)) ~ '/' ~ children.web.spec.replicas"
        - value: Running
    neverMatches:
      cases:
        - when: "false"
          value: never
    emptyCase:
      cases:
        - when: "true"
        - value: unreachable
"#;

const WEB: &str = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ parent.metadata.name ~ "-web" }}
spec:
  replicas: {{ parent.spec.replicas | default(1) }}
"#;

const SHARD: &str = r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-shard-" ~ index }}
data:
  item: {{ item }}
"#;

const EXTRA: &str = r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-extra" }}
"#;

fn compile_rule(rule: &str, templates: &[(&str, &str)]) -> Arc<CompiledRule> {
    let templates: BTreeMap<String, (String, String)> = templates
        .iter()
        .map(|(n, t)| (n.to_string(), (format!("templates/{n}"), t.to_string())))
        .collect();
    let sources = Sources {
        default_rollout: None,
        rule_files: vec![("rules/stat.yaml".to_string(), rule.to_string())],
        templates,
    };
    let set =
        rulebook::render::compile(&sources, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
    set.rules.values().next().unwrap().clone()
}

fn rule() -> Arc<CompiledRule> {
    compile_rule(
        RULE,
        &[
            ("web.yaml", WEB),
            ("shard.yaml", SHARD),
            ("extra.yaml", EXTRA),
        ],
    )
}

fn parent(spec: Json) -> Json {
    json!({
        "apiVersion": "test.rulebook.dev/v1",
        "kind": "Stat",
        "metadata": {"name": "st", "namespace": "default", "uid": "uid-p", "generation": 4},
        "spec": spec,
    })
}

/// A live object as the API server returns it, labelled with its child name.
fn live(child: &str, kind: &str, name: &str, index: Option<usize>, rest: Json) -> Json {
    let mut o = json!({
        "apiVersion": if kind == "Deployment" { "apps/v1" } else { "v1" },
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": format!("uid-{name}"),
            "labels": {"rulebook.dev/child": child},
            "annotations": {},
        },
    });
    if let Some(i) = index {
        o["metadata"]["annotations"]["rulebook.dev/index"] = json!(i.to_string());
    }
    for (k, v) in rest.as_object().cloned().unwrap_or_default() {
        o[k] = v;
    }
    o
}

fn web(replicas: u32, ready: Option<u32>) -> Json {
    let mut status = json!({"replicas": replicas});
    if let Some(r) = ready {
        status["readyReplicas"] = json!(r);
    }
    live(
        "web",
        "Deployment",
        "st-web",
        None,
        json!({"spec": {"replicas": replicas}, "status": status}),
    )
}

fn shard(i: usize, ready: &str) -> Json {
    live(
        "shards",
        "ConfigMap",
        &format!("st-shard-{i}"),
        Some(i),
        json!({"data": {"item": format!("s{i}"), "ready": ready}}),
    )
}

struct Eval {
    fields: Map<String, Json>,
    readiness: Readiness,
    desired: Vec<DesiredChild>,
}

fn eval(rule: &CompiledRule, spec: Json, objects: Vec<Json>) -> Eval {
    let parent = parent(spec);
    let observed = Observed::from_objects(objects);
    let desired = rule
        .render(&parent, &observed, &|_| Scope::Namespaced)
        .unwrap_or_else(|e| panic!("render: {e}"));
    let report = rule
        .status(&parent, &observed, &desired)
        .unwrap_or_else(|e| panic!("status: {e}"));
    Eval {
        fields: report.fields,
        readiness: report.readiness,
        desired,
    }
}

#[test]
fn jsonpath_singular_queries_give_a_value_and_others_a_list() {
    let r = rule();
    let e = eval(
        &r,
        json!({"replicas": 2, "shards": ["a", "b"]}),
        vec![web(2, Some(2)), shard(0, "yes"), shard(1, "no")],
    );
    let f = &e.fields;
    // Name and index selectors only: one node, as itself.
    assert_eq!(f["replicas"], json!(2));
    assert_eq!(f["webName"], json!("st-web"));
    assert_eq!(f["firstShard"], json!("st-shard-0"));
    // Wildcard, filter and descendant queries: always a list, even of one.
    assert_eq!(f["shardNames"], json!(["st-shard-0", "st-shard-1"]));
    assert_eq!(f["readyShards"], json!(["st-shard-0"]));
    assert_eq!(
        f["uids"].as_array().map(Vec::len),
        Some(3),
        "{:?}",
        f["uids"]
    );
}

#[test]
fn jsonpath_without_a_match_is_unset_or_the_default() {
    let r = rule();
    // Nothing live at all.
    let e = eval(&r, json!({"replicas": 2}), vec![]);
    let f = &e.fields;
    for unset in [
        "replicas",
        "webName",
        "firstShard",
        "shardNames",
        "readyShards",
        "uids",
    ] {
        assert!(!f.contains_key(unset), "{unset} = {:?}", f.get(unset));
    }
    assert_eq!(f["available"], json!(0), "the default");
    assert_eq!(f["webConditions"], json!([]), "a list default");
    // A match wins over the default, even a falsy one.
    let mut w = web(2, Some(0));
    w["status"]["availableReplicas"] = json!(0);
    w["status"]["conditions"] = json!([{"type": "Available", "status": "False"}]);
    let e = eval(&r, json!({"replicas": 2}), vec![w]);
    assert_eq!(e.fields["available"], json!(0));
    assert_eq!(
        e.fields["webConditions"],
        json!([{"type": "Available", "status": "False"}])
    );
    assert_eq!(e.fields["replicas"], json!(0), "a zero is a match");
    // A filter that matches nothing is unset, not an empty list.
    let e = eval(
        &r,
        json!({"shards": ["a"]}),
        vec![web(1, Some(1)), shard(0, "no")],
    );
    assert!(!e.fields.contains_key("readyShards"));
    assert_eq!(e.fields["shardNames"], json!(["st-shard-0"]));
}

#[test]
fn expressions_keep_their_types() {
    let r = rule();
    let e = eval(
        &r,
        json!({"replicas": 1, "shards": ["a", "b", "c"]}),
        vec![
            web(1, Some(1)),
            shard(0, "yes"),
            shard(1, "yes"),
            shard(2, "no"),
        ],
    );
    let f = &e.fields;
    assert_eq!(f["shardCount"], json!(3));
    assert!(f["shardCount"].is_u64() || f["shardCount"].is_i64());
    assert_eq!(f["parentName"], json!("st"));
    assert_eq!(f["many"], json!(true));
    assert_eq!(f["half"], json!(1.5));
    assert_eq!(
        f["quoted"],
        json!("42"),
        "a string that looks like a number"
    );
    assert_eq!(
        f["summary"],
        json!({"name": "st", "shards": ["a", "b", "c"]})
    );
    assert!(!f.contains_key("nothing"), "none is unset");
    assert!(!f.contains_key("undefinedField"), "undefined is unset");
    assert_eq!(f["literal"], json!({"a": 1, "b": [true, null, "x"]}));
    // A false bool is a value, not unset.
    let e = eval(&r, json!({"shards": []}), vec![]);
    assert_eq!(e.fields["many"], json!(false));
    assert_eq!(e.fields["shardCount"], json!(0));
}

#[test]
fn cases_take_the_first_match_and_fall_back() {
    let r = rule();
    let phase = |objects: Vec<Json>| eval(&r, json!({"replicas": 3}), objects).fields;
    assert_eq!(phase(vec![])["phase"], json!("Pending"));
    assert_eq!(phase(vec![web(3, None)])["phase"], json!("Scaling 0/3"));
    assert_eq!(phase(vec![web(3, Some(2))])["phase"], json!("Scaling 2/3"));
    assert_eq!(phase(vec![web(3, Some(3))])["phase"], json!("Running"));
    let f = phase(vec![]);
    assert!(!f.contains_key("neverMatches"), "no case held: unset");
    assert!(
        !f.contains_key("emptyCase"),
        "a case with neither value nor expr unsets, and stops"
    );
}

#[test]
fn ready_when_is_evaluated_per_for_each_child() {
    let r = rule();
    let spec = json!({"replicas": 1, "shards": ["a", "b", "c"]});
    // All present and ready.
    let e = eval(
        &r,
        spec.clone(),
        vec![
            web(1, Some(1)),
            shard(0, "yes"),
            shard(1, "yes"),
            shard(2, "yes"),
        ],
    );
    assert_eq!(e.desired.len(), 4);
    assert!(e.readiness.is_ready(), "{:?}", e.readiness);
    // One not ready, one missing, and the web Deployment not ready.
    let e = eval(
        &r,
        spec.clone(),
        vec![web(1, Some(0)), shard(0, "yes"), shard(1, "no")],
    );
    assert_eq!(e.readiness.not_ready, vec!["web", "shards[1]"]);
    assert_eq!(e.readiness.missing, vec!["shards[2]"]);
    // Live children that are no longer desired do not count.
    let e = eval(
        &r,
        json!({"replicas": 1, "shards": ["a"]}),
        vec![web(1, Some(1)), shard(0, "yes"), shard(1, "no")],
    );
    assert!(e.readiness.is_ready(), "{:?}", e.readiness);
}

#[test]
fn a_child_without_ready_when_is_ready_once_it_exists() {
    let r = rule();
    let spec = json!({"replicas": 1, "extra": true});
    let e = eval(&r, spec.clone(), vec![web(1, Some(1))]);
    assert_eq!(e.readiness.missing, vec!["extra"]);
    let extra = live("extra", "ConfigMap", "st-extra", None, json!({}));
    let e = eval(&r, spec, vec![web(1, Some(1)), extra]);
    assert!(e.readiness.is_ready(), "{:?}", e.readiness);
    // Not included: not required.
    let e = eval(
        &r,
        json!({"replicas": 1, "extra": false}),
        vec![web(1, Some(1))],
    );
    assert!(e.readiness.is_ready(), "{:?}", e.readiness);
}

#[test]
fn a_live_object_under_another_name_is_missing() {
    // Readiness matches live children by name, not only by child label.
    let r = rule();
    let mut stray = web(1, Some(1));
    stray["metadata"]["name"] = json!("someone-else");
    let e = eval(&r, json!({"replicas": 1}), vec![stray]);
    assert_eq!(e.readiness.missing, vec!["web"]);
}

#[test]
fn the_ready_condition_lists_not_ready_then_missing() {
    let r = rule();
    let e = eval(
        &r,
        json!({"replicas": 2, "shards": ["a", "b"], "extra": true}),
        vec![web(2, Some(1)), shard(0, "no")],
    );
    let c = e.readiness.condition();
    assert!(!c.status);
    assert_eq!(c.reason, "ChildrenNotReady");
    assert_eq!(
        c.message,
        "not ready: web, shards[0]; missing: shards[1], extra"
    );

    let only_missing = Readiness {
        missing: vec!["a".into()],
        not_ready: vec![],
        ..Readiness::default()
    };
    assert_eq!(only_missing.condition().message, "missing: a");
    let only_not_ready = Readiness {
        missing: vec![],
        not_ready: vec!["b".into()],
        ..Readiness::default()
    };
    assert_eq!(only_not_ready.condition().message, "not ready: b");

    let ready = Readiness::default().condition();
    assert!(ready.status);
    assert_eq!(ready.reason, "Ready");
    assert_eq!(ready.message, "all children are ready");
}

#[test]
fn a_long_ready_message_is_truncated() {
    let many = Readiness {
        missing: (0..1000).map(|i| format!("shards[{i}]")).collect(),
        not_ready: vec![],
        ..Readiness::default()
    };
    let m = many.condition().message;
    assert!(m.len() <= 1024 + '…'.len_utf8(), "{} bytes", m.len());
    assert!(m.starts_with("missing: shards[0], shards[1]"));
    assert!(m.ends_with('…'));
}

#[test]
fn observed_children_are_ordered_by_index() {
    let o = Observed::from_objects(vec![
        shard(10, "yes"),
        shard(2, "yes"),
        web(1, None),
        json!({"metadata": {"name": "unlabelled"}}),
        shard(0, "yes"),
    ]);
    let names: Vec<&str> = o.children["shards"]
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["st-shard-0", "st-shard-2", "st-shard-10"]);
    assert_eq!(o.children.len(), 2, "the unlabelled object is ignored");
}

#[test]
fn a_failing_status_expression_points_at_the_rule() {
    let rule_text = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: broken
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Stat
  status:
    sum:
      expr: "parent.spec.count + 'x'"
"#;
    let r = compile_rule(rule_text, &[]);
    let p = parent(json!({"count": 1}));
    let err = r
        .status(&p, &Observed::default(), &[])
        .expect_err("int + string");
    assert_eq!(err.file, "rules/stat.yaml");
    assert_eq!(err.line, Some(11));
    assert!(
        err.message.contains("rule 'broken': spec.status.sum"),
        "{err}"
    );
}

#[test]
fn ready_when_sees_child_and_index() {
    // `index` is the forEach index in readyWhen; here shard 1 is never ready.
    let rule_text = RULE.replace(
        "readyWhen: \"child.data.ready == 'yes' and index is number\"",
        "readyWhen: \"child.data.ready == 'yes' and index != 1\"",
    );
    let r = compile_rule(
        &rule_text,
        &[
            ("web.yaml", WEB),
            ("shard.yaml", SHARD),
            ("extra.yaml", EXTRA),
        ],
    );
    let e = eval(
        &r,
        json!({"replicas": 1, "shards": ["a", "b", "c"]}),
        vec![
            web(1, Some(1)),
            shard(0, "yes"),
            shard(1, "yes"),
            shard(2, "yes"),
        ],
    );
    assert_eq!(e.readiness.not_ready, vec!["shards[1]"]);
}

#[test]
fn ready_when_can_use_item_or_rejects_it_at_load() {
    // `item` is listed among readyWhen's variables; it must either be the forEach item
    // when readyWhen runs, or be refused when the rule loads, never silently undefined.
    let rule_text = RULE.replace(
        "readyWhen: \"child.data.ready == 'yes' and index is number\"",
        "readyWhen: \"child.data.item == 's' ~ item\"",
    );
    let templates: BTreeMap<String, (String, String)> = [
        ("web.yaml", WEB),
        ("shard.yaml", SHARD),
        ("extra.yaml", EXTRA),
    ]
    .iter()
    .map(|(n, t)| (n.to_string(), (format!("templates/{n}"), t.to_string())))
    .collect();
    let sources = Sources {
        default_rollout: None,
        rule_files: vec![("rules/stat.yaml".to_string(), rule_text)],
        templates,
    };
    match rulebook::render::compile(&sources, &Limits::default()) {
        Err(d) => assert!(d.to_string().contains("unknown variable 'item'"), "{d}"),
        Ok(set) => {
            let r = set.rules["stat"].clone();
            // shard(i) has data.item = "s<i>", the item is "<i>".
            let e = eval(
                &r,
                json!({"replicas": 1, "shards": ["0", "1"]}),
                vec![web(1, Some(1)), shard(0, "yes"), shard(1, "yes")],
            );
            assert!(
                e.readiness.is_ready(),
                "item in readyWhen: {:?}",
                e.readiness
            );
        }
    }
}

/// Where references point: a namespaced parent's stay in its namespace (or a literal
/// one); a cluster-scoped parent's may be computed; a selector is a label map.
#[test]
fn reference_targets_follow_the_parent_scope() {
    use rulebook::render::{RefSelect, RefTarget};
    let rule = compile_rule(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: stat
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Stat
  references:
    - name: own
      apiVersion: v1
      kind: Secret
      objectName: "parent.spec.secret"
    - name: shared
      apiVersion: v1
      kind: ConfigMap
      objectName: "'defaults'"
      namespace: platform
    - name: computed
      apiVersion: v1
      kind: ConfigMap
      selector: "{'team': parent.spec.team, 'size': parent.spec.size}"
      namespace: "'tenant-' ~ parent.metadata.name"
  children:
    - name: web
      apiVersion: v1
      kind: ConfigMap
      template: cm.yaml
"#,
        &[(
            "cm.yaml",
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n",
        )],
    );
    let scope = |_: usize| Scope::Namespaced;
    let spec = json!({"secret": "db", "team": "a", "size": 3});
    // A cluster-scoped parent: the computed namespace is used.
    let cluster = json!({"apiVersion": "test.rulebook.dev/v1", "kind": "Stat",
        "metadata": {"name": "acme", "uid": "u"}, "spec": spec});
    let labels = BTreeMap::from([
        ("size".to_string(), "3".to_string()),
        ("team".into(), "a".into()),
    ]);
    let targets = rule
        .reference_targets(&cluster, &Observed::default(), &scope, &mut rule.budget())
        .map_err(|e| e.to_string());
    // The first reference has no namespace and the parent none either: an error naming it.
    let err = targets.unwrap_err();
    assert!(
        err.contains("spec.references[0]") && err.contains("give the reference a namespace"),
        "{err}"
    );
    // A namespaced parent: its own namespace, the literal one, and the expression refused.
    let namespaced = json!({"apiVersion": "test.rulebook.dev/v1", "kind": "Stat",
        "metadata": {"name": "acme", "namespace": "team-a", "uid": "u"}, "spec": spec});
    let err = rule
        .reference_targets(
            &namespaced,
            &Observed::default(),
            &scope,
            &mut rule.budget(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.references[2]") && err.contains("only literally"),
        "{err}"
    );
    // The cluster-scoped parent again, with the first referenced kind cluster-scoped (no
    // namespace at all): every target lands where it should.
    let first_kind_cluster_scoped = |i: usize| {
        if i == 0 {
            Scope::Cluster
        } else {
            Scope::Namespaced
        }
    };
    let targets = rule
        .reference_targets(
            &cluster,
            &Observed::default(),
            &first_kind_cluster_scoped,
            &mut rule.budget(),
        )
        .unwrap();
    assert_eq!(
        targets,
        vec![
            RefTarget {
                reference: 0,
                namespace: None,
                select: RefSelect::Name("db".into())
            },
            RefTarget {
                reference: 1,
                namespace: Some("platform".into()),
                select: RefSelect::Name("defaults".into())
            },
            RefTarget {
                reference: 2,
                namespace: Some("tenant-acme".into()),
                select: RefSelect::Labels(labels)
            },
        ]
    );
}

/// The status sees the children as the reconcile left them: a dependency it just created
/// may be ready now, but the child that waited for it was not rendered in this reconcile,
/// so the parent is not Ready yet.
#[test]
fn a_child_skipped_by_this_render_still_waits_in_the_status() {
    let rule = compile_rule(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: stat
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Stat
  children:
    - name: db
      apiVersion: v1
      kind: ConfigMap
      template: db.yaml
    - name: app
      apiVersion: v1
      kind: ConfigMap
      template: app.yaml
      waitFor: [db]
"#,
        &[
            (
                "db.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: db\n",
            ),
            (
                "app.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: app\n",
            ),
        ],
    );
    let p = parent(json!({}));
    let scope = |_: usize| Scope::Namespaced;
    // The render, with nothing live: only db.
    let desired = rule.render(&p, &Observed::default(), &scope).unwrap();
    assert_eq!(desired.len(), 1);
    // The status, with db as its apply left it.
    let db = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "db", "labels": {"rulebook.dev/child": "db"}}});
    let after = Observed::from_objects([db]);
    let report = rule.status(&p, &after, &desired).unwrap();
    assert_eq!(report.readiness.waiting, vec!["app (for db)".to_string()]);
    assert!(!report.readiness.is_ready());
    // The next render sees db live and renders app too; then nothing waits.
    let desired = rule.render(&p, &after, &scope).unwrap();
    assert_eq!(desired.len(), 2);
    let report = rule.status(&p, &after, &desired).unwrap();
    assert!(
        report.readiness.waiting.is_empty(),
        "{:?}",
        report.readiness
    );
}

/// Contexts leave the live children out only when nothing names `children`: a template
/// that reads a child still sees it, and JSONPaths that start at `$.parent` or
/// `$['children']` still find their values in the trimmed status document.
#[test]
fn what_a_rule_reads_is_in_its_contexts() {
    let rule = compile_rule(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: reads
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Stat
  children:
    - name: svc
      apiVersion: v1
      kind: Service
      template: svc.yaml
    - name: conf
      apiVersion: v1
      kind: ConfigMap
      template: conf.yaml
  status:
    gen: "$.parent.metadata.generation"
    ip: "$['children']['svc']['spec']['clusterIP']"
"#,
        &[
            (
                "svc.yaml",
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: svc\nspec:\n  ports: [{port: 80}]\n",
            ),
            (
                "conf.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: conf\ndata:\n  ip: {{ children.svc.spec.clusterIP | default('none') }}\n",
            ),
        ],
    );
    let svc = live(
        "svc",
        "Service",
        "svc",
        None,
        json!({"spec": {"clusterIP": "10.0.0.9", "ports": [{"port": 80}]}}),
    );
    let e = eval(&rule, json!({}), vec![svc]);
    let conf = e.desired.iter().find(|d| d.name == "conf").unwrap();
    assert_eq!(conf.object["data"]["ip"], json!("10.0.0.9"));
    assert_eq!(e.fields.get("gen"), Some(&json!(4)));
    assert_eq!(e.fields.get("ip"), Some(&json!("10.0.0.9")));
}
