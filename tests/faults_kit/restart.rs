//! A control-plane component (the API server or etcd) restarted while parents converge: the
//! operator rides it out and converges.

use super::*;

// ---------------------------------------------------------------------------------------
// A control-plane component restarted mid-convergence.

pub async fn restart_mid_convergence(kind: &str, component: &str, n: usize) {
    let test = format!("restart_mid_convergence({component})");
    let client = client().await;
    let ns = namespace(&client, "faults-restart").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "r/config.yaml", &[]),
                child("secret", "v1", "Secret", "r/secret.yaml", &[]),
            ],
        ),
    );
    d.template(
        "r/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d.template(
        "r/secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\ndata:\n  rev: {{ parent.spec.rev | string | b64encode }}\n",
    );
    let op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds", "--concurrency", "8"])
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let names: BTreeSet<String> = (0..n).map(|i| format!("p{i}")).collect();
    let writer = {
        let parents = parents.clone();
        let objs: Vec<Json> = names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"rev": 0})))
            .collect();
        tokio::spawn(async move { put_all(&parents, objs, 8).await })
    };
    // Restart once convergence is under way.
    let ready_then = wait_for(
        Duration::from_secs(180),
        "some parents to be Ready",
        || async {
            let r = count_ready(&parents).await;
            (r >= n / 5).then_some(r)
        },
    )
    .await;
    let took = cluster_sh(&format!("restart-{component}")).await;
    println!(
        "{test}: {component} restarted in {:.1} s with {ready_then}/{n} parents Ready",
        took.as_secs_f64()
    );
    writer.await.unwrap();
    // Changes after the restart reach the operator through its new watches.
    let bumped: Vec<Json> = names
        .iter()
        .take(n / 2)
        .map(|p| parent(kind, &ns, p, json!({"rev": 1})))
        .collect();
    put_all(&parents, bumped, 8).await;
    let after = Instant::now();
    wait_all_ready(&parents, &names, Duration::from_secs(300)).await;
    wait_for(
        Duration::from_secs(120),
        "every child at its parent's rev",
        || async {
            let all = cms
                .list(&ListParams::default().labels(&format!("rulebook.dev/rule={rule}")))
                .await
                .ok()?;
            let bumped: BTreeSet<String> = names.iter().take(n / 2).cloned().collect();
            let good = all
                .items
                .iter()
                .map(to_json)
                .filter(|c| {
                    let p = name_of(c).trim_end_matches("-config").to_string();
                    let want = if bumped.contains(&p) { "1" } else { "0" };
                    c["data"]["rev"] == want
                })
                .count();
            (good == n).then_some(())
        },
    )
    .await;
    // A hand edit after the restart is repaired: the child watch is live again.
    let victim = format!("{}-config", names.iter().next().unwrap());
    merge(&cms, &victim, json!({"data": {"rev": "x"}})).await;
    wait_for(
        Duration::from_secs(60),
        "the edit to be repaired",
        || async {
            let c = to_json(&cms.get_opt(&victim).await.ok()??);
            (c["data"]["rev"] != "x").then_some(())
        },
    )
    .await;
    let s = status(&op).await;
    println!(
        "{test}: all {n} parents Ready for their generation {:.1} s after the post-restart changes; rule state {}",
        after.elapsed().as_secs_f64(),
        s["rules"][&rule]
    );
    assert_eq!(s["rules"][&rule]["state"], "running");
}
