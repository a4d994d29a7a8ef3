//! The Helm chart and the monitoring that ship in deploy/ (issue 46), against the real
//! local control plane:
//! - `helm install` of deploy/helm/rulebook, with the values `rulebook rbac --helm-values
//!   --helm-ruleset` generates from a rule of this test's own kind, creates every object
//!   through the API server's validation; kwok makes the operator's pods Ready (no
//!   container runs), so `--wait` sees the Deployment available; `helm uninstall` removes
//!   the cluster-scoped objects (named after the release, unique to the test);
//! - the chart's example values (ci/examples-values.yaml) are what `make rbac` prints;
//! - the chart's git values render flags `rulebook run` takes, and its PrometheusRule
//!   (`prometheusRule.enabled`) has deploy/prometheus/prometheusrule.yaml's groups;
//! - every metric the Grafana dashboard and the PrometheusRule query is one a running
//!   operator exports on `/metrics`.
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

/// `helm template` of the chart with the example values and `sets`; its objects.
fn template(sets: &[&str]) -> Vec<Json> {
    let home = tempfile::tempdir().expect("helm home");
    let mut args = vec![
        "template",
        "rb",
        "deploy/helm/rulebook",
        "--namespace",
        "rulebook-system",
        "-f",
        "deploy/helm/rulebook/ci/examples-values.yaml",
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    yaml_objects(&run_helm(home.path(), &args))
}

/// The chart's git values become flags `rulebook run` takes: every `git.*` value set,
/// the Deployment's arguments are parsed by the real binary's argument parser (`run
/// ARGS... --help` answers with the help only when every argument before it parsed:
/// an unknown flag or a bad value fails), and each value shows as its flag.
#[test]
fn the_charts_git_values_are_flags_rulebook_run_takes() {
    let sets = [
        (
            "git.url",
            "ssh://git@git.example.com/platform/rules.git",
            "--rules-git",
        ),
        ("git.ref", "release", "--git-ref"),
        ("git.path", "policy/rules", "--git-path"),
        (
            "git.templatesPath",
            "policy/templates",
            "--git-templates-path",
        ),
        ("git.interval", "45s", "--git-interval"),
        (
            "git.tokenFile",
            "/etc/rulebook/git-auth/token",
            "--git-token-file",
        ),
        ("git.tokenUser", "oauth2", "--git-token-user"),
        (
            "git.sshKeyFile",
            "/etc/rulebook/git-auth/ssh-privatekey",
            "--git-ssh-key",
        ),
        (
            "git.sshKnownHostsFile",
            "/etc/rulebook/git-auth/known_hosts",
            "--git-ssh-known-hosts",
        ),
        (
            "git.hookSecretFile",
            "/etc/rulebook/git-auth/hook-secret",
            "--git-hook-secret-file",
        ),
    ];
    let mut args: Vec<String> = vec![
        "rulesSource=git".into(),
        "git.authSecret=rules-auth".into(),
        "git.allowedSignersConfigMap=rules-signers".into(),
    ];
    args.extend(sets.iter().map(|(k, v, _)| format!("{k}={v}")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let objects = template(&args);
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let run_args: Vec<String> = pod["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string").to_string())
        .collect();
    for (_, value, flag) in sets {
        let want = format!("{flag}={value}");
        assert!(run_args.contains(&want), "{want} not in {run_args:?}");
    }
    for want in [
        "--git-verify=/etc/rulebook/git-verify/allowed_signers",
        "--git-cache-dir=/var/lib/rulebook/git",
    ] {
        assert!(
            run_args.iter().any(|a| a == want),
            "{want} not in {run_args:?}"
        );
    }
    // The cache directory is a writable volume (the root filesystem is read-only).
    let mounts = &pod["containers"][0]["volumeMounts"];
    let cache = mounts
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["mountPath"] == "/var/lib/rulebook/git")
        .unwrap_or_else(|| panic!("no mount at the cache directory: {mounts}"));
    assert_ne!(cache["readOnly"], true, "{cache}");

    assert_eq!(run_args[0], "run");
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(&run_args)
        .arg("--help")
        .output()
        .expect("run rulebook");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("--rules-git"),
        "rulebook {run_args:?} does not parse: {stderr}"
    );
    // The check can fail: a flag run does not know is refused the same way.
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(["run", "--git-no-such-flag=1", "--help"])
        .output()
        .expect("run rulebook");
    assert!(!out.status.success(), "an unknown flag parsed");
}

