//! Pause (SIGSTOP) and resume, optionally with every watch expired (410 Gone) meanwhile:
//! the operator must relist and miss no change made while it was stopped.

use super::*;

// ---------------------------------------------------------------------------------------
// Pause (SIGSTOP) and resume, optionally with a forced "410 Gone" on every watch.

/// How the operator's watches are interrupted while it is stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gap {
    /// SIGSTOP/SIGCONT only; enough writes to the watched objects meanwhile that the API
    /// server may drop the stalled watches, which then resume from their last
    /// resourceVersion (still in the watch cache).
    Pause,
    /// SIGSTOP, then restart the API server (its watch caches start over, so every older
    /// resourceVersion is "too old": 410 Gone), make the changes, then SIGCONT.
    Expired,
}

/// The rules of [`pause_resume`] for `kind` (also what installs its CRD early,
/// tests/faults_heavy.rs `heavy_kinds_of_the_tests_run_alone_installed_early`).
pub fn pause_rules(kind: &str) -> RuleDir {
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[child("config", "v1", "ConfigMap", "pause/config.yaml", &[])],
        ),
    );
    d.template(
        "pause/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d
}

/// Pause/resume: changes made while the operator is stopped must all be reconciled.
pub async fn pause_resume(kind: &str, gap: Gap) {
    const N: usize = 25;
    let test = format!("pause_resume({kind}, {gap:?})");
    let client = client().await;
    let ns = namespace(&client, "faults-pause").await;
    let rule = kind.to_lowercase();
    let d = pause_rules(kind);
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let mut names: BTreeSet<String> = (0..N).map(|i| format!("p{i}")).collect();
    put_all(
        &parents,
        names
            .iter()
            .map(|n| parent(kind, &ns, n, json!({"rev": 0})))
            .collect(),
        8,
    )
    .await;
    wait_all_ready(&parents, &names, Duration::from_secs(180)).await;
    // A lookalike ConfigMap (the rule's labels, no owner) that the writes below hammer:
    // its events go down the operator's child watch.
    let filler = to_json(
        &put(
            &cms,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "filler", "namespace": ns, "labels": {
                    "app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule}},
                "data": {"n": "0"}}),
        )
        .await,
    );
    let before: BTreeMap<String, String> = list(&cms, None)
        .await
        .iter()
        .map(|o| (name_of(o), uid_of(o)))
        .collect();
    let rv0 = retry("list", || async {
        cms.list(&ListParams::default().limit(1)).await
    })
    .await
    .metadata
    .resource_version
    .unwrap_or_default();

    // Three parents are deleted during the pause: the collector must have seen them to
    // remove their children.
    gc_watches(
        &client,
        &parent(kind, &ns, "x", json!({"rev": 0})),
        &plural(kind),
    )
    .await;
    signal(op.pid(), "STOP");
    let paused = Instant::now();
    let log_before = std::fs::read_to_string(&op.log).unwrap_or_default().len();
    if gap == Gap::Expired {
        let took = cluster_sh("restart-apiserver").await;
        println!(
            "{test}: API server restarted in {:.1} s",
            took.as_secs_f64()
        );
        // Proof that the resourceVersion the operator holds is gone: a watch from the
        // resourceVersion of just before the pause is refused with 410.
        let code = wait_for(
            Duration::from_secs(60),
            "a watch from the old resourceVersion to answer",
            || async {
                let mut s = cms
                    .watch(&WatchParams::default().timeout(5), &rv0)
                    .await
                    .ok()?
                    .boxed();
                match s.next().await {
                    Some(Ok(WatchEvent::Error(e))) if e.code == 429 || e.code >= 500 => None,
                    Some(Ok(WatchEvent::Error(e))) => Some(e.code),
                    Some(Ok(_)) => Some(200),
                    _ => None,
                }
            },
        )
        .await;
        assert_eq!(
            code, 410,
            "a watch from resourceVersion {rv0} is expired after the restart"
        );
        println!("{test}: a watch from resourceVersion {rv0} now answers 410 Gone");
    }

    // 300 writes of 64 KiB each down the stalled child watch (~19 MB: more than the
    // connection buffers hold), so that the API server gives up on the stalled watcher.
    let terminated0 = terminated_watchers(&client).await.unwrap_or(0.0);
    let blob = "x".repeat(64 << 10);
    for i in 1..=300 {
        merge(
            &cms,
            "filler",
            json!({"data": {"n": i.to_string(), "blob": blob}}),
        )
        .await;
    }
    if gap == Gap::Pause {
        // The point of the scenario: the operator's ConfigMap watch is dropped while it is
        // stopped. The changes below come after the drop, so they can reach the operator
        // only through the watch it re-establishes after SIGCONT.
        let dropped = poll_for(Duration::from_secs(30), || async {
            let now = terminated_watchers(&client).await?;
            (now > terminated0).then_some(now - terminated0)
        })
        .await;
        let Some(dropped) = dropped else {
            panic!(
                "{test}: the API server did not drop the stalled ConfigMap watcher \
                 (apiserver_terminated_watchers_total{{resource=\"configmaps\"}} is {:?}, was \
                 {terminated0} before 300 writes of 64 KiB): the scenario tests nothing",
                terminated_watchers(&client).await
            )
        };
        println!(
            "{test}: the API server dropped {dropped} stalled ConfigMap watcher(s) {:.1} s into the pause",
            paused.elapsed().as_secs_f64()
        );
    }

    // The changes, while the operator is stopped.
    let spec_changed: Vec<String> = (0..5).map(|i| format!("p{i}")).collect();
    let child_deleted: Vec<String> = (5..10).map(|i| format!("p{i}")).collect();
    let child_edited: Vec<String> = (10..15).map(|i| format!("p{i}")).collect();
    let parent_deleted: Vec<String> = (15..18).map(|i| format!("p{i}")).collect();
    let created: Vec<String> = (N..N + 5).map(|i| format!("p{i}")).collect();
    for p in &spec_changed {
        put(&parents, &parent(kind, &ns, p, json!({"rev": 1}))).await;
    }
    for p in &child_deleted {
        remove(&cms, &format!("{p}-config")).await;
    }
    for p in &child_edited {
        merge(
            &cms,
            &format!("{p}-config"),
            json!({"data": {"rev": "vandalised"}}),
        )
        .await;
    }
    for p in &parent_deleted {
        remove(&parents, p).await;
        names.remove(p);
    }
    for p in &created {
        put(&parents, &parent(kind, &ns, p, json!({"rev": 0}))).await;
        names.insert(p.clone());
    }
    println!(
        "{test}: operator stopped for {:.1} s: 300 writes of 64 KiB, then 5 specs changed, 5 children were deleted, 5 edited, 3 parents deleted, 5 created",
        paused.elapsed().as_secs_f64()
    );
    signal(op.pid(), "CONT");
    let resumed = Instant::now();

    let t = Duration::from_secs(120);
    let problems = |names: BTreeSet<String>| {
        let cms = cms.clone();
        let parents = parents.clone();
        let before = before.clone();
        let spec_changed = spec_changed.clone();
        let child_deleted = child_deleted.clone();
        async move {
            let mut bad = Vec::new();
            for p in &names {
                let Some(o) = parents.get_opt(p).await.ok().flatten() else {
                    bad.push(format!("{p}: parent missing"));
                    continue;
                };
                if !is_ready(&to_json(&o)) {
                    bad.push(format!("{p}: not Ready"));
                }
                match cms.get_opt(&format!("{p}-config")).await.ok().flatten() {
                    None => bad.push(format!(
                        "{p}-config: missing (parent {p}: {:?})",
                        ready_condition(&to_json(&o))
                    )),
                    Some(c) => {
                        let c = to_json(&c);
                        let want = if spec_changed.contains(p) { "1" } else { "0" };
                        if c["data"]["rev"] != want {
                            bad.push(format!("{p}-config: rev {}", c["data"]["rev"]));
                        }
                        if child_deleted.contains(p)
                            && before.get(&format!("{p}-config")) == Some(&uid_of(&c))
                        {
                            bad.push(format!("{p}-config: not recreated"));
                        }
                    }
                }
            }
            bad
        }
    };
    let start = Instant::now();
    loop {
        let bad = problems(names.clone()).await;
        if bad.is_empty() {
            break;
        }
        if start.elapsed() > t {
            let log = std::fs::read_to_string(&op.log).unwrap_or_default();
            panic!(
                "{test}: changes made while the operator was stopped are not all reconciled {t:?} after SIGCONT: {bad:?}\n--- operator log since the pause ---\n{}",
                log.get(log_before..).unwrap_or("")
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!(
        "{test}: every change made while stopped reconciled {:.1} s after SIGCONT",
        resumed.elapsed().as_secs_f64()
    );
    // The children of deleted parents go (garbage collector), the lookalike stays untouched
    // by the operator (only our 300 writes changed it).
    for p in &parent_deleted {
        let name = format!("{p}-config");
        wait_for(t, &format!("{name} to be garbage-collected"), || async {
            cms.get_opt(&name).await.ok()?.is_none().then_some(())
        })
        .await;
    }
    let f = get_json(&cms, "filler").await.expect("filler");
    assert_eq!(f["data"]["n"], "300");
    assert_eq!(uid_of(&f), uid_of(&filler));
    assert!(
        f["metadata"]["ownerReferences"].is_null(),
        "the lookalike was taken over: {}",
        f["metadata"]
    );
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    let since = log.get(log_before..).unwrap_or("");
    let expired = since
        .lines()
        .filter(|l| {
            l.contains("watch error")
                && (l.contains("410")
                    || l.contains("too old")
                    || l.contains("Expired")
                    || l.contains("expired"))
        })
        .count();
    println!("{test}: the operator logged {expired} expired-watch (410) error(s) after SIGCONT");
    if gap == Gap::Expired {
        assert!(
            expired > 0,
            "{test}: the operator never saw a 410 although its resourceVersions were expired:\n{since}"
        );
    }
    let h = op.get("/healthz").await;
    assert_eq!(h.trim(), "ok");
}
