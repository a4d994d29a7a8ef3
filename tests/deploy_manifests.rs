//! The deployment manifests (deploy/, deploy/README.md): every shape — the base (rules in
//! ConfigMaps), the git-sync overlay and the prometheus overlay — builds with kustomize and
//! passes a server-side dry run against the real control plane; the shapes are wired as
//! documented; and the generated parts cannot go stale: `deploy/base/rbac.yaml` is exactly
//! what `make rbac` prints, and the rule set the base mounts is, file for file at the
//! paths the pod sees, the repository's rules/ and templates/, and passes `rulebook check`.
//! Leader election works on exactly the RBAC the base deploys.
//!
//! Left in the cluster on purpose (idempotent): the namespace `rulebook-system` (a server
//! dry run of namespaced objects needs it to exist) and, when the cluster has no
//! prometheus-operator, a stand-in ServiceMonitor CRD.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value as Json, json};

/// The kustomizations `kubectl apply -k` takes (deploy/README.md).
const SHAPES: &[&str] = &[
    "deploy/base",
    "deploy/overlays/git-sync",
    "deploy/overlays/prometheus",
    "deploy/overlays/sharded",
];
const NAMESPACE: &str = "rulebook-system";
const SERVICE_ACCOUNT: &str = "rulebook";
/// `make rbac`'s flags: DEPLOY_RBAC_FLAGS in the Makefile. Without `--leader-elect`: the
/// Lease permissions are a Role on the one Lease in the operator's namespace
/// (deploy/base/leader-election.yaml), narrower than a ClusterRole (which names the Lease
/// in every namespace and may create any Lease).
const RBAC_FLAGS: &[&str] = &[
    "--service-account",
    "rulebook-system/rulebook",
    "--install-crds",
    "--webhooks",
];
const SERVICEMONITOR_CRD: &str = "servicemonitors.monitoring.coreos.com";
const T: Duration = Duration::from_secs(60);

fn kubectl() -> PathBuf {
    let path = repo().join(".cluster/bin/kubectl");
    assert!(
        path.exists(),
        "{} is missing: build the local control plane with `make cluster`",
        path.display()
    );
    path
}

/// `kubectl kustomize DIR` (the kustomize built into kubectl, as `kubectl apply -k` uses).
fn kustomize(dir: &str) -> String {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(repo().join(dir))
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `kubectl apply --dry-run=server -f -` with the admin kubeconfig; returns its stdout.
fn server_dry_run(dir: &str, yaml: &str) -> String {
    let mut child = Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["apply", "--dry-run=server", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl apply");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = yaml.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("kubectl apply");
    writer.join().expect("writer").expect("write to kubectl");
    assert!(
        out.status.success(),
        "kubectl apply --dry-run=server of {dir} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn objects_of(dir: &str) -> Vec<Json> {
    yaml_objects(&kustomize(dir))
}

fn find<'a>(objects: &'a [Json], kind: &str, name: &str) -> &'a Json {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among the manifests"))
}

fn strings(v: &Json) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default()
}

/// The value of `--flag=value` or `--flag value` in a container's args.
fn flag<'a>(container: &'a Json, name: &str) -> Option<&'a str> {
    let args = strings(&container["args"]);
    let prefix = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(prefix.as_str())
            .or_else(|| (*a == name).then(|| args.get(i + 1).copied()).flatten())
    })
}

fn container<'a>(pod: &'a Json, name: &str) -> &'a Json {
    pod["containers"]
        .as_array()
        .into_iter()
        .chain(pod["initContainers"].as_array())
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// Does `labels` carry every pair of `selector`?
fn selects(selector: &Json, labels: &Json) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| &labels[k] == v))
}

