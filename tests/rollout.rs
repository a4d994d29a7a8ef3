//! Progressive rollout of a rule change (issue 44, part 2) against the local control
//! plane, with `rulebook run` as a child process:
//!
//! 1. 50 parents, a change whose new version makes every child never ready: only the
//!    canary (the parent `order` picks) moves, `failWhen` fires, the rollback restores its
//!    child's old content; the audit log shows no write to any other parent or child;
//! 2. a good change reaches every parent through its batches, each batch's pause
//!    honoured (the steps' start times in the state, the children's writes in the audit
//!    log);
//! 3. SIGKILL mid-rollout with the old rule files gone from disk: after the restart the
//!    rollout resumes from the cluster, the parents not moved still render the old version
//!    (from the stored copy), and `rulebook rollout promote` moves the rest.
// A scenario test reads top to bottom as one story (the function size limit is for the
// product code).
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;
mod shards_kit;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use faults_kit::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);
const GROUP: &str = "rollout.rulebook.dev";

/// The rule for `kind` with a ConfigMap child from template `template`; `ready_when` and
/// `rollout` are YAML lines added to the child and the spec.
fn rule(kind: &str, template: &str, ready_when: Option<&str>, rollout: &str) -> String {
    let lower = kind.to_lowercase();
    let ready = ready_when
        .map(|r| format!("      readyWhen: \"{r}\"\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {lower}\nspec:\n  parent:\n    apiVersion: {GROUP}/v1\n    kind: {kind}\n  crd:\n    plural: {lower}s\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n  children:\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: {template}\n{ready}  rollout:\n{rollout}"
    )
}

fn template(marker: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\ndata:\n  marker: \"{marker}\"\n"
    )
}

fn parent(kind: &str, ns: &str, name: &str, canary: bool) -> Json {
    let mut p = json!({"apiVersion": format!("{GROUP}/v1"), "kind": kind,
        "metadata": {"name": name, "namespace": ns}, "spec": {}});
    if canary {
        p["metadata"]["labels"] = json!({"rulebook.dev/canary": "yes"});
    }
    p
}

/// The rollout state of `rule` in `ns`.
async fn state(client: &kube::Client, ns: &str, rule: &str) -> Option<Json> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms
        .get_opt(&format!("rulebook-rollout-{rule}"))
        .await
        .ok()??;
    serde_json::from_str(cm.data?.get("state")?).ok()
}

