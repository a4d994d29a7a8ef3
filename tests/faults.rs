//! Fault and abuse tests against the local control plane, with `rulebook run` as a child
//! process (light variants; they run beside the other tests of `make test`). The heavy
//! variants — 200 parents killed ten times, 500 poison parents, API server and etcd
//! restarts, a forced 410 Gone — are in `tests/faults_heavy.rs` (`make test` runs them one
//! at a time, or `make test-faults` alone). What each test does and the figures of the last runs:
//! docs/faults.md.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use kube::api::{Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(180);

// ---------------------------------------------------------------------------------------
// Process and control-plane faults.

/// A restart on a converged namespace changes nothing: no Ready parent turns
/// not-Ready (its children all exist), and none is left so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_ready_parents_ready() {
    const N: usize = 80;
    let client = client().await;
    let ns = namespace(&client, "faults-restart").await;
    let kind = "RestartParent";
    let d = RuleDir::new();
    d.rule(
        "restart.yaml",
        &rule_text(
            "restartparent",
            kind,
            &[
                child("config", "v1", "ConfigMap", "r/config.yaml", &[]),
                child("secret", "v1", "Secret", "r/secret.yaml", &[]),
            ],
        ),
    );
    d.template(
        "r/config.yaml",
        &configmap_template("config", "  a: \"b\"\n"),
    );
    d.template(
        "r/secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\ndata:\n  a: \"Yg==\"\n",
    );
    let args = ["--install-crds"];
    let mut op = d.operator().namespace(&ns).flags(&args).start().await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let names: BTreeSet<String> = (0..N).map(|i| format!("p{i}")).collect();
    put_all(
        &parents,
        names
            .iter()
            .map(|n| parent(kind, &ns, n, json!({})))
            .collect(),
        16,
    )
    .await;
    wait_all_ready(&parents, &names, T).await;
    let writes = "rulebook_api_writes_total{rule=\"restartparent\",verb=\"apply\"}";
    for round in 1..=2 {
        op.signal_and_wait("KILL");
        op = d.operator().namespace(&ns).flags(&args).start().await;
        // Watch the parents for 15 s after the restart (the measuring window).
        let mut flipped = BTreeSet::new();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            for o in list(&parents, None).await {
                if !is_ready(&o) {
                    flipped.insert(format!("{} {:?}", name_of(&o), ready_condition(&o)));
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let stuck: Vec<String> = list(&parents, None)
            .await
            .iter()
            .filter(|o| !is_ready(o))
            .map(|o| format!("{} {:?}", name_of(o), ready_condition(o)))
            .collect();
        // The series is there from the rule's start: 0 means counted and none.
        let applies = op.metric(writes).await;
        println!(
            "restart {round}: {} of {N} Ready parents turned not-Ready after the restart, {} still are after 15 s; {applies} applies",
            flipped.len(),
            stuck.len()
        );
        // Which of the stuck parents have lost a child (then not-Ready would be right, and
        // the bug is the lost child).
        let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
        let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
        let mut missing = Vec::new();
        for s in &stuck {
            let p = s.split(' ').next().unwrap_or_default();
            for (a, child) in [
                (&cms, format!("{p}-config")),
                (&secrets, format!("{p}-secret")),
            ] {
                if get_json(a, &child).await.is_none() {
                    missing.push(child);
                }
            }
        }
        assert!(
            stuck.is_empty() && flipped.is_empty(),
            "after restart {round}: parents left not Ready {stuck:?} (children missing: {missing:?}); \
             Ready parents reported not-Ready meanwhile {flipped:?}"
        );
        assert_eq!(applies, 0.0, "a restart re-applies nothing");
    }
}

/// SIGSTOP, changes of every sort, SIGCONT: every change is reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_made_while_paused_are_reconciled() {
    pause_resume("PauseLight", Gap::Pause).await;
}

// ---------------------------------------------------------------------------------------
// A fight over a field.

