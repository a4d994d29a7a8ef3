//! `allOf: true` on a status JSONPath: the list is published only when it is complete —
//! every object the render wants of the `forEach` child is live and every element has
//! the field — never a partial one; `check` refuses `allOf` where the elements are not
//! decidable (a singular path, `..`, two list segments).

use serde_json::{Value as Json, json};

use super::super::{CompiledRule, Observed, Scope};

const SUBNET: &str =
    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ '-' ~ item }}\n";

fn compile(status: &str) -> Result<std::sync::Arc<CompiledRule>, Vec<String>> {
    let rule = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: net\nspec:\n  \
         parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: Net\n  children:\n    \
         - name: subnets\n      apiVersion: v1\n      kind: ConfigMap\n      \
         template: subnet.yaml\n      forEach: \"parent.spec.zones\"\n  status:\n{status}"
    );
    super::super::testkit::compile_rule("net", &rule, &[("subnet.yaml", SUBNET)])
}

fn subnet(zone: &str, index: usize, id: Option<&str>) -> Json {
    let mut o = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": format!("n-{zone}"), "namespace": "ns",
                     "labels": {"rulebook.dev/child": "subnets"},
                     "annotations": {"rulebook.dev/index": index.to_string()}}});
    if let Some(id) = id {
        o["status"] = json!({"subnetID": id});
    }
    o
}

/// The status fields for zones `zones` with `live` subnets.
fn fields(rule: &CompiledRule, zones: &[&str], live: Vec<Json>) -> serde_json::Map<String, Json> {
    let parent = json!({"apiVersion": "t.rulebook.dev/v1", "kind": "Net",
        "metadata": {"name": "n", "namespace": "ns", "uid": "u"}, "spec": {"zones": zones}});
    let observed = Observed::from_objects(live);
    let desired = rule
        .render(&parent, &observed, &|_| Scope::Namespaced)
        .unwrap_or_else(|e| panic!("{e}"));
    rule.status(&parent, &observed, &desired)
        .unwrap_or_else(|e| panic!("{e}"))
        .fields
}

const BOTH: &str = "    partial: \"$.children.subnets[*].status.subnetID\"\n    \
                    ids:\n      jsonPath: \"$.children.subnets[*].status.subnetID\"\n      allOf: true\n    \
                    idsOrNone:\n      jsonPath: \"$.children.subnets[*].status.subnetID\"\n      allOf: true\n      default: []\n";

#[test]
fn an_all_of_list_is_absent_until_every_element_resolves() {
    let rule = compile(BOTH).unwrap_or_else(|d| panic!("{d:?}"));
    let zones = ["a", "b", "c"];
    // Nothing live: absent (or the default).
    let f = fields(&rule, &zones, vec![]);
    assert!(
        !f.contains_key("ids") && !f.contains_key("partial"),
        "{f:?}"
    );
    assert_eq!(f["idsOrNone"], json!([]));
    // Two of three live, both with their ID: without allOf a partial list; with it, absent
    // (the third subnet the render wants is not there yet).
    let two = vec![subnet("a", 0, Some("s-a")), subnet("b", 1, Some("s-b"))];
    let f = fields(&rule, &zones, two);
    assert_eq!(f["partial"], json!(["s-a", "s-b"]));
    assert!(!f.contains_key("ids"), "{f:?}");
    assert_eq!(f["idsOrNone"], json!([]));
    // All three live, one without its ID yet: still absent.
    let missing_one = vec![
        subnet("a", 0, Some("s-a")),
        subnet("b", 1, None),
        subnet("c", 2, Some("s-c")),
    ];
    let f = fields(&rule, &zones, missing_one);
    assert_eq!(f["partial"], json!(["s-a", "s-c"]));
    assert!(!f.contains_key("ids"), "{f:?}");
    // A null counts as unresolved.
    let mut null = subnet("b", 1, None);
    null["status"] = json!({"subnetID": null});
    let with_null = vec![
        subnet("a", 0, Some("s-a")),
        null,
        subnet("c", 2, Some("s-c")),
    ];
    assert!(!fields(&rule, &zones, with_null).contains_key("ids"));
    // Every one: the whole list, in index order.
    let all = vec![
        subnet("a", 0, Some("s-a")),
        subnet("b", 1, Some("s-b")),
        subnet("c", 2, Some("s-c")),
    ];
    let f = fields(&rule, &zones, all.clone());
    assert_eq!(f["ids"], json!(["s-a", "s-b", "s-c"]));
    assert_eq!(f["idsOrNone"], json!(["s-a", "s-b", "s-c"]));
    // A zone added: absent again until the new subnet has its ID.
    let f = fields(&rule, &["a", "b", "c", "d"], all);
    assert!(!f.contains_key("ids"), "{f:?}");
}

#[test]
fn check_refuses_all_of_where_the_elements_are_not_one_list() {
    let refused = |path: &str| -> String {
        let status = format!("    ids:\n      jsonPath: \"{path}\"\n      allOf: true\n");
        match compile(&status) {
            Ok(_) => panic!("allOf on {path} was accepted"),
            Err(e) => {
                assert_eq!(e.len(), 1, "{e:?}");
                e[0].clone()
            }
        }
    };
    let e = refused("$.children.subnets[0].status.subnetID");
    assert!(
        e.starts_with("rules/net.yaml:17:7: rule 'net': spec.status.ids.allOf: ")
            && e.contains("gives one value"),
        "{e}"
    );
    assert!(refused("$..subnetID").contains("descendant"));
    assert!(refused("$.children.subnets[*].status.ids[*]").contains("one list segment"));
    // A filter or a slice is one list segment.
    for ok in [
        "$.children.subnets[?@.status].status.subnetID",
        "$.children.subnets[0:2].metadata.name",
        "$.children.subnets[*]",
    ] {
        let status = format!("    ids:\n      jsonPath: \"{ok}\"\n      allOf: true\n");
        assert!(compile(&status).is_ok(), "{ok}");
    }
    // allOf goes with jsonPath only.
    let Err(e) = compile("    ids:\n      expr: \"1\"\n      allOf: true\n") else {
        panic!("allOf with expr")
    };
    assert!(e[0].contains("`allOf` goes only with `jsonPath`"), "{e:?}");
}
