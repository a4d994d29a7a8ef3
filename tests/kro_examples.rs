//! Issue 47 part 8: five of kro's own examples, ported under `examples/kro/` (webapp,
//! gemma-on-tpu, network-stack, saas-multi-tenant, cel-functions), each reach `Ready` on
//! the local control plane with its sample instance; and the cel-functions port renders
//! kro's values (seeded string, FNV-1a and SHA-256 in base64) for the same inputs.
//!
//! One operator runs the five rule directories at once (every namespace: the saas
//! tenant's children live in the namespace its Tenant makes). The foreign kinds the
//! examples create (ACK's EC2 kinds, Config Connector's IAM/storage kinds, the Project
//! they refer to) are installed as plain CRDs whose groups are this run's own (every
//! group in the copied rules, templates and instances is renamed, `kro.run` too, so no
//! cluster-scoped object is shared with another test); the test plays their
//! controllers: it writes the status fields the examples wait for (a service account's
//! e-mail, a bucket's Ready condition, the checkpoint Job's completion). kwok runs the
//! webapp's pods.
//!
//! kro's values are computed here, not read from Rulebook: `random.seededString` follows
//! kro's `pkg/cel/library/random.go` (SHA-256 of the seed, 4 bytes per character modulo
//! 36 over `0-9a-z`); the hashes of "app" are Python's (`hashlib.sha256`, FNV-1a 64 by
//! its definition, big-endian bytes, `base64.b64encode`).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::{Value as Json, json};
use sha2::{Digest, Sha256};

const T: Duration = Duration::from_secs(180);

/// The examples: their directory under `examples/kro/` and their instance file.
const EXAMPLES: [(&str, &str); 5] = [
    ("webapp", "instance.yaml"),
    ("cel-functions", "instance.yaml"),
    ("network-stack", "instance.yaml"),
    ("gemma-on-tpu", "instance.yaml"),
    ("saas-multi-tenant", "tenant-instance.yaml"),
];

/// The groups the examples use, by the short name this run's group is made from.
const GROUPS: [(&str, &str); 5] = [
    ("kro.run", "kro"),
    ("ec2.services.k8s.aws", "ec2"),
    ("iam.cnrm.cloud.google.com", "iam"),
    ("storage.cnrm.cloud.google.com", "storage"),
    ("resourcemanager.cnrm.cloud.google.com", "rm"),
];

/// The foreign kinds, by short group name and version.
const FOREIGN: [(&str, &str, &[&str]); 4] = [
    (
        "ec2",
        "v1alpha1",
        &[
            "VPC",
            "InternetGateway",
            "RouteTable",
            "Subnet",
            "ElasticIPAddress",
            "NATGateway",
            "SecurityGroup",
        ],
    ),
    (
        "iam",
        "v1beta1",
        &["IAMServiceAccount", "IAMPolicyMember", "IAMPartialPolicy"],
    ),
    ("storage", "v1beta1", &["StorageBucket"]),
    ("rm", "v1beta1", &["Project"]),
];

/// kro's `random.seededString(n, seed)` (pkg/cel/library/random.go).
fn kro_seeded_string(n: usize, seed: &str) -> String {
    const CHARS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let hash = Sha256::digest(seed.as_bytes());
    (0..n)
        .map(|i| {
            let s = (i * 4) % 32;
            let v = u32::from_be_bytes([hash[s], hash[s + 1], hash[s + 2], hash[s + 3]]);
            CHARS[(v % 36) as usize] as char
        })
        .collect()
}

fn plural(kind: &str) -> String {
    let k = kind.to_lowercase();
    if k.ends_with('s') {
        format!("{k}es")
    } else if let Some(stem) = k.strip_suffix('y') {
        format!("{stem}ies")
    } else {
        format!("{k}s")
    }
}

/// This run's group for a short group name.
fn group(short: &str, run: &str) -> String {
    format!("{short}.{run}.test")
}

