//! Deletion as a lifecycle, against the local control plane with `rulebook run` as a
//! child process (issue 16):
//!
//! 1. a DatabaseBackup-like rule: deleting the parent creates the finalize Job, waits for
//!    it (kwok completes its pod), then deletes the children in reverse rule order, each
//!    wave gone before the next (one child is held by a finalizer of the test's to show
//!    it), orphans the PersistentVolumeClaim, and removes the finalizer; a new parent of
//!    the same name does not adopt the orphan until the rule says `adopt: true`;
//! 2. a finalize Job that never completes: the timeout, a Warning event, teardown finishes;
//! 3. removing the rule file releases the finalizers of its parents, which can then go;
//! 4. `rulebook release --rule NAME` does the same without the operator;
//! 5. rules without `deletion` put no finalizer on their parents;
//! 6. a lookalike of the finalize child, put in place before the deletion, does not stand
//!    in for it.
//!
//! Killing the operator during each step of a teardown is in `tests/faults_heavy.rs`.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use faults_kit::teardown::*;
use faults_kit::*;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_job_then_reverse_waves_and_orphan() {
    let test = "finalize_job_then_reverse_waves_and_orphan";
    let client = client().await;
    let ns = namespace(&client, "deletion-db").await;
    let (kind, rule) = ("DelDatabase", "deldatabase");
    let d = RuleDir::new();
    database_templates(&d);
    d.rule("db.yaml", &database_rule(rule, kind, "60s", false));
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let pvcs = api(
        &client,
        Some(&ns),
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
    );
    let jobs = api(&client, Some(&ns), "batch/v1", "Job", "jobs");

    put(&parents, &parent(kind, &ns, "db1", json!({"hold": true}))).await;
    let names: BTreeSet<String> = ["db1".to_string()].into();
    wait_all_ready(&parents, &names, T).await;
    let p = get_json(&parents, "db1").await.expect("db1");
    let uid = uid_of(&p);
    assert_eq!(
        finalizers(&p),
        vec![FINALIZER],
        "{test}: the parent carries the finalizer"
    );
    assert!(
        get_json(&jobs, "db1-final-backup").await.is_none(),
        "{test}: the finalize Job exists only once the parent is being deleted"
    );

    let audit = Audit::mark();
    let deleted_at = Instant::now();
    remove(&parents, "db1").await;

    // The finalize Job is created and completes (kwok runs its pod to Succeeded): the job
    // controller's `Completed` event on it, and Rulebook's `Finalized` on the parent.
    wait_for(T, "the finalize Job to complete", || async {
        events_for(&client, &ns, "db1-final-backup")
            .await
            .iter()
            .any(|e| e["reason"] == "Completed")
            .then_some(())
    })
    .await;
    wait_for(T, "the Finalized event", || async {
        events_for(&client, &ns, "db1")
            .await
            .iter()
            .any(|e| e["reason"] == "Finalized")
            .then_some(())
    })
    .await;

    // Reverse order: the Job (last child) first, then `service`, held by the test's
    // finalizer. While it is held, the earlier children are not touched.
    wait_for(T, "the held ConfigMap to be deleted", || async {
        let cm = get_json(&cms, "db1-svc").await?;
        cm["metadata"]["deletionTimestamp"]
            .is_string()
            .then_some(())
    })
    .await;
    let waiting = wait_for(T, "the parent to say it waits for db1-svc", || async {
        let p = get_json(&parents, "db1").await?;
        let c = condition(&p, "Deleting")?;
        (c["reason"] == "DeletingChildren" && c["message"].as_str()?.contains("db1-svc"))
            .then_some(c)
    })
    .await;
    let config = get_json(&cms, "db1-config").await.expect("db1-config");
    assert!(
        config["metadata"]["deletionTimestamp"].is_null(),
        "{test}: the next wave started before the held child was gone"
    );
    let pvc = get_json(&pvcs, "db1-data").await.expect("db1-data");
    assert_eq!(owner_label(&pvc), Some(uid.as_str()));
    assert!(
        pvc["metadata"]["ownerReferences"].is_null(),
        "{test}: an Orphan child carries no ownerReference for the garbage collector to follow"
    );
    // While the teardown waits, the metric of the oldest one is the parent's deletion
    // time (the alert RulebookTeardownStuck reads it); once done, 0.
    let deletion = get_json(&parents, "db1").await.expect("db1")["metadata"]["deletionTimestamp"]
        .as_str()
        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        .expect("the parent's deletionTimestamp")
        .as_second();
    let series = format!("rulebook_teardown_oldest_deletion_seconds{{rule=\"{rule}\"}} ");
    let teardown_metric = |text: String| {
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse::<i64>().ok())
    };
    assert_eq!(
        teardown_metric(op.get("/metrics").await),
        Some(deletion),
        "{test}: the oldest teardown's deletion time"
    );
    let released = Instant::now();
    merge(&cms, "db1-svc", json!({"metadata": {"finalizers": null}})).await;

    wait_for(T, "the parent to be gone", || async {
        get_json(&parents, "db1").await.is_none().then_some(())
    })
    .await;
    let took = deleted_at.elapsed();
    wait_for(T, "the teardown metric back to 0", || async {
        (teardown_metric(op.get("/metrics").await) == Some(0)).then_some(())
    })
    .await;
    assert!(
        get_json(&cms, "db1-config").await.is_none(),
        "{test}: config left"
    );
    assert!(
        get_json(&cms, "db1-svc").await.is_none(),
        "{test}: service left"
    );
    assert!(
        get_json(&jobs, "db1-final-backup").await.is_none(),
        "{test}: Job left"
    );
    let pvc = get_json(&pvcs, "db1-data")
        .await
        .expect("{test}: the orphaned PVC survives");
    assert!(
        pvc["metadata"]["ownerReferences"].is_null(),
        "{test}: the orphan keeps an ownerReference: {}",
        pvc["metadata"]
    );
    let labels = pvc["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert!(
        !labels
            .keys()
            .any(|k| k.starts_with("rulebook.dev/") || k == "app.kubernetes.io/managed-by"),
        "{test}: the orphan keeps Rulebook's labels: {labels:?}"
    );

    // The audit log: one delete each, in reverse rule order, and the config's delete
    // only after the held ConfigMap was released.
    let deletes = rulebook_deletes(&audit, &ns);
    let shown: Vec<String> = deletes.iter().map(describe_audit).collect();
    let at = |name: &str| {
        let hits: Vec<&Json> = deletes
            .iter()
            .filter(|e| e["objectRef"]["name"] == name)
            .collect();
        assert_eq!(hits.len(), 1, "{test}: {name} deleted once: {shown:#?}");
        audit_time(hits[0]).expect("stageTimestamp")
    };
    let (t_job, t_svc, t_config) = (at("db1-final-backup"), at("db1-svc"), at("db1-config"));
    assert!(
        t_job <= t_svc && t_svc <= t_config,
        "{test}: not in reverse order: {shown:#?}"
    );
    let release_patch = audit
        .writes(&ns)
        .into_iter()
        .find(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["name"] == "db1-svc"
                && !e["userAgent"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("rulebook/")
        })
        .and_then(|e| audit_time(&e))
        .expect("the test's release of db1-svc in the audit log");
    assert!(
        release_patch <= t_config,
        "{test}: db1-config was deleted before the wave before it was gone: {shown:#?}"
    );
    assert!(
        !deletes.iter().any(|e| e["objectRef"]["name"] == "db1-data"),
        "{test}: the orphaned PVC was deleted"
    );
    // Events are sent in the background: wait for them a while before asking.
    let reasons = || async {
        events_for(&client, &ns, "db1")
            .await
            .iter()
            .filter_map(|e| e["reason"].as_str().map(String::from))
            .collect::<Vec<String>>()
    };
    let wanted = ["Finalizing", "Finalized", "Orphaned"];
    poll_for(T, || async {
        let got = reasons().await;
        wanted
            .iter()
            .all(|r| got.iter().any(|x| x == r))
            .then_some(())
    })
    .await;
    let reasons = reasons().await;
    for r in wanted {
        assert!(
            reasons.iter().any(|x| x == r),
            "{test}: no {r} event: {reasons:?}"
        );
    }

    // A new parent of the same name: the orphan is someone else's now.
    put(&parents, &parent(kind, &ns, "db1", json!({}))).await;
    let conflict = wait_for(T, "the new parent to report the conflict", || async {
        let p = get_json(&parents, "db1").await?;
        let (s, reason, message) = ready_condition(&p)?;
        (s == "False" && reason == "Conflict").then_some(message)
    })
    .await;
    assert!(conflict.contains("db1-data"), "{test}: {conflict}");
    let pvc = get_json(&pvcs, "db1-data").await.expect("db1-data");
    assert!(
        faults_kit::teardown::released(&pvc),
        "{test}: adopted silently: {}",
        pvc["metadata"]
    );
    // ... until the rule says `adopt: true`.
    d.rule("db.yaml", &database_rule(rule, kind, "60s", true));
    let new_uid = uid_of(&get_json(&parents, "db1").await.expect("db1"));
    wait_for(T, "the orphan to be adopted with adopt: true", || async {
        let pvc = get_json(&pvcs, "db1-data").await?;
        (owner_label(&pvc) == Some(new_uid.as_str())).then_some(())
    })
    .await;
    eprintln!(
        "{test}: parent deleted → finalize Job done → 3 waves in reverse order (one held {:.1} s by a \
         foreign finalizer) → PVC orphaned → finalizer removed: {:.1} s in all; waiting showed \
         {:?}; {} deletes by Rulebook",
        released.duration_since(deleted_at).as_secs_f64(),
        took.as_secs_f64(),
        waiting["message"],
        deletes.len()
    );
    drop(op);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_timeout_warns_and_teardown_finishes() {
    let test = "finalize_timeout_warns_and_teardown_finishes";
    let client = client().await;
    let ns = namespace(&client, "deletion-stuck").await;
    let (kind, rule) = ("DelStuck", "delstuck");
    let d = RuleDir::new();
    database_templates(&d);
    d.rule("db.yaml", &database_rule(rule, kind, "3s", false));
    let _op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let jobs = api(&client, Some(&ns), "batch/v1", "Job", "jobs");
    // A marker written before the deletion (by the parent's author) counts for nothing:
    // the finalize step still runs.
    let mut p = parent(kind, &ns, "db2", json!({"stuck": true}));
    p["metadata"]["annotations"] = json!({"rulebook.dev/finalized": "done@2020-01-01T00:00:00Z"});
    put(&parents, &p).await;
    wait_all_ready(&parents, &["db2".to_string()].into(), T).await;
    let deleted_at = Instant::now();
    remove(&parents, "db2").await;
    wait_for(T, "the suspended finalize Job to exist", || async {
        get_json(&jobs, "db2-final-backup").await.map(|_| ())
    })
    .await;
    wait_for(T, "the parent to be gone after the timeout", || async {
        get_json(&parents, "db2").await.is_none().then_some(())
    })
    .await;
    let took = deleted_at.elapsed();
    let warning = events_for(&client, &ns, "db2")
        .await
        .into_iter()
        .find(|e| e["reason"] == "FinalizeTimedOut")
        .unwrap_or_else(|| panic!("{test}: no FinalizeTimedOut event"));
    assert_eq!(warning["type"], "Warning");
    assert!(
        took >= Duration::from_secs(3),
        "{test}: gone after {took:?}, before the 3 s timeout"
    );
    assert!(
        get_json(&jobs, "db2-final-backup").await.is_none(),
        "{test}: Job left"
    );
    eprintln!(
        "{test}: a finalize Job that never completes: FinalizeTimedOut after the 3 s timeout, parent gone {:.1} s after its deletion; note: {}",
        took.as_secs_f64(),
        warning["note"]
    );
}

