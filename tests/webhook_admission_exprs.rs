//! `expr:` checks and computed defaults, served by Rulebook's admission webhooks and
//! called by the local control plane's API server (issue 43): a parent that violates a
//! check reading a reference is refused by `kubectl apply` with the rule's rendered
//! message; a computed default read from a referenced ConfigMap is in the stored object;
//! a check reading `old` refuses an update; a Secret's value among the references never
//! reaches a denial.

mod common;
mod webhook_kit;

use std::process::Command;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, PostParams};
use serde_json::json;
use webhook_kit::*;

/// The rule: a plan that must exist (a ConfigMap `plan-<spec.plan>`), an immutable tier,
/// and the image defaulted from the ConfigMap `platform-defaults`.
fn rule(h: &Hooked) -> String {
    h.rule_yaml(
        r#"    - name: plan
      apiVersion: v1
      kind: ConfigMap
      objectName: "'plan-' ~ parent.spec.plan"
      optional: true
    - name: platformDefaults
      apiVersion: v1
      kind: ConfigMap
      objectName: "'platform-defaults'"
      optional: true
    - name: token
      apiVersion: v1
      kind: Secret
      objectName: "'api-token'"
      optional: true
"#,
        r#"    validate:
      - expr: "refs.plan is defined"
        message: "plan {{ parent.spec.plan }} does not exist (token {{ refs.token.data.token | default('') }})"
        fieldPath: spec.plan
      - expr: "parent.spec.tier == old.spec.tier"
        message: "tier is immutable"
        fieldPath: spec.tier
    default:
      - path: spec.image
        expr: "refs.platformDefaults.data.image"
"#,
    )
}

/// `kubectl apply -f -` of `object`: (exit success, stderr).
fn kubectl_apply(object: &serde_json::Value) -> (bool, String) {
    let kubectl = std::env::var_os("RULEBOOK_TEST_KUBECTL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".cluster/bin/kubectl")
        });
    assert!(
        kubectl.exists(),
        "{} is missing: build the local control plane with `make cluster` (or set RULEBOOK_TEST_KUBECTL)",
        kubectl.display()
    );
    let mut child = Command::new(kubectl)
        .args(["apply", "-f", "-", "--kubeconfig"])
        .arg(kubeconfig_path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(object.to_string().as_bytes())
            .expect("write the object");
    }
    let out = child.wait_with_output().expect("kubectl's output");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expr_checks_and_computed_defaults_are_enforced_by_the_api_server() {
    let client = client().await;
    let ns = namespace(&client, "wh-expr").await;
    let h = Hooked::new("expr", "Fail");
    std::fs::write(h.rules.join(format!("{}.yaml", h.rule)), rule(&h)).unwrap();
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    for (name, data) in [
        ("plan-gold", json!({"replicas": "3"})),
        ("platform-defaults", json!({"image": "nginx:1.27"})),
    ] {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": name}, "data": data})).unwrap();
        maps.create(&PostParams::default(), &cm).await.unwrap();
    }
    let token = "dGhlLWFwaS10b2tlbi12YWx1ZQ==";
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let s: Secret = serde_json::from_value(
        json!({"metadata": {"name": "api-token"}, "data": {"token": token}}),
    )
    .unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();

    let port = free_port();
    let _op = h.operator(&ns, port).start().await;
    wait_established(&client, &h.crd_name()).await;
    let parent = |name: &str, plan: &str, tier: &str| {
        json!({"apiVersion": API_VERSION, "kind": h.kind,
            "metadata": {"name": name, "namespace": ns.name()},
            "spec": {"plan": plan, "tier": tier}})
    };
    let parents = h.parents(&client, &ns);
    // The configurations take effect a moment after they are written: a dry run shows
    // when the check is enforced.
    wait_for(
        T,
        "the API server to call the validating webhook",
        || async {
            let probe: kube::api::DynamicObject =
                serde_json::from_value(parent("probe", "missing", "web")).ok()?;
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            match parents.create(&dry, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains("does not exist") => Some(()),
                _ => None,
            }
        },
    )
    .await;

    // A parent whose plan does not exist: refused by kubectl apply, with the message.
    let (ok, stderr) = kubectl_apply(&parent("lost", "missing", "web"));
    assert!(!ok, "kubectl apply succeeded");
    assert!(
        stderr.contains("plan missing does not exist"),
        "kubectl said: {stderr}"
    );
    // The Secret's value the message template printed is redacted.
    assert!(
        !stderr.contains(token),
        "a Secret value in a denial: {stderr}"
    );
    assert!(!stderr.contains("the-api-token-value"), "{stderr}");
    assert!(parents.get_opt("lost").await.unwrap().is_none());

    // A parent whose plan exists: stored, with the image from platform-defaults.
    let (ok, stderr) = kubectl_apply(&parent("app", "gold", "web"));
    assert!(ok, "kubectl apply failed: {stderr}");
    let stored = parents.get("app").await.unwrap();
    assert_eq!(
        stored.data["spec"]["image"], "nginx:1.27",
        "the computed default is stored: {:?}",
        stored.data
    );
    // A value the author gave is kept.
    let mut own = parent("own", "gold", "web");
    own["spec"]["image"] = json!("mine:1");
    let (ok, stderr) = kubectl_apply(&own);
    assert!(ok, "{stderr}");
    assert_eq!(
        parents.get("own").await.unwrap().data["spec"]["image"],
        "mine:1"
    );

    // The tier is immutable: an update that changes it is refused.
    let (ok, stderr) = kubectl_apply(&parent("app", "gold", "db"));
    assert!(!ok, "the tier changed");
    assert!(
        stderr.contains("tier is immutable"),
        "kubectl said: {stderr}"
    );
    assert_eq!(
        parents.get("app").await.unwrap().data["spec"]["tier"],
        "web"
    );
    h.remove_configurations(&client).await;
}