/// Creates `rulebook-system` for real (idempotent, left in place): a server-side dry run
/// of the Namespace object does not create it, and the namespaced objects need it.
async fn ensure_namespace(client: &kube::Client) {
    let api: Api<Namespace> = Api::all(client.clone());
    wait_for(T, "namespace rulebook-system to be Active", || async {
        match api.get_opt(NAMESPACE).await.expect("get namespace") {
            Some(ns) => ns
                .status
                .and_then(|s| s.phase)
                .is_some_and(|p| p == "Active")
                .then_some(()),
            None => {
                let ns: Namespace =
                    serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).unwrap();
                match api.create(&PostParams::default(), &ns).await {
                    Ok(_) => None,
                    Err(kube::Error::Api(e)) if e.code == 409 => None,
                    Err(e) => panic!("create namespace {NAMESPACE}: {e}"),
                }
            }
        }
    })
    .await;
}

/// Installs a stand-in for the prometheus-operator's ServiceMonitor CRD when the cluster
/// has none, so that the prometheus overlay's ServiceMonitor can be dry-run. It accepts any
/// spec (preserve-unknown-fields); a real CRD, when present, is left alone.
async fn ensure_servicemonitor_crd(client: &kube::Client) {
    let crds = api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    if crds
        .get_opt(SERVICEMONITOR_CRD)
        .await
        .expect("get CRD")
        .is_none()
    {
        let stub: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {
                "name": SERVICEMONITOR_CRD,
                "annotations": {
                    "rulebook.dev/stub": "stands in for the prometheus-operator CRD (tests/deploy_manifests.rs)"
                }
            },
            "spec": {
                "group": "monitoring.coreos.com",
                "scope": "Namespaced",
                "names": {
                    "plural": "servicemonitors",
                    "singular": "servicemonitor",
                    "kind": "ServiceMonitor",
                    "listKind": "ServiceMonitorList"
                },
                "versions": [{
                    "name": "v1",
                    "served": true,
                    "storage": true,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": true
                    }}
                }]
            }
        }))
        .unwrap();
        match crds.create(&PostParams::default(), &stub).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {} // created meanwhile
            Err(e) => panic!("create the ServiceMonitor CRD stub: {e}"),
        }
    }
    wait_for(T, "the ServiceMonitor CRD to be Established", || async {
        let crd = to_json(&crds.get_opt(SERVICEMONITOR_CRD).await.ok()??);
        crd["status"]["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "Established" && c["status"] == "True")
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_passes_a_server_side_dry_run() {
    let client = client().await;
    ensure_namespace(&client).await;
    ensure_servicemonitor_crd(&client).await;
    for dir in SHAPES {
        let yaml = kustomize(dir);
        let objects = yaml_objects(&yaml);
        let out = server_dry_run(dir, &yaml);
        let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(
            lines.len(),
            objects.len(),
            "{dir}: one line per object expected from kubectl:\n{out}"
        );
        assert!(
            lines.iter().all(|l| l.ends_with("(server dry run)")),
            "{dir}:\n{out}"
        );
    }
}

#[test]
fn rbac_yaml_is_what_make_rbac_generates() {
    let makefile = std::fs::read_to_string(repo().join("Makefile")).expect("Makefile");
    assert!(
        makefile.contains(&format!("DEPLOY_RBAC_FLAGS := {}", RBAC_FLAGS.join(" "))),
        "the Makefile's DEPLOY_RBAC_FLAGS and this test's RBAC_FLAGS differ"
    );
    let file = std::fs::read_to_string(repo().join("deploy/base/rbac.yaml")).expect("rbac.yaml");
    // Without the header comment `make rbac` writes.
    let body: String = file
        .split_inclusive('\n')
        .skip_while(|l| l.starts_with('#'))
        .collect();
    let mut args = vec!["rbac", "--rules", "rules", "--templates", "templates"];
    args.extend(RBAC_FLAGS);
    let generated = rulebook(&args);
    assert!(
        body == generated,
        "deploy/base/rbac.yaml is stale: run `make rbac`.\n--- rulebook rbac prints:\n{generated}"
    );
}

/// Files below `dir` as the operator reads them (symlinks followed, dot-names skipped),
/// by relative path; `rules_only` keeps `*.yaml`/`*.yml`.
fn read_tree(dir: &Path, rules_only: bool) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, rules_only: bool, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            if std::fs::metadata(&path).expect("metadata").is_dir() {
                walk(root, &path, rules_only, out);
            } else if !rules_only || name.ends_with(".yaml") || name.ends_with(".yml") {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .to_string();
                out.insert(rel, std::fs::read_to_string(&path).expect("read"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, rules_only, &mut out);
    out
}

/// Writes a ConfigMap volume the way the kubelet does: the files in a timestamped
/// directory, `..data` linking to it, and each top-level entry linking through `..data`.
fn materialise(mount: &Path, configmap: &Json, items: &Json) {
    assert!(
        configmap.get("binaryData").is_none(),
        "{}: rules and templates are text",
        configmap["metadata"]["name"]
    );
    let data = configmap["data"].as_object().cloned().unwrap_or_default();
    let files: Vec<(String, String)> = match items.as_array() {
        Some(items) => items
            .iter()
            .map(|i| {
                let key = i["key"].as_str().expect("key");
                let text = data
                    .get(key)
                    .and_then(Json::as_str)
                    .unwrap_or_else(|| panic!("item {key} is not a key of the ConfigMap"));
                (i["path"].as_str().expect("path").to_string(), text.into())
            })
            .collect(),
        None => data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().expect("text").into()))
            .collect(),
    };
    let stamp = "..2026_01_01_00_00_00.000000001";
    let mut top = std::collections::BTreeSet::new();
    for (path, text) in &files {
        let target = mount.join(stamp).join(path);
        std::fs::create_dir_all(target.parent().unwrap()).expect("mkdir");
        std::fs::write(&target, text).expect("write");
        top.insert(path.split('/').next().unwrap().to_string());
    }
    std::fs::create_dir_all(mount).expect("mkdir");
    std::os::unix::fs::symlink(stamp, mount.join("..data")).expect("..data");
    for entry in top {
        std::os::unix::fs::symlink(format!("..data/{entry}"), mount.join(&entry)).expect("link");
    }
}

#[test]
fn the_mounted_rule_set_is_the_repositorys_and_passes_check() {
    let objects = objects_of("deploy/base");
    let pod = &find(&objects, "Deployment", "rulebook")["spec"]["template"]["spec"];
    let rulebook_container = container(pod, "rulebook");
    let root = tempfile::tempdir().expect("tempdir");
    for mount in rulebook_container["volumeMounts"]
        .as_array()
        .expect("mounts")
    {
        let volume = pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .expect("the mounted volume");
        let Some(name) = volume["configMap"]["name"].as_str() else {
            continue;
        };
        let path = mount["mountPath"].as_str().expect("mountPath");
        materialise(
            &root.path().join(path.trim_start_matches('/')),
            find(&objects, "ConfigMap", name),
            &volume["configMap"]["items"],
        );
    }
    let dir = |f: &str| {
        let p = flag(rulebook_container, f).unwrap_or_else(|| panic!("no {f} flag"));
        root.path().join(p.trim_start_matches('/'))
    };
    let (rules, templates) = (dir("--rules"), dir("--templates"));
    let stale = "the ConfigMaps differ from rules/ and templates/: run `make deploy-sync`";
    assert_eq!(
        read_tree(&rules, true),
        read_tree(&repo().join("rules"), true),
        "{stale}"
    );
    assert_eq!(
        read_tree(&templates, false),
        read_tree(&repo().join("templates"), false),
        "{stale}"
    );
    let out = rulebook(&[
        "check",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
    ]);
    let rules_in_repo = rulebook(&["check", "--rules", "rules", "--templates", "templates"]);
    assert_eq!(
        out.lines().last(),
        rules_in_repo.lines().last(),
        "the mounted rule set loads as many rules as the repository's:\n{out}"
    );
}

#[test]
fn the_sharded_overlay_runs_three_members_instead_of_a_leader() {
    let objects = objects_of("deploy/overlays/sharded");
    let deployment = find(&objects, "Deployment", "rulebook");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Json::as_str)
        .collect();
    assert!(args.contains(&"--sharding=namespace"), "{args:?}");
    assert!(!args.contains(&"--leader-elect"), "{args:?}");
    let pdb = find(&objects, "PodDisruptionBudget", "rulebook");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert!(pdb["spec"].get("minAvailable").is_none());
    let role = find(&objects, "Role", "rulebook-shard-members");
    assert_eq!(role["metadata"]["namespace"], NAMESPACE);
    find(&objects, "RoleBinding", "rulebook-shard-members");
}

#[test]
fn the_shapes_are_wired_as_documented() {
    let base = objects_of("deploy/base");
    let git_sync = objects_of("deploy/overlays/git-sync");
    let prometheus = objects_of("deploy/overlays/prometheus");

    // Every shape: a restricted pod, and leader election with what it needs.
    for (dir, objects) in SHAPES.iter().zip([&base, &git_sync, &prometheus]) {
        find(objects, "Namespace", NAMESPACE);
        find(objects, "ServiceAccount", SERVICE_ACCOUNT);
        let deployment = find(objects, "Deployment", "rulebook");
        assert_eq!(deployment["spec"]["replicas"], 2, "{dir}");
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT, "{dir}");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{dir}");
        assert_eq!(pod["securityContext"]["runAsUser"], 65532, "{dir}");
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
            "{dir}"
        );
        for c in pod["containers"]
            .as_array()
            .into_iter()
            .chain(pod["initContainers"].as_array())
            .flatten()
        {
            let sc = &c["securityContext"];
            let what = format!("{dir}: container {}", c["name"]);
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{what}");
            assert_ne!(sc["runAsNonRoot"], false, "{what}");
            assert!(!c["resources"]["limits"].is_null(), "{what}: limits");
        }
        let op = container(pod, "rulebook");
        let args = strings(&op["args"]);
        for f in [
            "run",
            "--leader-elect",
            "--install-crds",
            "--log-format=json",
        ] {
            assert!(args.contains(&f), "{dir}: {f} missing from {args:?}");
        }
        let env: BTreeMap<&str, &Json> = op["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap(),
                    &e["valueFrom"]["fieldRef"]["fieldPath"],
                )
            })
            .collect();
        assert_eq!(env["POD_NAME"], "metadata.name", "{dir}: --identity");
        assert_eq!(env["POD_NAMESPACE"], "metadata.namespace", "{dir}");
        // Probes and the Service reach --metrics-addr.
        let port = flag(op, "--metrics-addr")
            .and_then(|a| a.rsplit(':').next())
            .unwrap_or("8080");
        let ports = op["ports"].as_array().expect("ports");
        let metrics = ports.iter().find(|p| p["name"] == "metrics").expect("port");
        assert_eq!(metrics["containerPort"].to_string(), port, "{dir}");
        assert_eq!(op["livenessProbe"]["httpGet"]["path"], "/healthz", "{dir}");
        assert_eq!(op["readinessProbe"]["httpGet"]["path"], "/readyz", "{dir}");
        for probe in ["livenessProbe", "readinessProbe"] {
            assert_eq!(op[probe]["httpGet"]["port"], "metrics", "{dir}: {probe}");
        }
        let labels = &deployment["spec"]["template"]["metadata"]["labels"];
        let service = find(objects, "Service", "rulebook-metrics");
        assert!(selects(&service["spec"]["selector"], labels), "{dir}");
        let service_port = &service["spec"]["ports"][0];
        assert_eq!(service_port["name"], "metrics", "{dir}");
        assert_eq!(service_port["port"], 8080, "{dir}");
        // The webhooks: every replica serves them behind a Service on its webhook port,
        // which the flags name; two replicas at least, so one answers through a drain.
        assert!(deployment["spec"]["replicas"].as_i64() >= Some(2), "{dir}");
        let webhook = ports
            .iter()
            .find(|p| p["name"] == "webhook")
            .expect("webhook port");
        assert_eq!(
            webhook["containerPort"].to_string(),
            flag(op, "--webhook-port").unwrap_or("9443"),
            "{dir}"
        );
        assert_eq!(
            flag(op, "--webhook-service"),
            Some("rulebook-system/rulebook-webhook:443"),
            "{dir}"
        );
        let hooks = find(objects, "Service", "rulebook-webhook");
        assert!(selects(&hooks["spec"]["selector"], labels), "{dir}");
        assert_eq!(
            hooks["spec"]["ports"],
            json!([{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]),
            "{dir}"
        );
        let pdb = find(objects, "PodDisruptionBudget", "rulebook");
        assert_eq!(pdb["spec"]["minAvailable"], 1, "{dir}");
        assert!(
            selects(&pdb["spec"]["selector"]["matchLabels"], labels),
            "{dir}"
        );
        // The operator's port, for this namespace and the labelled ones only (what the
        // cluster's network plugin enforces is not tested here: kwok runs no pods).
        let policy = find(objects, "NetworkPolicy", "rulebook");
        assert!(
            selects(&policy["spec"]["podSelector"]["matchLabels"], labels),
            "{dir}"
        );
        assert_eq!(
            strings(&policy["spec"]["policyTypes"]),
            ["Ingress"],
            "{dir}"
        );
        let rules = policy["spec"]["ingress"].as_array().expect("ingress");
        assert_eq!(rules.len(), 2, "{dir}");
        assert_eq!(
            rules[1],
            json!({"ports": [{"port": "webhook", "protocol": "TCP"}]}),
            "{dir}: the API server calls the webhooks from anywhere"
        );
        assert_eq!(
            rules[0]["ports"],
            json!([{"port": "metrics", "protocol": "TCP"}])
        );
        assert_eq!(
            rules[0]["from"],
            json!([
                {"podSelector": {}},
                {"namespaceSelector": {"matchLabels": {"rulebook.dev/metrics-access": "true"}}},
            ]),
            "{dir}"
        );
    }

    // Base: the rule set from ConfigMaps (see the_mounted_rule_set_is_the_repositorys...).
    let op = container(
        &find(&base, "Deployment", "rulebook")["spec"]["template"]["spec"],
        "rulebook",
    );
    assert_eq!(flag(op, "--rules"), Some("/etc/rulebook/rules"));
    assert_eq!(flag(op, "--templates"), Some("/etc/rulebook/templates"));

    // git-sync: no ConfigMaps; both containers share the clone, read through its link.
    assert!(
        !git_sync.iter().any(|o| o["kind"] == "ConfigMap"),
        "git-sync: the rule-set ConfigMaps are gone"
    );
    let pod = &find(&git_sync, "Deployment", "rulebook")["spec"]["template"]["spec"];
    let volumes = pod["volumes"].as_array().expect("volumes");
    assert!(
        volumes.iter().all(|v| v["configMap"].is_null()),
        "{volumes:?}"
    );
    let sync = container(pod, "git-sync");
    assert_eq!(sync["restartPolicy"], "Always", "a native sidecar");
    assert!(!sync["startupProbe"].is_null(), "holds the operator back");
    assert!(flag(sync, "--repo").is_some());
    let root = flag(sync, "--root").expect("--root");
    let link = flag(sync, "--link").expect("--link");
    assert_eq!(flag(sync, "--period"), Some("30s"));
    let mount_of = |c: &Json, path: &str| {
        c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"] == path)
            .map(|m| m["name"].clone())
    };
    let op = container(pod, "rulebook");
    assert_eq!(
        mount_of(sync, root),
        mount_of(op, root),
        "one shared volume"
    );
    assert!(mount_of(op, root).is_some());
    assert_eq!(
        flag(op, "--rules"),
        Some(format!("{root}/{link}/rules").as_str())
    );
    assert_eq!(
        flag(op, "--templates"),
        Some(format!("{root}/{link}/templates").as_str())
    );
    assert!(mount_of(op, "/etc/rulebook/rules").is_none());

    // prometheus: the base plus a ServiceMonitor that scrapes the metrics Service.
    assert_eq!(prometheus.len(), base.len() + 1);
    let monitor = find(&prometheus, "ServiceMonitor", "rulebook");
    let service = find(&prometheus, "Service", "rulebook-metrics");
    assert!(selects(
        &monitor["spec"]["selector"]["matchLabels"],
        &service["metadata"]["labels"]
    ));
    assert!(strings(&monitor["spec"]["namespaceSelector"]["matchNames"]).contains(&NAMESPACE));
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
}

