//! Hostile objects against the admission webhooks, on the local control plane (issue 43):
//! a tenant creating objects with a megabyte string, and objects nested deeper than the
//! webhook reads, several at once, gets each answered within the API server's timeout
//! (the big ones judged and defaulted, the deep ones refused by the webhook's answer —
//! the rule's `failurePolicy` is `Ignore`, so a failed call would store them unchecked);
//! meanwhile another tenant's creates of the same kind, in another namespace, go through,
//! each well within the timeout. Timings are printed as measurements.

mod common;
mod webhook_kit;

use std::time::{Duration, Instant};

use common::*;
use kube::api::{DynamicObject, PostParams};
use serde_json::{Value as Json, json};
use webhook_kit::*;

/// The API server's webhook timeout (`timeoutSeconds` of the generated configurations).
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// A check on the replicas (the kit's refusal), a check reading the whole object, and a
/// default computed from its biggest field.
fn rule(h: &Hooked) -> String {
    h.rule_yaml(
        "",
        r#"    failurePolicy: Ignore
    validate:
      - expr: "(parent.spec.replicas | default(1)) <= 3"
        message: "replicas {{ parent.spec.replicas }} is more than 3"
      - expr: "(parent | tojson | length) < 4000000"
        message: "the object is too big to judge"
    default:
      - path: spec.size
        expr: "parent.spec.blob | default('') | length"
"#,
    )
}

fn parent(h: &Hooked, name: &str, spec: Json) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": API_VERSION, "kind": h.kind,
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("parent")
}

/// `{"d": {"d": … {"replicas": 1} … }}`, `depth` levels.
fn nested(depth: usize) -> Json {
    let mut v = json!({"replicas": 1});
    for _ in 0..depth {
        v = json!({ "d": v });
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_objects_are_answered_in_time_and_do_not_delay_another_tenant() {
    let client = client().await;
    let hostile_ns = namespace(&client, "wh-hostile").await;
    let other_ns = namespace(&client, "wh-other").await;
    let h = Hooked::new("hostile", "Ignore");
    std::fs::write(h.rules.join(format!("{}.yaml", h.rule)), rule(&h)).unwrap();
    let port = free_port();
    // Every namespace: the two tenants' objects go to the same webhooks.
    let _op = Operator::on(&h.rules, &h.templates)
        .flags(&h.flags(&hostile_ns, port))
        .start()
        .await;
    wait_established(&client, &h.crd_name()).await;
    h.wait_enforced(&client, &hostile_ns).await;
    let hostile = h.parents(&client, &hostile_ns);
    let other = h.parents(&client, &other_ns);

    // The hostile tenant: four objects with a megabyte string, two nested 200 deep, at
    // once.
    let blob = "x".repeat(1_000_000);
    let mut attacks = Vec::new();
    for i in 0..6 {
        let spec = if i < 4 {
            json!({"replicas": 1, "blob": blob})
        } else {
            nested(200)
        };
        let (api, o) = (hostile.clone(), parent(&h, &format!("big-{i}"), spec));
        attacks.push(tokio::spawn(async move {
            let started = Instant::now();
            let out = api.create(&PostParams::default(), &o).await;
            (
                started.elapsed(),
                out.map(|_| ()).map_err(|e| e.to_string()),
            )
        }));
    }
    // Meanwhile, the other tenant creates, one after another.
    let mut latencies = Vec::new();
    for i in 0..5 {
        let o = parent(&h, &format!("small-{i}"), json!({"replicas": 2}));
        let started = Instant::now();
        let out = other.create(&PostParams::default(), &o).await;
        let took = started.elapsed();
        assert!(
            out.is_ok(),
            "the other tenant's create {i} failed after {took:?}: {out:?}"
        );
        latencies.push(took);
    }
    let mut answered = Vec::new();
    for a in attacks {
        answered.push(a.await.expect("create task"));
    }
    println!("other tenant's creates during the attack: {latencies:?}");
    println!(
        "hostile creates answered in: {:?}",
        answered.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    for (took, out) in &answered {
        if let Err(e) = out {
            println!(
                "refused after {took:?}: {}",
                e.chars().take(300).collect::<String>()
            );
        }
    }

    for (i, took) in latencies.iter().enumerate() {
        assert!(
            *took < WEBHOOK_TIMEOUT,
            "the other tenant's create {i} took {took:?}"
        );
    }
    // A create passes two webhooks (mutating, then validating), each within the timeout.
    for (i, (took, out)) in answered.iter().enumerate() {
        assert!(
            *took < 2 * WEBHOOK_TIMEOUT + Duration::from_secs(2),
            "create big-{i} took {took:?}"
        );
        if i < 4 {
            assert!(
                out.is_ok(),
                "big-{i} (a megabyte string) was refused: {out:?}"
            );
        } else {
            // Refused by the webhook's answer, not a failed call: with `Ignore`, a failed
            // call would store it unchecked.
            let e = out.as_ref().err().cloned().unwrap_or_default();
            assert!(
                e.contains("the object cannot be judged"),
                "big-{i} (nested 200 deep): {out:?}"
            );
        }
    }
    // The big ones were judged and defaulted, not let through: their computed size is
    // stored; the deep ones are not stored.
    for i in 0..4 {
        let stored = hostile.get(&format!("big-{i}")).await.unwrap();
        assert_eq!(stored.data["spec"]["size"], 1_000_000, "big-{i}");
    }
    for i in 4..6 {
        assert!(
            hostile
                .get_opt(&format!("big-{i}"))
                .await
                .unwrap()
                .is_none()
        );
    }
    // And the small ones got their default too.
    assert_eq!(other.get("small-0").await.unwrap().data["spec"]["size"], 0);
    h.remove_configurations(&client).await;
}
