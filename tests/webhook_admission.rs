//! The API server calls the admission webhook Rulebook serves (issue 43), on the local
//! control plane: a rule with an `expr:` check gets a generated
//! ValidatingWebhookConfiguration (scoped to its kind, `caBundle` from Rulebook's CA,
//! the settings docs/reference/webhooks.md promises), a create of its kind is refused
//! with the webhook's answer, `/readyz` says the server serves, and the configuration
//! goes when the rule does.

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod webhook_kit;

use base64::Engine as _;
use common::*;
use kube::api::PostParams;
use serde_json::json;
use webhook_kit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_calls_the_webhook_rulebook_serves() {
    let client = client().await;
    let ns = namespace(&client, "wh-adm").await;
    let h = Hooked::new("adm", "Fail");
    let port = free_port();
    let op = h.operator(&ns, port).start().await;
    wait_established(&client, &h.crd_name()).await;

    let config = h.wait_configuration(&client).await;
    let hook = &config["webhooks"][0];
    assert_eq!(
        config["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "rulebook"
    );
    assert_eq!(hook["name"], format!("{}.rules.rulebook.dev", h.rule));
    assert_eq!(
        hook["clientConfig"]["url"],
        format!("https://127.0.0.1:{port}/validate/{}", h.rule)
    );
    assert_eq!(
        hook["rules"],
        json!([{
            "apiGroups": [GROUP], "apiVersions": ["v1"], "resources": [h.plural],
            "operations": ["CREATE", "UPDATE"], "scope": "Namespaced",
        }])
    );
    for (key, want) in [
        ("failurePolicy", json!("Fail")),
        ("timeoutSeconds", json!(5)),
        ("sideEffects", json!("None")),
        ("matchPolicy", json!("Equivalent")),
        ("admissionReviewVersions", json!(["v1"])),
    ] {
        assert_eq!(hook[key], want, "{key}");
    }
    let excluded = &hook["namespaceSelector"]["matchExpressions"];
    assert_eq!(excluded[0]["operator"], "NotIn");
    assert!(
        excluded[0]["values"]
            .as_array()
            .unwrap()
            .contains(&json!("kube-system"))
    );
    assert_eq!(
        excluded[1]["values"],
        json!([ns.name()]),
        "run --namespace keeps to it"
    );
    // The caBundle is the CA in the Secret every replica reads.
    let ca = base64::engine::general_purpose::STANDARD
        .decode(hook["clientConfig"]["caBundle"].as_str().unwrap())
        .unwrap();
    let data = secret_data(&client, &ns, &h.name)
        .await
        .expect("the certificates' Secret");
    assert_eq!(String::from_utf8(ca).unwrap(), data["ca-bundle.crt"]);
    wait_for(T, "/readyz", || async {
        (op.get_opt("/readyz").await? == "ok").then_some(())
    })
    .await;

    // The API server calls the webhook and passes its refusal on.
    let message = h.wait_enforced(&client, &ns).await;
    println!("refused: {message}");
    let parents = h.parents(&client, &ns);
    let refused = parents
        .create(&PostParams::default(), &h.parent("big", 5))
        .await;
    match refused {
        Err(kube::Error::Api(s)) => {
            assert!(is_refusal(&s.message), "{}", s.message);
            assert!(s.message.contains("denied the request"), "{}", s.message);
        }
        other => panic!("the create was not refused by the webhook: {other:?}"),
    }
    assert!(
        parents.get_opt("big").await.unwrap().is_none(),
        "nothing stored"
    );
    let answered = op
        .metric(r#"rulebook_webhook_requests_total{route="validate",code="200"}"#)
        .await;
    assert!(answered >= 2.0, "reviews counted: {answered}");
    let expiry = op
        .metric("rulebook_webhook_certificate_expiry_seconds")
        .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        expiry > now + 80.0 * 86400.0,
        "a 90-day certificate: {expiry}"
    );

    // The rule goes: so does its webhook, and creates are no longer judged.
    std::fs::remove_file(h.rules.join(format!("{}.yaml", h.rule))).unwrap();
    let configs = h.validating(&client);
    wait_for(
        T,
        "the configuration to be deleted with its rule",
        || async { configs.get_opt(&h.name).await.ok()?.is_none().then_some(()) },
    )
    .await;
    wait_for(T, "creates to be no longer judged", || async {
        parents
            .create(&PostParams::default(), &h.parent("after", 5))
            .await
            .ok()
    })
    .await;
    h.remove_configurations(&client).await;
}
