//! The webhook's certificates on the local control plane (issue 43): they rotate while
//! the API server keeps calling, without one failed request, through a whole CA rotation,
//! each step confirmed by the replica (its record in the Secret), with the `caBundle` of
//! the webhook configuration and of a versioned rule's CRD conversion following it; and
//! replicas started together agree on one CA and serve certificates the `caBundle`
//! trusts.
//!
//! The rotation runs with lifetimes short enough for a test (`--webhook-cert-validity
//! 24s --webhook-ca-validity 60s --webhook-refresh 1s`): a serving certificate every
//! 16 s, a new CA at 40 s, trusted beside the old one until the old one leaves at 56 s
//! (each step at least 3 × refresh + 5 s = 8 s after the one before, once confirmed).

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod webhook_kit;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use kube::api::PostParams;
use webhook_kit::*;

/// What the API server answered creates while the certificates rotated.
#[derive(Default)]
struct Outcomes {
    /// The webhook answered (refused with the rule's message).
    answered: u64,
    /// Anything else: the webhook could not be called (TLS, connection).
    failed: Vec<String>,
}

/// How many CAs a `caBundle` held: the most at once, and the last time it was read.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    most: usize,
    last: usize,
}

impl Held {
    fn saw(&mut self, base64_pem: &str) {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(base64_pem)
            .unwrap_or_default();
        let n = ders(&String::from_utf8_lossy(&pem)).len();
        self.most = self.most.max(n);
        self.last = n;
    }

    /// Two CAs were trusted together, and one is left.
    fn rotated(self) -> bool {
        self.most == 2 && self.last == 1
    }
}

/// What the Secret, the configuration and the CRD were seen to hold.
#[derive(Default)]
struct Seen {
    serving: BTreeSet<String>,
    cas: BTreeSet<String>,
    /// The webhook configuration's `caBundle`.
    configuration: Held,
    /// The versioned rule's CRD's `spec.conversion.webhook.clientConfig.caBundle`.
    crd: Held,
    /// Rotation phases whose step the replica confirmed in the Secret.
    confirmed: BTreeSet<String>,
}

/// A second rule, beside the hooked one, whose CRD has two versions and conversion
/// templates: the operator writes its CA bundle into the CRD's conversion.
fn add_versioned_rule(h: &Hooked) -> String {
    let kind = format!("{}v", h.kind);
    let plural = format!("{}s", kind.to_lowercase());
    let rule = format!(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {name}-v
spec:
  parent:
    apiVersion: {API_VERSION}
    kind: {kind}
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: hooked/config.yaml
  crd:
    plural: {plural}
    versions:
      - name: v1
        storage: true
        specSchema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
      - name: v1alpha1
        specSchema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
    conversion:
      - {{ from: v1alpha1, to: v1, template: hooked/same.yaml }}
      - {{ from: v1, to: v1alpha1, template: hooked/same.yaml }}
"#,
        name = h.rule,
    );
    std::fs::write(h.rules.join(format!("{}-v.yaml", h.rule)), rule).unwrap();
    std::fs::write(
        h.templates.join("hooked/same.yaml"),
        "spec:\n  replicas: {{ object.spec.replicas }}\n",
    )
    .unwrap();
    format!("{plural}.{GROUP}")
}

