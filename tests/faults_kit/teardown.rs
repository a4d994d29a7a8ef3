//! The database rule of the deletion tests (`tests/deletion.rs`) and the SIGKILL-during-
//! teardown scenario (`tests/faults_heavy.rs`): a parent whose deletion runs a finalize
//! Job, then deletes its children in reverse rule order and orphans its PVC.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value as Json, json};

use super::*;
use crate::common::*;

pub const FINALIZER: &str = "rulebook.dev/finalizer";
pub const HOLD: &str = "test.rulebook.dev/hold";

/// The database rule: `config` (ConfigMap), `data` (PVC, orphaned), `service` (ConfigMap
/// held by the test's finalizer when `spec.hold`), `final_backup` (the finalize Job,
/// suspended — never done — when `spec.stuck`).
pub fn database_rule(rule: &str, kind: &str, timeout: &str, adopt: bool) -> String {
    let mut text = rule_text(
        rule,
        kind,
        &[
            child("config", "v1", "ConfigMap", "db/config.yaml", &[]),
            child(
                "data",
                "v1",
                "PersistentVolumeClaim",
                "db/pvc.yaml",
                &if adopt {
                    vec!["deletionPolicy: Orphan", "adopt: true"]
                } else {
                    vec!["deletionPolicy: Orphan"]
                },
            ),
            child("service", "v1", "ConfigMap", "db/service.yaml", &[]),
            child("final_backup", "batch/v1", "Job", "db/backup.yaml", &[]),
        ],
    );
    text.push_str(&format!(
        "  deletion:\n    order: reverse\n    finalize:\n      child: final_backup\n      \
         doneWhen: \"child.status.succeeded | default(0) >= 1\"\n      timeout: {timeout}\n"
    ));
    text
}

