//! Render + status cost per parent, without a cluster (docs/benchmarks.md, "Render cost").
//!
//! The MyWeb example rule (`rules/` + `templates/`), the parent from `examples/myweb.yaml`,
//! and observed children shaped like what the operator's caches hold: the rendered
//! objects plus the fields the API server and kube-controller-manager add (uid,
//! resourceVersion, managedFields, a Deployment status, a Service clusterIP). The same
//! for the benchmark rule (`benches/rules`), whose per-parent cost the end-to-end
//! workloads pay.
//!
//! `cargo bench --bench render`; `make bench` reads the figure from
//! `<target dir>/criterion/<rule>/render_status/new/estimates.json` (`CARGO_TARGET_DIR`
//! when set, else `target/`).

use std::path::{Path, PathBuf};

use criterion::{Criterion, criterion_group, criterion_main};
use rulebook::render::{CompiledRule, DesiredChild, Limits, Observed, Scope};
use serde_json::{Value as Json, json};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn load_rule(rules: &Path, templates: &Path, name: &str) -> std::sync::Arc<CompiledRule> {
    let set = rulebook::render::load(rules, templates, &Limits::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", rules.display()));
    set.rules
        .get(name)
        .unwrap_or_else(|| panic!("no rule '{name}' in {}", rules.display()))
        .clone()
}

/// A parent as the API server returns it: namespace, uid, generation, managedFields.
fn served_parent(mut parent: Json) -> Json {
    let meta = parent["metadata"].as_object_mut().expect("metadata");
    meta.insert("namespace".into(), json!("bench"));
    meta.insert("uid".into(), json!("6f1c9b8e-3d2a-4c5b-9e8f-0a1b2c3d4e5f"));
    meta.insert("generation".into(), json!(3));
    meta.insert("resourceVersion".into(), json!("184467"));
    meta.insert("creationTimestamp".into(), json!("2026-01-01T00:00:00Z"));
    parent
}

/// The rendered children as they come back from the API server and sit in the caches.
fn live_children(desired: &[DesiredChild]) -> Vec<Json> {
    desired
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut o = d.object.clone();
            let meta = o["metadata"].as_object_mut().expect("metadata");
            meta.insert("uid".into(), json!(format!("00000000-0000-0000-0000-00000000000{i}")));
            meta.insert("resourceVersion".into(), json!(format!("{}", 200_000 + i)));
            meta.insert("creationTimestamp".into(), json!("2026-01-01T00:00:01Z"));
            let mut fields = json!({"f:metadata": {"f:annotations": {}, "f:labels": {}, "f:ownerReferences": {}}});
            for key in ["data", "spec", "type"] {
                if o.get(key).is_some() {
                    fields[format!("f:{key}")] = json!({});
                }
            }
            let mut managed = vec![json!({
                "manager": "rulebook", "operation": "Apply", "apiVersion": d.api_version(),
                "time": "2026-01-01T00:00:01Z", "fieldsType": "FieldsV1", "fieldsV1": fields,
            })];
            match d.kind() {
                "Deployment" => {
                    let replicas = o.pointer("/spec/replicas").cloned().unwrap_or(json!(1));
                    o["status"] = json!({
                        "observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                        "readyReplicas": replicas, "availableReplicas": replicas,
                        "conditions": [
                            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                             "message": "Deployment has minimum availability.",
                             "lastUpdateTime": "2026-01-01T00:00:05Z", "lastTransitionTime": "2026-01-01T00:00:05Z"},
                            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                             "message": "ReplicaSet has successfully progressed.",
                             "lastUpdateTime": "2026-01-01T00:00:05Z", "lastTransitionTime": "2026-01-01T00:00:01Z"}
                        ]
                    });
                    o["spec"]["strategy"] = json!({"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}});
                    o["spec"]["revisionHistoryLimit"] = json!(10);
                    o["spec"]["progressDeadlineSeconds"] = json!(600);
                    // Other managers keep only name, operation and time in the cache.
                    managed.push(json!({"manager": "kube-controller-manager", "operation": "Update",
                        "subresource": "status", "time": "2026-01-01T00:00:05Z"}));
                }
                "Service" => {
                    o["spec"]["clusterIP"] = json!("10.0.0.17");
                    o["spec"]["clusterIPs"] = json!(["10.0.0.17"]);
                    o["spec"]["ipFamilies"] = json!(["IPv4"]);
                    o["spec"]["ipFamilyPolicy"] = json!("SingleStack");
                    o["spec"]["sessionAffinity"] = json!("None");
                    o["spec"]["externalTrafficPolicy"] = json!("Cluster");
                    o["status"] = json!({"loadBalancer": {}});
                }
                _ => {}
            }
            o["metadata"]["managedFields"] = Json::Array(managed);
            o
        })
        .collect()
}

fn bench_rule(c: &mut Criterion, group: &str, rule: &CompiledRule, parent: Json) {
    let scope = |_: usize| Scope::Namespaced;
    let desired = rule
        .render(&parent, &Observed::default(), &scope)
        .expect("render");
    let observed = Observed::from_objects(live_children(&desired));
    // Sanity: with every child live, the parent is Ready.
    let report = rule.status(&parent, &observed, &desired).expect("status");
    assert!(
        report.readiness.is_ready(),
        "{group}: the observed set should make the parent ready: {:?}",
        report.readiness
    );

    let mut g = c.benchmark_group(group);
    g.bench_function("render", |b| {
        b.iter(|| rule.render(&parent, &observed, &scope).expect("render"))
    });
    g.bench_function("status", |b| {
        b.iter(|| rule.status(&parent, &observed, &desired).expect("status"))
    });
    // What one reconcile computes per parent.
    g.bench_function("render_status", |b| {
        b.iter(|| {
            let d = rule.render(&parent, &observed, &scope).expect("render");
            rule.status(&parent, &observed, &d).expect("status")
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let root = repo();
    let myweb = load_rule(&root.join("rules"), &root.join("templates"), "myweb");
    let text = std::fs::read_to_string(root.join("examples/myweb.yaml")).expect("example");
    let parent: Json = serde_saphyr::from_str(&text).expect("example yaml");
    bench_rule(c, "myweb", &myweb, served_parent(parent));

    let bench = load_rule(
        &root.join("benches/rules"),
        &root.join("benches/templates"),
        "bench",
    );
    let parent = json!({
        "apiVersion": "bench.rulebook.dev/v1", "kind": "Bench",
        "metadata": {"name": "b-00042"},
        "spec": {"size": 42, "data": "payload-00042-".repeat(8)},
    });
    bench_rule(c, "bench", &bench, served_parent(parent));
}

criterion_group! {
    name = render;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    targets = benches
}
criterion_main!(render);
