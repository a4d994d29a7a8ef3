//! `cel:` rules enforced by the API server itself (issue 43), on the local control plane,
//! through `kubectl apply`: a rule that defines its CRD gets its checks in the CRD's
//! `x-kubernetes-validations` (the transition rule "tier is immutable") or, for what a
//! CRD rule cannot read (`self.metadata.namespace`), in a generated
//! ValidatingAdmissionPolicy; its `cel:` default in a MutatingAdmissionPolicy; a rule on
//! a built-in kind (ConfigMap) gets a ValidatingAdmissionPolicy; a rule's policies go
//! when the rule does. Every object is labelled with the test's own selector (`run
//! --selector`), which the bindings carry, so no other test's objects are judged.
// One scenario, read as one story (the cluster's objects carry over between its steps).
#![allow(clippy::too_many_lines)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};

const T: Duration = Duration::from_secs(90);
const GROUP: &str = "cel.rulebook.dev";

/// `kubectl apply -f -` of `yaml` with the kubectl of the local control plane (beside its
/// kubeconfig): stdout, or stderr when it fails.
fn kubectl_apply(yaml: &str) -> Result<String, String> {
    let config = kubeconfig_path();
    let kubectl = config
        .parent()
        .map(|d| d.join("bin/kubectl"))
        .filter(|k| k.exists())
        .unwrap_or_else(|| "kubectl".into());
    let mut child = Command::new(kubectl)
        .env("KUBECONFIG", &config)
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(yaml.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("kubectl output");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into())
    }
}

fn rule_files(dir: &std::path::Path, id: &str) -> (String, String, String) {
    let kind = format!("Cel{id}");
    let app = format!("celapp-{id}");
    let cm = format!("celcm-{id}");
    let rules = dir.join("rules");
    let templates = dir.join("templates/t");
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::create_dir_all(&templates).unwrap();
    std::fs::write(
        rules.join("app.yaml"),
        format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {app}
spec:
  parent:
    apiVersion: {GROUP}/v1
    kind: {kind}
  crd:
    specSchema:
      type: object
      properties:
        replicas: {{type: integer}}
        tier: {{type: string}}
        image: {{type: string}}
  admission:
    validate:
      - cel: "self.spec.replicas <= 10 || self.metadata.namespace.startsWith('prod-')"
        message: "more than 10 replicas only in prod- namespaces"
      - cel: "self.spec.tier == oldSelf.spec.tier"
        message: "tier is immutable"
        fieldPath: spec.tier
    default:
      - path: spec.image
        cel: "'nginx:' + (object.spec.tier == 'gold' ? 'stable' : 'latest')"
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: t/cm.yaml
"#
        ),
    )
    .unwrap();
    std::fs::write(
        rules.join("cm.yaml"),
        format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {cm}
spec:
  parent:
    apiVersion: v1
    kind: ConfigMap
  admission:
    validate:
      - cel: "!has(self.data) || !('mode' in self.data) || self.data.mode in ['fast', 'safe']"
        message: "mode must be fast or safe"
  children: []
"#
        ),
    )
    .unwrap();
    std::fs::write(
        templates.join("cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}-cfg\ndata:\n  image: \"{{ parent.spec.image }}\"\n",
    )
    .unwrap();
    (kind, app, cm)
}

fn policies(client: &kube::Client, kind: &str, plural: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, plural),
    )
}

fn app_yaml(kind: &str, ns: &str, name: &str, id: &str, replicas: i64, tier: &str) -> String {
    format!(
        "apiVersion: {GROUP}/v1\nkind: {kind}\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{celtest: \"{id}\"}}\nspec:\n  replicas: {replicas}\n  tier: {tier}\n"
    )
}

