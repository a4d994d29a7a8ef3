//! Secret values stay out of what Rulebook tells people, against the local control
//! plane: a value that only a Secret child about to be written holds (no cache has it)
//! and that the API server quotes in its refusal of another child must not reach the
//! parent's `Ready` condition, its Warning Event or the operator's log.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::time::Duration;

use common::*;
use faults_kit::*;
use kube::api::{Api, ListParams};
use serde_json::json;

const T: Duration = Duration::from_secs(120);

/// The parent's token, upper-cased by the templates: the value itself is in no object
/// Rulebook reads, only in the Secret child it renders.
const TOKEN: &str = "s3cret-token-4711";
const SECRET: &str = "S3CRET-TOKEN-4711";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_childs_value_quoted_by_the_api_server_is_redacted() {
    let test = "a_secret_childs_value_quoted_by_the_api_server_is_redacted";
    let client = client().await;
    let ns = namespace(&client, "secrets").await;
    let kind = "SecretQuote";
    let d = RuleDir::new();
    // The Service comes first and is refused ("spec.type: Unsupported value: ..."), so
    // the Secret is never written and no cache holds its value.
    d.rule(
        "quote.yaml",
        &rule_text(
            "secretquote",
            kind,
            &[
                child("svc", "v1", "Service", "quote/svc.yaml", &[]),
                child("creds", "v1", "Secret", "quote/creds.yaml", &[]),
            ],
        ),
    );
    d.template(
        "quote/svc.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {{ parent.metadata.name ~ \"-svc\" }}\n\
         spec:\n  type: {{ parent.spec.token | upper }}\n  ports:\n    - port: 80\n",
    );
    d.template(
        "quote/creds.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-creds\" }}\n\
         stringData:\n  token: {{ parent.spec.token | upper }}\n",
    );
    // Everything Rulebook logs, and kube's client as far as the filter lets it.
    let op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds"])
        .kubeconfig(&kubeconfig_path())
        .logging("debug,[rule]=trace,tower=info,hyper=info,hyper_util=info,rustls=info")
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, T).await;
    put(&parents, &parent(kind, &ns, "app", json!({"token": TOKEN}))).await;

    let (status, reason, message) = wait_for(T, "Ready=False on app", || async {
        let o = get_json(&parents, "app").await?;
        ready_condition(&o).filter(|(s, _, _)| s == "False")
    })
    .await;
    // Every Warning Event about the parent, once the one for this failure is there.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    let notes = wait_for(T, "the Warning event on app", || async {
        let notes: Vec<String> = events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|e| e.type_.as_deref() == Some("Warning"))
            .filter_map(|e| e.note)
            .collect();
        (!notes.is_empty()).then_some(notes)
    })
    .await;
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    eprintln!("{test}: Ready={status} {reason}: {message}");
    for n in &notes {
        eprintln!("{test}: Warning event: {n}");
    }
    assert_eq!(reason, "ApplyFailed", "{test}: {message}");
    // The API server did quote the value (else this test shows nothing).
    assert!(
        message.contains("[redacted]"),
        "{test}: the refusal should quote the type, redacted: {message}"
    );
    assert!(!message.contains(SECRET), "{test}: condition: {message}");
    for n in &notes {
        assert!(!n.contains(SECRET), "{test}: event: {n}");
    }
    assert!(
        !log.contains(SECRET),
        "{test}: the operator's log quotes the value"
    );
}
