//! `rulebook release` one parent at a time, against the local control plane: a parent
//! whose `Orphan` children the releaser may not let go of keeps its finalizer (and its
//! children), and does not hold the release of the others — which let go of theirs first
//! and lose the finalizer. The command says which it kept and why, and exits with 1.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::process::Command;
use std::time::Duration;

use common::*;
use faults_kit::*;
use serde_json::json;

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_whose_orphans_cannot_be_let_go_of_keeps_its_finalizer_alone() {
    let test = "a_parent_whose_orphans_cannot_be_let_go_of_keeps_its_finalizer_alone";
    let client = client().await;
    let (free, held) = (
        namespace(&client, "release-free").await,
        namespace(&client, "release-held").await,
    );
    let (kind, rule) = ("RelKept", "relkept");
    let d = RuleDir::new();
    d.template("cm.yaml", &configmap_template("cm", "  k: v\n"));
    d.rule("r.yaml", &orphan_rule(rule, kind));
    let op = d.operator().flags(&["--install-crds"]).start().await;
    let (xs, ys) = (
        kind_api(&client, &free, kind, T).await,
        kind_api(&client, &held, kind, T).await,
    );
    put(&xs, &parent(kind, &free, "x", json!({}))).await;
    put(&ys, &parent(kind, &held, "y", json!({}))).await;
    wait_all_ready(&xs, &["x".to_string()].into(), T).await;
    wait_all_ready(&ys, &["y".to_string()].into(), T).await;
    drop(op); // uninstalled first

    // The releaser may patch every parent of the kind, and ConfigMaps in one namespace.
    let role = unique("releaser");
    let sa = format!("system:serviceaccount:{free}:releaser");
    let rbac = vec![
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": role},
               "rules": [{"apiGroups": [GROUP], "resources": [plural(kind)],
                          "verbs": ["get", "list", "patch"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": role},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
               "subjects": [{"kind": "User", "name": sa}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": role, "namespace": free},
               "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                          "verbs": ["get", "list", "patch"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": role, "namespace": free},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
               "subjects": [{"kind": "User", "name": sa}]}),
    ];
    let kubeconfig = service_account_kubeconfig(&client, &free, "releaser", rbac).await;
    let release = |kubeconfig: &std::path::Path| {
        let dirs = [&d.rules, &d.templates].map(|p| p.to_str().unwrap().to_string());
        let kubeconfig = kubeconfig.to_str().unwrap().to_string();
        [
            "release",
            "--rules",
            &dirs[0],
            "--templates",
            &dirs[1],
            "--rule",
            rule,
            "--kubeconfig",
            &kubeconfig,
        ]
        .map(String::from)
    };
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(release(kubeconfig.path()))
        .output()
        .expect("run rulebook release");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{test}: {stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("orphaned ConfigMap {free}/x-cm"))
            && stdout.contains(&format!("released {kind} {free}/x")),
        "{test}: {stdout}"
    );
    assert!(
        stderr.contains(&format!("kept {kind} {held}/y")) && stderr.contains("forbidden"),
        "{test}: {stderr}"
    );
    let cms = |ns: &str| api(&client, Some(ns), "v1", "ConfigMap", "configmaps");
    let x = get_json(&xs, "x").await.expect("x");
    let y = get_json(&ys, "y").await.expect("y");
    assert!(x["metadata"]["finalizers"].is_null(), "{test}: {x}");
    assert_eq!(
        y["metadata"]["finalizers"],
        json!(["rulebook.dev/finalizer"])
    );
    let x_cm = get_json(&cms(&free), "x-cm").await.expect("x-cm");
    let y_cm = get_json(&cms(&held), "y-cm").await.expect("y-cm");
    assert!(
        faults_kit::teardown::released(&x_cm),
        "{test}: {}",
        x_cm["metadata"]
    );
    assert_eq!(
        faults_kit::teardown::owner_label(&y_cm),
        Some(uid_of(&y).as_str()),
        "{test}: y-cm is still y's"
    );

    // An administrator's release frees the other too.
    let admin = release(&kubeconfig_path());
    rulebook(&admin.each_ref().map(String::as_str));
    let y = get_json(&ys, "y").await.expect("y");
    assert!(y["metadata"]["finalizers"].is_null(), "{test}: {y}");
}