/// The plural of the RBAC kinds the base binds with.
fn rbac_plural(kind: &str) -> &'static str {
    match kind {
        "ClusterRole" => "clusterroles",
        "ClusterRoleBinding" => "clusterrolebindings",
        "Role" => "roles",
        "RoleBinding" => "rolebindings",
        other => panic!("unexpected RBAC kind {other}"),
    }
}

/// Deletes the cluster-scoped RBAC copies when dropped, also when the test fails.
struct ClusterScoped(Vec<(String, String)>);

impl Drop for ClusterScoped {
    fn drop(&mut self) {
        for (kind, name) in &self.0 {
            let _ = Command::new(kubectl())
                .arg("--kubeconfig")
                .arg(kubeconfig_path())
                .args(["delete", "--ignore-not-found", "--wait=false"])
                .arg(format!("{}/{name}", rbac_plural(kind)))
                .output();
        }
    }
}

/// A ServiceAccount `rulebook` in `ns` with exactly the permissions the base gives
/// rulebook-system/rulebook: every (Cluster)Role bound to it there, copied and bound to the
/// new account (cluster-scoped copies under unique names, namespaced ones into `ns`).
/// Returns a kubeconfig that authenticates as it, and the cluster-scoped copies (deleted
/// when dropped).
async fn deployed_identity(
    client: &kube::Client,
    ns: &str,
    objects: &[Json],
) -> (tempfile::NamedTempFile, ClusterScoped) {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;

    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": SERVICE_ACCOUNT}})).unwrap();
    sas.create(&PostParams::default(), &sa)
        .await
        .expect("create ServiceAccount");
    let mut cluster_scoped = ClusterScoped(Vec::new());
    let bindings = objects.iter().filter(|o| {
        (o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
            && o["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == SERVICE_ACCOUNT
                    && s["namespace"] == NAMESPACE
            })
    });
    for binding in bindings {
        let role_kind = binding["roleRef"]["kind"].as_str().expect("roleRef.kind");
        let role = find(
            objects,
            role_kind,
            binding["roleRef"]["name"].as_str().expect("roleRef.name"),
        );
        let mut copy_of = |kind: &str, original: &Json| {
            let name = if kind.starts_with("Cluster") {
                let name = unique("rulebook-deploy");
                cluster_scoped.0.push((kind.to_string(), name.clone()));
                name
            } else {
                original["metadata"]["name"].as_str().unwrap().to_string()
            };
            let mut metadata = json!({"name": name});
            if !kind.starts_with("Cluster") {
                metadata["namespace"] = json!(ns);
            }
            (name, metadata)
        };
        let (role_name, metadata) = copy_of(role_kind, role);
        let role_ns = (!role_kind.starts_with("Cluster")).then_some(ns);
        let role_api = api(
            client,
            role_ns,
            "rbac.authorization.k8s.io/v1",
            role_kind,
            rbac_plural(role_kind),
        );
        apply(
            &role_api,
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": role_kind,
                "metadata": metadata,
                "rules": role["rules"],
            }),
        )
        .await;
        let binding_kind = binding["kind"].as_str().unwrap();
        let (_, metadata) = copy_of(binding_kind, binding);
        let binding_ns = (!binding_kind.starts_with("Cluster")).then_some(ns);
        let binding_api = api(
            client,
            binding_ns,
            "rbac.authorization.k8s.io/v1",
            binding_kind,
            rbac_plural(binding_kind),
        );
        apply(
            &binding_api,
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": binding_kind,
                "metadata": metadata,
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": role_kind,
                    "name": role_name,
                },
                "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": ns}],
            }),
        )
        .await;
    }
    let request: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": [], "expirationSeconds": 3600}
    }))
    .unwrap();
    let token = sas
        .create_token_request(SERVICE_ACCOUNT, &PostParams::default(), &request)
        .await
        .expect("token request")
        .status
        .and_then(|s| s.token)
        .expect("a token");
    (token_kubeconfig(&token), cluster_scoped)
}