/// Another client rewrites a field Rulebook manages every 200 ms for 40 s. Rulebook
/// repairs a few times, then backs off (bounded applies), reports Conflict naming the
/// other field manager, and keeps serving the rule's other parents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fight_is_bounded_and_reported() {
    let client = client().await;
    let ns = namespace(&client, "faults-fight").await;
    let kind = "FightParent";
    let rule = "fightparent";
    let d = RuleDir::new();
    d.rule(
        "fight.yaml",
        &rule_text(
            rule,
            kind,
            &[child("config", "v1", "ConfigMap", "fight/config.yaml", &[])],
        ),
    );
    d.template(
        "fight/config.yaml",
        &configmap_template("config", "  mode: \"rulebook\"\n"),
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let names: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    for n in &names {
        put(&parents, &parent(kind, &ns, n, json!({}))).await;
    }
    wait_all_ready(&parents, &names, T).await;

    let writes =
        |verb: &str| format!("rulebook_api_writes_total{{rule=\"{rule}\",verb=\"{verb}\"}}");
    let (a0, s0, e0) = (
        op.metric(&writes("apply")).await,
        op.metric(&writes("apply_status")).await,
        op.metric(&writes("event")).await,
    );
    const FIGHT: Duration = Duration::from_secs(40);
    let done = Arc::new(AtomicBool::new(false));
    let fighter_writes = Arc::new(AtomicU64::new(0));
    let fighter = {
        let cms = cms.clone();
        let done = done.clone();
        let count = fighter_writes.clone();
        tokio::spawn(async move {
            let pp = PatchParams {
                field_manager: Some("fault-fighter".into()),
                ..PatchParams::default()
            };
            let start = Instant::now();
            let mut i = 0u64;
            while start.elapsed() < FIGHT {
                i += 1;
                let body = json!({"data": {"mode": format!("fighter-{i}")}});
                if cms
                    .patch("a-config", &pp, &Patch::Merge(&body))
                    .await
                    .is_ok()
                {
                    count.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let fight_start = Instant::now();

    // The fought parent reports the conflict and who it is with.
    let a = wait_for(FIGHT, "a to report Conflict", || async {
        let o = to_json(&parents.get_opt("a").await.ok()??);
        let (s, r, _) = ready_condition(&o)?;
        (s == "False" && r == "Conflict").then_some(o)
    })
    .await;
    let (_, _, message) = ready_condition(&a).unwrap();
    println!(
        "fight: Conflict after {:.1} s: {message}",
        fight_start.elapsed().as_secs_f64()
    );
    assert!(
        message.contains("fault-fighter") && message.contains("a-config"),
        "the message names the object and the other field manager: {message}"
    );

    // Meanwhile the rule's other parents are served: a hand edit of b's child is repaired promptly.
    let vandal = PatchParams {
        field_manager: Some("vandal".into()),
        ..PatchParams::default()
    };
    cms.patch(
        "b-config",
        &vandal,
        &Patch::Merge(json!({"data": {"mode": "vandalised"}})),
    )
    .await
    .unwrap();
    let edited = Instant::now();
    wait_for(
        Duration::from_secs(15),
        "b-config to be repaired during the fight",
        || async {
            let c = to_json(&cms.get_opt("b-config").await.ok()??);
            (c["data"]["mode"] == "rulebook").then_some(())
        },
    )
    .await;
    let repair = edited.elapsed();
    for n in ["b", "c"] {
        let o = to_json(&parents.get_opt(n).await.unwrap().unwrap());
        assert!(
            is_ready(&o),
            "{n} stays Ready during the fight: {:?}",
            ready_condition(&o)
        );
    }

    fighter.await.unwrap();
    let window = fight_start.elapsed();
    let (a1, s1, e1) = (
        op.metric(&writes("apply")).await,
        op.metric(&writes("apply_status")).await,
        op.metric(&writes("event")).await,
    );
    let applies = a1 - a0 - 1.0; // less b's one repair
    println!(
        "fight: over {:.1} s the other client wrote a-config {} times; Rulebook applied it {applies} times (plus 1 repair of b-config, {:.2} s after the edit); {} status writes and {} events for the rule",
        window.as_secs_f64(),
        fighter_writes.load(Ordering::SeqCst),
        repair.as_secs_f64(),
        s1 - s0,
        e1 - e0
    );
    // 3 repairs per 60 s, the 4th starts a 16 s backoff, then 32 s: 8 applies in 40 s.
    assert!(
        applies <= 10.0,
        "Rulebook hot-loops against the other client: {applies} applies in {window:?}"
    );
    assert!(applies >= 3.0, "Rulebook did repair a few times: {applies}");
    // Status and events are written when the message changes; bounded too.
    assert!(
        s1 - s0 <= 2.0 * window.as_secs_f64(),
        "status writes during the fight: {}",
        s1 - s0
    );

    // Once the other client stops, the backoff runs out and the child is repaired: the
    // 32 s backoff started about 17 s into the fight, so it ends about 10 s after it; 60 s
    // is generous.
    let stopped = Instant::now();
    let a = loop {
        let c = get_json(&cms, "a-config").await.unwrap();
        let p = get_json(&parents, "a").await.unwrap();
        if c["data"]["mode"] == "rulebook" && is_ready(&p) {
            break p;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(60),
            "a-config not repaired 60 s after the other client stopped: data.mode {}, parent a {:?}",
            c["data"]["mode"],
            ready_condition(&p)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!(
        "fight: a-config repaired and a Ready {:.1} s after the other client stopped ({:?})",
        stopped.elapsed().as_secs_f64(),
        ready_condition(&a)
    );
}

// ---------------------------------------------------------------------------------------
// A CRD deleted under a running rule.

/// Two rules in one operator; one rule's CRD is deleted: that rule reports it, the other
/// keeps working; the CRD and its parents recreated, they are reconciled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_crd_stops_only_its_rule() {
    let client = client().await;
    let ns = namespace(&client, "faults-crd").await;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 100_000_000;
    let doomed = format!("FaultDoomed{}x{stamp}", std::process::id());
    let survivor = "FaultSurvivor";
    let (dr, sr) = (doomed.to_lowercase(), survivor.to_lowercase());
    let crds = crds_api(&client);
    for k in [doomed.as_str(), survivor] {
        put(&crds, &crd(k)).await;
    }
    let d = RuleDir::new();
    for (r, k) in [(&dr, doomed.as_str()), (&sr, survivor)] {
        d.rule(
            &format!("{r}.yaml"),
            &rule_text(
                r,
                k,
                &[child(
                    "config",
                    "v1",
                    "ConfigMap",
                    &format!("{r}/config.yaml"),
                    &[],
                )],
            ),
        );
        d.template(
            &format!("{r}/config.yaml"),
            &configmap_template("config", "  v: {{ parent.spec.v | default(0) | string }}\n"),
        );
    }
    // No --install-crds: the operator must not put the CRD back itself.
    let op = d.operator().namespace(&ns).start().await;
    let dp = kind_api(&client, &ns, &doomed, T).await;
    let sp = kind_api(&client, &ns, survivor, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let dn: BTreeSet<String> = ["d1", "d2"].iter().map(|s| s.to_string()).collect();
    for n in &dn {
        put(&dp, &parent(&doomed, &ns, n, json!({"v": 1}))).await;
    }
    put(&sp, &parent(survivor, &ns, "s1", json!({"v": 1}))).await;
    wait_all_ready(&dp, &dn, T).await;
    wait_ready(&sp, "s1", "True", None, T).await;

    // Delete the CRD, and with it every Doomed object. Their children are the garbage
    // collector's: it removes them if it handles the parents' deletion before the kind
    // leaves its REST mapping, and otherwise only after the CRD is back (it cannot look
    // up an owner of a kind that does not exist). So the test does not wait for it.
    let old_uids: BTreeSet<String> = {
        let mut u = BTreeSet::new();
        for n in &dn {
            u.insert(uid_of(&get_json(&dp, n).await.unwrap()));
        }
        u
    };
    let crd_name = format!("{}.{GROUP}", plural(&doomed));
    remove(&crds, &crd_name).await;
    wait_for(T, "the CRD to be gone", || async {
        crds.get_opt(&crd_name).await.ok()?.is_none().then_some(())
    })
    .await;
    // The rule's controller keeps running and its parent watch keeps failing: /status
    // shows the watch error with the API server's 404 for the deleted kind.
    let last = std::sync::Mutex::new(Json::Null);
    let reported = poll_for(T, || async {
        let r = status(&op).await["rules"][&dr].clone();
        *last.lock().unwrap() = r.clone();
        let message = r["message"].as_str().unwrap_or_default();
        (r["state"] == "running" && message.starts_with("watch error: ") && message.contains("404"))
            .then_some(r)
    })
    .await;
    let Some(reported) = reported else {
        panic!(
            "the doomed rule did not report the 404 of its deleted kind on /status within {T:?}; \
             last seen: {}",
            last.lock().unwrap()
        )
    };
    println!("crd deleted: /status reports {reported}");

    // The other rule runs on.
    put(&sp, &parent(survivor, &ns, "s2", json!({"v": 2}))).await;
    wait_ready(&sp, "s2", "True", None, T).await;
    cms.patch(
        "s1-config",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "x"}})),
    )
    .await
    .unwrap();
    wait_for(T, "s1-config to be repaired", || async {
        let c = to_json(&cms.get_opt("s1-config").await.ok()??);
        (c["data"]["v"] == "1").then_some(())
    })
    .await;
    assert_eq!(status(&op).await["rules"][&sr]["state"], "running");

    // Recreated: the CRD, then new parents, are reconciled.
    put(&crds, &crd(&doomed)).await;
    let dp = kind_api(&client, &ns, &doomed, T).await;
    let dn2: BTreeSet<String> = ["d3", "d4"].iter().map(|s| s.to_string()).collect();
    for n in &dn2 {
        put(&dp, &parent(&doomed, &ns, n, json!({"v": 3}))).await;
    }
    let back = Instant::now();
    wait_all_ready(&dp, &dn2, T).await;
    for n in &dn2 {
        let p = get_json(&dp, n).await.unwrap();
        let c = get_json(&cms, &format!("{n}-config")).await.expect("child");
        assert_eq!(c["data"]["v"], "3");
        assert_eq!(c["metadata"]["ownerReferences"][0]["uid"], uid_of(&p));
    }
    // The old parents' children, where the collector has not removed them yet, are
    // left as they were: still owned by the deleted parents, never re-applied.
    for n in &dn {
        if let Some(c) = get_json(&cms, &format!("{n}-config")).await {
            let owner = c["metadata"]["ownerReferences"][0]["uid"]
                .as_str()
                .unwrap_or("");
            assert!(old_uids.contains(owner), "{n}-config: owner {owner}");
            assert_eq!(c["data"]["v"], "1", "{n}-config was rewritten");
        }
    }
    println!(
        "crd recreated: parents reconciled {:.1} s after they were recreated",
        back.elapsed().as_secs_f64()
    );
    let after = wait_for(
        T,
        "the doomed rule to run again without an error",
        || async {
            let s = status(&op).await;
            let r = s["rules"][&dr].clone();
            (r["state"] == "running" && r["message"].is_null()).then_some(r)
        },
    )
    .await;
    println!("crd recreated: /status reports {after}");
    remove(&crds, &crd_name).await;
}

// ---------------------------------------------------------------------------------------
// Hostile input and tenancy.

/// A few dozen hostile strings, each in a parent's spec, rendered into a ConfigMap's
/// data and an annotation through the real API server.
fn hostile_values() -> Vec<String> {
    let mut v: Vec<String> = [
        "line one\nline two",
        "trailing newline\n",
        "---",
        "a\n---\nkind: Secret\nmetadata: {name: stolen}",
        "...",
        "--- !!python/object/apply:os.system ['id']",
        "key: value",
        "a: b\nc: d",
        "  nested: deeper\n  more: x",
        "- item",
        "{a: 1}",
        "{\"a\": 1}",
        "[1, 2, 3]",
        "[",
        "}",
        "? complex key\n: value",
        "&a anchored",
        "*a",
        "<<: *a",
        "!!binary aGVsbG8=",
        "!custom value",
        "%YAML 1.2",
        "'single quoted'",
        "\"double quoted\"",
        "say \"hi\"",
        "back\\slash",
        "\\n \\t \\u0041 \\",
        "# a comment",
        "value # trailing comment",
        "|\n  literal block",
        ">-\n  folded block",
        "",
        " ",
        "\ttab",
        "a\rb",
        "\r\n",
        "nul\0byte",
        "\u{1b}[31mred\u{1b}[0m",
        "\u{7f} DEL",
        "\u{85} NEL",
        "\u{80}\u{81}\u{9f} C1 controls",
        "LS\u{2028}inside",
        "PS\u{2029}inside",
        "\u{feff}BOM first",
        "\u{202e}RTL override\u{202c}",
        "\u{fffe}\u{ffff} non-characters",
        "emoji 😀 and astral 𝄞",
        "{{ 7*7 }}",
        "{% raw %}{{ x }}{% endraw %}",
        "{# comment #}",
        "${HOME} $(id) `id`",
        "0x10",
        "1e3",
        ".nan",
        "yes",
        "off",
        "null",
        "~",
        "2026-01-01T00:00:00Z",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push("x: y\n".repeat(2000)); // 8 KB of structure
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_values_round_trip_through_the_api_server() {
    let client = client().await;
    let ns = namespace(&client, "faults-inject").await;
    let kind = "InjectParent";
    let d = RuleDir::new();
    d.rule(
        "inject.yaml",
        &rule_text(
            "injectparent",
            kind,
            &[child("cm", "v1", "ConfigMap", "inject/cm.yaml", &[])],
        )
        // and a status field echoing the value
        .replace(
            "  crd:",
            "  status:\n    echo: \"$.parent.spec.value\"\n  crd:",
        ),
    );
    d.template(
        "inject/cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-cm\" }}\n  annotations:\n    faults.rulebook.dev/payload: {{ parent.spec.value }}\ndata:\n  value: {{ parent.spec.value }}\n  fixed: \"constant\"\n",
    );
    let _op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds", "--concurrency", "8"])
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let values = hostile_values();
    let mut names = BTreeSet::new();
    for (i, v) in values.iter().enumerate() {
        let name = format!("inject-{i}");
        // Created with a JSON POST: a server-side apply body is read as YAML by the API
        // server, which refuses some of these characters (DEL, NEL, ...) outright.
        create(&parents, &parent(kind, &ns, &name, json!({"value": v}))).await;
        names.insert(name);
    }
    // Every parent gets a verdict (Ready True or False) for its generation; a parent
    // whose status cannot be written gets none, hence the bounded wait.
    let start = Instant::now();
    let verdicts: Vec<Json> = loop {
        let items: Vec<Json> = list(&parents, None).await;
        let done = items
            .iter()
            .filter(|o| {
                ready_condition(o).is_some()
                    && o.pointer("/metadata/generation") == o.pointer("/status/observedGeneration")
            })
            .count();
        if done == names.len() || start.elapsed() > Duration::from_secs(60) {
            break items;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (mut refused, mut altered) = (Vec::new(), Vec::new());
    for o in &verdicts {
        let i: usize = name_of(o).trim_start_matches("inject-").parse().unwrap();
        let v = &values[i];
        match ready_condition(o) {
            None => refused.push(format!(
                "{v:?} → no status at all after 60 s (the status write is refused too)"
            )),
            Some((s, r, m)) if s != "True" => refused.push(format!("{v:?} → {r}: {m}")),
            Some(_) => {
                if o["status"]["echo"].as_str() != Some(v.as_str()) {
                    altered.push(format!(
                        "{v:?} came back in status.echo as {}",
                        o["status"]["echo"]
                    ));
                }
            }
        }
    }

    let labels: BTreeSet<&str> = [
        "app.kubernetes.io/managed-by",
        "rulebook.dev/child",
        "rulebook.dev/owner",
        "rulebook.dev/rule",
    ]
    .into();
    let annotations: BTreeSet<&str> =
        ["faults.rulebook.dev/payload", "rulebook.dev/desired-hash"].into();
    let keys = |o: &Json| -> BTreeSet<String> {
        o.as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    // Structure: the keys of data, labels and annotations; value: the payload itself.
    let mut changed = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let Some(c) = get_json(&cms, &format!("inject-{i}-cm")).await else {
            continue; // counted in `refused`
        };
        let m = &c["metadata"];
        let mut problems = Vec::new();
        if keys(&c["data"]) != BTreeSet::from(["fixed".to_string(), "value".to_string()]) {
            problems.push(format!("data keys {:?}", keys(&c["data"])));
        }
        if c["data"]["fixed"] != "constant" {
            problems.push("data.fixed".into());
        }
        if keys(&m["labels"]) != labels.iter().map(|s| s.to_string()).collect() {
            problems.push(format!("labels {:?}", keys(&m["labels"])));
        }
        if keys(&m["annotations"]) != annotations.iter().map(|s| s.to_string()).collect() {
            problems.push(format!("annotations {:?}", keys(&m["annotations"])));
        }
        if !problems.is_empty() {
            changed.push(format!("{v:?}: {problems:?}"));
        }
        let (value, note) = (
            c["data"]["value"].as_str(),
            m["annotations"]["faults.rulebook.dev/payload"].as_str(),
        );
        if value != Some(v.as_str()) || note != Some(v.as_str()) {
            let p = get_json(&parents, &format!("inject-{i}")).await.unwrap();
            altered.push(format!(
                "{v:?} came back as data.value {value:?}, annotation {note:?} (the parent holds it {})",
                if p["spec"]["value"].as_str() == Some(v.as_str()) { "intact" } else { "altered" }
            ));
        }
    }
    // Nothing else appeared: exactly one ConfigMap per parent.
    let children = list(&cms, Some("rulebook.dev/rule=injectparent")).await;
    println!(
        "injection (API server): {} of {} payloads changed structure; {} came back altered; {} not delivered; {} children for {} parents",
        changed.len(),
        values.len(),
        altered
            .iter()
            .filter_map(|l| l.split(" came back").next())
            .collect::<BTreeSet<_>>()
            .len(),
        refused.len(),
        children.len(),
        values.len()
    );
    for line in altered.iter().chain(&refused) {
        println!("injection (API server):   {line}");
    }
    assert!(
        changed.is_empty(),
        "payloads that changed structure: {changed:#?}"
    );
    assert!(
        altered.is_empty() && refused.is_empty(),
        "payloads that did not round-trip: altered {altered:#?}, not delivered {refused:#?}"
    );
    assert_eq!(children.len(), values.len() - refused.len());
}

/// A child cannot be put in another namespace, neither with `metadata.namespace` nor
/// with a name that smuggles a path or a query into the request URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_cannot_leave_its_namespace() {
    let client = client().await;
    let ns = namespace(&client, "faults-tenant").await;
    let other = namespace(&client, "faults-other").await;
    let kind = "EscapeParent";
    let d = RuleDir::new();
    d.rule(
        "escape.yaml",
        &rule_text(
            "escapeparent",
            kind,
            &[child("cm", "v1", "ConfigMap", "escape/cm.yaml", &[])],
        ),
    );
    d.template(
        "escape/cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.spec.name }}\n  namespace: {{ parent.spec.target }}\ndata:\n  owner: {{ parent.metadata.name }}\n",
    );
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let other_cms = api(&client, Some(&other), "v1", "ConfigMap", "configmaps");
    let mut victims = Vec::new();
    for (a, n) in [(&cms, &ns), (&other_cms, &other)] {
        let v = put(
            a,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "victim", "namespace": n}, "data": {"owner": "victim"}}),
        )
        .await;
        victims.push((a.clone(), rv_of(&to_json(&v))));
    }
    let _op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cases: Vec<(&str, String, String)> = vec![
        ("good", "good-cm".into(), ns.to_string()),
        ("to-other", "escaped-cm".into(), other.to_string()),
        (
            "dotdot",
            format!("../../{other}/configmaps/victim"),
            ns.to_string(),
        ),
        (
            "dotdot2",
            format!("..%2F..%2F{other}%2Fconfigmaps%2Fvictim"),
            ns.to_string(),
        ),
        ("subresource", "victim/status".into(), ns.to_string()),
        ("query", "victim?dryRun=All&x=".into(), ns.to_string()),
        ("fragment", "new-cm#frag".into(), ns.to_string()),
    ];
    for (p, name, target) in &cases {
        put(
            &parents,
            &parent(kind, &ns, p, json!({"name": name, "target": target})),
        )
        .await;
    }
    wait_ready(&parents, "good", "True", None, T).await;
    let escaped = wait_ready(&parents, "to-other", "False", Some("RenderFailed"), T).await;
    let (_, _, m) = ready_condition(&escaped).unwrap();
    println!("namespace escape: to-other → RenderFailed: {m}");
    assert!(
        m.contains(other.as_str()) && m.contains(ns.as_str()),
        "the message names both namespaces: {m}"
    );
    for (p, name, _) in &cases[2..] {
        let o = wait_for(T, &format!("{p} to report a failure"), || async {
            let o = to_json(&parents.get_opt(p).await.ok()??);
            let (s, _, _) = ready_condition(&o)?;
            (s == "False"
                && o.pointer("/metadata/generation") == o.pointer("/status/observedGeneration"))
            .then_some(o)
        })
        .await;
        let (_, r, m) = ready_condition(&o).unwrap();
        println!("namespace escape: child name {name:?} → {r}: {m}");
        // Refused before any request is made, with a message naming the name.
        assert_eq!(r, "RenderFailed", "{name:?}: {m}");
        assert!(m.contains("metadata.name"), "{name:?}: {m}");
    }
    // Nothing appeared in (or changed) the other namespace; the victims are untouched.
    let theirs: Vec<String> = list(&other_cms, None)
        .await
        .iter()
        .map(name_of)
        .filter(|n| n != "victim" && n != "kube-root-ca.crt")
        .collect();
    assert!(
        theirs.is_empty(),
        "created in the other namespace: {theirs:?}"
    );
    for (a, rv) in &victims {
        let v = get_json(a, "victim").await.unwrap();
        assert_eq!(&rv_of(&v), rv, "victim changed: {v}");
        assert_eq!(v["data"]["owner"], "victim");
    }
    let ours: Vec<String> = list(&cms, Some("rulebook.dev/rule=escapeparent"))
        .await
        .iter()
        .map(name_of)
        .collect();
    assert_eq!(
        ours,
        vec!["good-cm".to_string()],
        "only the good child exists"
    );
}

/// A namespaced parent with a cluster-scoped child: the rule does not start, says why,
/// and creates nothing; the operator's other rule runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scoped_child_is_refused() {
    let client = client().await;
    let ns = namespace(&client, "faults-scope").await;
    let d = RuleDir::new();
    d.rule(
        "scope.yaml",
        &rule_text(
            "scopeparent",
            "ScopeParent",
            &[child(
                "role",
                "rbac.authorization.k8s.io/v1",
                "ClusterRole",
                "scope/role.yaml",
                &[],
            )],
        ),
    );
    let role = format!("faults-{ns}-role");
    d.template(
        "scope/role.yaml",
        &format!("apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: {role}\nrules:\n  - apiGroups: [\"\"]\n    resources: [\"secrets\"]\n    verbs: [\"*\"]\n"),
    );
    d.rule(
        "fine.yaml",
        &rule_text(
            "scopeokparent",
            "ScopeOkParent",
            &[child("cm", "v1", "ConfigMap", "scope/cm.yaml", &[])],
        ),
    );
    d.template("scope/cm.yaml", &configmap_template("cm", "  a: \"b\"\n"));
    let op = d.start_in(&ns).await;
    let s = wait_for(T, "the rule to report the cluster-scoped child", || async {
        let s = status(&op).await;
        let r = s["rules"]["scopeparent"].clone();
        (r["state"] == "waiting"
            && r["message"]
                .as_str()
                .is_some_and(|m| m.contains("cluster-scoped")))
        .then_some(r)
    })
    .await;
    println!("cluster-scoped child: /status reports {s}");
    let scoped = kind_api(&client, &ns, "ScopeParent", T).await;
    let fine = kind_api(&client, &ns, "ScopeOkParent", T).await;
    put(&scoped, &parent("ScopeParent", &ns, "x", json!({}))).await;
    put(&fine, &parent("ScopeOkParent", &ns, "y", json!({}))).await;
    wait_ready(&fine, "y", "True", None, T).await;
    let roles = api(
        &client,
        None,
        "rbac.authorization.k8s.io/v1",
        "ClusterRole",
        "clusterroles",
    );
    assert!(
        get_json(&roles, &role).await.is_none(),
        "ClusterRole {role} was created"
    );
    assert!(
        list(&roles, Some("rulebook.dev/rule=scopeparent"))
            .await
            .is_empty()
    );
    let x = get_json(&scoped, "x").await.unwrap();
    assert!(
        x["status"].is_null(),
        "no controller serves the refused rule: {}",
        x["status"]
    );
    assert_eq!(
        status(&op).await["rules"]["scopeparent"]["state"],
        "waiting"
    );
}

/// An existing object with the child's name that Rulebook did not create: Conflict, the
/// object untouched; with `adopt: true` the rule takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_object_is_left_alone_until_adopted() {
    let client = client().await;
    let ns = namespace(&client, "faults-adopt").await;
    let kind = "AdoptParent";
    let d = RuleDir::new();
    let write = |adopt: bool| {
        let extra: &[&str] = if adopt { &["adopt: true"] } else { &[] };
        d.rule(
            "adopt.yaml",
            &rule_text(
                "adoptparent",
                kind,
                &[child(
                    "config",
                    "v1",
                    "ConfigMap",
                    "adopt/config.yaml",
                    extra,
                )],
            ),
        );
    };
    write(false);
    d.template(
        "adopt/config.yaml",
        &configmap_template("config", "  mode: \"rulebook\"\n"),
    );
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let foreign = to_json(
        &put(
            &cms,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "x-config", "namespace": ns, "labels": {"team": "other"}},
                "data": {"mode": "foreign", "extra": "keep"}}),
        )
        .await,
    );
    let _op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    put(&parents, &parent(kind, &ns, "x", json!({}))).await;
    put(&parents, &parent(kind, &ns, "y", json!({}))).await;
    let x = wait_ready(&parents, "x", "False", Some("Conflict"), T).await;
    let (_, _, m) = ready_condition(&x).unwrap();
    println!("foreign object: x → Conflict: {m}");
    assert!(m.contains("x-config") && m.contains("adopt: true"), "{m}");
    wait_ready(&parents, "y", "True", None, T).await;
    let now = get_json(&cms, "x-config").await.unwrap();
    assert_eq!(
        rv_of(&now),
        rv_of(&foreign),
        "the foreign object was written"
    );
    assert!(now["metadata"]["ownerReferences"].is_null());
    assert_eq!(now["metadata"]["labels"], json!({"team": "other"}));
    assert_eq!(now["data"], json!({"mode": "foreign", "extra": "keep"}));

    write(true);
    let x = wait_ready(&parents, "x", "True", None, T).await;
    let c = get_json(&cms, "x-config").await.unwrap();
    assert_eq!(
        c["metadata"]["uid"], foreign["metadata"]["uid"],
        "adopted, not replaced"
    );
    assert_eq!(c["data"]["mode"], "rulebook");
    assert_eq!(
        c["data"]["extra"], "keep",
        "fields the template does not set stay"
    );
    assert_eq!(c["metadata"]["labels"]["rulebook.dev/owner"], uid_of(&x));
    assert_eq!(c["metadata"]["labels"]["team"], "other");
    let refs = c["metadata"]["ownerReferences"].as_array().unwrap();
    assert!(
        refs.iter()
            .any(|r| r["uid"] == uid_of(&x) && r["controller"] == true)
    );
    println!("foreign object: adopted after `adopt: true`");
}

