//! The example rules (MyWeb, MyApp, Project) reconciled by a real `rulebook run` against
//! the local control plane: children appear owned and labelled, status and Ready follow
//! the pods kwok runs, spec changes propagate, deleted or edited children are repaired,
//! `includeWhen` prunes exactly its child, deleting the parent garbage-collects the
//! children, and a parent whose template fails reports it without disturbing others.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);

struct Kinds {
    cm: Api<DynamicObject>,
    deploy: Api<DynamicObject>,
    svc: Api<DynamicObject>,
    secret: Api<DynamicObject>,
}

fn kinds(client: &kube::Client, ns: &str) -> Kinds {
    Kinds {
        cm: api(client, Some(ns), "v1", "ConfigMap", "configmaps"),
        deploy: api(client, Some(ns), "apps/v1", "Deployment", "deployments"),
        svc: api(client, Some(ns), "v1", "Service", "services"),
        secret: api(client, Some(ns), "v1", "Secret", "secrets"),
    }
}

async fn get(api: &Api<DynamicObject>, name: &str) -> Option<Json> {
    api.get_opt(name).await.ok().flatten().map(|o| to_json(&o))
}

async fn wait_exists(api: &Api<DynamicObject>, name: &str) -> Json {
    wait_for(T, &format!("{name} to exist"), || get(api, name)).await
}

async fn wait_gone(api: &Api<DynamicObject>, name: &str) {
    wait_for(T, &format!("{name} to be deleted"), || async {
        get(api, name).await.is_none().then_some(())
    })
    .await
}

/// The child is controlled by the parent and carries Rulebook's labels.
fn assert_owned(child: &Json, parent: &Json, rule: &str, child_name: &str) {
    let uid = parent["metadata"]["uid"].as_str().unwrap();
    let refs = child["metadata"]["ownerReferences"]
        .as_array()
        .expect("ownerReferences");
    assert!(
        refs.iter()
            .any(|r| r["uid"] == uid && r["controller"] == true && r["kind"] == parent["kind"]),
        "{} is not controlled by its parent: {refs:?}",
        child["metadata"]["name"]
    );
    let labels = &child["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/managed-by"], "rulebook");
    assert_eq!(labels["rulebook.dev/rule"], rule);
    assert_eq!(labels["rulebook.dev/owner"], uid);
    assert_eq!(labels["rulebook.dev/child"], child_name);
    // The rule version is the parent's (status.ruleVersion), not every child's.
    assert!(child["metadata"]["annotations"]["rulebook.dev/rule-version"].is_null());
}