/// An object that carries the finalize child's marks (labels, the parent's controller
/// reference), put in place by the parent's author before the deletion: before, the
/// teardown took it for the finalize child — a suspended Job that never completes, so the
/// real backup never ran and the step timed out. The finalize child is created for the
/// deletion; anything older is a lookalike, pruned with the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookalike_of_the_finalize_child_does_not_stand_in_for_it() {
    let test = "a_lookalike_of_the_finalize_child_does_not_stand_in_for_it";
    let client = client().await;
    let ns = namespace(&client, "deletion-decoy").await;
    let (kind, rule) = ("DelDecoy", "deldecoy");
    let d = RuleDir::new();
    database_templates(&d);
    d.rule("db.yaml", &database_rule(rule, kind, "600s", false));
    let _op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let jobs = api(&client, Some(&ns), "batch/v1", "Job", "jobs");
    put(&parents, &parent(kind, &ns, "db3", json!({}))).await;
    wait_all_ready(&parents, &["db3".to_string()].into(), T).await;
    let uid = uid_of(&get_json(&parents, "db3").await.expect("db3"));
    put(
        &jobs,
        &json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "decoy", "namespace": ns, "finalizers": [HOLD],
                "labels": {"app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule,
                           "rulebook.dev/owner": uid, "rulebook.dev/child": "final_backup"},
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": kind, "name": "db3",
                                     "uid": uid, "controller": true}]},
            "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "c", "image": "registry.example/none:1"}]}}}}),
    )
    .await;
    // Pruned at once (the parent does not render it), it stays in deletion: its author's
    // finalizer holds it.
    wait_for(T, "the decoy to be pruned", || async {
        get_json(&jobs, "decoy")
            .await
            .is_some_and(|j| !j["metadata"]["deletionTimestamp"].is_null())
            .then_some(())
    })
    .await;
    // The deletion must come at least a second after the decoy's creation (timestamps
    // are in seconds): wait for the clock to pass it.
    let made = jiff::Timestamp::now();
    wait_for(T, "a second to pass", || async {
        (jiff::Timestamp::now().duration_since(made).as_secs() >= 1).then_some(())
    })
    .await;
    remove(&parents, "db3").await;
    wait_for(T, "the real finalize Job to be created", || async {
        get_json(&jobs, "db3-final-backup").await.map(|_| ())
    })
    .await;
    // Let the decoy go, or its wave waits for it (up to 10 minutes).
    jobs.patch(
        "decoy",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("release the decoy");
    wait_for(T, "the parent to be gone", || async {
        get_json(&parents, "db3").await.is_none().then_some(())
    })
    .await;
    let finalized = events_for(&client, &ns, "db3")
        .await
        .into_iter()
        .find(|e| e["reason"] == "Finalized");
    assert!(
        finalized.is_some(),
        "{test}: the finalize step ran to its end (no Finalized event)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_rule_releases_its_finalizers() {
    let test = "removing_the_rule_releases_its_finalizers";
    let client = client().await;
    let ns = namespace(&client, "deletion-removed").await;
    let (kind, rule) = ("DelRemoved", "delremoved");
    let d = RuleDir::new();
    d.template("cm.yaml", &configmap_template("cm", "  k: v\n"));
    d.template("plain.yaml", &configmap_template("plain", "  k: v\n"));
    d.rule("r.yaml", &orphan_rule(rule, kind));
    // A second rule without deletion steps: its parents never carry the finalizer.
    d.rule(
        "plain.yaml",
        &rule_text(
            "delplain",
            "DelPlain",
            &[child("config", "v1", "ConfigMap", "plain.yaml", &[])],
        ),
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let plain = kind_api(&client, &ns, "DelPlain", T).await;
    let names: BTreeSet<String> = (0..3).map(|i| format!("r{i}")).collect();
    for n in &names {
        put(&parents, &parent(kind, &ns, n, json!({}))).await;
        put(&plain, &parent("DelPlain", &ns, n, json!({}))).await;
    }
    wait_all_ready(&parents, &names, T).await;
    wait_all_ready(&plain, &names, T).await;
    for o in list(&parents, None).await {
        assert_eq!(finalizers(&o), vec![FINALIZER], "{test}: {}", name_of(&o));
    }
    for o in list(&plain, None).await {
        assert!(
            finalizers(&o).is_empty(),
            "{test}: a parent of a rule without deletion steps has finalizers: {:?}",
            finalizers(&o)
        );
    }

    let removed = Instant::now();
    std::fs::remove_file(d.rules.join("r.yaml")).unwrap();
    wait_for(T, "every parent's finalizer to be released", || async {
        list(&parents, None)
            .await
            .iter()
            .all(|o| finalizers(o).is_empty())
            .then_some(())
    })
    .await;
    let took = removed.elapsed();
    // The Orphan children were let go of before the finalizers came off: the garbage
    // collector does not take them with their parents.
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for n in &names {
        let cm = get_json(&cms, &format!("{n}-cm"))
            .await
            .unwrap_or_else(|| panic!("{test}: {n}-cm is gone"));
        assert!(
            released(&cm),
            "{test}: {n}-cm still owned after the release: {}",
            cm["metadata"]
        );
    }
    for n in &names {
        remove(&parents, n).await;
    }
    wait_for(T, "the parents to be gone", || async {
        list(&parents, None).await.is_empty().then_some(())
    })
    .await;
    // Events are sent in the background: wait for it a while before asking.
    let released = poll_for(T, || async {
        events_for(&client, &ns, "r0")
            .await
            .into_iter()
            .any(|e| e["reason"] == "FinalizerReleased")
            .then_some(())
    })
    .await
    .is_some();
    assert!(released, "{test}: no FinalizerReleased event on r0");
    eprintln!(
        "{test}: rule file removed → finalizers of 3 parents released {:.1} s later; the parents could be deleted",
        took.as_secs_f64()
    );
    drop(op);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_command_frees_parents_without_the_operator() {
    let test = "release_command_frees_parents_without_the_operator";
    let client = client().await;
    let ns = namespace(&client, "deletion-release").await;
    let (kind, rule) = ("DelRelease", "delrelease");
    let d = RuleDir::new();
    d.template("cm.yaml", &configmap_template("cm", "  k: v\n"));
    d.rule("r.yaml", &orphan_rule(rule, kind));
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    for (name, team) in [("x", "a"), ("y", "b")] {
        let mut p = parent(kind, &ns, name, json!({}));
        p["metadata"]["labels"] = json!({"team": team});
        put(&parents, &p).await;
    }
    wait_all_ready(&parents, &["x".to_string(), "y".to_string()].into(), T).await;
    drop(op); // the operator is uninstalled first
    remove(&parents, "x").await;
    remove(&parents, "y").await;
    for n in ["x", "y"] {
        let p = get_json(&parents, n).await.expect("held by the finalizer");
        assert!(p["metadata"]["deletionTimestamp"].is_string());
    }
    let kubeconfig = kubeconfig_path();
    let common = [
        "release",
        "--rules",
        d.rules.to_str().unwrap(),
        "--templates",
        d.templates.to_str().unwrap(),
        "--namespace",
        &ns,
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ];
    // By rule, for the parents of one team only.
    let out = rulebook(&[&common[..], &["--rule", rule, "--selector", "team=a"]].concat());
    assert!(out.contains("1 of 1 parents"), "{test}: {out}");
    assert!(
        out.contains(&format!("orphaned ConfigMap {ns}/x-cm")),
        "{test}: {out}"
    );
    wait_for(T, "x to be gone", || async {
        get_json(&parents, "x").await.is_none().then_some(())
    })
    .await;
    assert!(
        get_json(&parents, "y").await.is_some(),
        "{test}: y released too"
    );
    // By kind, with the rule gone from the directory as well.
    std::fs::remove_file(d.rules.join("r.yaml")).unwrap();
    let api_version = format!("{GROUP}/v1");
    let out = rulebook(
        &[
            &common[..],
            &["--api-version", &api_version, "--kind", kind],
        ]
        .concat(),
    );
    assert!(out.contains("1 of 1 parents"), "{test}: {out}");
    // Without the rule, its Orphan children are found by the parent's record.
    assert!(
        out.contains(&format!("orphaned ConfigMap {ns}/y-cm")),
        "{test}: {out}"
    );
    wait_for(T, "y to be gone", || async {
        get_json(&parents, "y").await.is_none().then_some(())
    })
    .await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for n in ["x-cm", "y-cm"] {
        let cm = get_json(&cms, n)
            .await
            .unwrap_or_else(|| panic!("{test}: {n} was deleted: its policy is Orphan"));
        assert!(released(&cm), "{test}: {n}: {}", cm["metadata"]);
    }
}

/// The teardown runs on exactly the RBAC `rulebook rbac` generates (the operator checks
/// every permission a rule needs before starting it), which has `patch` on every rule's
/// parents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_runs_on_the_generated_rbac() {
    let test = "teardown_runs_on_the_generated_rbac";
    let client = client().await;
    let ns = namespace(&client, "deletion-rbac").await;
    let (kind, rule) = ("DelRbac", "delrbac");
    let d = RuleDir::new();
    database_templates(&d);
    d.template("plain.yaml", &configmap_template("plain", "  k: v\n"));
    d.rule("db.yaml", &database_rule(rule, kind, "60s", false));
    d.rule(
        "plain.yaml",
        &rule_text(
            "delrbacplain",
            "DelRbacPlain",
            &[child("config", "v1", "ConfigMap", "plain.yaml", &[])],
        ),
    );
    let role = unique("rulebook-deletion");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        d.rules.to_str().unwrap(),
        "--templates",
        d.templates.to_str().unwrap(),
        "--install-crds",
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]));
    let verbs_on = |resource: &str| -> Vec<String> {
        rbac[0]["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .filter(|r| {
                r["resources"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x == resource))
            })
            .flat_map(|r| r["verbs"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_str().map(String::from))
            .collect()
    };
    assert!(
        verbs_on("delrbacs").contains(&"patch".to_string()),
        "{test}: no patch on the parents of a rule with deletion steps: {:?}",
        verbs_on("delrbacs")
    );
    // Also on a rule without deletion steps: its parents may carry a finalizer an
    // earlier version put there, which only Rulebook takes off.
    assert!(
        verbs_on("delrbacplains").contains(&"patch".to_string()),
        "{test}: no patch on the parents of a rule without deletion steps"
    );
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;
    let op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds"])
        .kubeconfig(kubeconfig.path())
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, T).await;
    put(&parents, &parent(kind, &ns, "db", json!({}))).await;
    wait_all_ready(&parents, &["db".to_string()].into(), T).await;
    remove(&parents, "db").await;
    wait_for(T, "the parent to be gone", || async {
        get_json(&parents, "db").await.is_none().then_some(())
    })
    .await;
    let pvcs = api(
        &client,
        Some(&ns),
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
    );
    let pvc = get_json(&pvcs, "db-data").await.expect("the orphaned PVC");
    assert!(released(&pvc), "{test}: {}", pvc["metadata"]);
    let log = op.log_tail();
    assert!(
        !log.contains("forbidden") && !log.contains("Forbidden"),
        "{test}: refused: {log}"
    );
}