/// Exhaustion: a ~1 MB spec, a 10^6-item forEach, a runaway loop and runaway recursion
/// each fail their own parent clearly; the operator stays healthy and serves the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhaustion_fails_only_its_parent() {
    let client = client().await;
    let ns = namespace(&client, "faults-exhaust").await;
    let kind = "ExhaustParent";
    let d = RuleDir::new();
    let when = |mode: &str| format!("includeWhen: \"parent.spec.mode == '{mode}'\"");
    d.rule(
        "exhaust.yaml",
        &rule_text(
            "exhaustparent",
            kind,
            &[
                child("big", "v1", "ConfigMap", "exhaust/big.yaml", &[&when("big")]),
                child(
                    "range",
                    "v1",
                    "ConfigMap",
                    "exhaust/item.yaml",
                    &["forEach: \"range(parent.spec.n) if parent.spec.mode == 'range' else []\""],
                ),
                child(
                    "million",
                    "v1",
                    "ConfigMap",
                    "exhaust/item.yaml",
                    &["forEach: \"(range(1000) | list) * 1000 if parent.spec.mode == 'million' else []\""],
                ),
                child("loop", "v1", "ConfigMap", "exhaust/loop.yaml", &[&when("loop")]),
                child("deep", "v1", "ConfigMap", "exhaust/deep.yaml", &[&when("deep")]),
                child("plain", "v1", "ConfigMap", "exhaust/plain.yaml", &[&when("plain")]),
            ],
        ),
    );
    d.template(
        "exhaust/big.yaml",
        &configmap_template(
            "big",
            "  a: {{ parent.spec.big }}\n  b: {{ parent.spec.big }}\n",
        ),
    );
    d.template(
        "exhaust/item.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-\" ~ index }}\n",
    );
    d.template(
        "exhaust/loop.yaml",
        &format!(
            "{{% for i in range(100000) %}}{{% for j in range(100000) %}}{{% endfor %}}{{% endfor %}}\n{}",
            configmap_template("loop", "  a: \"b\"\n")
        ),
    );
    d.template(
        "exhaust/deep.yaml",
        &format!(
            "{{% macro down(n) %}}{{{{ down(n + 1) }}}}{{% endmacro %}}\n{}",
            configmap_template("deep", "  a: {{ down(0) }}\n")
        ),
    );
    d.template(
        "exhaust/plain.yaml",
        &configmap_template("plain", "  a: \"b\"\n"),
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    // ~900 KB, with characters JSON must escape: the parent fits the API server's limits,
    // the child (printed twice) does not fit the 1 MiB render limit.
    let big: String = "0123456789abcdef\"\\<>&'\n".repeat(900_000 / 24);
    // A limit of the per-parent render budget (output size, forEach items, fuel) is
    // RenderBudgetExceeded; the recursion limit is minijinja's own error, RenderFailed.
    let budget = "RenderBudgetExceeded";
    let cases = [
        (
            "big",
            json!({"mode": "big", "big": big}),
            budget,
            "larger than the limit",
        ),
        (
            "range",
            json!({"mode": "range", "n": 1_000_000}),
            budget,
            "too many elements",
        ),
        (
            "million",
            json!({"mode": "million"}),
            budget,
            "more than the limit of 1000",
        ),
        ("loop", json!({"mode": "loop"}), budget, "fuel"),
        ("deep", json!({"mode": "deep"}), "RenderFailed", "recursion"),
    ];
    for (name, spec, _, _) in &cases {
        put(&parents, &parent(kind, &ns, name, spec.clone())).await;
    }
    for (name, _, reason, want) in &cases {
        let o = wait_ready(&parents, name, "False", None, T).await;
        let (_, r, m) = ready_condition(&o).unwrap_or_default();
        println!("exhaustion: {name} → {r}: {m}");
        assert_eq!(&r, reason, "{name}: {m}");
        assert!(m.contains(want), "{name}: the message says {want:?}: {m}");
        assert!(m.len() <= 1100, "{name}: message of {} bytes", m.len());
    }
    // Healthy, and the others are served.
    assert_eq!(op.get("/healthz").await.trim(), "ok");
    let started = Instant::now();
    let plain: BTreeSet<String> = (0..5).map(|i| format!("plain-{i}")).collect();
    for n in &plain {
        put(&parents, &parent(kind, &ns, n, json!({"mode": "plain"}))).await;
    }
    wait_all_ready(&parents, &plain, T).await;
    println!(
        "exhaustion: 5 plain parents Ready {:.2} s after creation beside the exhausting ones",
        started.elapsed().as_secs_f64()
    );
    let made: Vec<String> = list(&cms, Some("rulebook.dev/rule=exhaustparent"))
        .await
        .iter()
        .map(name_of)
        .collect();
    assert_eq!(
        made.len(),
        5,
        "only the plain parents got children: {made:?}"
    );
    assert_eq!(op.get("/healthz").await.trim(), "ok");
}