async fn wait_crd(
    client: &kube::Client,
    ns: &str,
    api_version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let a = api(client, Some(ns), api_version, kind, plural);
    wait_for(T, &format!("the {kind} CRD to be served"), || async {
        a.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    a
}

fn node_port() -> u16 {
    // Spread over the NodePort range so parallel tests do not collide.
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    30000 + (n % 2700) as u16
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn myweb_lifecycle() {
    let client = client().await;
    let ns = namespace(&client, "myweb").await;
    let op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let webs = wait_crd(
        &client,
        &ns,
        "operator.k8s-summit.org/v1",
        "MyWeb",
        "mywebs",
    )
    .await;
    let k = kinds(&client, &ns);
    let port = node_port();
    let mut parent = example("myweb.yaml", &ns);
    parent["spec"]["nodePortNumber"] = json!(port);
    apply(&webs, parent.clone()).await;

    // Children appear, owned and labelled; status follows the pods kwok makes ready.
    let p = wait_ready(&webs, "hello", "True", Some("Ready"), T).await;
    let cm = wait_exists(&k.cm, "hello-html").await;
    let deploy = wait_exists(&k.deploy, "hello-web").await;
    let svc = wait_exists(&k.svc, "hello").await;
    assert_owned(&cm, &p, "myweb", "html");
    assert_owned(&deploy, &p, "myweb", "web");
    assert_owned(&svc, &p, "myweb", "svc");
    assert!(
        cm["data"]["index.html"]
            .as_str()
            .unwrap()
            .contains("Hello from Rulebook")
    );
    assert_eq!(svc["spec"]["ports"][0]["nodePort"], port);
    assert_eq!(p["status"]["readyReplicas"], 2);
    assert_eq!(p["status"]["url"], format!("http://hello.{ns}.svc"));
    assert_eq!(p["status"]["nodePort"], port);
    assert_eq!(p["status"]["phase"], "Serving");

    // A spec change reaches the children.
    parent["spec"]["pageContentHtml"] = json!("<p>second version</p>");
    parent["spec"]["replicas"] = json!(3);
    apply(&webs, parent.clone()).await;
    wait_for(T, "the ConfigMap to carry the new page", || async {
        let cm = get(&k.cm, "hello-html").await?;
        (cm["data"]["index.html"] == "<p>second version</p>").then_some(())
    })
    .await;
    let p = wait_for(T, "3 ready replicas in status", || async {
        let p = get(&webs, "hello").await?;
        (p["status"]["readyReplicas"] == 3 && ready_condition(&p)?.0 == "True").then_some(p)
    })
    .await;
    assert_eq!(
        p["status"]["observedGeneration"],
        p["metadata"]["generation"]
    );

    // A deleted child is recreated.
    let old_uid = get(&k.cm, "hello-html").await.unwrap()["metadata"]["uid"].clone();
    k.cm.delete("hello-html", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(T, "the ConfigMap to be recreated", || async {
        let cm = get(&k.cm, "hello-html").await?;
        (cm["metadata"]["uid"] != old_uid).then_some(())
    })
    .await;

    // Hand edits of templated fields are reverted.
    k.deploy
        .patch(
            "hello-web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 7}})),
        )
        .await
        .unwrap();
    k.cm.patch(
        "hello-html",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"index.html": "defaced"}})),
    )
    .await
    .unwrap();
    wait_for(T, "hand edits to be reverted", || async {
        let d = get(&k.deploy, "hello-web").await?;
        let cm = get(&k.cm, "hello-html").await?;
        (d["spec"]["replicas"] == 3 && cm["data"]["index.html"] == "<p>second version</p>")
            .then_some(())
    })
    .await;

    // includeWhen turning false prunes that child, and only that child.
    let cm_uid = get(&k.cm, "hello-html").await.unwrap()["metadata"]["uid"].clone();
    let deploy_uid = get(&k.deploy, "hello-web").await.unwrap()["metadata"]["uid"].clone();
    parent["spec"]
        .as_object_mut()
        .unwrap()
        .remove("nodePortNumber");
    apply(&webs, parent.clone()).await;
    wait_gone(&k.svc, "hello").await;
    let p = wait_ready(&webs, "hello", "True", None, T).await;
    assert!(
        p["status"].get("url").is_none(),
        "url should be unset: {}",
        p["status"]
    );
    assert_eq!(
        get(&k.cm, "hello-html").await.unwrap()["metadata"]["uid"],
        cm_uid
    );
    assert_eq!(
        get(&k.deploy, "hello-web").await.unwrap()["metadata"]["uid"],
        deploy_uid
    );

    // Deleting the parent garbage-collects the children.
    webs.delete("hello", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&k.cm, "hello-html").await;
    wait_gone(&k.deploy, "hello-web").await;
    assert!(
        op.metric("rulebook_children_pruned_total{rule=\"myweb\"}")
            .await
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn myapp_lifecycle() {
    let client = client().await;
    let ns = namespace(&client, "myapp").await;
    let _op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let apps = wait_crd(&client, &ns, "app.example.com/v1", "MyApp", "myapps").await;
    let k = kinds(&client, &ns);
    let mut parent = example("myapp.yaml", &ns);
    apply(&apps, parent.clone()).await;

    let p = wait_ready(&apps, "shop", "True", Some("Ready"), T).await;
    assert_eq!(p["status"]["availableReplicas"], 3);
    let d = wait_exists(&k.deploy, "shop").await;
    assert_owned(&d, &p, "myapp", "deployment");
    assert_eq!(
        d["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.example.com/shop:2.1"
    );

    parent["spec"]["image"] = json!("registry.example.com/shop:2.2");
    parent["spec"]["replicas"] = json!(1);
    apply(&apps, parent.clone()).await;
    let p = wait_for(T, "1 available replica after the update", || async {
        let p = get(&apps, "shop").await?;
        (p["status"]["availableReplicas"] == 1 && ready_condition(&p)?.0 == "True").then_some(p)
    })
    .await;
    assert_eq!(
        p["status"]["observedGeneration"],
        p["metadata"]["generation"]
    );
    let d = get(&k.deploy, "shop").await.unwrap();
    assert_eq!(
        d["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.example.com/shop:2.2"
    );

    let old_uid = d["metadata"]["uid"].clone();
    k.deploy
        .delete("shop", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(T, "the Deployment to be recreated", || async {
        let d = get(&k.deploy, "shop").await?;
        (d["metadata"]["uid"] != old_uid).then_some(())
    })
    .await;

    apps.delete("shop", &DeleteParams::default()).await.unwrap();
    wait_gone(&k.deploy, "shop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn project_lifecycle() {
    let client = client().await;
    let ns = namespace(&client, "project").await;
    let _op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let projects = wait_crd(&client, &ns, "xyz.com/v1", "Project", "projects").await;
    let k = kinds(&client, &ns);
    let mut parent = example("project.yaml", &ns);
    apply(&projects, parent.clone()).await;

    let p = wait_ready(&projects, "apollo", "True", Some("Ready"), T).await;
    assert_eq!(p["status"]["ready"], true);
    let secret = wait_exists(&k.secret, "apollo-credentials").await;
    assert_owned(&secret, &p, "project", "secret");
    assert_eq!(
        secret["data"]["password"],
        "Y29ycmVjdC1ob3JzZS1iYXR0ZXJ5LXN0YXBsZQ=="
    );
    let d = wait_exists(&k.deploy, "apollo").await;
    assert_owned(&d, &p, "project", "app");
    let env = &d["spec"]["template"]["spec"]["containers"][0]["env"][0];
    assert_eq!(
        env["valueFrom"]["secretKeyRef"]["name"],
        "apollo-credentials"
    );

    // A new password reaches the Secret and rolls the pods (the template hashes it).
    let old_gen =
        d["spec"]["template"]["metadata"]["annotations"]["rulebook.dev/spec-generation"].clone();
    parent["spec"]["password"] = json!("a-much-better-password");
    apply(&projects, parent.clone()).await;
    wait_for(
        T,
        "the new password in the Secret and the pod template",
        || async {
            let s = get(&k.secret, "apollo-credentials").await?;
            let d = get(&k.deploy, "apollo").await?;
            (s["data"]["password"] == "YS1tdWNoLWJldHRlci1wYXNzd29yZA=="
                && d["spec"]["template"]["metadata"]["annotations"]["rulebook.dev/spec-generation"]
                    != old_gen)
                .then_some(())
        },
    )
    .await;

    // The Secret is a child too: deleted, it comes back.
    k.secret
        .delete("apollo-credentials", &DeleteParams::default())
        .await
        .unwrap();
    wait_exists(&k.secret, "apollo-credentials").await;

    projects
        .delete("apollo", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&k.secret, "apollo-credentials").await;
    wait_gone(&k.deploy, "apollo").await;
}

/// A rule of the test's own, with a CRD that lets a parent ask its template to fail.
fn widget_rules(dir: &std::path::Path) {
    std::fs::create_dir_all(dir.join("rules")).unwrap();
    std::fs::create_dir_all(dir.join("templates")).unwrap();
    std::fs::write(
        dir.join("rules/widget.yaml"),
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: widget
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Widget
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: widget.yaml
  status:
    size: "$.children.config.data.size"
  crd:
    plural: widgets
    specSchema:
      type: object
      x-kubernetes-preserve-unknown-fields: true
"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("templates/widget.yaml"),
        r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-config" }}
data:
  size: {{ parent.spec.size | string }}
{% if parent.spec.fail %}
  broken: {{ parent.spec.doesNotExist }}
{% endif %}
"#,
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_template_marks_only_its_parent() {
    let client = client().await;
    let ns = namespace(&client, "render-fail").await;
    let dir = tempfile::tempdir().unwrap();
    widget_rules(dir.path());
    let _op = Operator::on(&dir.path().join("rules"), &dir.path().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let widgets = wait_crd(&client, &ns, "test.rulebook.dev/v1", "Widget", "widgets").await;
    let cm = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let widget = |name: &str, fail: bool| {
        json!({"apiVersion": "test.rulebook.dev/v1", "kind": "Widget",
               "metadata": {"name": name, "namespace": ns}, "spec": {"size": 3, "fail": fail}})
    };
    apply(&widgets, widget("good-a", false)).await;
    apply(&widgets, widget("bad", true)).await;
    apply(&widgets, widget("good-b", false)).await;

    let bad = wait_ready(&widgets, "bad", "False", Some("RenderFailed"), T).await;
    let (_, _, message) = ready_condition(&bad).unwrap();
    assert!(
        message.contains("widget.yaml:8") && message.contains("undefined"),
        "the message names the template file and line: {message}"
    );
    for good in ["good-a", "good-b"] {
        let p = wait_ready(&widgets, good, "True", Some("Ready"), T).await;
        assert_eq!(p["status"]["size"], "3");
        assert!(get(&cm, &format!("{good}-config")).await.is_some());
    }
    assert!(
        get(&cm, "bad-config").await.is_none(),
        "nothing is applied for a parent that failed to render"
    );

    // Fixing the parent fixes it.
    apply(&widgets, widget("bad", false)).await;
    wait_ready(&widgets, "bad", "True", Some("Ready"), T).await;
}