/// A rule change that drops the deletion steps takes the finalizer off the parents again
/// (the new rule version's reconciles do it), and they are deleted as any other parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_deletion_steps_removes_the_finalizer() {
    let test = "dropping_the_deletion_steps_removes_the_finalizer";
    let client = client().await;
    let ns = namespace(&client, "deletion-dropped").await;
    let (kind, rule) = ("DelDropped", "deldropped");
    let d = RuleDir::new();
    d.template("cm.yaml", &configmap_template("cm", "  k: v\n"));
    d.rule("r.yaml", &orphan_rule(rule, kind));
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let names: BTreeSet<String> = (0..2).map(|i| format!("d{i}")).collect();
    for n in &names {
        put(&parents, &parent(kind, &ns, n, json!({}))).await;
    }
    wait_all_ready(&parents, &names, T).await;
    wait_for(T, "every parent to carry the finalizer", || async {
        list(&parents, None)
            .await
            .iter()
            .all(|o| finalizers(o) == vec![FINALIZER])
            .then_some(())
    })
    .await;
    // The same rule without deletionPolicy: Orphan.
    d.rule(
        "r.yaml",
        &rule_text(
            rule,
            kind,
            &[child("config", "v1", "ConfigMap", "cm.yaml", &[])],
        ),
    );
    wait_for(T, "the finalizers to be removed", || async {
        list(&parents, None)
            .await
            .iter()
            .all(|o| finalizers(o).is_empty())
            .then_some(())
    })
    .await;
    for n in &names {
        remove(&parents, n).await;
    }
    wait_for(T, "the parents to be gone", || async {
        list(&parents, None).await.is_empty().then_some(())
    })
    .await;
    assert!(
        events_for(&client, &ns, "d0")
            .await
            .iter()
            .all(|e| e["reason"] != "FinalizerReleased"),
        "{test}: the rule was changed, not removed: its own reconciles take the finalizer off"
    );
    drop(op);
}

