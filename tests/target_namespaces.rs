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

/// Issue 47 part 6: a namespaced parent's child in another namespace, where the rule's
/// `targetNamespaces` lists it (and nowhere else). The child carries no ownerReference
/// (the garbage collector would take a namespaced owner in another namespace for absent
/// and delete it) but the parent's name and namespace; its watch events still reach the
/// parent (a deleted child comes back, an edit of the parent reaches it at once); the
/// parent carries Rulebook's finalizer and records the namespace, and its deletion
/// deletes the child there. A parent steering a child outside the list gets
/// `Ready=False` and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaced_parent_places_a_child_in_a_listed_namespace_and_takes_it_away() {
    let test = "a_namespaced_parent_places_a_child_in_a_listed_namespace_and_takes_it_away";
    let client = client().await;
    let home = namespace(&client, "targets-home").await;
    let shared = namespace(&client, "targets-shared").await;
    let outside = namespace(&client, "targets-else").await;
    let (kind, rule) = ("TargetNsApp", "targetnsapp");
    let dir = RuleDir::new();
    dir.template(
        "cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\n  namespace: {{ parent.spec.ns }}\ndata:\n  v: {{ parent.spec.v | string }}\n",
    );
    let text = rule_text(
        rule,
        kind,
        &[child("cm", "v1", "ConfigMap", "cm.yaml", &[])],
    )
    .replace(
        "  children:\n",
        &format!("  targetNamespaces: [\"{}\"]\n  children:\n", &*shared),
    );
    dir.rule("r.yaml", &text);
    // Every namespace watched: the children live outside the parents' namespace.
    let op = dir.operator().flags(&["--install-crds"]).start().await;
    let parents = kind_api(&client, &home, kind, T).await;
    let cms = |ns: &str| api(&client, Some(ns), "v1", "ConfigMap", "configmaps");
    let parent = |name: &str, ns: &str, v: u64| {
        json!({"apiVersion": API_VERSION, "kind": kind,
               "metadata": {"name": name, "namespace": &*home}, "spec": {"ns": ns, "v": v}})
    };
    apply(&parents, parent("away", &shared, 1)).await;
    apply(&parents, parent("astray", &outside, 1)).await;

    // Placed in the listed namespace, owned by labels and annotations only.
    let p = wait_ready(&parents, "away", "True", Some("Ready"), T).await;
    let cm = get_json(&cms(&shared), "away")
        .await
        .expect("the child in the shared namespace");
    assert!(
        cm["metadata"].get("ownerReferences").is_none(),
        "{test}: {cm}"
    );
    let ann = &cm["metadata"]["annotations"];
    assert_eq!(
        ann["rulebook.dev/parent-namespace"],
        json!(&*home),
        "{test}: {cm}"
    );
    assert_eq!(ann["rulebook.dev/parent-name"], "away", "{test}: {cm}");
    assert_eq!(
        cm["metadata"]["labels"]["rulebook.dev/owner"],
        json!(uid_of(&p))
    );
    let p = get_json(&parents, "away").await.expect("the parent");
    assert!(
        p["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.contains(&json!("rulebook.dev/finalizer"))),
        "{test}: the parent carries the finalizer: {}",
        p["metadata"]
    );
    assert_eq!(
        p["metadata"]["annotations"]["rulebook.dev/child-namespaces"],
        json!(&*shared),
        "{test}: the parent records where its child is"
    );

    // Outside the list: refused, nothing written there.
    let a = wait_ready(&parents, "astray", "False", Some("RenderFailed"), T).await;
    let (_, _, message) = ready_condition(&a).expect("a Ready condition");
    assert!(
        message.contains(&format!(
            "the child's namespace '{}' is not among the rule's targetNamespaces ({})",
            &*outside, &*shared
        )),
        "{test}: {message}"
    );
    assert!(cms(&outside).get_opt("astray").await.unwrap().is_none());

    // The child's watch events reach its parent: a change of the parent is applied, and
    // a deleted child comes back (no resync: the rule's is the default, minutes away).
    merge(&parents, "away", json!({"spec": {"v": 2}})).await;
    wait_for(T, "the child to follow the parent", || async {
        let cm = get_json(&cms(&shared), "away").await?;
        (cm["data"]["v"] == "2").then_some(())
    })
    .await;
    let before = uid_of(&get_json(&cms(&shared), "away").await.expect("the child"));
    cms(&shared)
        .delete("away", &DeleteParams::default())
        .await
        .expect("delete the child");
    wait_for(T, "the deleted child to come back", || async {
        let cm = get_json(&cms(&shared), "away").await?;
        (uid_of(&cm) != before).then_some(())
    })
    .await;

    // Lookalikes claiming the parent by labels and annotations (as its children
    // elsewhere do): one in the parent's own namespace naming another namespace as the
    // parent's, one in a namespace outside the list naming the right one. Neither is the
    // parent's: a reconcile (the parent changed) and the teardown leave both alone.
    let claim = |ns: &str, home: &str, name: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule,
                    "rulebook.dev/owner": uid_of(&p), "rulebook.dev/child": "cm"},
                "annotations": {"rulebook.dev/parent-name": "away",
                    "rulebook.dev/parent-namespace": home}},
            "data": {"v": "lookalike"}})
    };
    apply(&cms(&home), claim(&home, "zzz", "fake-home")).await;
    apply(&cms(&outside), claim(&outside, &home, "fake-out")).await;
    merge(&parents, "away", json!({"spec": {"v": 3}})).await;
    wait_for(T, "the parent's reconcile after the lookalikes", || async {
        let o = get_json(&parents, "away").await?;
        let cm = get_json(&cms(&shared), "away").await?;
        (o.pointer("/status/observedGeneration") == o.pointer("/metadata/generation")
            && cm["data"]["v"] == "3")
            .then_some(())
    })
    .await;
    assert!(
        get_json(&cms(&home), "fake-home").await.is_some(),
        "{test}: a lookalike at home naming another namespace was taken for a child elsewhere"
    );

    // The parent's deletion deletes its child elsewhere (no garbage collector would),
    // then lets the parent go.
    parents
        .delete("away", &DeleteParams::default())
        .await
        .expect("delete the parent");
    wait_for(
        T,
        "the parent and its child elsewhere to be gone",
        || async {
            let parent_gone = parents.get_opt("away").await.ok()?.is_none();
            let child_gone = cms(&shared).get_opt("away").await.ok()?.is_none();
            (parent_gone && child_gone).then_some(())
        },
    )
    .await;
    for (ns, name) in [(&*home, "fake-home"), (&*outside, "fake-out")] {
        let o = get_json(&cms(ns), name).await;
        assert!(
            o.as_ref().is_some_and(|o| o["data"]["v"] == "lookalike"),
            "{test}: the teardown touched the lookalike {ns}/{name}: {o:?}"
        );
    }
    drop(op);
    let _ = parents.delete("astray", &DeleteParams::default()).await;
}
