//! Poison parents (templates that fail to render) beside healthy ones: the failing ones
//! back off and write nothing new, the healthy ones converge.

use super::*;

// ---------------------------------------------------------------------------------------
// Poison parents.

pub struct PoisonReport {
    pub alone: Duration,
    pub with_poison: Duration,
    pub settled: Duration,
    pub reconciles_per_poison_in_30s: f64,
    pub writes_per_poison_in_30s: f64,
}

pub async fn poison(kind: &str, poisoned: usize, healthy: usize) -> PoisonReport {
    let test = format!("poison({poisoned} poison + {healthy} healthy)");
    let client = client().await;
    let ns = namespace(&client, "faults-poison").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[child(
                "config",
                "v1",
                "ConfigMap",
                "poison/config.yaml",
                &[],
            )],
        ),
    );
    d.template(
        "poison/config.yaml",
        &configmap_template(
            "config",
            "  ok: \"yes\"\n{% if parent.spec.poison %}\n  broken: {{ parent.spec.missing.field }}\n{% endif %}\n",
        ),
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let t = Duration::from_secs(600);
    let batch = |prefix: &str, n: usize, poison: bool| -> (BTreeSet<String>, Vec<Json>) {
        let names: BTreeSet<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let objs = names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"poison": poison})))
            .collect();
        (names, objs)
    };

    // 1. Healthy parents alone.
    let (h1, objs) = batch("alone-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h1, t).await;
    let alone = start.elapsed();

    // 2. The poison, then the same number of healthy parents right behind it.
    let (pn, objs) = batch("poison-", poisoned, true);
    put_all(&parents, objs, 16).await;
    let (h2, objs) = batch("beside-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h2, t).await;
    let with_poison = start.elapsed();

    // 3. Every poison parent reports RenderFailed, naming the template line.
    wait_for(t, "every poison parent to report RenderFailed", || async {
        let items = parents.list(&ListParams::default()).await.ok()?;
        let failed = items
            .items
            .iter()
            .map(to_json)
            .filter(|o| {
                pn.contains(&name_of(o))
                    && ready_condition(o).is_some_and(|(s, r, m)| {
                        s == "False" && r == "RenderFailed" && m.contains("poison/config.yaml:")
                    })
            })
            .count();
        (failed == pn.len()).then_some(())
    })
    .await;

    // 4. They back off: reconciles and writes over 30 s, once the events of the first
    // round are sent (the outbox sends them in the background, later on a busy machine).
    wait_for(t, "the first round's events to be sent", || async {
        (op.metric("rulebook_events_unsent").await == 0.0).then_some(())
    })
    .await;
    let series = format!("rulebook_reconciles_total{{rule=\"{rule}\",result=\"render_failed\"}}");
    let writes =
        |verb: &str| format!("rulebook_api_writes_total{{rule=\"{rule}\",verb=\"{verb}\"}}");
    let (apply_status, event) = (writes("apply_status"), writes("event"));
    let [r0, a0, e0] = op
        .metrics_when_idle(
            &rule,
            [series.as_str(), apply_status.as_str(), event.as_str()],
        )
        .await;
    // The series counts what the per-parent figure below divides: every poison parent has
    // reported RenderFailed, so each failed a reconcile at least once.
    assert!(
        r0 >= poisoned as f64,
        "{series} is {r0} although {poisoned} parents report RenderFailed"
    );
    let w0 = a0 + e0;
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await; // the measuring window
    let r1 = op.metric(&series).await;
    let w1 = op.metric(&writes("apply_status")).await + op.metric(&writes("event")).await;
    let secs = window.elapsed().as_secs_f64();
    let per = (r1 - r0) / poisoned as f64;
    let wper = (w1 - w0) / poisoned as f64;

    // 5. Healthy parents once the poison has settled into its backoff.
    let (h3, objs) = batch("settled-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h3, t).await;
    let settled = start.elapsed();

    println!(
        "{test}: {healthy} healthy parents converge in {:.2} s alone, {:.2} s right behind {poisoned} poison parents (×{:.2}), {:.2} s once the poison backs off (×{:.2})",
        alone.as_secs_f64(),
        with_poison.as_secs_f64(),
        with_poison.as_secs_f64() / alone.as_secs_f64(),
        settled.as_secs_f64(),
        settled.as_secs_f64() / alone.as_secs_f64()
    );
    println!(
        "{test}: over {secs:.1} s after the first round: {} render_failed reconciles ({per:.2} per poison parent), {} status/event writes ({wper:.3} per poison parent)",
        r1 - r0,
        w1 - w0
    );
    // A render error is retried after 16 s, 32 s, ...: at most 2 retries fit in any 30 s
    // window (3 counting one reconcile from a change); a hot loop would make hundreds.
    assert!(
        per <= 3.0,
        "poison parents do not back off: {per:.2} reconciles each in {secs:.0} s"
    );
    // Same error, same status: nothing new to write.
    assert!(
        wper <= 0.1,
        "failing parents keep writing status/events: {wper:.3} writes each in {secs:.0} s"
    );
    // No timing claims: the healthy parents converging at all (the waits above) is the check.
    let h = op.get("/healthz").await;
    assert_eq!(h.trim(), "ok");
    PoisonReport {
        alone,
        with_poison,
        settled,
        reconciles_per_poison_in_30s: per,
        writes_per_poison_in_30s: wper,
    }
}
