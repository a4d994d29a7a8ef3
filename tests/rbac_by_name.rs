//! Hostile tenants and cluster-wide kinds Rulebook does not own, against the real control
//! plane. The RBAC of `rulebook rbac --install-crds --leader-elect` names the CRDs the
//! rules define and the one Lease (Kubernetes checks resourceNames for a get, update or
//! patch, for a list or watch with a field selector on the name, and for the create
//! of a server-side apply); only a plain Lease create is unnamed. The operator installs
//! its CRDs (create, then update) and leads on exactly that RBAC, and is refused nothing.
//! A CRD of the same name that somebody else installed is never taken over: the rule
//! says why on /status, the CRD stays as it was, the other rules run. /status names no
//! tenant object.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;
use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);
const GROUP: &str = "byname.rulebook.dev";

fn strings(v: &Json) -> BTreeSet<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Json::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The ClusterRole's rules on `resource`, as `(resourceNames, verbs)`.
fn grants(role: &Json, resource: &str) -> Vec<(BTreeSet<String>, BTreeSet<String>)> {
    role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| strings(&r["resources"]).contains(resource))
        .map(|r| (strings(&r["resourceNames"]), strings(&r["verbs"])))
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Everything the role grants on CRDs and Leases is limited to `crds` and `lease`, but a
/// Lease create (which Kubernetes cannot limit by name).
fn assert_limited_by_name(role: &Json, crds: &BTreeSet<String>, lease: &str) {
    assert_eq!(
        grants(role, "customresourcedefinitions"),
        vec![(
            crds.clone(),
            set(&["create", "get", "list", "patch", "watch"])
        )],
        "CRD access: the rules' CRDs only\n{role:#}"
    );
    assert_eq!(
        grants(role, "leases"),
        vec![
            (set(&[lease]), set(&["get", "list", "update", "watch"])),
            (BTreeSet::new(), set(&["create"])),
        ],
        "Lease access: the one Lease, but create\n{role:#}"
    );
}

#[test]
fn generated_rbac_limits_crd_and_lease_access_to_names() {
    let crd_names: BTreeSet<String> = yaml_objects(&rulebook(&["crds"]))
        .iter()
        .map(|c| c["metadata"]["name"].as_str().expect("name").to_string())
        .collect();
    assert_eq!(crd_names.len(), 5, "one CRD per example rule");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--install-crds",
        "--leader-elect",
        "--lease-name",
        "my-lease",
    ]));
    assert_limited_by_name(&rbac[0], &crd_names, "my-lease");
    // Without the flags, nothing on CRDs or Leases at all.
    let plain = yaml_objects(&rulebook(&["rbac"]));
    assert!(grants(&plain[0], "customresourcedefinitions").is_empty());
    assert!(grants(&plain[0], "leases").is_empty());
}

/// A rule `name` with parent kind `kind` (group GROUP), a CRD section (`crd_extra` added
/// to it) and one ConfigMap child.
fn write_rule(dir: &Path, name: &str, kind: &str, crd_extra: &str) {
    std::fs::create_dir_all(dir.join("rules")).unwrap();
    std::fs::create_dir_all(dir.join("templates")).unwrap();
    std::fs::write(
        dir.join("templates/cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  note: {{ parent.spec.note }}\n",
    )
    .unwrap();
    let plural = format!("{}s", kind.to_lowercase());
    std::fs::write(
        dir.join(format!("rules/{name}.yaml")),
        format!(
            "apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {name}
spec:
  parent:
    apiVersion: {GROUP}/v1
    kind: {kind}
  children:
    - name: cm
      apiVersion: v1
      kind: ConfigMap
      template: cm.yaml
  crd:
    plural: {plural}
{crd_extra}"
        ),
    )
    .unwrap();
}

async fn client_from(kubeconfig: &Path) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config");
    kube::Client::try_from(config).expect("client")
}

/// Whether the identity of `client` may `verb` the `resource` object `name`.
async fn may(
    client: &kube::Client,
    verb: &str,
    group: &str,
    resource: &str,
    ns: Option<&str>,
    name: &str,
) -> bool {
    let review: SelfSubjectAccessReview = serde_json::from_value(json!({
        "spec": {"resourceAttributes": {
            "verb": verb, "group": group, "resource": resource,
            "namespace": ns, "name": name,
        }}
    }))
    .unwrap();
    Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("access review")
        .status
        .is_some_and(|s| s.allowed)
}