fn cm_yaml(ns: &str, name: &str, id: &str, mode: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{celtest: \"{id}\"}}\ndata:\n  mode: {mode}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cel_rules_are_enforced_by_the_api_server() {
    let client = client().await;
    let dev = namespace(&client, "cel-dev").await;
    let prod = namespace(&client, "prod-cel").await;
    let dir = tempfile::tempdir().unwrap();
    let id: String = unique("c")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let (kind, app, cm) = rule_files(dir.path(), &id);
    let selector = format!("celtest={id}");
    let lease = format!("cel-{id}");
    let _op = Operator::on(&dir.path().join("rules"), &dir.path().join("templates"))
        .flags(&[
            "--install-crds",
            "--selector",
            &selector,
            "--lease-name",
            &lease,
        ])
        .start()
        .await;
    wait_established(&client, &format!("{}s.{GROUP}", kind.to_lowercase())).await;
    let vaps = policies(
        &client,
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
    );
    let maps = policies(
        &client,
        "MutatingAdmissionPolicy",
        "mutatingadmissionpolicies",
    );
    for name in [format!("rulebook-{app}"), format!("rulebook-{cm}")] {
        wait_for(T, &format!("the policy {name}"), || async {
            vaps.get_opt(&name).await.ok().flatten()
        })
        .await;
    }
    let map = maps
        .get(&format!("rulebook-{app}"))
        .await
        .expect("the mutating policy");
    assert_eq!(
        map.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("rulebook.dev/installation")),
        Some(&lease)
    );

    // The namespace rule (a ValidatingAdmissionPolicy): refused outside prod-, with the
    // rule's message. Policies take effect shortly after they are created: wait for it.
    // (Right after its CRD is installed, the mutating policy refuses the kind's writes
    // for a few seconds, until the API server knows the kind's schema.)
    let refusal = wait_for(T, "the namespace rule to refuse", || async {
        let e = kubectl_apply(&app_yaml(&kind, &dev, "big", &id, 30, "gold")).err()?;
        println!("refused: {e}");
        e.contains("more than 10 replicas only in prod- namespaces")
            .then_some(e)
    })
    .await;
    assert!(refusal.contains("ValidatingAdmissionPolicy"), "{refusal}");
    wait_for(
        T,
        "30 replicas in a prod- namespace to be allowed",
        || async { kubectl_apply(&app_yaml(&kind, &prod, "big", &id, 30, "gold")).ok() },
    )
    .await;

    // The cel default (a MutatingAdmissionPolicy) is in the stored object.
    let plural = format!("{}s", kind.to_lowercase());
    let apps = api(&client, Some(&dev), &format!("{GROUP}/v1"), &kind, &plural);
    let stored = wait_for(T, "the defaulted image", || async {
        kubectl_apply(&app_yaml(&kind, &dev, "small", &id, 3, "gold")).ok()?;
        let o = apps.get("small").await.ok()?;
        o.data["spec"]["image"].as_str().map(str::to_string)
    })
    .await;
    assert_eq!(stored, "nginx:stable");

    // The transition rule (in the CRD): the tier cannot change.
    let refusal = kubectl_apply(&app_yaml(&kind, &dev, "small", &id, 3, "silver"))
        .expect_err("changing the tier is refused");
    assert!(refusal.contains("tier is immutable"), "{refusal}");
    kubectl_apply(&app_yaml(&kind, &dev, "small", &id, 4, "gold")).expect("other updates pass");

    // A built-in parent kind: a ValidatingAdmissionPolicy on ConfigMaps of the selector.
    let refusal = wait_for(T, "the ConfigMap rule to refuse", || async {
        let e = kubectl_apply(&cm_yaml(&dev, "bad", &id, "turbo")).err()?;
        e.contains("mode must be fast or safe").then_some(e)
    })
    .await;
    assert!(refusal.contains(&format!("rulebook-{cm}")), "{refusal}");
    kubectl_apply(&cm_yaml(&dev, "good", &id, "fast")).expect("a good mode is allowed");

    // The rule goes: so does its policy, and the ConfigMap is no longer judged.
    std::fs::remove_file(dir.path().join("rules/cm.yaml")).unwrap();
    wait_for(T, "the ConfigMap rule's policy to be deleted", || async {
        vaps.get_opt(&format!("rulebook-{cm}"))
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // The binding is a delete of its own, after the policy's: waited for, not assumed.
    let bindings = policies(
        &client,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
    );
    wait_for(T, "the ConfigMap rule's binding to be deleted", || async {
        bindings
            .get_opt(&format!("rulebook-{cm}"))
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    wait_for(T, "the ConfigMap to be admitted", || async {
        kubectl_apply(&cm_yaml(&dev, "bad", &id, "turbo")).ok()
    })
    .await;

    // Both rules go: no policy of this installation is left.
    std::fs::remove_file(dir.path().join("rules/app.yaml")).unwrap();
    wait_for(
        T,
        "every policy of the installation to be deleted",
        || async {
            let left = vaps.get_opt(&format!("rulebook-{app}")).await.ok()?;
            let left_map = maps.get_opt(&format!("rulebook-{app}")).await.ok()?;
            (left.is_none() && left_map.is_none()).then_some(())
        },
    )
    .await;
}
