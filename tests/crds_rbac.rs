//! CRDs defined in rules and least-privilege RBAC generated from rules, against the real
//! control plane: `rulebook crds` is accepted and validates parents; the operator runs
//! as a ServiceAccount bound to exactly `rulebook rbac`'s output; a missing verb stops
//! only the rule that needs it; breaking CRD changes are refused, additive ones applied.

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);

async fn install_example_crds(client: &kube::Client) -> Vec<Json> {
    let crds = yaml_objects(&rulebook(&["crds"]));
    assert_eq!(crds.len(), 5, "one CRD per example rule");
    apply_all(client, &crds).await;
    for c in &crds {
        wait_established(client, c["metadata"]["name"].as_str().unwrap()).await;
    }
    crds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_from_rules_are_established_and_validate_parents() {
    let client = client().await;
    install_example_crds(&client).await;
    let ns = namespace(&client, "crds").await;
    let webs = api(
        &client,
        Some(&ns),
        "operator.k8s-summit.org/v1",
        "MyWeb",
        "mywebs",
    );
    let apps = api(&client, Some(&ns), "app.example.com/v1", "MyApp", "myapps");
    let projects = api(&client, Some(&ns), "xyz.com/v1", "Project", "projects");

    // Valid parents are accepted, with schema defaults filled in.
    let web = apply(&webs, example("myweb.yaml", &ns)).await;
    apply(&apps, example("myapp.yaml", &ns)).await;
    apply(&projects, example("project.yaml", &ns)).await;
    assert_eq!(to_json(&web)["spec"]["replicas"], 2);
    let mut minimal = example("myweb.yaml", &ns);
    minimal["metadata"]["name"] = json!("minimal");
    for k in ["image", "replicas", "nodePortNumber"] {
        minimal["spec"].as_object_mut().unwrap().remove(k);
    }
    let minimal = to_json(&apply(&webs, minimal).await);
    assert_eq!(minimal["spec"]["replicas"], 1, "schema default");
    assert_eq!(minimal["spec"]["image"], "nginx:1.27", "schema default");

    // Parents that violate the schema are rejected by the API server.
    let rejected = |api: Api<DynamicObject>, obj: Json, why: &'static str| async move {
        let obj: DynamicObject = serde_json::from_value(obj).unwrap();
        match api.create(&PostParams::default(), &obj).await {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{why}: {}", s.message),
            other => panic!("{why}: expected a 422 rejection, got {other:?}"),
        }
    };
    let mut bad = example("myweb.yaml", &ns);
    bad["metadata"]["name"] = json!("too-many");
    bad["spec"]["replicas"] = json!(1000);
    rejected(webs.clone(), bad, "replicas above the maximum").await;
    let mut bad = example("myweb.yaml", &ns);
    bad["metadata"]["name"] = json!("no-page");
    bad["spec"]
        .as_object_mut()
        .unwrap()
        .remove("pageContentHtml");
    rejected(webs.clone(), bad, "a required field missing").await;
    let mut bad = example("myapp.yaml", &ns);
    bad["metadata"]["name"] = json!("wrong-type");
    bad["spec"]["replicas"] = json!("three");
    rejected(apps.clone(), bad, "a string where an integer belongs").await;
    let mut bad = example("project.yaml", &ns);
    bad["metadata"]["name"] = json!("weak");
    bad["spec"]["password"] = json!("short");
    rejected(projects.clone(), bad, "a password below minLength").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_runs_on_exactly_the_generated_rbac() {
    let client = client().await;
    install_example_crds(&client).await;

    // Everything the rules need: all three example rules converge.
    let ns = namespace(&client, "rbac-full").await;
    let role = unique("rulebook-rbac-full");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]));
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;
    let _op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns)
        .kubeconfig(kubeconfig.path())
        .start()
        .await;
    let webs = api(
        &client,
        Some(&ns),
        "operator.k8s-summit.org/v1",
        "MyWeb",
        "mywebs",
    );
    let apps = api(&client, Some(&ns), "app.example.com/v1", "MyApp", "myapps");
    let projects = api(&client, Some(&ns), "xyz.com/v1", "Project", "projects");
    let mut web = example("myweb.yaml", &ns);
    web["spec"]
        .as_object_mut()
        .unwrap()
        .remove("nodePortNumber");
    apply(&webs, web).await;
    apply(&apps, example("myapp.yaml", &ns)).await;
    apply(&projects, example("project.yaml", &ns)).await;
    wait_ready(&webs, "hello", "True", Some("Ready"), T).await;
    wait_ready(&apps, "shop", "True", Some("Ready"), T).await;
    wait_ready(&projects, "apollo", "True", Some("Ready"), T).await;

    // One verb less (delete on Secrets): the rule that needs it says so, the others run.
    let ns2 = namespace(&client, "rbac-less").await;
    let role2 = unique("rulebook-rbac-less");
    let mut rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--name",
        &role2,
        "--service-account",
        &format!("{ns2}/rulebook"),
    ]));
    let rules = rbac[0]["rules"].as_array_mut().unwrap();
    let secrets = rules
        .iter_mut()
        .find(|r| r["resources"][0] == "secrets")
        .expect("a rule for secrets");
    secrets["verbs"] = json!(["create", "get", "list", "patch", "watch"]);
    let kubeconfig = service_account_kubeconfig(&client, &ns2, "rulebook", rbac).await;
    let op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns2)
        .kubeconfig(kubeconfig.path())
        .start()
        .await;
    let status = wait_for(T, "the project rule to report the missing verb", || async {
        let s: Json = serde_json::from_str(&op.get("/status").await).ok()?;
        let project = &s["rules"]["project"];
        // It may first wait for its CRD to be served; the permission check comes after.
        // The other rules run their own checks at their own pace: wait for them too.
        (project["state"] == "waiting"
            && project["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("missing permissions"))
            && s["rules"]["myweb"]["state"] == "running"
            && s["rules"]["myapp"]["state"] == "running")
            .then(|| s.clone())
    })
    .await;
    let message = status["rules"]["project"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("delete") && message.contains("secrets"),
        "the message names the missing verb and resource: {message}"
    );
    let webs2 = api(
        &client,
        Some(&ns2),
        "operator.k8s-summit.org/v1",
        "MyWeb",
        "mywebs",
    );
    let apps2 = api(&client, Some(&ns2), "app.example.com/v1", "MyApp", "myapps");
    let mut web = example("myweb.yaml", &ns2);
    web["spec"]
        .as_object_mut()
        .unwrap()
        .remove("nodePortNumber");
    apply(&webs2, web).await;
    apply(&apps2, example("myapp.yaml", &ns2)).await;
    wait_ready(&webs2, "hello", "True", Some("Ready"), T).await;
    wait_ready(&apps2, "shop", "True", Some("Ready"), T).await;
    assert_eq!(
        op.metric("rulebook_rule_running{rule=\"project\"}").await,
        0.0
    );
}