/// Copies `from` to `to`, every example group renamed to this run's.
fn copy_renamed(from: &Path, to: &Path, run: &str) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_renamed(&entry.path(), &target, run);
        } else {
            std::fs::write(
                &target,
                renamed(&std::fs::read_to_string(entry.path()).expect("read"), run),
            )
            .expect("write");
        }
    }
}

fn renamed(text: &str, run: &str) -> String {
    GROUPS.iter().fold(text.to_string(), |t, (from, short)| {
        t.replace(from, &group(short, run))
    })
}

fn foreign_crd(short: &str, version: &str, kind: &str, run: &str) -> Json {
    let g = group(short, run);
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{}.{g}", plural(kind))},
        "spec": {
            "group": g,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural(kind), "singular": kind.to_lowercase(),
                      "listKind": format!("{kind}List")},
            "versions": [{
                "name": version, "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                                               "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    })
}

/// Plays the foreign controllers for one round: the status each example waits for.
async fn play_controllers(client: &kube::Client, ns: &str, run: &str) {
    let patch = PatchParams::default();
    let iam = format!("{}/v1beta1", group("iam", run));
    let sas = api(
        client,
        Some(ns),
        &iam,
        "IAMServiceAccount",
        "iamserviceaccounts",
    );
    for sa in sas
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let o = to_json(&sa);
        let name = o["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if o.pointer("/status/email").is_none() {
            let email = format!("{name}@k8sai-example.iam.gserviceaccount.com");
            let _ = sas
                .patch_status(
                    &name,
                    &patch,
                    &Patch::Merge(json!({"status": {"email": email}})),
                )
                .await;
        }
    }
    let storage = format!("{}/v1beta1", group("storage", run));
    let buckets = api(
        client,
        Some(ns),
        &storage,
        "StorageBucket",
        "storagebuckets",
    );
    for b in buckets
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let o = to_json(&b);
        if o.pointer("/status/conditions").is_none() {
            let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
            let name = o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let _ = buckets
                .patch_status(&name, &patch, &Patch::Merge(ready))
                .await;
        }
    }
    // The checkpoint Job's pod needs a TPU node: it never runs here; the Job completes.
    let jobs = api(client, Some(ns), "batch/v1", "Job", "jobs");
    if let Ok(Some(job)) = jobs.get_opt("gemma-tpu-loader").await {
        let o = to_json(&job);
        if o.pointer("/status/startTime").is_some() && o.pointer("/status/completionTime").is_none()
        {
            let now = chrono_now();
            let condition = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now, "lastProbeTime": now});
            let done = json!({"status": {"completionTime": now, "succeeded": 1, "active": 0,
                "conditions": [condition("SuccessCriteriaMet"), condition("Complete")]}});
            let _ = jobs
                .patch_status("gemma-tpu-loader", &patch, &Patch::Merge(done))
                .await;
        }
    }
}

/// Now in RFC 3339 (seconds), as the API server writes times.
fn chrono_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The sample instances, placed in `ns` (the saas Tenant is cluster-scoped), with the
/// apiVersion, kind and plural of each parent.
fn instances(dir: &Path, ns: &str, tenant: &str) -> Vec<Json> {
    let mut out = Vec::new();
    for (example, file) in EXAMPLES {
        let text = std::fs::read_to_string(dir.join(example).join("examples").join(file))
            .expect("instance");
        for mut o in yaml_objects(&text) {
            if example == "saas-multi-tenant" {
                o["metadata"]["name"] = json!(tenant);
                o["spec"]["tenantId"] = json!(tenant);
            } else {
                o["metadata"]["namespace"] = json!(ns);
            }
            if example == "webapp" {
                // kro's webapp puts its children in spec.namespace: the parent's own here.
                o["spec"]["namespace"] = json!(ns);
            }
            out.push(o);
        }
    }
    out
}