/// A child orphaned while it is cached as a stub (over the cache budget: a stub keeps only
/// its controller reference) keeps every other owner's reference: the orphaning patch is
/// built from the object as the API server holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_stub_keeps_its_other_owners() {
    let test = "an_orphaned_stub_keeps_its_other_owners";
    let client = client().await;
    let ns = namespace(&client, "deletion-stub").await;
    let (kind, rule) = ("DelStub", "delstub");
    let d = RuleDir::new();
    d.template("cm.yaml", &configmap_template("cm", "  k: v\n"));
    d.rule("r.yaml", &orphan_rule(rule, kind));
    // No budget: every parent and child with content is cached as a stub.
    let op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds", "--cache-namespace-mib", "0"])
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    put(&parents, &parent(kind, &ns, "s0", json!({}))).await;
    let names: BTreeSet<String> = ["s0".to_string()].into();
    wait_all_ready(&parents, &names, T).await;
    let series =
        format!("rulebook_cache_stubbed_objects_total{{rule=\"{rule}\",cache=\"children\"}}");
    wait_for(T, "the child to be cached as a stub", || async {
        (op.metric_opt(&series).await? >= 1.0).then_some(())
    })
    .await;
    // Another owner of the child, as a tenant's controller might add.
    let anchor = put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "anchor", "namespace": ns}}),
    )
    .await;
    let anchor_uid = anchor.metadata.uid.clone().unwrap_or_default();
    let child = get_json(&cms, "s0-cm").await.expect("s0-cm");
    let mut refs = child["metadata"]["ownerReferences"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    refs.push(
        json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "anchor", "uid": anchor_uid}),
    );
    merge(
        &cms,
        "s0-cm",
        json!({"metadata": {"ownerReferences": refs}}),
    )
    .await;

    remove(&parents, "s0").await;
    wait_for(T, "the parent to be gone", || async {
        get_json(&parents, "s0").await.is_none().then_some(())
    })
    .await;
    let child = get_json(&cms, "s0-cm").await.expect("the orphaned child");
    let owners: Vec<String> = child["metadata"]["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["uid"].as_str().map(String::from))
        .collect();
    eprintln!("{test}: the orphaned child's owners: {owners:?}");
    assert_eq!(
        owners,
        [anchor_uid],
        "{test}: the orphaned child lost its other owner, or kept the parent"
    );
    drop(op);
}

