//! What happens when no Rulebook process serves webhooks (issue 43), on the local control
//! plane: two rules with `expr:` checks, one `failurePolicy: Fail`, one `Ignore`, each
//! served by its own operator. Both processes are killed (SIGKILL): a create of the
//! `Fail` kind is refused with an error that names the webhook and why it could not be
//! called, a create of the `Ignore` kind is stored unchecked; no parent or child made
//! before is lost; started again, the operators serve again (the webhook judges creates)
//! and reconcile what was stored meanwhile.

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod webhook_kit;

use common::*;
use kube::api::{Api, PostParams};
use webhook_kit::*;

/// Installs the rule's CRD (as `rulebook crds` prints it) so that parents can be made
/// before any webhook exists.
/// Installs `h`'s CRD and waits until the kind is served in `ns`: `Established` comes a
/// moment before the API server routes the new resource (a create right after it was
/// answered 404 under a loaded `make test`).
async fn install_crd(client: &kube::Client, h: &Hooked, ns: &str) {
    let rules = h.rules.to_str().unwrap();
    let templates = h.templates.to_str().unwrap();
    let crds = yaml_objects(&rulebook(&[
        "crds",
        "--rules",
        rules,
        "--templates",
        templates,
    ]));
    apply_all(client, &crds).await;
    wait_established(client, &h.crd_name()).await;
    let parents = h.parents(client, ns);
    wait_for(T, "the kind to be served", || async {
        parents.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
}

async fn child_exists(cms: &Api<k8s_openapi::api::core::v1::ConfigMap>, name: &str) -> Option<()> {
    cms.get_opt(name).await.ok()?.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_every_webhook_server_fails_creates_per_failure_policy_and_loses_nothing() {
    let client = client().await;
    let ns = namespace(&client, "wh-down").await;
    let fail = Hooked::new("fail", "Fail");
    let ignore = Hooked::new("ign", "Ignore");
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client.clone(), &ns);
    let mut kept = Vec::new();
    for (h, prefix) in [(&fail, "f"), (&ignore, "i")] {
        install_crd(&client, h, &ns).await;
        for n in 0..2 {
            let name = format!("{prefix}-kept-{n}");
            h.parents(&client, &ns)
                .create(&PostParams::default(), &h.parent(&name, 1))
                .await
                .unwrap();
            kept.push((h, name));
        }
    }
    let (pf, pi) = (free_port(), free_port());
    let mut ops = vec![
        fail.operator(&ns, pf).start().await,
        ignore.operator(&ns, pi).start().await,
    ];
    for h in [&fail, &ignore] {
        h.wait_configuration(&client).await;
        h.wait_enforced(&client, &ns).await;
    }
    for (_, name) in &kept {
        wait_for(T, &format!("the child of {name}"), || {
            child_exists(&cms, name)
        })
        .await;
    }

    for op in &mut ops {
        op.signal_and_wait("KILL");
    }
    // Fail: refused, with the reason the webhook could not be called.
    let refusal = match fail
        .parents(&client, &ns)
        .create(&PostParams::default(), &fail.parent("f-down", 1))
        .await
    {
        Err(kube::Error::Api(s)) => s.message,
        other => panic!("a create under failurePolicy Fail was not refused: {other:?}"),
    };
    println!("failurePolicy Fail, no webhook server: {refusal}");
    assert!(refusal.contains("failed calling webhook"), "{refusal}");
    assert!(
        refusal.contains(&format!("{}.rules.rulebook.dev", fail.rule)),
        "{refusal}"
    );
    assert!(refusal.contains("connection refused"), "{refusal}");
    // Ignore: stored unchecked.
    ignore
        .parents(&client, &ns)
        .create(&PostParams::default(), &ignore.parent("i-down", 1))
        .await
        .expect("a create under failurePolicy Ignore is stored");
    // Nothing made before is lost.
    for (h, name) in &kept {
        assert!(
            h.parents(&client, &ns)
                .get_opt(name)
                .await
                .unwrap()
                .is_some(),
            "{name} lost"
        );
        assert!(
            child_exists(&cms, name).await.is_some(),
            "the child of {name} lost"
        );
    }

    // Started again: the webhooks judge again, and what was stored meanwhile reconciles.
    let _ops = [
        fail.operator(&ns, pf).start().await,
        ignore.operator(&ns, pi).start().await,
    ];
    for h in [&fail, &ignore] {
        h.wait_enforced(&client, &ns).await;
    }
    wait_for(T, "the child of i-down", || child_exists(&cms, "i-down")).await;
    assert!(
        fail.parents(&client, &ns)
            .get_opt("f-down")
            .await
            .unwrap()
            .is_none()
    );
    for h in [&fail, &ignore] {
        h.remove_configurations(&client).await;
    }
}