fn api_for(client: &kube::Client, o: &Json) -> kube::Api<kube::api::DynamicObject> {
    let s = |p: &str| {
        o.pointer(p)
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let (av, kind, ns) = (
        s("/apiVersion"),
        s("/kind"),
        o.pointer("/metadata/namespace").and_then(Json::as_str),
    );
    api(client, ns, &av, &kind, &plural(&kind))
}

/// Installs the foreign kinds as this run's CRDs; their names.
async fn install_foreign_crds(client: &kube::Client, run: &str) -> Vec<String> {
    let crds = crds_api(client);
    let mut foreign = Vec::new();
    for (short, version, kinds) in FOREIGN {
        for kind in kinds {
            let crd = foreign_crd(short, version, kind, run);
            foreign.push(crd["metadata"]["name"].as_str().expect("name").to_string());
            apply(&crds, crd).await;
        }
    }
    for name in &foreign {
        wait_established(client, name).await;
    }
    foreign
}

fn crds_api(client: &kube::Client) -> kube::Api<kube::api::DynamicObject> {
    api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_five_kro_examples_reach_ready() {
    let client = client().await;
    let ns = namespace(&client, "kro").await;
    let run = unique("kx").to_lowercase();
    let tenant = format!("tenant-{run}");
    let dir = tempfile::tempdir().expect("tempdir");
    let (rules, templates, examples) = (
        dir.path().join("rules"),
        dir.path().join("templates"),
        dir.path().join("examples"),
    );
    for (example, _) in EXAMPLES {
        let from = repo().join("examples/kro").join(example);
        copy_renamed(&from.join("rules"), &rules.join(example), &run);
        copy_renamed(&from.join("templates"), &templates, &run);
        copy_renamed(
            &from.join("examples"),
            &examples.join(example).join("examples"),
            &run,
        );
    }
    let foreign = install_foreign_crds(&client, &run).await;
    let _op = Operator::on(&rules, &templates)
        .flags(&["--install-crds"])
        .start()
        .await;

    let parents = instances(&examples, &ns, &tenant);
    for o in &parents {
        let api = api_for(&client, o);
        let name = o["metadata"]["name"].as_str().expect("name").to_string();
        wait_for(T, &format!("{} to be served", o["kind"]), || async {
            api.list(&Default::default()).await.ok().map(|_| ())
        })
        .await;
        apply(&api, o.clone()).await;
        if let Some(status) = o.get("status") {
            // The Project's status is Config Connector's to write.
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
            .expect("project status");
        }
    }
    let waited: Vec<&Json> = parents.iter().filter(|o| o["kind"] != "Project").collect();
    wait_for(T, "the five examples to be Ready", || async {
        play_controllers(&client, &ns, &run).await;
        let mut pending = Vec::new();
        for o in &waited {
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            let live = api_for(&client, o)
                .get_opt(name)
                .await
                .ok()
                .flatten()
                .map(|p| to_json(&p));
            match live.as_ref().and_then(ready_condition) {
                Some((s, _, _)) if s == "True" => {}
                other => pending.push(format!("{} {name}: {other:?}", o["kind"])),
            }
        }
        if !pending.is_empty() {
            eprintln!("not Ready yet: {pending:?}");
        }
        pending.is_empty().then_some(())
    })
    .await;

    cel_functions_values(&client, &ns, &parents).await;
    saas_children(&client, &tenant).await;

    cleanup(&client, &waited, &tenant, &run, foreign).await;
}

/// The cel-functions Deployment's values are kro's for the same instance.
async fn cel_functions_values(client: &kube::Client, ns: &str, parents: &[Json]) {
    let something = parents
        .iter()
        .find(|o| o["kind"] == "Something")
        .expect("Something");
    let name = something["metadata"]["name"].as_str().expect("name");
    let live = to_json(
        &api_for(client, something)
            .get(name)
            .await
            .expect("Something"),
    );
    let uid = live["metadata"]["uid"].as_str().expect("uid");
    let deployments = api(client, Some(ns), "apps/v1", "Deployment", "deployments");
    let d = to_json(
        &deployments
            .get("app")
            .await
            .expect("the cel-functions Deployment"),
    );
    let env: std::collections::BTreeMap<String, String> = d
        .pointer("/spec/template/spec/containers/0/env")
        .and_then(Json::as_array)
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e["value"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let want = [
        ("RANDOM_SEEDED_STRING", kro_seeded_string(10, uid)),
        // python3: base64.b64encode(fnv1a64(b"app").to_bytes(8, "big"))
        ("HASH_FNV64A_BASE64", "50+nGQVqg4w=".to_string()),
        // python3: base64.b64encode(hashlib.sha256(b"app").digest())
        (
            "HASH_SHA256_BASE64",
            "oXLO3K5HR0thXFTVEKXYSo3qMDLpWFh0MLQTU4vj8zM=".to_string(),
        ),
        ("FULL_DNS_NAME", "a.b.c.d.example.com".to_string()),
        ("DNS_FIRST_PART", "a".to_string()),
        ("DNS_PARTIALS", "a".to_string()),
        ("LISTS_SUM", "600".to_string()),
        ("JSON_UNMARSHAL_EXAMPLE", "exampleJSONValue".to_string()),
        ("JSON_MARSHAL_EXAMPLE", r#"{"name":"app"}"#.to_string()),
        ("QUANTITY_COMPARISON", "small".to_string()),
    ];
    for (key, value) in want {
        assert_eq!(env.get(key), Some(&value), "{key} (env: {env:?})");
    }
    let services = api(client, Some(ns), "v1", "Service", "services");
    let s = to_json(
        &services
            .get("app")
            .await
            .expect("the cel-functions Service"),
    );
    assert_eq!(s["metadata"]["labels"]["partials"], "a.b.c");
    assert_eq!(s["metadata"]["labels"]["first_part"], "a");
}

/// The saas Tenant's children made their objects in the tenant's own namespace.
async fn saas_children(client: &kube::Client, tenant: &str) {
    let deployments = api(client, Some(tenant), "apps/v1", "Deployment", "deployments");
    assert!(
        deployments
            .get_opt(&format!("{tenant}-deployment"))
            .await
            .expect("get")
            .is_some()
    );
    let quotas = api(
        client,
        Some(tenant),
        "v1",
        "ResourceQuota",
        "resourcequotas",
    );
    assert!(
        quotas
            .get_opt(&format!("{tenant}-quota"))
            .await
            .expect("get")
            .is_some()
    );
}

#[test]
fn the_seeded_string_follows_kros_algorithm() {
    // python3, kro's loop written out: h = hashlib.sha256(seed).digest();
    // "".join(C[int.from_bytes(h[i*4%32:i*4%32+4], "big") % 36] for i in range(n))
    assert_eq!(kro_seeded_string(10, "test-seed"), "5czheg3o5c");
    assert_eq!(kro_seeded_string(20, "test-seed"), "5czheg3o5czheg3o5czh");
}

/// Cleanup, while the operator runs: every parent (the gemma one carries Rulebook's
/// finalizer for its `Orphan` ServiceAccount: the operator lets go of it and removes the
/// finalizer), the tenant's namespace, then every CRD of the run.
async fn cleanup(
    client: &kube::Client,
    waited: &[&Json],
    tenant: &str,
    run: &str,
    foreign: Vec<String>,
) {
    let client = client.clone();
    for o in waited {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let _ = api_for(&client, o)
            .delete(name, &DeleteParams::default())
            .await;
    }
    for o in waited {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let api = api_for(&client, o);
        wait_for(
            T,
            &format!("{} {name} to be deleted", o["kind"]),
            || async { matches!(api.get_opt(name).await, Ok(None)).then_some(()) },
        )
        .await;
    }
    TestNamespace::delete_leftover(&client, tenant).await;
    let own = [
        "webapps",
        "somethings",
        "networkstacks",
        "gemmaontpuservers",
        "tenants",
        "tenantenvironments",
        "tenantapplications",
    ];
    for name in own
        .iter()
        .map(|p| format!("{p}.{}", group("kro", run)))
        .chain(foreign)
    {
        let _ = crds_api(&client)
            .delete(&name, &DeleteParams::default())
            .await;
    }
}
