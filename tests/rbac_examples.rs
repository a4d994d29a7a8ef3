//! Issue 45: every shipped example rule (rules/, templates/) runs under exactly what
//! `rulebook rbac` generates for it — no admin, no wildcard — and every shipped example
//! parent (examples/*.yaml) becomes Ready. Before `bind` by name, the Tenant's
//! RoleBinding (roleRef ClusterRole `admin`) was refused by the API server's escalation
//! check and the Tenant backed off with `ApplyFailed` for ever.
//!
//! The rules are copied with their API groups and names renamed (`xyz.com` →
//! `xyz-<unique>.test`, `tenant` → `tenant-<unique>`): the operator installs its own CRDs
//! (`--install-crds`, granted by name), and no other test's operator — most run the
//! repository's rules, and would reconcile a cluster-scoped Tenant whatever their
//! `--namespace` — can make these parents Ready in its place. The operator watches every
//! namespace, as deployed (a Tenant's children live in the namespace it creates, which
//! `--namespace` would not watch); the renamed rules label their children with their own
//! names, so other tests' children are not theirs. The templates are the repository's.
// A scenario test reads top to bottom as one story (see tests/deploy_manifests.rs).
#![allow(clippy::too_many_lines)]

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, DeleteParams, DynamicObject};
use serde_json::json;

const T: Duration = Duration::from_secs(120);

/// The example groups, renamed for this run.
fn groups(u: &str) -> [(&'static str, String); 3] {
    [
        ("operator.k8s-summit.org", format!("op-{u}.test")),
        ("app.example.com", format!("app-{u}.test")),
        ("xyz.com", format!("xyz-{u}.test")),
    ]
}

fn renamed(text: &str, u: &str) -> String {
    groups(u)
        .iter()
        .fold(text.to_string(), |t, (from, to)| t.replace(from, to))
}

/// A rule file with its groups and its own name renamed.
fn renamed_rule(text: &str, u: &str) -> String {
    let text = renamed(text, u);
    let at =
        text.find("\nmetadata:\n  name: ").expect("metadata.name") + "\nmetadata:\n  name: ".len();
    let end = at + text[at..].find('\n').expect("a line");
    format!("{}-{u}{}", &text[..end], &text[end..])
}

/// The plural of an example object's kind.
fn plural(kind: &str) -> String {
    match kind {
        "MyWeb" | "MyApp" | "Project" | "TeamApp" | "Tenant" | "Secret" | "ConfigMap" => {
            format!("{}s", kind.to_lowercase())
        }
        other => panic!("an example of kind {other}: add its plural here"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_example_is_ready_on_exactly_the_generated_rbac() {
    let client = client().await;
    let ns = namespace(&client, "rbac-examples").await;
    let u = unique("g").to_lowercase();
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules");
    std::fs::create_dir_all(&rules).unwrap();
    let mut files = 0;
    for entry in std::fs::read_dir(repo().join("rules")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            std::fs::write(
                rules.join(path.file_name().unwrap()),
                renamed_rule(&text, &u),
            )
            .unwrap();
            files += 1;
        }
    }
    assert_eq!(files, 5, "the shipped rules");
    let templates = repo().join("templates");

    // Exactly `rulebook rbac` for these rules, bound to a ServiceAccount of the test's.
    let role = unique("rulebook-rbac-examples");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
        "--install-crds",
    ]));
    let text = serde_json::to_string(&rbac).unwrap();
    assert!(!text.contains("\"*\""), "no wildcard: {text}");
    assert!(!text.contains("escalate"), "no escalate: {text}");
    let bind = rbac
        .iter()
        .flat_map(|o| o["rules"].as_array().into_iter().flatten())
        .find(|r| r["verbs"] == json!(["bind"]))
        .expect("bind on the Tenant's role, by name");
    assert_eq!(bind["resources"], json!(["clusterroles"]));
    assert_eq!(bind["resourceNames"], json!(["admin"]));
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;
    let op = Operator::on(&rules, &templates)
        .kubeconfig(kubeconfig.path())
        .flags(&["--install-crds"])
        .start()
        .await;

    // Every example, its groups renamed, in the test's namespace; the Tenant (cluster-
    // scoped) named uniquely, since it creates the namespace `tenant-<name>`.
    let tenant = unique("acme").to_lowercase();
    let mut parents: Vec<(Api<DynamicObject>, String)> = Vec::new();
    let mut crds = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(repo().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = renamed(&std::fs::read_to_string(&path).unwrap(), &u);
        for mut o in yaml_objects(&text) {
            let kind = o["kind"].as_str().unwrap().to_string();
            let av = o["apiVersion"].as_str().unwrap().to_string();
            let namespaced = o["metadata"].get("namespace").is_some();
            if namespaced {
                o["metadata"]["namespace"] = json!(ns.to_string());
            } else {
                o["metadata"]["name"] = json!(tenant);
            }
            if kind == "MyWeb" {
                // A NodePort is one per cluster: other tests' MyWebs may hold it.
                o["spec"].as_object_mut().unwrap().remove("nodePortNumber");
            }
            let name = o["metadata"]["name"].as_str().unwrap().to_string();
            let api = api(
                &client,
                namespaced.then_some(ns.as_str()),
                &av,
                &kind,
                &plural(&kind),
            );
            let is_parent = av.contains(&u);
            if is_parent {
                let group = av.split('/').next().unwrap();
                let crd = format!("{}.{group}", plural(&kind));
                wait_established(&client, &crd).await;
                crds.insert(crd);
            }
            apply(&api, o).await;
            if is_parent {
                parents.push((api, name));
            }
        }
    }
    assert_eq!(parents.len(), 5, "one example parent per shipped rule");
    for (api, name) in &parents {
        wait_ready(api, name, "True", Some("Ready"), T).await;
    }
    // The Tenant's RoleBinding is there, binding `admin` in its namespace.
    let bindings = api(
        &client,
        Some(&format!("tenant-{tenant}")),
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        "rolebindings",
    );
    let rb = to_json(
        &bindings
            .get("tenant-admins")
            .await
            .expect("the Tenant's RoleBinding"),
    );
    assert_eq!(rb["roleRef"]["name"], "admin");
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    let forbidden: Vec<&str> = log.lines().filter(|l| l.contains("forbidden")).collect();
    assert!(
        forbidden.is_empty(),
        "refused on the generated RBAC:\n{}",
        forbidden.join("\n")
    );

    // Clean up: the CRDs take their objects with them, and the garbage collector the
    // Tenant's namespace.
    drop(op);
    let crd_api = api(
        &client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    for crd in crds {
        let _ = crd_api.delete(&crd, &DeleteParams::default()).await;
    }
}