/// The marker of every child ConfigMap of the namespace, by name.
async fn markers(cms: &Api<DynamicObject>) -> BTreeMap<String, String> {
    cms.list(&Default::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter_map(|o| {
                    let m = to_json(o)["data"]["marker"].as_str()?.to_string();
                    Some((o.metadata.name.clone()?, m))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The names of the children of `cms` that carry marker `v`.
async fn at_version(cms: &Api<DynamicObject>, v: &str) -> Vec<String> {
    markers(cms)
        .await
        .into_iter()
        .filter(|(_, m)| m == v)
        .map(|(k, _)| k)
        .collect()
}

/// `(status, reason, message)` of a parent's `Rollout` condition.
fn rollout_condition(o: &Json) -> Option<(String, String, String)> {
    let c = o
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Rollout")?;
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    Some((s("status"), s("reason"), s("message")))
}

/// Rulebook's writes of the parents and children (not of its own rollout objects).
fn writes_to_parents_and_children(audit: &Audit, ns: &str) -> Vec<Json> {
    rulebook_writes(audit, ns)
        .into_iter()
        .filter(|e| {
            !e["objectRef"]["name"].as_str().is_some_and(|n| {
                n.starts_with("rulebook-rollout-") || n.starts_with("rulebook-rule-")
            })
        })
        .collect()
}

/// The batches (`namespace/name` of each parent) `rulebook diff -o json` plans for the
/// rules of `d` over the parents in `ns`.
fn diff_plan(d: &RuleDir, ns: &str) -> Vec<Vec<String>> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(["diff", "-o", "json", "--namespace", ns, "--kubeconfig"])
        .arg(kubeconfig_path())
        .arg("--rules")
        .arg(&d.rules)
        .arg("--templates")
        .arg(&d.templates)
        .output()
        .expect("rulebook diff");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "diff -o json: {e}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let rules = report.as_array().cloned().unwrap_or_default();
    let plan = rules
        .iter()
        .find_map(|r| r.get("rollout").filter(|p| !p.is_null()))
        .unwrap_or_else(|| panic!("no rollout plan in {report}"));
    plan["batches"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| {
            b["parents"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str().map(String::from))
                .collect()
        })
        .collect()
}

async fn start(d: &RuleDir, ns: &str) -> Operator {
    d.operator()
        .namespace(ns)
        .flags(&[
            "--install-crds",
            "--concurrency",
            "8",
            "--lease-namespace",
            ns,
        ])
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_never_gets_ready_moves_only_the_canary_and_rolls_back() {
    const N: usize = 50;
    let kind = "Rollbad";
    let client = client().await;
    let ns = namespace(&client, "rollout-bad").await;
    let rollout = "    steps:\n      - {parents: 1}\n      - {percent: 50, pause: 2s}\n      - {percent: 100}\n    order: \"parent.metadata.labels['rulebook.dev/canary'] is defined\"\n    gate: \"batch.ready >= batch.total and batch.age >= '2s'\"\n    onFailure: Rollback\n    failWhen: \"batch.notReadyFor >= '4s'\"\n";
    let d = RuleDir::new();
    d.template("rollbad/v1.yaml", &template("v1"));
    d.rule(
        "rollbad.yaml",
        &rule(kind, "rollbad/v1.yaml", None, rollout),
    );
    let op = start(&d, &ns).await;
    let parents = faults_kit_parents(&client, &ns, kind).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for i in 0..N {
        apply(&parents, parent(kind, &ns, &format!("p{i:02}"), i == 17)).await;
    }
    wait_for(T, "every child at v1", || async {
        let m = markers(&cms).await;
        (m.values().filter(|v| *v == "v1").count() == N).then_some(())
    })
    .await;
    wait_for(T, "every parent ready on v1", || async {
        let items = parents.list(&Default::default()).await.ok()?.items;
        let ready = items
            .iter()
            .filter(|o| ready_condition(&to_json(o)).is_some_and(|c| c.0 == "True"))
            .count();
        (ready == N).then_some(())
    })
    .await;
    let before = state(&client, &ns, "rollbad")
        .await
        .expect("a settled state");
    assert_eq!(before["phase"], "Complete");

    // The bad version: a readyWhen its child never meets.
    let audit = Audit::mark();
    d.template("rollbad/v2.yaml", &template("v2"));
    d.rule(
        "rollbad.yaml",
        &rule(
            kind,
            "rollbad/v2.yaml",
            Some("child.data.ok == 'yes'"),
            rollout,
        ),
    );
    let canary_moved = wait_for(T, "the canary's child at v2", || async {
        (markers(&cms).await.get("p17").map(String::as_str) == Some("v2")).then_some(())
    });
    canary_moved.await;
    let failed = wait_for(T, "the rollout to roll back", || async {
        let s = state(&client, &ns, "rollbad").await?;
        (s["phase"] == "RolledBack").then_some(s)
    })
    .await;
    println!("rolled back: {}", failed["message"]);
    assert_eq!(
        failed["step"], 0,
        "no batch after the canary moved: {failed}"
    );
    wait_for(T, "the canary's child back at v1", || async {
        (markers(&cms).await.get("p17").map(String::as_str) == Some("v1")).then_some(())
    })
    .await;
    let m = markers(&cms).await;
    assert_eq!(m.len(), N);
    assert!(m.values().all(|v| v == "v1"), "{m:?}");
    // Only the canary and its child were written.
    let writes = writes_to_parents_and_children(&audit, &ns);
    let others: Vec<String> = writes
        .iter()
        .filter(|e| e["objectRef"]["name"] != "p17")
        .map(describe_audit)
        .collect();
    assert!(
        others.is_empty(),
        "writes to other parents or children:\n{}",
        others.join("\n")
    );
    let child_writes = writes
        .iter()
        .filter(|e| e["objectRef"]["resource"] == "configmaps")
        .count();
    assert!(
        child_writes >= 2,
        "the canary's child moved and came back: {child_writes} writes"
    );
    let log = op.log_tail();
    assert!(log.contains("rollout failed"), "{log}");
    // The `Rollout` condition came with the canary's status writes (its ruleVersion went
    // and came back); no other parent was written, so none carries one.
    let canary = to_json(&parents.get("p17").await.unwrap());
    let (status, reason, message) = rollout_condition(&canary).expect("the canary's condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "RolledBack"),
        "{message}"
    );
    assert!(message.contains("failWhen held"), "{message}");
    let other = to_json(&parents.get("p03").await.unwrap());
    assert_eq!(rollout_condition(&other), None, "{other}");
}

/// The parents' API of `kind`, once its CRD is served.
/// Creates parents `<prefix>0` … `<prefix>{n-1}` of `kind` in `ns` (none a canary) and
/// waits until each child carries marker `v1`; the ConfigMaps of `ns`.
async fn parents_at_v1(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    prefix: &str,
    n: usize,
) -> (Api<DynamicObject>, Api<DynamicObject>) {
    let parents = faults_kit_parents(client, ns, kind).await;
    let cms = api(client, Some(ns), "v1", "ConfigMap", "configmaps");
    for i in 0..n {
        apply(&parents, parent(kind, ns, &format!("{prefix}{i}"), false)).await;
    }
    wait_for(T, "every child at v1", || async {
        let m = markers(&cms).await;
        (m.values().filter(|v| *v == "v1").count() == n).then_some(())
    })
    .await;
    (parents, cms)
}

/// How many of the `first` writes fall into each step, given the steps' start times.
fn per_step(first: &BTreeMap<String, jiff::Timestamp>, started: &[i64]) -> Vec<usize> {
    (0..started.len())
        .map(|i| {
            let (from, to) = (started[i], started.get(i + 1).copied().unwrap_or(i64::MAX));
            first
                .values()
                .filter(|t| t.as_second() >= from && t.as_second() < to)
                .count()
        })
        .collect()
}

async fn faults_kit_parents(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let a = api(
        client,
        Some(ns),
        &format!("{GROUP}/v1"),
        kind,
        &plural(kind),
    );
    wait_for(T, "the CRD to be served", || async {
        a.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_change_reaches_every_parent_batch_by_batch_with_its_pauses() {
    const N: usize = 6;
    let kind = "Rollgood";
    let client = client().await;
    let ns = namespace(&client, "rollout-good").await;
    let rollout = "    steps:\n      - {parents: 1}\n      - {percent: 50, pause: 3s}\n      - {percent: 100, pause: 3s}\n";
    let d = RuleDir::new();
    d.template("rollgood/v1.yaml", &template("v1"));
    d.rule(
        "rollgood.yaml",
        &rule(kind, "rollgood/v1.yaml", None, rollout),
    );
    let _op = start(&d, &ns).await;
    let parents = faults_kit_parents(&client, &ns, kind).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for i in 0..N {
        apply(&parents, parent(kind, &ns, &format!("g{i}"), false)).await;
    }
    wait_for(T, "every child at v1, the state settled", || async {
        let m = markers(&cms).await;
        let s = state(&client, &ns, "rollgood").await?;
        (m.values().filter(|v| *v == "v1").count() == N).then_some(s)
    })
    .await;
    // `rulebook diff` of the change, before it lands: the plan, batch by batch.
    let next = RuleDir::new();
    next.template("rollgood/v2.yaml", &template("v2"));
    next.rule(
        "rollgood.yaml",
        &rule(kind, "rollgood/v2.yaml", None, rollout),
    );
    let planned = diff_plan(&next, &ns);
    let sizes: Vec<usize> = planned.iter().map(Vec::len).collect();
    assert_eq!(sizes, [1, 2, 3], "the plan: {planned:?}");
    let audit = Audit::mark();
    d.template("rollgood/v2.yaml", &template("v2"));
    d.rule(
        "rollgood.yaml",
        &rule(kind, "rollgood/v2.yaml", None, rollout),
    );
    let done = wait_for(T, "the rollout to complete", || async {
        let s = state(&client, &ns, "rollgood").await?;
        (s["phase"] == "Complete" && s["from"] != s["to"]).then_some(s)
    })
    .await;
    wait_for(T, "every child at v2", || async {
        let m = markers(&cms).await;
        (m.values().filter(|v| *v == "v2").count() == N).then_some(())
    })
    .await;
    let started: Vec<i64> = done["stepsStarted"]
        .as_array()
        .expect("stepsStarted")
        .iter()
        .filter_map(Json::as_i64)
        .collect();
    let ended = done["ended"].as_i64().expect("ended");
    println!("steps started {started:?}, ended {ended}");
    assert_eq!(started.len(), 3, "{done}");
    assert!(started[2] - started[1] >= 3, "step 1's pause: {started:?}");
    assert!(
        ended - started[2] >= 3,
        "step 2's pause: {started:?} {ended}"
    );
    // The children's first write after the change, by batch: 1, then 2 more (50 % of 6),
    // then the other 3, each batch after its step started.
    let mut first: BTreeMap<String, jiff::Timestamp> = BTreeMap::new();
    for e in writes_to_parents_and_children(&audit, &ns) {
        if e["objectRef"]["resource"] == "configmaps"
            && let (Some(n), Some(t)) = (e["objectRef"]["name"].as_str(), audit_time(&e))
        {
            first.entry(n.to_string()).or_insert(t);
        }
    }
    assert_eq!(first.len(), N, "{first:?}");
    let batches = per_step(&first, &started);
    println!("children written per batch: {batches:?}");
    assert_eq!(batches, [1, 2, 3], "{first:?} {started:?}");
    // Each parent's one status write of the rollout (its new ruleVersion) carried the
    // `Rollout` condition naming its batch: no write of its own.
    let batch_of = |t: &jiff::Timestamp| started.iter().filter(|s| **s <= t.as_second()).count();
    let status_writes = writes_to_parents_and_children(&audit, &ns)
        .into_iter()
        .filter(|e| e["objectRef"]["subresource"] == "status")
        .fold(BTreeMap::<String, usize>::new(), |mut m, e| {
            *m.entry(e["objectRef"]["name"].as_str().unwrap_or("").to_string())
                .or_default() += 1;
            m
        });
    for (name, t) in &first {
        let p = to_json(&parents.get(name).await.unwrap());
        let (status, reason, message) = rollout_condition(&p).expect("a Rollout condition");
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", "Moved"),
            "{name}: {message}"
        );
        let want = format!("batch {} of 3", batch_of(t));
        assert!(
            message.ends_with(&want),
            "{name}: {message} (wanted {want})"
        );
        // `diff` had placed it in the batch it moved in.
        let planned_in = planned
            .iter()
            .position(|b| b.iter().any(|p| p == &format!("{ns}/{name}")))
            .map(|i| i + 1);
        assert_eq!(
            planned_in,
            Some(batch_of(t)),
            "{name}: the plan {planned:?}"
        );
        assert_eq!(
            status_writes.get(name),
            Some(&1),
            "{name}: {status_writes:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_resumes_after_sigkill_with_the_old_files_gone() {
    const N: usize = 4;
    let kind = "Rollkill";
    let client = client().await;
    let ns = namespace(&client, "rollout-kill").await;
    // Held at the canary: the gate waits an hour.
    let rollout = "    steps:\n      - {parents: 1}\n      - {percent: 100}\n    gate: \"batch.ready >= batch.total and batch.age >= '1h'\"\n";
    let d = RuleDir::new();
    d.template("rollkill/v1.yaml", &template("v1"));
    d.rule(
        "rollkill.yaml",
        &rule(kind, "rollkill/v1.yaml", None, rollout),
    );
    let mut op = start(&d, &ns).await;
    let (_, cms) = parents_at_v1(&client, &ns, kind, "k", N).await;
    d.template("rollkill/v2.yaml", &template("v2"));
    d.rule(
        "rollkill.yaml",
        &rule(kind, "rollkill/v2.yaml", None, rollout),
    );
    let canary = wait_for(T, "one child at v2", || async {
        let moved = at_version(&cms, "v2").await;
        (moved.len() == 1).then(|| moved[0].clone())
    })
    .await;
    op.signal_and_wait("KILL");
    // The old version's files are gone: only the cluster keeps it.
    std::fs::remove_file(d.templates.join("rollkill/v1.yaml")).unwrap();
    let _op = start(&d, &ns).await;
    // A child of a parent that did not move, deleted: it comes back with the old version.
    let unmoved = if canary == "k0" { "k1" } else { "k0" };
    cms.delete(unmoved, &Default::default()).await.unwrap();
    wait_for(T, "the deleted child back, at v1", || async {
        (markers(&cms).await.get(unmoved).map(String::as_str) == Some("v1")).then_some(())
    })
    .await;
    let m = markers(&cms).await;
    assert_eq!(m.get(&canary).map(String::as_str), Some("v2"), "{m:?}");
    assert_eq!(m.values().filter(|v| *v == "v1").count(), N - 1, "{m:?}");
    let s = state(&client, &ns, "rollkill").await.expect("state");
    assert_eq!(
        (s["phase"].as_str(), s["step"].as_i64()),
        (Some("Progressing"), Some(0))
    );
    // Promoted by hand: every parent moves.
    let kc = kubeconfig_path();
    let out = rulebook(&[
        "rollout",
        "promote",
        "--rule",
        "rollkill",
        "--namespace",
        &ns,
        "--kubeconfig",
        kc.to_str().unwrap(),
    ]);
    assert!(out.contains("Complete"), "{out}");
    wait_for(T, "every child at v2", || async {
        let m = markers(&cms).await;
        (m.values().filter(|v| *v == "v2").count() == N).then_some(())
    })
    .await;
}

/// The holder of the Lease `rulebook` in `ns`.
async fn lease_holder(client: &kube::Client, ns: &str) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), ns);
    leases
        .get_opt("rulebook")
        .await
        .ok()??
        .spec?
        .holder_identity
}

/// A leader change mid-rollout, on a rule whose rollout is the operator-wide default
/// (`--default-rollout`): the new leader keeps the batch the old one moved (no second
/// canary), takes the gate's clock from the cluster (the next step starts no sooner than
/// the gate allows after the first step started, under the old leader), and no child is
/// written twice for the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_change_mid_rollout_neither_skips_the_gate_nor_moves_a_batch_twice() {
    const N: usize = 6;
    const GATE_SECONDS: i64 = 20;
    let kind = "Rolllead";
    let client = client().await;
    let ns = namespace(&client, "rollout-lead").await;
    let d = RuleDir::new();
    let default = d
        .rules
        .parent()
        .expect("a parent")
        .join("default-rollout.yaml");
    std::fs::write(
        &default,
        format!(
            "steps:\n  - parents: 2\n  - percent: 100\ngate: \"batch.ready >= batch.total and batch.age >= '{GATE_SECONDS}s'\"\n"
        ),
    )
    .unwrap();
    let no_rollout = |t: &str| rule(kind, t, None, "").replace("  rollout:\n", "");
    d.template("rolllead/v1.yaml", &template("v1"));
    d.rule("rolllead.yaml", &no_rollout("rolllead/v1.yaml"));
    let replica = |id: &str| {
        let default = default.display().to_string();
        let id = id.to_string();
        let d = &d;
        let ns = ns.to_string();
        async move {
            d.operator()
                .namespace(&ns)
                .flags(&[
                    "--install-crds",
                    "--leader-elect",
                    "--lease-duration",
                    "5",
                    "--lease-namespace",
                    &ns,
                    "--identity",
                    &id,
                    "--default-rollout",
                    &default,
                ])
                .start()
                .await
        }
    };
    let mut a = replica("replica-a").await;
    wait_for(T, "replica-a to lead", || async {
        (lease_holder(&client, &ns).await.as_deref() == Some("replica-a")).then_some(())
    })
    .await;
    let _b = replica("replica-b").await;
    let (_, cms) = parents_at_v1(&client, &ns, kind, "l", N).await;

    let audit = Audit::mark();
    d.template("rolllead/v2.yaml", &template("v2"));
    d.rule("rolllead.yaml", &no_rollout("rolllead/v2.yaml"));
    let moved = wait_for(T, "the first batch (2 children) at v2", || async {
        let moved = at_version(&cms, "v2").await;
        (moved.len() == 2).then_some(moved)
    })
    .await;
    let first = state(&client, &ns, "rolllead").await.expect("a state");
    assert_eq!(first["step"], 0, "{first}");
    let step0 = first["stepsStarted"][0].as_i64().expect("stepsStarted[0]");

    // The leader dies mid-rollout; the other replica takes the Lease.
    a.signal_and_wait("KILL");
    wait_for(T, "replica-b to lead", || async {
        (lease_holder(&client, &ns).await.as_deref() == Some("replica-b")).then_some(())
    })
    .await;
    // The new leader reconciles (a deleted child of a parent not moved comes back, at the
    // old version) while the batch is held: still the same two moved, no others.
    let unmoved = (0..N)
        .map(|i| format!("l{i}"))
        .find(|n| !moved.contains(n))
        .expect("an unmoved parent");
    cms.delete(&unmoved, &Default::default()).await.unwrap();
    wait_for(
        T,
        "the deleted child back, at v1, from replica-b",
        || async {
            (markers(&cms).await.get(&unmoved).map(String::as_str) == Some("v1")).then_some(())
        },
    )
    .await;
    let s = state(&client, &ns, "rolllead").await.expect("a state");
    let now_moved = at_version(&cms, "v2").await;
    if s["step"] == 0 {
        assert_eq!(now_moved, moved, "the new leader moved another batch: {s}");
    }
    assert_eq!(
        s["stepsStarted"][0].as_i64(),
        Some(step0),
        "the first step's start is the cluster's, kept: {s}"
    );

    // The gate passes under the new leader, no sooner than it allows.
    let done = wait_for(T, "the rollout to complete", || async {
        let s = state(&client, &ns, "rolllead").await?;
        (s["phase"] == "Complete" && s["from"] != s["to"]).then_some(s)
    })
    .await;
    let started: Vec<i64> = done["stepsStarted"]
        .as_array()
        .expect("stepsStarted")
        .iter()
        .filter_map(Json::as_i64)
        .collect();
    println!("steps started {started:?} (first batch {moved:?})");
    assert_eq!(started.first(), Some(&step0), "{done}");
    assert!(
        started.get(1).is_some_and(|s1| s1 - step0 >= GATE_SECONDS),
        "the gate ({GATE_SECONDS}s) was skipped: {started:?}"
    );
    wait_for(T, "every child at v2", || async {
        let m = markers(&cms).await;
        (m.values().filter(|v| *v == "v2").count() == N).then_some(())
    })
    .await;
    // Each child written once for the change (the deleted one twice: back at v1, then v2),
    // and before the second step only the first batch's (whichever replica led).
    let mut writes: BTreeMap<String, usize> = BTreeMap::new();
    let mut early: Vec<String> = Vec::new();
    for e in writes_to_parents_and_children(&audit, &ns) {
        if e["objectRef"]["resource"] == "configmaps"
            && let Some(n) = e["objectRef"]["name"].as_str()
        {
            *writes.entry(n.to_string()).or_default() += 1;
            if n != unmoved && audit_time(&e).is_some_and(|t| t.as_second() < started[1]) {
                early.push(n.to_string());
            }
        }
    }
    early.sort();
    assert_eq!(early, moved, "children written before the gate passed");
    for i in 0..N {
        let n = format!("l{i}");
        let want = if n == unmoved { 2 } else { 1 };
        assert_eq!(writes.get(&n), Some(&want), "{n}: {writes:?}");
    }
}

/// Names `<prefix>-<i>` for namespaces, `per` of them in each of `ranges` (the shares of
/// the replicas, as their `/status` says), so that every replica owns some parents.
fn names_in_shares(prefix: &str, ranges: &[String], per: usize) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new(); ranges.len()];
    for i in 0..10_000 {
        let n = format!("{prefix}-{i}");
        if let Some(k) = ranges.iter().position(|r| shards_kit::in_ranges(r, &n))
            && out[k].len() < per
        {
            out[k].push(n);
        }
        if out.iter().all(|o| o.len() == per) {
            break;
        }
    }
    out
}

/// A rollout over two `--sharding namespace` replicas, one of which is SIGKILLed during
/// the first batch: each replica reconciles its share from the one rollout state in the
/// cluster, the survivor takes over the other's parents and the coordination, every batch
/// moves after its step started and no sooner than the gate allows, and each child is
/// written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_rollout_moves_each_batch_once_when_a_replica_leaves() {
    const GATE_SECONDS: i64 = 6;
    let kind = "Rollshard";
    let client = client().await;
    let home = namespace(&client, "rollout-shard").await;
    let rollout = format!(
        "    steps:\n      - {{parents: 2}}\n      - {{percent: 50}}\n      - {{percent: 100}}\n    gate: \"batch.ready >= batch.total and batch.age >= '{GATE_SECONDS}s'\"\n"
    );
    let d = RuleDir::new();
    d.template("rollshard/v1.yaml", &template("v1"));
    d.rule(
        "rollshard.yaml",
        &rule(kind, "rollshard/v1.yaml", None, &rollout),
    );
    let group = unique("rollshard");
    // This run's parents only: the replicas watch every namespace, where an interrupted
    // run may have left parents of the kind.
    let selector = format!("rulebook.test/run={group}");
    let replica = |id: &'static str| {
        let (d, group, home, selector) = (&d, group.clone(), home.to_string(), selector.clone());
        async move {
            d.operator()
                .flags(&[
                    "--install-crds",
                    "--selector",
                    &selector,
                    "--sharding",
                    "namespace",
                    "--lease-name",
                    &group,
                    "--lease-namespace",
                    &home,
                    "--lease-duration",
                    "6",
                    "--shard-rebalance-seconds",
                    "3600",
                    "--identity",
                    id,
                ])
                .start()
                .await
        }
    };
    let mut a = replica("rollshard-a").await;
    let b = replica("rollshard-b").await;
    let ranges = shards_kit::settled_ranges(&[&a, &b], |r| r.len() == 2).await;
    // Three namespaces in each share, one parent in each.
    let shares = names_in_shares(&unique("rollout-shard"), &ranges, 3);
    let spaces: Vec<String> = shares.iter().flatten().cloned().collect();
    assert_eq!(spaces.len(), 6, "{shares:?} over {ranges:?}");
    let mut guards = Vec::new();
    for ns in &spaces {
        guards.push(TestNamespace::create_without_pods(&client, ns).await);
    }
    let _guards = TestNamespaces::new(guards);
    let parents = faults_kit_parents(&client, &home, kind).await;
    drop(parents);
    for (i, ns) in spaces.iter().enumerate() {
        let p = faults_kit_parents(&client, ns, kind).await;
        let mut o = parent(kind, ns, &format!("s{i}"), false);
        o["metadata"]["labels"] = json!({"rulebook.test/run": group});
        apply(&p, o).await;
    }
    // How many of the children carry marker `v`.
    let at = |v: &'static str| {
        let (client, spaces) = (client.clone(), spaces.clone());
        async move {
            let mut n = 0;
            for (i, ns) in spaces.iter().enumerate() {
                let cms = api(&client, Some(ns), "v1", "ConfigMap", "configmaps");
                n += usize::from(
                    markers(&cms)
                        .await
                        .get(&format!("s{i}"))
                        .map(String::as_str)
                        == Some(v),
                );
            }
            n
        }
    };
    wait_for(T, "every child at v1", || async {
        (at("v1").await == 6).then_some(())
    })
    .await;

    let audit = Audit::mark();
    d.template("rollshard/v2.yaml", &template("v2"));
    d.rule(
        "rollshard.yaml",
        &rule(kind, "rollshard/v2.yaml", None, &rollout),
    );
    wait_for(T, "the first batch (2 children) at v2", || async {
        (at("v2").await == 2).then_some(())
    })
    .await;
    // Replica a leaves mid-rollout; b takes every namespace (and the coordination).
    a.signal_and_wait("KILL");
    shards_kit::settled_ranges(&[&b], |r| {
        spaces.iter().all(|ns| shards_kit::in_ranges(&r[0], ns))
    })
    .await;
    let done = wait_for(T, "the rollout to complete", || async {
        let s = state(&client, &home, "rollshard").await?;
        (s["phase"] == "Complete" && s["from"] != s["to"]).then_some(s)
    })
    .await;
    wait_for(T, "every child at v2", || async {
        (at("v2").await == 6).then_some(())
    })
    .await;
    let started: Vec<i64> = done["stepsStarted"]
        .as_array()
        .expect("stepsStarted")
        .iter()
        .filter_map(Json::as_i64)
        .collect();
    println!("steps started {started:?}");
    assert_eq!(started.len(), 3, "{done}");
    for w in started.windows(2) {
        assert!(
            w[1] - w[0] >= GATE_SECONDS,
            "a gate was skipped: {started:?}"
        );
    }
    // Each child's writes for the change: one, in the batch its step allowed (2, then 1
    // more for 50 % of 6, then the other 3), by the replica that owned it then.
    let mut first: BTreeMap<String, jiff::Timestamp> = BTreeMap::new();
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_b_in_a_share = 0;
    for ns in &spaces {
        for e in writes_to_parents_and_children(&audit, ns) {
            if e["objectRef"]["resource"] == "configmaps"
                && let (Some(n), Some(t)) = (e["objectRef"]["name"].as_str(), audit_time(&e))
            {
                first.entry(n.to_string()).or_insert(t);
                *count.entry(n.to_string()).or_default() += 1;
                let by_b = e["userAgent"]
                    .as_str()
                    .is_some_and(|u| u.contains("(rollshard-b)"));
                if by_b && shares[0].contains(ns) {
                    by_b_in_a_share += 1;
                }
            }
        }
    }
    assert!(
        count.values().all(|c| *c == 1) && count.len() == 6,
        "{count:?}"
    );
    let batches = per_step(&first, &started);
    let trail: Vec<String> = spaces
        .iter()
        .flat_map(|ns| rulebook_writes(&audit, ns))
        .map(|e| describe_audit(&e))
        .collect();
    assert_eq!(
        batches,
        [2, 1, 3],
        "{first:?} {started:?}\n{done}\n{}",
        trail.join("\n")
    );
    assert!(
        by_b_in_a_share >= 1,
        "the survivor moved none of the parents of the replica that left"
    );
}