fn evolver_rule(dir: &std::path::Path, kind: &str, spec_schema: &str) {
    let plural = format!("{}s", kind.to_lowercase());
    std::fs::create_dir_all(dir.join("rules")).unwrap();
    std::fs::create_dir_all(dir.join("templates")).unwrap();
    std::fs::write(
        dir.join("templates/cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("rules/evolver.yaml"),
        format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: evolver
spec:
  parent:
    apiVersion: crdtest.rulebook.dev/v1
    kind: {kind}
  children:
    - name: cm
      apiVersion: v1
      kind: ConfigMap
      template: cm.yaml
  crd:
    plural: {plural}
    specSchema:
{spec_schema}"#
        ),
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaking_crd_changes_are_refused_and_additive_ones_applied() {
    let client = client().await;
    let ns = namespace(&client, "crd-evolve").await;
    let dir = tempfile::tempdir().unwrap();
    // A kind of its own per run: CRDs outlive tests on a reused cluster.
    let kind = format!("Evolver{}", unique("x").replace(['x', '-'], ""));
    let crd_name = format!("{}s.crdtest.rulebook.dev", kind.to_lowercase());
    let v1 = "      type: object\n      properties:\n        size: { type: integer }\n";
    evolver_rule(dir.path(), &kind, v1);
    let op = Operator::on(&dir.path().join("rules"), &dir.path().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    wait_established(&client, &crd_name).await;
    let crds = api(
        &client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let props = |crd: Json| {
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            .clone()
    };

    // Breaking: `size` removed, `color` added. Refused with a clear message; the CRD stays.
    let breaking = "      type: object\n      properties:\n        color: { type: string }\n";
    evolver_rule(dir.path(), &kind, breaking);
    let problem = wait_for(T, "the refusal on /status", || async {
        let s: Json = serde_json::from_str(&op.get("/status").await).ok()?;
        s["rules"]["evolver"]["problem"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert!(
        problem.contains("refusing breaking schema changes") && problem.contains("size: removed"),
        "{problem}"
    );
    assert!(
        problem.contains("allowBreakingChanges"),
        "says how to allow it: {problem}"
    );
    let crd = to_json(&crds.get(&crd_name).await.unwrap());
    assert!(
        props(crd.clone()).get("size").is_some(),
        "the CRD keeps size"
    );
    assert!(
        props(crd).get("color").is_none(),
        "nothing of the refused change is applied"
    );

    // Additive: `size` kept, `color` added. Applied; the problem is gone.
    let additive = "      type: object\n      properties:\n        size: { type: integer }\n        color: { type: string }\n";
    evolver_rule(dir.path(), &kind, additive);
    wait_for(T, "the additive change to reach the CRD", || async {
        let crd = to_json(&crds.get_opt(&crd_name).await.ok()??);
        props(crd).get("color").map(|_| ())
    })
    .await;
    wait_for(T, "the problem to clear", || async {
        let s: Json = serde_json::from_str(&op.get("/status").await).ok()?;
        s["rules"]["evolver"].get("problem").is_none().then_some(())
    })
    .await;

    // With allowBreakingChanges the removal goes through.
    evolver_rule(dir.path(), &kind, breaking);
    let path = dir.path().join("rules/evolver.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("  crd:\n", "  crd:\n    allowBreakingChanges: true\n"),
    )
    .unwrap();
    wait_for(
        T,
        "the allowed breaking change to reach the CRD",
        || async {
            let crd = to_json(&crds.get_opt(&crd_name).await.ok()??);
            props(crd).get("size").is_none().then_some(())
        },
    )
    .await;
}

/// A rule with a `namespaceSelector` watches the Namespaces: `rulebook rbac` grants it, and
/// without that grant the rule waits with a message naming it at start, instead of
/// running with a Namespace watch that fails for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_selector_without_the_namespaces_watch_waits_naming_it() {
    let client = client().await;
    let ns = namespace(&client, "rbac-nssel").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::create_dir_all(&templates).expect("templates dir");
    std::fs::write(
        templates.join("cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}-copy\n",
    )
    .expect("template");
    std::fs::write(
        rules.join("by-namespace.yaml"),
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: by-namespace\nspec:\n  parent:\n    apiVersion: v1\n    kind: Secret\n    selector:\n      namespaceSelector:\n        matchLabels: {rulebook.test/nssel: \"yes\"}\n  children:\n    - name: copy\n      apiVersion: v1\n      kind: ConfigMap\n      template: cm.yaml\n",
    )
    .expect("rule");
    let (r, t) = (rules.display().to_string(), templates.display().to_string());
    let role = unique("rulebook-nssel");
    let mut rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        &r,
        "--templates",
        &t,
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]));
    let grants = rbac[0]["rules"].as_array_mut().expect("rules");
    let before = grants.len();
    grants.retain(|g| g["resources"][0] != "namespaces");
    assert_eq!(
        grants.len() + 1,
        before,
        "rbac granted the Namespaces watch"
    );
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;
    let op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .kubeconfig(kubeconfig.path())
        .start()
        .await;
    let message = wait_for(
        T,
        "the rule to report the missing Namespaces watch",
        || async {
            let s: Json = serde_json::from_str(&op.get("/status").await).ok()?;
            let rule = &s["rules"]["by-namespace"];
            (rule["state"] == "waiting")
                .then(|| rule["message"].as_str().map(str::to_string))
                .flatten()
                .filter(|m| m.starts_with("missing permissions"))
        },
    )
    .await;
    assert!(
        message.contains("get, list, watch namespaces"),
        "the message names the Namespaces watch: {message}"
    );
}