/// A cluster-scoped parent's teardown acts only where its render placed children (the
/// namespaces it records on itself): a tenant who may edit objects in another namespace
/// makes a ConfigMap there that claims the parent (its labels, a controller reference to
/// its UID, a finalizer of its own) and another that claims to be its `Orphan` child;
/// a third, in the children's namespace, is made after the parent's deletion began.
/// Deleting the parent deletes its real children in their waves, lets go of its `Orphan`
/// child, and is done in bounded time: none of the lookalikes is deleted, patched or
/// waited for by Rulebook (audit log), and they are still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scoped_parents_teardown_stays_where_it_placed_children() {
    let test = "a_cluster_scoped_parents_teardown_stays_where_it_placed_children";
    let client = client().await;
    let target = namespace(&client, "deletion-global").await;
    let other = namespace(&client, "deletion-global-eve").await;
    let (kind, rule) = ("DelGlobal", "delglobal");
    let d = RuleDir::new();
    d.template(
        "a.yaml",
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-a\" }}}}\n  \
             namespace: {target}\n  finalizers: [\"{HOLD}\"]\ndata:\n  k: v\n"
        ),
    );
    d.template(
        "keep.yaml",
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-keep\" }}}}\n  \
             namespace: {target}\ndata:\n  k: v\n"
        ),
    );
    let mut text = rule_text(
        rule,
        kind,
        &[
            child("a", "v1", "ConfigMap", "a.yaml", &[]),
            child(
                "keep",
                "v1",
                "ConfigMap",
                "keep.yaml",
                &["deletionPolicy: Orphan"],
            ),
        ],
    )
    .replace("  crd:\n", "  crd:\n    scope: Cluster\n");
    text.push_str("  deletion:\n    order: reverse\n");
    d.rule("g.yaml", &text);
    let op = d.operator().flags(&["--install-crds"]).start().await;
    let globals = api(&client, None, API_VERSION, kind, &plural(kind));
    wait_for(T, "the cluster-scoped CRD to be served", || async {
        globals.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    let name = unique("global");
    put(
        &globals,
        &json!({"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": {}}),
    )
    .await;
    wait_all_ready(&globals, &[name.clone()].into(), T).await;
    let p = get_json(&globals, &name).await.expect("the parent");
    let uid = uid_of(&p);
    assert_eq!(
        p["metadata"]["annotations"]["rulebook.dev/child-namespaces"],
        target.as_str(),
        "{test}: the parent records where its children are"
    );
    let cms = |ns: &str| api(&client, Some(ns), "v1", "ConfigMap", "configmaps");
    let (in_target, in_other) = (cms(&target), cms(&other));

    // The lookalikes in a namespace the parent places nothing in.
    let marks = json!({
        "app.kubernetes.io/managed-by": "rulebook",
        "rulebook.dev/rule": rule,
        "rulebook.dev/owner": uid,
        "rulebook.dev/child": "a",
    });
    let controller = json!([{"apiVersion": API_VERSION, "kind": kind, "name": name,
                             "uid": uid, "controller": true}]);
    let fake = |ns: &str, name: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": ns, "labels": marks,
                            "ownerReferences": controller, "finalizers": [HOLD]},
               "data": {"k": "fake"}})
    };
    put(&in_other, &fake(&other, "eve-fake")).await;
    let mut orphan_marks = marks.clone();
    orphan_marks["rulebook.dev/child"] = json!("keep");
    put(
        &in_other,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "eve-orphan", "namespace": other, "labels": orphan_marks,
                             "annotations": {"rulebook.dev/deletion-policy": "Orphan",
                                             "rulebook.dev/parent-name": name}}}),
    )
    .await;

    let audit = Audit::mark();
    let deleted_at = Instant::now();
    remove(&globals, &name).await;
    // The teardown waits for its held child; meanwhile a lookalike appears among the
    // children, after the deletion began.
    wait_for(T, "the held child to be deleted", || async {
        let a = get_json(&in_target, &format!("{name}-a")).await?;
        a["metadata"]["deletionTimestamp"].is_string().then_some(())
    })
    .await;
    // Made after the deletion: creation times are in seconds, and one made in the
    // deletion's second counts as made before it.
    let deletion: jiff::Timestamp =
        get_json(&globals, &name).await.expect("the parent")["metadata"]["deletionTimestamp"]
            .as_str()
            .and_then(|t| t.parse().ok())
            .expect("a deletionTimestamp");
    wait_for(T, "the second after the deletion's", || async {
        (jiff::Timestamp::now() >= deletion + jiff::SignedDuration::from_secs(1)).then_some(())
    })
    .await;
    put(&in_target, &fake(&target, "late-fake")).await;
    // Seen by the operator's cache (its watch event wakes the parent) before the held
    // child goes: the parent's status still names only its own child.
    wait_for(
        T,
        "the parent to say it waits for its held child",
        || async {
            let p = get_json(&globals, &name).await?;
            let c = condition(&p, "Deleting")?;
            (c["reason"] == "DeletingChildren").then_some(())
        },
    )
    .await;
    merge(
        &in_target,
        &format!("{name}-a"),
        json!({"metadata": {"finalizers": null}}),
    )
    .await;
    wait_for(T, "the parent to be gone", || async {
        get_json(&globals, &name).await.is_none().then_some(())
    })
    .await;
    let took = deleted_at.elapsed();

    assert!(
        get_json(&in_target, &format!("{name}-a")).await.is_none(),
        "{test}: the real child is left"
    );
    let keep = get_json(&in_target, &format!("{name}-keep"))
        .await
        .expect("the Orphan child survives");
    assert!(released(&keep), "{test}: {}", keep["metadata"]);
    for (api, fake) in [
        (&in_other, "eve-fake"),
        (&in_other, "eve-orphan"),
        (&in_target, "late-fake"),
    ] {
        assert!(
            get_json(api, fake).await.is_some(),
            "{test}: the lookalike {fake} is gone"
        );
    }
    let orphan = get_json(&in_other, "eve-orphan").await.expect("eve-orphan");
    assert_eq!(
        owner_label(&orphan),
        Some(uid.as_str()),
        "{test}: let go of"
    );
    let written: Vec<String> = rulebook_writes(&audit, &other)
        .iter()
        .map(describe_audit)
        .collect();
    assert!(
        written.is_empty(),
        "{test}: Rulebook wrote in a namespace the parent places nothing in: {written:#?}"
    );
    let deleted: Vec<String> = rulebook_deletes(&audit, &target)
        .iter()
        .filter(|e| e["objectRef"]["name"] == "late-fake")
        .map(describe_audit)
        .collect();
    assert!(
        deleted.is_empty(),
        "{test}: Rulebook deleted a lookalike made after the deletion began: {deleted:#?}"
    );
    eprintln!(
        "{test}: parent deleted with a lookalike in another namespace and one made during its \
         teardown: gone in {:.1} s; Rulebook's deletes in the other namespace: 0",
        took.as_secs_f64()
    );
    drop(op);
    for (api, fake) in [(&in_other, "eve-fake"), (&in_target, "late-fake")] {
        merge(api, fake, json!({"metadata": {"finalizers": null}})).await;
    }
}

