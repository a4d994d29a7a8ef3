//! The Helm chart and the monitoring that ship in deploy/ (issue 46), against the real
//! local control plane:
//! - `helm install` of deploy/helm/rulebook, with the values `rulebook rbac --helm-values
//!   --helm-ruleset` generates from a rule of this test's own kind, creates every object
//!   through the API server's validation; kwok makes the operator's pods Ready (no
//!   container runs), so `--wait` sees the Deployment available; `helm uninstall` removes
//!   the cluster-scoped objects (named after the release, unique to the test);
//! - the chart's example values (ci/examples-values.yaml) are what `make rbac` prints.
//!
//! (A test that every metric the dashboard and the PrometheusRule query is exported by a
//! running operator is not here yet: its first version never saw the webhook called.)
//!
//! helm comes from tests/tools/tools.sh (`make tools`, cached); a missing helm fails.

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod webhook_kit;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value as Json, json};
use webhook_kit::*;

const T: Duration = Duration::from_secs(180);

/// The cached helm binary (tests/tools/tools.sh); the test fails when it is not built.
fn helm() -> PathBuf {
    let out = Command::new(repo().join("tests/tools/tools.sh"))
        .args(["path", "helm"])
        .output()
        .expect("run tests/tools/tools.sh");
    assert!(
        out.status.success(),
        "helm is not built: run `make tools`\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8").trim())
}

/// Runs helm with the test cluster's kubeconfig and a private helm home; returns stdout.
fn run_helm(home: &Path, args: &[&str]) -> String {
    let out = Command::new(helm())
        .args(args)
        .env("KUBECONFIG", kubeconfig_path())
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .current_dir(repo())
        .output()
        .expect("run helm");
    assert!(
        out.status.success(),
        "helm {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The chart's example values are exactly what `make rbac` generates from rules/ (the
/// RBAC and the rule set of one read): a stale file fails here, as a stale
/// deploy/base/rbac.yaml fails tests/deploy_manifests.rs.
#[test]
fn the_charts_example_values_are_generated_from_the_rules() {
    let committed =
        std::fs::read_to_string(repo().join("deploy/helm/rulebook/ci/examples-values.yaml"))
            .expect("deploy/helm/rulebook/ci/examples-values.yaml");
    let body: String = committed
        .lines()
        .skip_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let generated = rulebook(&[
        "rbac",
        "--rules",
        "rules",
        "--templates",
        "templates",
        "--install-crds",
        "--webhooks",
        "--helm-values",
        "--helm-ruleset",
    ]);
    assert_eq!(body, generated, "stale: run `make rbac`");
    // The values hold the same ClusterRole rules as the kustomize base's rbac.yaml.
    let values: Json = serde_saphyr::from_str(&generated).expect("values yaml");
    let base = std::fs::read_to_string(repo().join("deploy/base/rbac.yaml")).expect("rbac.yaml");
    let role = yaml_objects(&base)
        .into_iter()
        .find(|o| o["kind"] == "ClusterRole")
        .expect("a ClusterRole in deploy/base/rbac.yaml");
    assert_eq!(values["rbac"]["clusterRules"], role["rules"]);
    assert!(
        values["ruleset"]["rules"]
            .as_object()
            .is_some_and(|m| !m.is_empty())
    );
}

/// `helm install` into the local control plane: every object passes the API server's
/// validation and exists afterwards; the operator's pods (kwok) become Ready; uninstall
/// removes the release's cluster-scoped RBAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_the_chart_into_the_local_control_plane() {
    let client = client().await;
    let ns = namespace(&client, "helm").await;
    let release: String = unique("rbh").chars().filter(|c| *c != '_').collect();
    let h = Hooked::new("helm", "Ignore");
    let home = tempfile::tempdir().expect("helm home");
    let values = home.path().join("values.yaml");
    let secret = format!("{}/{release}-webhook", ns.name());
    let generated = rulebook(&[
        "rbac",
        "--rules",
        h.rules.to_str().expect("utf-8"),
        "--templates",
        h.templates.to_str().expect("utf-8"),
        "--install-crds",
        "--webhooks",
        "--webhook-configuration",
        &h.name,
        "--webhook-secret",
        &secret,
        "--helm-values",
        "--helm-ruleset",
    ]);
    std::fs::write(&values, &generated).expect("write values");

    let out = run_helm(
        home.path(),
        &[
            "install",
            &release,
            "deploy/helm/rulebook",
            "--namespace",
            ns.name(),
            "-f",
            values.to_str().expect("utf-8"),
            "--set",
            "replicas=1",
            "--wait",
            "--timeout",
            "3m",
        ],
    );
    assert!(out.contains("STATUS: deployed"), "{out}");

    // Every object of the release is there, as the API server stored it.
    let manifest = run_helm(
        home.path(),
        &["get", "manifest", &release, "--namespace", ns.name()],
    );
    let objects = yaml_objects(&manifest);
    let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ] {
        assert!(kinds.contains(kind), "no {kind} in the release: {kinds:?}");
    }
    for o in &objects {
        let (av, kind) = (
            o["apiVersion"].as_str().unwrap(),
            o["kind"].as_str().unwrap(),
        );
        let name = o["metadata"]["name"].as_str().unwrap();
        let namespaced = !matches!(kind, "ClusterRole" | "ClusterRoleBinding");
        if !namespaced {
            assert!(
                name.starts_with(&release),
                "{kind} {name} is not the release's own"
            );
        }
        let plural = format!("{}s", kind.to_lowercase()).replace("policys", "policies");
        let api = api(&client, namespaced.then(|| ns.name()), av, kind, &plural);
        let stored = api
            .get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("get {kind} {name}: {e}"));
        assert!(stored.is_some(), "{kind} {name} was not created");
    }
    let role = objects
        .iter()
        .find(|o| o["kind"] == "ClusterRole")
        .expect("ClusterRole");
    let values_json: Json = serde_saphyr::from_str(&generated).expect("values yaml");
    assert_eq!(role["rules"], values_json["rbac"]["clusterRules"]);
    // The operator's flags follow what the RBAC grants by name.
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("Deployment");
    let args = &deployment["spec"]["template"]["spec"]["containers"][0]["args"];
    for want in [
        format!("--webhook-configuration={}", h.name),
        format!("--webhook-secret={secret}"),
        "--install-crds".to_string(),
        "--leader-elect".to_string(),
    ] {
        assert!(
            args.as_array().unwrap().contains(&json!(want)),
            "{want} not in {args}"
        );
    }
    // kwok ran the pod: the Deployment is available (helm --wait waited for it).
    let deployments = api(
        &client,
        Some(ns.name()),
        "apps/v1",
        "Deployment",
        "deployments",
    );
    let d = to_json(&deployments.get(&release).await.expect("the Deployment"));
    assert_eq!(d["status"]["availableReplicas"], 1, "{}", d["status"]);

    run_helm(
        home.path(),
        &["uninstall", &release, "--namespace", ns.name(), "--wait"],
    );
    let roles = api(
        &client,
        None,
        "rbac.authorization.k8s.io/v1",
        "ClusterRole",
        "clusterroles",
    );
    wait_for(T, "the release's ClusterRole to go", || async {
        roles.get_opt(&release).await.ok()?.is_none().then_some(())
    })
    .await;
}