/// The rotation phases the replicas' confirmations in the Secret were written in (a
/// record is an annotation `rulebook.dev/webhook-replica-<id>`; the phase is the Secret's).
async fn confirmed_phases(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(client.clone(), ns);
    let Ok(Some(s)) = secrets.get_opt(name).await else {
        return Vec::new();
    };
    let ann = s.metadata.annotations.unwrap_or_default();
    let phase = ann
        .get("rulebook.dev/webhook-rotation")
        .cloned()
        .unwrap_or_default();
    ann.keys()
        .filter(|k| k.starts_with("rulebook.dev/webhook-replica-"))
        .map(|_| phase.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_continuous_creates_without_a_failed_request() {
    let client = client().await;
    let ns = namespace(&client, "wh-rot").await;
    let h = Hooked::new("rot", "Fail");
    let versioned = add_versioned_rule(&h);
    let port = free_port();
    let _op = h
        .operator(&ns, port)
        .flags(&[
            "--webhook-refresh",
            "1s",
            "--webhook-cert-validity",
            "24s",
            "--webhook-ca-validity",
            "60s",
        ])
        .start()
        .await;
    wait_established(&client, &h.crd_name()).await;
    wait_established(&client, &versioned).await;
    h.wait_configuration(&client).await;
    h.wait_enforced(&client, &ns).await;
    let crds = api(
        &client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );

    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..2 {
        let (parents, outcomes, done) = (h.parents(&client, &ns), outcomes.clone(), done.clone());
        let parent = h.parent(&format!("load-{c}"), 5);
        clients.push(tokio::spawn(async move {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                // ~40 a second per client: continuous, without crowding the shared API server.
                tokio::time::sleep(Duration::from_millis(25)).await;
                let r = parents.create(&dry, &parent).await;
                let mut o = outcomes.lock().unwrap();
                match r {
                    Err(kube::Error::Api(s)) if is_refusal(&s.message) => o.answered += 1,
                    Err(e) => o.failed.push(e.to_string()),
                    Ok(_) => o
                        .failed
                        .push("allowed without the webhook's refusal".into()),
                }
            }
        }));
    }

    // Watch the Secret and the configuration until a whole CA rotation is over.
    let started = Instant::now();
    let mut seen = Seen::default();
    let configs = h.validating(&client);
    let first_ca = secret_data(&client, &ns, &h.name).await.expect("Secret")["ca.crt"].clone();
    while started.elapsed() < Duration::from_secs(150) {
        if let Some(d) = secret_data(&client, &ns, &h.name).await {
            seen.serving.insert(d["tls.crt"].clone());
            seen.cas.insert(d["ca.crt"].clone());
        }
        if let Some(c) = configs.get_opt(&h.name).await.ok().flatten() {
            let c = to_json(&c);
            let ca = c["webhooks"][0]["clientConfig"]["caBundle"].as_str();
            seen.configuration.saw(ca.unwrap_or(""));
        }
        if let Some(c) = crds.get_opt(&versioned).await.ok().flatten() {
            let c = to_json(&c);
            let ca = c.pointer("/spec/conversion/webhook/clientConfig/caBundle");
            seen.crd.saw(ca.and_then(|v| v.as_str()).unwrap_or(""));
        }
        for phase in confirmed_phases(&client, &ns, &h.name).await {
            seen.confirmed.insert(phase);
        }
        let rotated = seen.cas.len() >= 2 && seen.configuration.rotated() && seen.crd.rotated();
        if rotated && seen.serving.len() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }
    let o = std::mem::take(&mut *outcomes.lock().unwrap());
    println!(
        "{:.0} s: {} creates answered by the webhook, {} failed; {} serving certificates, {} CAs, \
         caBundle held up to {} CAs (configuration), {} (CRD); steps confirmed: {:?}",
        started.elapsed().as_secs_f64(),
        o.answered,
        o.failed.len(),
        seen.serving.len(),
        seen.cas.len(),
        seen.configuration.most,
        seen.crd.most,
        seen.confirmed,
    );
    assert!(
        o.failed.is_empty(),
        "requests failed: {:?}",
        &o.failed[..o.failed.len().min(5)]
    );
    assert!(o.answered >= 100, "too few creates to tell: {}", o.answered);
    assert!(
        seen.cas.len() >= 2 && !seen.cas.iter().all(|c| c == &first_ca),
        "the CA rotated"
    );
    assert_eq!(
        seen.configuration.most, 2,
        "old and new CA trusted together during the rotation"
    );
    assert_eq!(seen.configuration.last, 1, "the old CA left the caBundle");
    assert_eq!(
        seen.crd, seen.configuration,
        "the CRD's conversion caBundle followed the rotation as the configuration's did"
    );
    let end = secret_data(&client, &ns, &h.name).await.expect("Secret");
    let crd = to_json(&crds.get(&versioned).await.expect("the versioned CRD"));
    let crd_ca = crd["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"]
        .as_str()
        .unwrap_or("");
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(crd_ca)
            .unwrap_or_default(),
        end["ca-bundle.crt"].as_bytes(),
        "the CRD trusts the Secret's bundle"
    );
    assert!(
        seen.confirmed.contains("Adding") && seen.confirmed.contains("Dropping"),
        "the replica confirmed each rotation step: {:?}",
        seen.confirmed
    );
    assert!(
        seen.serving.len() >= 4,
        "serving certificates: {}",
        seen.serving.len()
    );
    h.remove_configurations(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_ca_and_serve_what_the_ca_bundle_trusts() {
    let client = client().await;
    let ns = namespace(&client, "wh-two").await;
    let h = Hooked::new("two", "Fail");
    let lease = [
        "--leader-elect",
        "--lease-namespace",
        ns.name(),
        "--lease-name",
        &h.name,
    ];
    let (pa, pb) = (free_port(), free_port());
    // Started together: both find no Secret and race to create it.
    let (a, b) = tokio::join!(
        h.operator(&ns, pa).flags(&lease).start(),
        h.operator(&ns, pb).flags(&lease).start()
    );
    for op in [&a, &b] {
        wait_for(T, "both replicas ready", || async {
            op.get_opt("/readyz").await?.starts_with("ok").then_some(())
        })
        .await;
    }
    let data = secret_data(&client, &ns, &h.name)
        .await
        .expect("the Secret");
    assert_eq!(ders(&data["ca-bundle.crt"]).len(), 1, "one CA");
    let created: usize = [&a, &b]
        .iter()
        .map(|op| {
            std::fs::read_to_string(&op.log)
                .unwrap_or_default()
                .matches("new CA and serving certificate")
                .count()
        })
        .sum();
    assert_eq!(created, 1, "exactly one replica created the CA");
    let serving = ders(&data["tls.crt"]);
    for port in [pa, pb] {
        let cert = handshake(port, &data["ca-bundle.crt"])
            .await
            .unwrap_or_else(|e| panic!("replica on {port}: {e}"));
        assert_eq!(
            cert, serving[0],
            "replica on {port} serves the shared certificate"
        );
    }
    // The leader's configuration trusts that CA.
    let config = h.wait_configuration(&client).await;
    let ca = base64::engine::general_purpose::STANDARD
        .decode(
            config["webhooks"][0]["clientConfig"]["caBundle"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(String::from_utf8(ca).unwrap(), data["ca-bundle.crt"]);
    // A client trusting another CA is refused: the handshake checks the chain.
    let other = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    assert!(handshake(pa, &other.cert.pem()).await.is_err());
    h.remove_configurations(&client).await;
}
