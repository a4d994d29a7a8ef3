//! Issue 45: where a cluster-scoped parent may put its children (`spec.targetNamespaces`),
//! against the local control plane. A parent that steers its child into a namespace
//! outside the list, or into `kube-system`, gets `Ready=False` (`RenderFailed`, the
//! namespace and the list named) and nothing is written there; a parent within the list
//! is Ready with its child, unaffected.
// The fault kit's scenario functions are long stories (tests/faults.rs says why).
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::time::Duration;

use common::*;
use faults_kit::*;
use kube::api::DeleteParams;
use serde_json::json;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_outside_the_target_namespaces_is_refused_and_not_written() {
    let client = client().await;
    let allowed = namespace(&client, "targets-in").await;
    let outside = namespace(&client, "targets-out").await;
    let (kind, rule) = ("TargetNsTenant", "targetnstenant");
    let dir = RuleDir::new();
    dir.template(
        "cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\n  namespace: {{ parent.spec.ns }}\ndata:\n  owner: {{ parent.metadata.name }}\n",
    );
    let text = rule_text(
        rule,
        kind,
        &[child("cm", "v1", "ConfigMap", "cm.yaml", &[])],
    )
    .replace("  crd:\n", "  crd:\n    scope: Cluster\n")
    .replace(
        "  children:\n",
        &format!("  targetNamespaces: [\"{}\"]\n  children:\n", &*allowed),
    );
    dir.rule("r.yaml", &text);
    // Every namespace watched: the children live outside any one of the test's.
    let _op = dir.operator().flags(&["--install-crds"]).start().await;
    let parents = api(&client, None, API_VERSION, kind, &plural(kind));
    wait_for(T, "the CRD to be served", || async {
        parents.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;

    let id = unique("t").to_lowercase();
    let parent = |name: &str, ns: &str| {
        json!({"apiVersion": API_VERSION, "kind": kind,
               "metadata": {"name": format!("{name}-{id}")}, "spec": {"ns": ns}})
    };
    let (good, bad, kube) = (
        format!("good-{id}"),
        format!("bad-{id}"),
        format!("kube-{id}"),
    );
    apply(&parents, parent("good", &allowed)).await;
    apply(&parents, parent("bad", &outside)).await;
    apply(&parents, parent("kube", "kube-system")).await;

    wait_ready(&parents, &good, "True", Some("Ready"), T).await;
    let cms = |ns: &str| api(&client, Some(ns), "v1", "ConfigMap", "configmaps");
    assert!(cms(&allowed).get_opt(&good).await.unwrap().is_some());
    for (name, ns) in [(&bad, &*outside), (&kube, "kube-system")] {
        let p = wait_ready(&parents, name, "False", Some("RenderFailed"), T).await;
        let (_, _, message) = ready_condition(&p).expect("a Ready condition");
        assert!(
            message.contains(&format!("the child's namespace '{ns}'")),
            "{message}"
        );
        assert!(
            cms(ns).get_opt(name).await.unwrap().is_none(),
            "nothing written in {ns}"
        );
    }
    let (_, _, message) =
        ready_condition(&to_json(&parents.get(&bad).await.unwrap())).expect("Ready");
    assert!(
        message.contains(&format!(
            "not among the rule's targetNamespaces ({})",
            &*allowed
        )),
        "{message}"
    );

    for name in [&good, &bad, &kube] {
        let _ = parents.delete(name, &DeleteParams::default()).await;
    }
    let crds = api(
        &client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let _ = crds
        .delete(
            &format!("{}.{GROUP}", plural(kind)),
            &DeleteParams::default(),
        )
        .await;
}
