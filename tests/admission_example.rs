//! The admission example (examples/admission, issue 43), offline: `rulebook check` accepts
//! it, and its example Workspaces are judged as the webhooks would judge them — the
//! references found from each Workspace in its example file, the defaults computed on
//! the mutating pass, the checks run on the defaulted object on the validating pass.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use rulebook::render::admission::{AdmitRequest, Operation, Phase, Verdict};
use rulebook::render::{CompiledRule, Limits, Observed, RefSelect, Scope};
use serde_json::{Map, Value as Json, json};

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/admission")
}

fn rule() -> std::sync::Arc<CompiledRule> {
    let set = rulebook::render::load(
        &example().join("rules"),
        &example().join("templates"),
        &Limits::default(),
    )
    .unwrap_or_else(|d| panic!("{d}"));
    set.rules["workspace"].clone()
}

/// The objects of an example file: the Workspace first, then what it reads.
fn objects(file: &str) -> Vec<Json> {
    let text = std::fs::read_to_string(example().join("examples").join(file)).unwrap();
    common::yaml_objects(&text)
}

/// `refs` for `parent`: each reference's target looked up among `objects` by name, as
/// a cache would (a `watchSelector` the object does not match hides it).
fn refs(rule: &CompiledRule, parent: &Json, objects: &[Json]) -> Map<String, Json> {
    let mut budget = rule.budget();
    let targets = rule
        .reference_targets(
            parent,
            &Observed::default(),
            &|_| Scope::Namespaced,
            &mut budget,
        )
        .unwrap();
    let mut out = Map::new();
    for t in targets {
        let r = &rule.rule.spec.references[t.reference];
        let RefSelect::Name(name) = &t.select else {
            panic!("the example's references are by name")
        };
        let found = objects.iter().find(|o| {
            o["kind"] == r.kind.value.as_str()
                && o["metadata"]["name"] == name.as_str()
                && r.watch_selector
                    .as_ref()
                    .is_none_or(|w| o["metadata"]["labels"].get(w.value.as_str()).is_some())
        });
        if let Some(o) = found {
            out.insert(r.name.value.clone(), o.clone());
        }
    }
    out
}

/// The mutating pass, the patch applied, then the validating pass.
fn judge(
    rule: &CompiledRule,
    operation: Operation,
    object: &Json,
    old: Option<&Json>,
    objects: &[Json],
) -> (Vec<Json>, Verdict) {
    let refs = refs(rule, object, objects);
    let request = |phase, object| AdmitRequest {
        phase,
        operation,
        object,
        old,
        refs: &refs,
    };
    let Verdict::Allowed { patch } = rule.admit(&request(Phase::Mutate, object)).unwrap() else {
        panic!("the mutating pass denied")
    };
    let mut defaulted = object.clone();
    for op in &patch {
        let path: Vec<String> = op["path"].as_str().unwrap()[1..]
            .split('/')
            .map(|p| p.replace("~1", "/").replace("~0", "~"))
            .collect();
        let (last, parents) = path.split_last().unwrap();
        let mut here = &mut defaulted;
        for p in parents {
            here = &mut here[p.as_str()];
        }
        here[last.as_str()] = op["value"].clone();
    }
    let verdict = rule.admit(&request(Phase::Validate, &defaulted)).unwrap();
    (patch, verdict)
}

#[test]
fn the_admission_example_checks() {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(["check", "--rules", "rules", "--templates", "templates"])
        .current_dir(example())
        .env_remove("RULEBOOK_RULES")
        .env_remove("RULEBOOK_TEMPLATES")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok  workspace  platform.example.com/v1 Workspace"),
        "{stdout}"
    );
}

#[test]
fn the_example_workspaces_are_judged_as_documented() {
    let rule = rule();
    let objects = objects("workspace.yaml");
    let shop = &objects[0];
    let (patch, verdict) = judge(&rule, Operation::Create, shop, None, &objects);
    assert_eq!(verdict, Verdict::Allowed { patch: vec![] });
    assert_eq!(
        patch,
        vec![
            json!({"op": "add", "path": "/spec/image", "value": "registry.example.com/platform/base:2.3"}),
            json!({"op": "add", "path": "/metadata/labels", "value": {"platform.example.com/plan": "gold"}}),
        ]
    );

    // More replicas than the plan allows.
    let mut big = shop.clone();
    big["spec"]["replicas"] = json!(9);
    let (_, verdict) = judge(&rule, Operation::Create, &big, None, &objects);
    assert_eq!(
        verdict,
        Verdict::Denied {
            index: 1,
            message: "plan gold allows at most 5 replicas, not 9".into(),
            field: Some("spec.replicas".into()),
        }
    );

    // The tier cannot change on an update.
    let mut batch = shop.clone();
    batch["spec"]["tier"] = json!("batch");
    let (_, verdict) = judge(&rule, Operation::Update, &batch, Some(shop), &objects);
    assert_eq!(
        verdict,
        Verdict::Denied {
            index: 2,
            message: "tier is immutable (it is web)".into(),
            field: Some("spec.tier".into()),
        }
    );

    // A plan that does not exist; and one the platform did not label as a plan.
    let refused = objects_with(&objects, "workspace-refused.yaml");
    let (_, verdict) = judge(&rule, Operation::Create, &refused[0], None, &refused);
    assert_eq!(
        verdict,
        Verdict::Denied {
            index: 0,
            message: "plan diamond does not exist".into(),
            field: Some("spec.plan".into()),
        }
    );
    let mut unlabelled = objects.clone();
    unlabelled[1]["metadata"]["labels"] = json!({});
    let (_, verdict) = judge(&rule, Operation::Create, shop, None, &unlabelled);
    assert!(
        matches!(verdict, Verdict::Denied { index: 0, .. }),
        "{verdict:?}"
    );
}

/// The objects of `file`, with the other example's referenced objects after them.
fn objects_with(others: &[Json], file: &str) -> Vec<Json> {
    let mut out = objects(file);
    out.extend(others.iter().skip(1).cloned());
    out
}