pub fn database_templates(d: &RuleDir) {
    d.template("db/config.yaml", &configmap_template("config", "  k: v\n"));
    d.template(
        "db/pvc.yaml",
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {{ parent.metadata.name ~ \"-data\" }}\n\
         spec:\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: 1Gi\n",
    );
    d.template(
        "db/service.yaml",
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-svc\" }}}}\n\
             {{% if parent.spec.hold | default(false) %}}  finalizers: [\"{HOLD}\"]\n{{% endif %}}data:\n  k: v\n"
        ),
    );
    d.template(
        "db/backup.yaml",
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: {{ parent.metadata.name ~ \"-final-backup\" }}\n\
         spec:\n  suspend: {{ parent.spec.stuck | default(false) }}\n  backoffLimit: 0\n  template:\n    spec:\n      \
         restartPolicy: Never\n      containers:\n        - name: backup\n          image: registry.example/backup:1\n",
    );
}

/// Whether a child has been let go of: no ownerReference (an `Orphan` child never has
/// one) and none of Rulebook's labels.
pub fn released(o: &Json) -> bool {
    let labels = o["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    o["metadata"]["ownerReferences"].is_null()
        && !labels
            .keys()
            .any(|k| k.starts_with("rulebook.dev/") || k == "app.kubernetes.io/managed-by")
}

/// The parent UID a child's owner label names.
pub fn owner_label(o: &Json) -> Option<&str> {
    o["metadata"]["labels"]["rulebook.dev/owner"].as_str()
}

pub fn finalizers(o: &Json) -> Vec<String> {
    o["metadata"]["finalizers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

pub fn condition(o: &Json, type_: &str) -> Option<Json> {
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

pub async fn events_for(client: &kube::Client, ns: &str, parent: &str) -> Vec<Json> {
    let events = api(client, Some(ns), "events.k8s.io/v1", "Event", "events");
    list(&events, None)
        .await
        .into_iter()
        .filter(|e| e["regarding"]["name"] == parent)
        .collect()
}

/// Rulebook's deletes (user agent `rulebook/…`) in the audit log since `audit`, by object.
pub fn rulebook_deletes(audit: &Audit, ns: &str) -> Vec<Json> {
    audit
        .writes(ns)
        .into_iter()
        .filter(|e| {
            e["verb"] == "delete"
                && e["userAgent"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("rulebook/"))
        })
        .collect()
}

/// Where a round of [`kill_during_teardown`] kills the operator.
#[derive(Clone, Copy, Debug)]
pub enum KillAt {
    /// Right after the parents' deletion (finalize children being created).
    Deleted,
    /// Once a finalize Job exists (waiting for doneWhen, marking the step over).
    Finalizing,
    /// While a wave waits for a held child (released while the operator is down).
    Waves,
    /// A moment after the held children are released (the last waves, the finalizer).
    Finishing,
}

/// What [`kill_during_teardown`] found.
pub struct TeardownKills {
    pub rounds: usize,
    pub parents: usize,
    /// Slowest time from a restart to the round's parents all gone.
    pub slowest_after_restart: Duration,
}

/// `rounds` rounds of `per_round` database parents each: deleted, the operator SIGKILLed
/// at one step of the teardown (the steps in turn, with some jitter), restarted, and the
/// round checked: every parent gone (none left with the finalizer), no child left but the
/// orphaned PVCs (without owner or Rulebook labels), and no child deleted twice.
pub async fn kill_during_teardown(
    kind: &str,
    rounds: usize,
    per_round: usize,
    timeout: Duration,
) -> TeardownKills {
    let test = "kill_during_teardown";
    let client = client().await;
    let ns = namespace(&client, "teardown-kill").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    database_templates(&d);
    d.rule("db.yaml", &database_rule(&rule, kind, "60s", false));
    let start = || {
        d.operator()
            .namespace(&ns)
            .flags(&["--install-crds"])
            .start()
    };
    let mut op = start().await;
    let parents = kind_api(&client, &ns, kind, timeout).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let jobs = api(&client, Some(&ns), "batch/v1", "Job", "jobs");
    let pvcs = api(
        &client,
        Some(&ns),
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
    );
    let mut rng = Rng::new(test);
    let steps = [
        KillAt::Deleted,
        KillAt::Finalizing,
        KillAt::Waves,
        KillAt::Finishing,
    ];
    let audit = Audit::mark();
    let mut slowest = Duration::ZERO;
    for round in 0..rounds {
        let at = steps[round % steps.len()];
        let names: BTreeSet<String> = (0..per_round).map(|i| format!("k{round}-{i}")).collect();
        for n in &names {
            put(&parents, &parent(kind, &ns, n, json!({"hold": true}))).await;
        }
        wait_all_ready(&parents, &names, timeout).await;
        let uids: BTreeSet<String> = list(&parents, None)
            .await
            .iter()
            .filter(|o| names.contains(&name_of(o)))
            .map(uid_of)
            .collect();
        for n in &names {
            remove(&parents, n).await;
        }
        let release_holds = || async {
            for n in &names {
                let cm = format!("{n}-svc");
                if get_json(&cms, &cm).await.is_some() {
                    merge(&cms, &cm, json!({"metadata": {"finalizers": null}})).await;
                }
            }
        };
        match at {
            KillAt::Deleted => tokio::time::sleep(rng.millis(0, 150)).await,
            KillAt::Finalizing => {
                wait_for(timeout, "a finalize Job", || async {
                    let found = list(&jobs, None).await.iter().any(|j| {
                        names
                            .iter()
                            .any(|n| name_of(j) == format!("{n}-final-backup"))
                    });
                    found.then_some(())
                })
                .await;
                tokio::time::sleep(rng.millis(0, 500)).await;
            }
            KillAt::Waves | KillAt::Finishing => {
                wait_for(timeout, "a held child being deleted", || async {
                    let held = list(&cms, None).await.iter().any(|c| {
                        names.iter().any(|n| name_of(c) == format!("{n}-svc"))
                            && c["metadata"]["deletionTimestamp"].is_string()
                    });
                    held.then_some(())
                })
                .await;
                if matches!(at, KillAt::Finishing) {
                    release_holds().await;
                    tokio::time::sleep(rng.millis(0, 200)).await;
                }
            }
        }
        op.signal_and_wait("KILL");
        release_holds().await;
        let restarted = Instant::now();
        op = start().await;
        wait_for(timeout, "the round's parents to be gone", || async {
            let left = list(&parents, None)
                .await
                .iter()
                .filter(|o| names.contains(&name_of(o)))
                .count();
            (left == 0).then_some(())
        })
        .await;
        slowest = slowest.max(restarted.elapsed());
        // Nothing of the round's parents is left but the orphaned PVCs.
        let owned_by_round = |o: &Json| {
            let owner = o["metadata"]["labels"]["rulebook.dev/owner"]
                .as_str()
                .unwrap_or("");
            let refs = o["metadata"]["ownerReferences"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .any(|r| uids.contains(r["uid"].as_str().unwrap_or("")))
                })
                .unwrap_or(false);
            uids.contains(owner) || refs
        };
        for (what, a) in [("ConfigMap", &cms), ("Job", &jobs), ("PVC", &pvcs)] {
            let left: Vec<String> = list(a, None)
                .await
                .iter()
                .filter(|o| owned_by_round(o))
                .map(name_of)
                .collect();
            assert!(
                left.is_empty(),
                "{test}: round {round} (killed at {at:?}): {what}s still owned: {left:?}"
            );
        }
        for n in &names {
            assert!(
                get_json(&pvcs, &format!("{n}-data")).await.is_some(),
                "{test}: round {round} (killed at {at:?}): the orphaned PVC of {n} is gone"
            );
        }
    }
    // No child deleted twice: one successful delete by Rulebook per object at most.
    let mut deleted: BTreeMap<String, usize> = BTreeMap::new();
    for e in rulebook_deletes(&audit, &ns) {
        let code = e["responseStatus"]["code"].as_i64().unwrap_or(0);
        if (200..300).contains(&code) {
            let key = format!(
                "{}/{}",
                e["objectRef"]["resource"].as_str().unwrap_or(""),
                e["objectRef"]["name"].as_str().unwrap_or("")
            );
            *deleted.entry(key).or_default() += 1;
        }
    }
    let twice: Vec<&String> = deleted
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| k)
        .collect();
    assert!(
        twice.is_empty(),
        "{test}: deleted more than once: {twice:?}"
    );
    drop(op);
    TeardownKills {
        rounds,
        parents: rounds * per_round,
        slowest_after_restart: slowest,
    }
}