/// Templates cannot read environment variables or files: such templates are refused at
/// load (the last good rule set keeps serving, so nothing hostile is ever rendered), and
/// a computed include of a path outside the templates fails only its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templates_cannot_read_env_or_files() {
    let client = client().await;
    let ns = namespace(&client, "faults-sandbox").await;
    let kind = "SandboxParent";
    let d = RuleDir::new();
    d.rule(
        "sandbox.yaml",
        &rule_text(
            "sandboxparent",
            kind,
            &[child(
                "config",
                "v1",
                "ConfigMap",
                "sandbox/config.yaml",
                &[],
            )],
        ),
    );
    let good = configmap_template("config", "  marker: \"good\"\n");
    d.template("sandbox/config.yaml", &good);
    d.rule(
        "dyn.yaml",
        &rule_text(
            "dynparent",
            "DynIncParent",
            &[child("config", "v1", "ConfigMap", "dyn/config.yaml", &[])],
        ),
    );
    d.template(
        "dyn/config.yaml",
        &configmap_template("config", "  included: {% include parent.spec.path %}\n"),
    );
    d.template("dyn/part.yaml", "\"partial\"");
    // A file next to the templates directory.
    std::fs::write(d.templates.join("../secret.txt"), "TOP-SECRET-FILE").unwrap();
    let op = d.start_in(&ns).await;
    let sp = kind_api(&client, &ns, kind, T).await;
    let dp = kind_api(&client, &ns, "DynIncParent", T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    put(&sp, &parent(kind, &ns, "s0", json!({}))).await;
    wait_ready(&sp, "s0", "True", None, T).await;

    // Computed includes: only templates of the directory can be named.
    put(
        &dp,
        &parent("DynIncParent", &ns, "ok", json!({"path": "dyn/part.yaml"})),
    )
    .await;
    wait_ready(&dp, "ok", "True", None, T).await;
    assert_eq!(
        get_json(&cms, "ok-config").await.unwrap()["data"]["included"],
        "partial"
    );
    for (name, path) in [
        ("passwd", "/etc/passwd"),
        ("up", "../../../../../../etc/passwd"),
        ("sibling", "../secret.txt"),
        ("proc", "/proc/self/environ"),
    ] {
        put(
            &dp,
            &parent("DynIncParent", &ns, name, json!({"path": path})),
        )
        .await;
        let o = wait_ready(&dp, name, "False", Some("RenderFailed"), T).await;
        let (_, _, m) = ready_condition(&o).unwrap();
        println!("sandbox: include {path:?} → RenderFailed: {m}");
        assert!(!m.contains("root:") && !m.contains("TOP-SECRET"), "{m}");
        assert!(get_json(&cms, &format!("{name}-config")).await.is_none());
    }

    // Hostile templates are refused at load.
    let hostile = [
        (
            "env",
            "  marker: {{ env.HOME }}\n",
            "unknown variable 'env'",
        ),
        (
            "getenv",
            "  marker: {{ getenv(\"HOME\") }}\n",
            "unknown variable 'getenv'",
        ),
        (
            "include /etc/passwd",
            "  marker: {% include \"/etc/passwd\" %}\n",
            "/etc/passwd",
        ),
        (
            "include ../../x",
            "  marker: {% include \"../../x\" %}\n",
            "../../x",
        ),
        (
            "import ../secret.txt",
            "{% import \"../secret.txt\" as s %}\n  marker: \"x\"\n",
            "../secret.txt",
        ),
    ];
    for (i, (what, data, want)) in hostile.iter().enumerate() {
        d.template("sandbox/config.yaml", &configmap_template("config", data));
        let s = wait_for(T, &format!("{what} to be refused"), || async {
            let s = status(&op).await;
            (s["ruleset"]["valid"] == false).then_some(s)
        })
        .await;
        let errors = s["ruleset"]["errors"].to_string();
        println!("sandbox: {what} refused at load: {errors}");
        assert!(errors.contains(want), "{what}: {errors}");
        // The last good rule set serves: a new parent gets the good template.
        let name = format!("s{}", i + 1);
        put(&sp, &parent(kind, &ns, &name, json!({}))).await;
        wait_ready(&sp, &name, "True", None, T).await;
        let c = get_json(&cms, &format!("{name}-config")).await.unwrap();
        assert_eq!(c["data"]["marker"], "good", "{what}");
        d.template("sandbox/config.yaml", &good);
        wait_for(T, "the rule set to be valid again", || async {
            (status(&op).await["ruleset"]["valid"] == true).then_some(())
        })
        .await;
    }
    let markers: BTreeSet<String> = list(&cms, Some("rulebook.dev/rule=sandboxparent"))
        .await
        .iter()
        .map(|c| c["data"]["marker"].to_string())
        .collect();
    assert_eq!(markers, BTreeSet::from(["\"good\"".to_string()]));
}
