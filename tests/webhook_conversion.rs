//! The conversion webhook through Rulebook's server, on the local control plane (issue
//! 43): a rule whose CRD has `v1` (stored) and `v1alpha1`, converted by templates; the
//! operator installs the CRD with its conversion webhook's URL and CA. An object created
//! as `v1alpha1` reads back as `v1` and the reverse. Conversion has no failure policy:
//! with the webhook server killed, the kind cannot be read in the version it is not
//! stored in (a clear error naming the conversion webhook), while nothing stored is lost;
//! started again, reads in both versions work again.

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod webhook_kit;

use common::*;
use kube::api::PostParams;
use kube::core::DynamicObject;
use serde_json::json;
use webhook_kit::{GROUP, T, free_port};

const RULE: &str = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: RULENAME
spec:
  parent:
    apiVersion: webhook.rulebook.dev/v1
    kind: KIND
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: conv/config.yaml
  crd:
    plural: PLURAL
    versions:
      - name: v1
        storage: true
        specSchema:
          type: object
          properties:
            container:
              type: object
              properties:
                image: { type: string }
      - name: v1alpha1
        specSchema:
          type: object
          properties:
            image: { type: string }
    conversion:
      - { from: v1alpha1, to: v1, template: conv/up.yaml }
      - { from: v1, to: v1alpha1, template: conv/down.yaml }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_convert_through_the_webhook_and_wait_for_it_when_it_is_down() {
    let client = client().await;
    let ns = namespace(&client, "wh-conv").await;
    let id: String = unique("cv")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let (kind, rule) = (format!("Wh{id}"), format!("wh-{id}"));
    let plural = format!("{}s", kind.to_lowercase());
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::create_dir_all(templates.join("conv")).unwrap();
    let text = RULE
        .replace("RULENAME", &rule)
        .replace("PLURAL", &plural)
        .replace("KIND", &kind);
    std::fs::write(rules.join("conv.yaml"), text).unwrap();
    for (file, body) in [
        (
            "config.yaml",
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  image: {{ parent.spec.container.image }}\n",
        ),
        (
            "up.yaml",
            "spec:\n  container:\n    image: {{ object.spec.image }}\n",
        ),
        (
            "down.yaml",
            "spec:\n  image: {{ object.spec.container.image }}\n",
        ),
    ] {
        std::fs::write(templates.join("conv").join(file), body).unwrap();
    }
    let port = free_port();
    let name = format!("rulebook-test-{id}");
    let flags = [
        "--install-crds".to_string(),
        "--webhook-bind".into(),
        "127.0.0.1".into(),
        "--webhook-port".into(),
        port.to_string(),
        "--webhook-url".into(),
        format!("https://127.0.0.1:{port}"),
        "--webhook-secret".into(),
        format!("{ns}/{name}"),
        "--webhook-configuration".into(),
        name.clone(),
    ];
    let start = || {
        Operator::on(&rules, &templates)
            .namespace(&ns)
            .flags(&flags)
            .start()
    };
    let mut op = start().await;
    let crd = format!("{plural}.{GROUP}");
    wait_established(&client, &crd).await;
    let v1 = api(
        &client,
        Some(&ns),
        "webhook.rulebook.dev/v1",
        &kind,
        &plural,
    );
    let alpha = api(
        &client,
        Some(&ns),
        "webhook.rulebook.dev/v1alpha1",
        &kind,
        &plural,
    );
    let old: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "webhook.rulebook.dev/v1alpha1", "kind": kind,
        "metadata": {"name": "old"}, "spec": {"image": "img:1"},
    }))
    .unwrap();
    // The CRD may be Established a moment before its conversion webhook answers.
    wait_for(T, "a v1alpha1 create converted to v1", || async {
        alpha.create(&PostParams::default(), &old).await.ok()
    })
    .await;
    let read = to_json(&v1.get("old").await.unwrap());
    assert_eq!(read["spec"], json!({"container": {"image": "img:1"}}));
    let back = to_json(&alpha.get("old").await.unwrap());
    assert_eq!(back["spec"], json!({"image": "img:1"}));
    let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(client.clone(), &ns);
    wait_for(T, "the child, rendered from v1", || async {
        let cm = cms.get_opt("old").await.ok()??;
        (cm.data?.get("image")? == "img:1").then_some(())
    })
    .await;

    op.signal_and_wait("KILL");
    let err = match alpha.get("old").await {
        Err(kube::Error::Api(s)) => s.message,
        other => panic!("read as v1alpha1 with no conversion webhook: {other:?}"),
    };
    println!("no webhook server, read as v1alpha1: {err}");
    assert!(err.contains("conversion webhook"), "{err}");
    assert_eq!(
        to_json(&v1.get("old").await.unwrap())["spec"]["container"]["image"],
        "img:1"
    );
    assert!(
        cms.get_opt("old").await.unwrap().is_some(),
        "the child is kept"
    );

    let _op = start().await;
    let again = wait_for(T, "reads as v1alpha1 again", || async {
        alpha.get("old").await.ok()
    })
    .await;
    assert_eq!(to_json(&again)["spec"], json!({"image": "img:1"}));
}