async fn leads(op: &Operator) -> bool {
    let status: Json = serde_json::from_str(&op.get("/status").await).expect("/status");
    status["leader"] == true
}

fn assert_nothing_forbidden(op: &Operator, who: &str) {
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    let forbidden: Vec<&str> = log.lines().filter(|l| l.contains("forbidden")).collect();
    assert!(
        forbidden.is_empty(),
        "instance {who} was refused something on the deployed RBAC:\n{}",
        forbidden.join("\n")
    );
}

/// Leader election works on exactly the RBAC the base deploys: one instance takes the
/// Lease, a second stands by and takes it over when the first stops, and neither is ever
/// refused anything, nor is their webhook server (which reads, creates and renews the
/// certificates' Secret). (The Deployment's flags, but for the rule directories, the
/// endpoint, the webhook port and Secret, the namespaces and `--install-crds`: the
/// example CRDs are shared with other tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_works_on_the_deployed_rbac() {
    let client = client().await;
    let objects = objects_of("deploy/base");
    let ns = namespace(&client, "deploy-rbac").await;
    let (kubeconfig, cluster_scoped) = deployed_identity(&client, &ns, &objects).await;
    let pod = &find(&objects, "Deployment", "rulebook")["spec"]["template"]["spec"];
    let own = [
        "--rules",
        "--templates",
        "--metrics-addr",
        "--install-crds",
        "--webhook-port",
        "--webhook-secret",
    ];
    let deployment_flags: Vec<String> = strings(&container(pod, "rulebook")["args"])
        .into_iter()
        .filter(|a| *a != "run" && !own.iter().any(|f| a.starts_with(f)))
        .map(str::to_string)
        .collect();
    assert!(deployment_flags.iter().any(|f| f == "--leader-elect"));
    let start = |identity: &'static str| {
        let mut extra = deployment_flags.clone();
        extra.extend(["--lease-namespace".into(), ns.to_string()]);
        extra.extend(["--identity".into(), identity.into()]);
        // Each instance's webhook server on a port of its own; the certificates' Secret
        // in the test's namespace, where the base's Role on it is copied.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        extra.extend(["--webhook-bind".into(), "127.0.0.1".into()]);
        extra.extend(["--webhook-port".into(), port.to_string()]);
        extra.extend(["--webhook-secret".into(), format!("{ns}/rulebook-webhook")]);
        let kubeconfig = kubeconfig.path().to_path_buf();
        let ns = ns.to_string();
        async move {
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            Operator::on(&repo().join("rules"), &repo().join("templates"))
                .namespace(&ns)
                .flags(&extra)
                .kubeconfig(&kubeconfig)
                .start()
                .await
        }
    };

    let mut a = start("a").await;
    wait_for(T, "instance a to take the Lease", || async {
        leads(&a).await.then_some(())
    })
    .await;
    let b = start("b").await;
    b.wait_standing_by(T).await;
    assert!(!leads(&b).await, "b stands by while a leads");
    a.signal_and_wait("TERM");
    wait_for(T, "instance b to take the Lease over", || async {
        leads(&b).await.then_some(())
    })
    .await;
    assert_nothing_forbidden(&a, "a");
    assert_nothing_forbidden(&b, "b");

    drop(cluster_scoped);
}