/// Children with `deletionPolicy: Orphan` carry no ownerReference, so they outlive every
/// propagation policy: a parent deleted in the foreground (the garbage collector deletes
/// every dependent it finds at once, before the teardown could let go of them), in the
/// background, or with `orphan` (the collector strips the dependents' references first).
/// Each time the Orphan children stay (never deleted: audit log), are let go of, and the
/// parent says so (`Orphaned`); the other child goes. An `Orphan` child that still has
/// the ownerReference an older Rulebook put on it loses it at its next apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_every_propagation_policy() {
    let test = "an_orphan_child_outlives_every_propagation_policy";
    let client = client().await;
    let ns = namespace(&client, "deletion-propagation").await;
    let (kind, rule) = ("DelPropagation", "delpropagation");
    let d = RuleDir::new();
    d.template(
        "pvc.yaml",
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {{ parent.metadata.name ~ \"-data\" }}\n\
         spec:\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: 1Gi\n",
    );
    d.template("ledger.yaml", &configmap_template("ledger", "  l: x\n"));
    d.template("plain.yaml", &configmap_template("plain", "  k: v\n"));
    d.rule(
        "r.yaml",
        &rule_text(
            rule,
            kind,
            &[
                child(
                    "data",
                    "v1",
                    "PersistentVolumeClaim",
                    "pvc.yaml",
                    &["deletionPolicy: Orphan"],
                ),
                child(
                    "ledger",
                    "v1",
                    "ConfigMap",
                    "ledger.yaml",
                    &["deletionPolicy: Orphan"],
                ),
                child("plain", "v1", "ConfigMap", "plain.yaml", &[]),
            ],
        ),
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let pvcs = api(
        &client,
        Some(&ns),
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
    );
    let policies = [
        ("fg", DeleteParams::foreground()),
        ("bg", DeleteParams::background()),
        ("or", DeleteParams::orphan()),
    ];
    let names: BTreeSet<String> = policies.iter().map(|(n, _)| n.to_string()).collect();
    for n in &names {
        put(&parents, &parent(kind, &ns, n, json!({}))).await;
    }
    wait_all_ready(&parents, &names, T).await;
    let mut uids = std::collections::BTreeMap::new();
    for n in &names {
        let uid = uid_of(&get_json(&parents, n).await.expect("parent"));
        for (api, child) in [(&pvcs, format!("{n}-data")), (&cms, format!("{n}-ledger"))] {
            let o = get_json(api, &child).await.expect("an Orphan child");
            assert_eq!(owner_label(&o), Some(uid.as_str()), "{test}: {child}");
            assert!(
                o["metadata"]["ownerReferences"].is_null(),
                "{test}: {child} carries an ownerReference: {}",
                o["metadata"]
            );
            assert_eq!(
                o["metadata"]["annotations"]["rulebook.dev/parent-name"],
                n.as_str()
            );
        }
        let plain = get_json(&cms, &format!("{n}-plain")).await.expect("plain");
        assert_eq!(plain["metadata"]["ownerReferences"][0]["uid"], uid.as_str());
        uids.insert(n.clone(), uid);
    }

    // An older Rulebook's `Orphan` child: its apply (field manager `rulebook`) carried the
    // ownerReference, and another desired hash. The next apply drops the reference.
    let old = get_json(&cms, "fg-ledger").await.expect("fg-ledger");
    let mut body = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "fg-ledger", "namespace": ns,
                     "labels": old["metadata"]["labels"],
                     "annotations": old["metadata"]["annotations"],
                     "ownerReferences": [{"apiVersion": API_VERSION, "kind": kind, "name": "fg",
                                          "uid": uids["fg"], "controller": true}]},
        "data": old["data"]});
    body["metadata"]["annotations"]["rulebook.dev/desired-hash"] = json!("older");
    let older: DynamicObject = serde_json::from_value(body).expect("object");
    cms.patch(
        "fg-ledger",
        &PatchParams::apply("rulebook").force(),
        &Patch::Apply(&older),
    )
    .await
    .expect("apply as an older Rulebook");
    wait_for(
        T,
        "the older reference to be dropped by the next apply",
        || async {
            let o = get_json(&cms, "fg-ledger").await?;
            (o["metadata"]["ownerReferences"].is_null()
                && o["metadata"]["annotations"]["rulebook.dev/desired-hash"] != "older")
                .then_some(())
        },
    )
    .await;

    // The garbage collector must watch the kind for the foreground deletion to proceed.
    gc_watches(
        &client,
        &parent(kind, &ns, "canary", json!({})),
        &plural(kind),
    )
    .await;
    let audit = Audit::mark();
    for (n, params) in &policies {
        parents.delete(n, params).await.expect("delete the parent");
    }
    wait_for(T, "the parents to be gone", || async {
        let left = list(&parents, None).await;
        left.iter()
            .all(|o| !names.contains(&name_of(o)))
            .then_some(())
    })
    .await;
    let deletes: Vec<String> = audit
        .writes(&ns)
        .iter()
        .filter(|e| e["verb"] == "delete")
        .map(describe_audit)
        .collect();
    for (n, _) in &policies {
        for (api, child) in [(&pvcs, format!("{n}-data")), (&cms, format!("{n}-ledger"))] {
            let o = get_json(api, &child)
                .await
                .unwrap_or_else(|| panic!("{test}: {child} was deleted: {deletes:#?}"));
            assert!(
                o["metadata"]["deletionTimestamp"].is_null(),
                "{test}: {child} is being deleted: {deletes:#?}"
            );
            assert!(released(&o), "{test}: {child}: {}", o["metadata"]);
        }
        assert!(
            !deletes.iter().any(|e| e.contains(&format!("/{n}-data "))
                || e.contains(&format!("/{n}-ledger "))),
            "{test}: an Orphan child of {n} was deleted: {deletes:#?}"
        );
    }
    for n in ["fg", "bg"] {
        wait_for(T, &format!("{n}-plain to go with its parent"), || async {
            get_json(&cms, &format!("{n}-plain"))
                .await
                .is_none()
                .then_some(())
        })
        .await;
    }
    for (n, _) in &policies {
        let orphaned = poll_for(T, || async {
            let events = events_for(&client, &ns, n).await;
            let ours = |what: &str| {
                events.iter().any(|e| {
                    e["reason"] == "Orphaned"
                        && e["note"]
                            .as_str()
                            .is_some_and(|m| m.contains(&format!("{n}-{what}")))
                })
            };
            (ours("data") && ours("ledger")).then_some(())
        })
        .await;
        assert!(
            orphaned.is_some(),
            "{test}: no Orphaned events on {n}: {:#?}",
            events_for(&client, &ns, n)
                .await
                .iter()
                .map(|e| (e["reason"].clone(), e["note"].clone()))
                .collect::<Vec<_>>()
        );
    }
    eprintln!(
        "{test}: foreground, background and orphan deletion: every Orphan child kept and let go of; \
         {} deletes in the namespace",
        deletes.len()
    );
    drop(op);
}
