//! Where renders run, against the local control plane with `rulebook run` as a child
//! process (`render::slice`, `reconcile::offload`): a straight-line rule's renders of
//! light parents get their first attempt on the async runtime and most stay there; a
//! parent heavier than the slice's input gate goes straight to the blocking pool and is
//! served there all the same; a rule with a loop never gets a first attempt. Counted by
//! `rulebook_renders_offloaded_total{rule}`.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::time::Duration;

use common::*;
use faults_kit::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use serde_json::json;

const T: Duration = Duration::from_secs(120);
const LIGHT: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn light_renders_stay_on_the_runtime_heavy_and_looping_ones_go_to_the_pool() {
    let test = "light_renders_stay_on_the_runtime_heavy_and_looping_ones_go_to_the_pool";
    let client = client().await;
    let ns = namespace(&client, "render-slice").await;
    let d = RuleDir::new();
    // Straight-line: interpolations, `~`, a filter.
    d.template(
        "plain.yaml",
        &configmap_template(
            "plain",
            "  v: {{ (parent.spec.blob ~ \"!\") | length | string }}\n",
        ),
    );
    d.rule(
        "plain.yaml",
        &rule_text(
            "sliceplain",
            "SlicePlain",
            &[child("out", "v1", "ConfigMap", "plain.yaml", &[])],
        ),
    );
    // The same with a loop.
    d.template(
        "looped.yaml",
        &configmap_template(
            "looped",
            "  v: \"{% for c in parent.spec.blob %}{% endfor %}{{ parent.spec.blob | length }}\"\n",
        ),
    );
    d.rule(
        "looped.yaml",
        &rule_text(
            "slicelooped",
            "SliceLooped",
            &[child("out", "v1", "ConfigMap", "looped.yaml", &[])],
        ),
    );
    // The straight-line rule again, for the heavy parent alone: its counter then counts
    // that parent's evaluations and nothing else.
    d.rule(
        "heavy.yaml",
        &rule_text(
            "sliceheavy",
            "SliceHeavy",
            &[child("out", "v1", "ConfigMap", "plain.yaml", &[])],
        ),
    );
    let op = d.start_in(&ns).await;
    let plain = kind_api(&client, &ns, "SlicePlain", T).await;
    let heavy_kind = kind_api(&client, &ns, "SliceHeavy", T).await;
    let looped = kind_api(&client, &ns, "SliceLooped", T).await;
    let offloaded = |rule: &str| format!("rulebook_renders_offloaded_total{{rule=\"{rule}\"}}");

    // Light parents of both rules: each parent costs a render and a status evaluation
    // at least.
    for i in 0..LIGHT {
        let spec = json!({"blob": "a"});
        put(
            &plain,
            &parent("SlicePlain", &ns, &format!("p{i}"), spec.clone()),
        )
        .await;
        put(&looped, &parent("SliceLooped", &ns, &format!("l{i}"), spec)).await;
    }
    for i in 0..LIGHT {
        wait_ready(&plain, &format!("p{i}"), "True", None, T).await;
        wait_ready(&looped, &format!("l{i}"), "True", None, T).await;
    }
    let plain_light = op.metric(&offloaded("sliceplain")).await;
    let looped_light = op.metric(&offloaded("slicelooped")).await;
    eprintln!(
        "{test}: to the pool for {LIGHT} light parents: straight-line rule {plain_light}, \
         rule with a loop {looped_light}"
    );
    // The slice is wall-clock time: a busy machine may preempt an attempt mid-render and
    // send it to the pool, so "most", not "none".
    assert!(
        plain_light < LIGHT as f64,
        "{test}: {plain_light} renders of {LIGHT} light parents of a straight-line rule went to the pool"
    );
    assert!(
        looped_light >= 2.0 * LIGHT as f64,
        "{test}: a rule with a loop gets no first attempt: {looped_light} renders of {LIGHT} \
         parents (a render and a status each) went to the pool"
    );

    // A parent heavier than the gate (64 KiB), the only one of its rule: its render and
    // status go straight to the pool, and it is served.
    let blob = "x".repeat(100 << 10);
    put(
        &heavy_kind,
        &parent("SliceHeavy", &ns, "heavy", json!({"blob": blob})),
    )
    .await;
    let heavy = wait_ready(&heavy_kind, "heavy", "True", None, T).await;
    let moved = op.metric(&offloaded("sliceheavy")).await;
    eprintln!("{test}: the heavy parent sent {moved} evaluations to the pool");
    assert!(
        moved >= 2.0,
        "{test}: the heavy parent's render and status went to the pool: {moved}"
    );
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm = cms
        .get("heavy-plain")
        .await
        .expect("the heavy parent's child");
    let v = cm.data.as_ref().and_then(|d| d.get("v")).cloned();
    assert_eq!(
        v.as_deref(),
        Some(&*((100 << 10) + 1).to_string()),
        "{test}: the heavy parent's child, rendered on the pool ({heavy})"
    );
    drop(op);
}