/// What the test compares of a CRD to prove it unchanged.
fn fingerprint(crd: &Json) -> (Json, Json, Json) {
    (
        crd["metadata"]["resourceVersion"].clone(),
        crd["metadata"]["managedFields"].clone(),
        crd["spec"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installs_and_leads_on_rbac_limited_to_names_and_never_takes_over_a_foreign_crd() {
    let client = client().await;
    let ns = namespace(&client, "rbac-names").await;
    let id = unique("x").replace(['x', '-'], "");
    let (owned_kind, foreign_kind) = (format!("Owned{id}"), format!("Squatted{id}"));
    let owned_crd = format!("{}s.{GROUP}", owned_kind.to_lowercase());
    let foreign_crd = format!("{}s.{GROUP}", foreign_kind.to_lowercase());
    let crds = api(
        &client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );

    // Another operator's CRD, with the name a rule's CRD section would give.
    let foreign_plural = format!("{}s", foreign_kind.to_lowercase());
    let foreign: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": foreign_crd, "labels": {"app.kubernetes.io/managed-by": "another-operator"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": foreign_kind, "listKind": format!("{foreign_kind}List"), "plural": foreign_plural, "singular": foreign_kind.to_lowercase()},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"theirs": {"type": "string"}}}}}}}],
        },
    }))
    .unwrap();
    crds.patch(
        &foreign_crd,
        &PatchParams::apply("another-operator"),
        &Patch::Apply(&foreign),
    )
    .await
    .expect("the foreign CRD");
    wait_established(&client, &foreign_crd).await;
    let before = fingerprint(&to_json(&crds.get(&foreign_crd).await.unwrap()));

    let dir = tempfile::tempdir().unwrap();
    write_rule(dir.path(), "owned", &owned_kind, "");
    write_rule(dir.path(), "squatter", &foreign_kind, "");
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    let lease = unique("lease");
    let role = unique("rulebook-rbac-names");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
        "--install-crds",
        "--leader-elect",
        "--lease-name",
        &lease,
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]));
    assert_limited_by_name(
        &rbac[0],
        &[owned_crd.clone(), foreign_crd.clone()].into(),
        &lease,
    );
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;

    // The names are what the role grants: nothing on any other CRD or Lease.
    let sa = client_from(kubeconfig.path()).await;
    let ext = "apiextensions.k8s.io";
    assert!(
        may(
            &sa,
            "patch",
            ext,
            "customresourcedefinitions",
            None,
            &owned_crd
        )
        .await
    );
    assert!(
        may(
            &sa,
            "create",
            ext,
            "customresourcedefinitions",
            None,
            &owned_crd
        )
        .await
    );
    for verb in ["create", "patch", "update", "delete"] {
        assert!(
            !may(
                &sa,
                verb,
                ext,
                "customresourcedefinitions",
                None,
                "mywebs.operator.k8s-summit.org"
            )
            .await,
            "{verb} on another CRD"
        );
    }
    let coord = "coordination.k8s.io";
    assert!(may(&sa, "update", coord, "leases", Some(&ns), &lease).await);
    assert!(!may(&sa, "update", coord, "leases", Some(&ns), "other-lease").await);
    assert!(!may(&sa, "patch", coord, "leases", Some(&ns), &lease).await);

    // A lease of 60 s: a standby polls every 15 s, so a quick takeover below proves that
    // its watch on the Lease (by name) is allowed.
    let start = |identity: &'static str| {
        let (kubeconfig, rules, templates) = (
            kubeconfig.path().to_path_buf(),
            rules.clone(),
            templates.clone(),
        );
        let (lease, ns) = (lease.clone(), ns.to_string());
        async move {
            Operator::on(&rules, &templates)
                .namespace(&ns)
                .flags(&[
                    "--install-crds",
                    "--leader-elect",
                    "--lease-name",
                    &lease,
                    "--lease-namespace",
                    &ns,
                    "--lease-duration",
                    "60",
                    "--identity",
                    identity,
                ])
                .kubeconfig(&kubeconfig)
                .start()
                .await
        }
    };
    let mut op = start("a").await;
    wait_for(T, "the operator to take the Lease", || async {
        leads(&op).await.then_some(())
    })
    .await;

    // Its own CRD: created by apply, as field manager `rulebook`.
    wait_established(&client, &owned_crd).await;
    let owned = to_json(&crds.get(&owned_crd).await.unwrap());
    assert!(
        strings(&json!(
            owned["metadata"]["managedFields"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["manager"].clone())
                .collect::<Vec<_>>()
        ))
        .contains("rulebook"),
        "{owned:#}"
    );

    // The foreign one: refused, with the reason, and left exactly as it was.
    let problem = wait_for(T, "the refusal on /status", || async {
        let s: Json = serde_json::from_str(&op.get("/status").await).ok()?;
        s["rules"]["squatter"]["problem"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert!(
        problem.contains(&foreign_crd)
            && problem.contains("not installed by Rulebook")
            && problem.contains("another-operator")
            && problem.contains("refusing to take it over"),
        "{problem}"
    );
    assert_eq!(
        fingerprint(&to_json(&crds.get(&foreign_crd).await.unwrap())),
        before,
        "the foreign CRD is unchanged"
    );

    // The other rule runs: a parent converges; /status says nothing of it.
    let marker = unique("tenant-note");
    let parents = api(
        &client,
        Some(&ns),
        &format!("{GROUP}/v1"),
        &owned_kind,
        &format!("{}s", owned_kind.to_lowercase()),
    );
    let parent_name = unique("tenant-parent");
    apply(
        &parents,
        json!({
            "apiVersion": format!("{GROUP}/v1"),
            "kind": owned_kind,
            "metadata": {"name": parent_name, "namespace": ns},
            "spec": {"note": marker},
        }),
    )
    .await;
    wait_ready(&parents, &parent_name, "True", Some("Ready"), T).await;
    let status = op.get("/status").await;
    assert!(
        !status.contains(&parent_name)
            && !status.contains(&marker)
            && !status.contains(ns.as_str()),
        "/status names no tenant object: {status}"
    );

    // A change to its own CRD is an update by name; the foreign CRD is refused again.
    write_rule(
        dir.path(),
        "owned",
        &owned_kind,
        "    categories: [rulebook-by-name]\n",
    );
    write_rule(
        dir.path(),
        "squatter",
        &foreign_kind,
        "    categories: [rulebook-by-name]\n",
    );
    wait_for(T, "the change to reach the owned CRD", || async {
        let crd = to_json(&crds.get_opt(&owned_crd).await.ok()??);
        (crd["spec"]["names"]["categories"] == json!(["rulebook-by-name"])).then_some(())
    })
    .await;
    assert_eq!(
        fingerprint(&to_json(&crds.get(&foreign_crd).await.unwrap())),
        before,
        "the foreign CRD is still unchanged"
    );
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap();
    assert!(
        s["rules"]["squatter"]["problem"]
            .as_str()
            .is_some_and(|p| p.contains("refusing to take it over")),
        "{s:#}"
    );
    assert!(s["rules"]["owned"].get("problem").is_none(), "{s:#}");

    // A standby takes over at once when the leader releases the Lease.
    let standby = start("b").await;
    standby.wait_standing_by(T).await;
    assert!(!leads(&standby).await, "b stands by while a leads");
    op.signal_and_wait("TERM");
    let released = std::time::Instant::now();
    wait_for(T, "b to take the Lease over", || async {
        leads(&standby).await.then_some(())
    })
    .await;
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "b took {took:?} to take over: its watch on the Lease should see the release at once"
    );
    for (who, op) in [("a", &op), ("b", &standby)] {
        let log = std::fs::read_to_string(&op.log).unwrap_or_default();
        let forbidden: Vec<&str> = log.lines().filter(|l| l.contains("forbidden")).collect();
        assert!(
            forbidden.is_empty(),
            "{who} was refused something on the generated RBAC:\n{}",
            forbidden.join("\n")
        );
    }
}

async fn leads(op: &Operator) -> bool {
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap_or_default();
    s["leader"] == true
}