/// `prometheusRule.enabled` renders one PrometheusRule whose groups are exactly
/// deploy/prometheus/prometheusrule.yaml's (the chart reads that file through a link:
/// one source); off by default.
#[test]
fn the_chart_renders_the_prometheusrule_of_deploy() {
    let source: Json = serde_saphyr::from_str(
        &std::fs::read_to_string(repo().join("deploy/prometheus/prometheusrule.yaml"))
            .expect("the PrometheusRule"),
    )
    .expect("yaml");
    let link = std::fs::read_link(repo().join("deploy/helm/rulebook/files/prometheusrule.yaml"))
        .expect("files/prometheusrule.yaml is a symbolic link");
    assert_eq!(link, Path::new("../../../prometheus/prometheusrule.yaml"));
    let objects = template(&[
        "prometheusRule.enabled=true",
        "prometheusRule.labels.release=prom",
    ]);
    let rules: Vec<&Json> = objects
        .iter()
        .filter(|o| o["kind"] == "PrometheusRule")
        .collect();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0]["spec"]["groups"], source["spec"]["groups"]);
    assert_eq!(rules[0]["metadata"]["namespace"], "rulebook-system");
    assert_eq!(rules[0]["metadata"]["labels"]["release"], "prom");
    assert!(
        !template(&[]).iter().any(|o| o["kind"] == "PrometheusRule"),
        "a PrometheusRule by default"
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

/// The metric names a PromQL expression reads (`rulebook_…`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("rulebook_") {
        let start = i + at;
        let before_ok =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = expr[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |e| start + e);
        if before_ok {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Every query of the Grafana dashboard and every alert expression names a metric a
/// running operator exports: an operator with a rule of this test's kind serving its
/// admission webhook, one parent reconciled and one create refused by the webhook, so
/// that the per-rule and webhook families have series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_query_names_an_exported_metric() {
    let dashboard: Json = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/rulebook-dashboard.json"))
            .expect("the dashboard"),
    )
    .expect("dashboard json");
    let mut queried: BTreeSet<String> = BTreeSet::new();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    for p in panels {
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let names = metric_names(t["expr"].as_str().expect("expr"));
            assert!(!names.is_empty(), "{} names no rulebook metric", t["expr"]);
            queried.extend(names);
        }
    }
    let rule_file = std::fs::read_to_string(repo().join("deploy/prometheus/prometheusrule.yaml"))
        .expect("the PrometheusRule");
    let rule: Json = serde_saphyr::from_str(&rule_file).expect("yaml");
    let mut alerted = BTreeSet::new();
    for r in rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
    {
        alerted.extend(metric_names(r["expr"].as_str().expect("expr")));
    }
    assert!(alerted.len() >= 8, "{alerted:?}");

    let client = client().await;
    let ns = namespace(&client, "helm-metrics").await;
    let h = Hooked::new("hmet", "Fail");
    // The rule with a rollout whose gate holds the first batch: a template change puts
    // the parents on two versions (rulebook_rollout_parents).
    // The check's message is the kit's: wait_enforced recognises the refusal by it (the
    // first version of this test had another message and waited for it in vain).
    let admission = "    failurePolicy: Fail\n    validate:\n      - expr: \"parent.spec.replicas <= 3\"\n        message: \"replicas {{ parent.spec.replicas }} is more than 3\"\n";
    let rollout = "  rollout:\n    steps:\n      - parents: 1\n      - percent: 100\n    gate: \"batch.age >= '1h'\"\n";
    std::fs::write(
        h.rules.join(format!("{}.yaml", h.rule)),
        h.rule_yaml("", admission) + rollout,
    )
    .expect("write the rule");
    let port = free_port();
    let op = h
        .operator(ns.name(), port)
        .flags(&["--lease-namespace", ns.name()])
        .start()
        .await;
    wait_established(&client, &h.crd_name()).await;
    h.wait_configuration(&client).await;
    // One create refused by the webhook, as the API server calls it, so that the webhook
    // families have series.
    let refused = h.wait_enforced(&client, ns.name()).await;
    assert!(is_refusal(&refused), "{refused}");
    let configmaps = api(&client, Some(ns.name()), "v1", "ConfigMap", "configmaps");
    for name in ["one", "two"] {
        apply(&h.parents(&client, ns.name()), to_json(&h.parent(name, 1))).await;
        wait_for(T, "the parent's child", || async {
            configmaps.get_opt(name).await.ok().flatten()
        })
        .await;
    }
    std::fs::write(
        h.templates.join("hooked/config.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  version: \"2\"\n",
    )
    .expect("change the template");
    let text = wait_for(T, "the rollout to count its parents", || async {
        let text = op.get("/metrics").await;
        text.contains("rulebook_rollout_parents{").then_some(text)
    })
    .await;
    h.remove_configurations(&client).await;
    let exported: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    let missing: Vec<_> = queried
        .union(&alerted)
        .filter(|n| !exported.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {exported:?}"
    );
}
