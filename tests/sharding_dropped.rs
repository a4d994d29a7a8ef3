//! The clean-up of a child kind dropped from a rule, on sharded replicas, against the
//! local control plane: each replica lets go of the dropped kind's children only in the
//! namespaces its share holds, through the rule's own gate, as its reconciles write.
//! From the audit log: every Secret is deleted once, by the replica whose ranges hold its
//! namespace, and no object is written by two replicas in one second.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;
mod shards_kit;

use std::collections::BTreeMap;

use common::*;
use faults_kit::*;
use kube::api::ListParams;
use shards_kit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_kind_is_cleaned_up_by_the_replica_of_each_namespace() {
    let test = "a_dropped_kind_is_cleaned_up_by_the_replica_of_each_namespace";
    let (kind, rule) = ("ShardDrop", "sharddrop");
    let (spaces_n, per) = (8, 2);
    let client = client().await;
    // Parents of this kind left by an earlier run would count in the balance, and names
    // alike hash alike: this run's namespaces could all fall to one replica.
    let leftovers = api(&client, None, API_VERSION, kind, &plural(kind));
    if let Ok(l) = leftovers.list(&ListParams::default()).await {
        // This test's own kind: namespaces an earlier run did not get to clean up.
        let spaces: std::collections::BTreeSet<String> = l
            .items
            .iter()
            .filter_map(|p| p.metadata.namespace.clone())
            .collect();
        for ns in &spaces {
            TestNamespace::delete_leftover(&client, ns).await;
        }
    }
    wait_for(T, "parents of an earlier run to be gone", || async {
        match leftovers.list(&ListParams::default().limit(1)).await {
            Ok(l) => l.items.is_empty().then_some(()),
            Err(_) => Some(()), // no CRD yet: no parents
        }
    })
    .await;
    let fleet = Fleet::new(kind, rule, kubeconfig_path());
    let d = fleet.dir();
    d.template(
        "secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-tok\" }}\nstringData:\n  t: x\n",
    );
    let cm = child("cm", "v1", "ConfigMap", "cm.yaml", &[]);
    let tok = child("tok", "v1", "Secret", "secret.yaml", &[]);
    d.rule("shard.yaml", &rule_text(rule, kind, &[cm.clone(), tok]));
    let spaces = namespaces(&client, &unique("drop"), spaces_n).await;
    let ids = [unique("drop-a"), unique("drop-b")];
    let a = fleet.replica_as(Some(&ids[0])).await;
    let b = fleet.replica_as(Some(&ids[1])).await;
    create_parents(&client, kind, &spaces, per).await;
    all_ready(&client, kind, &spaces, spaces_n * per, None, T).await;
    let secrets = api(&client, None, "v1", "Secret", "secrets");
    let ours = || async {
        secrets
            .list(&ListParams::default().labels(&format!("rulebook.dev/rule={rule}")))
            .await
            .ok()
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|s| {
                        s.metadata
                            .namespace
                            .as_ref()
                            .is_some_and(|ns| spaces.contains(ns))
                    })
                    .count()
            })
    };
    wait_for(T, "every parent's Secret", || async {
        (ours().await? == spaces_n * per).then_some(())
    })
    .await;
    // Both replicas hold namespaces of this test (the ranges follow the parents' load).
    let ranges = settled_ranges(&[&a, &b], |r| {
        r.iter().all(|r| spaces.iter().any(|ns| in_ranges(r, ns)))
    })
    .await;
    let held: Vec<usize> = ranges
        .iter()
        .map(|r| spaces.iter().filter(|ns| in_ranges(r, ns)).count())
        .collect();
    let generation = share(&a).await["generation"].clone();
    assert!(generation.is_u64(), "{test}: /status has no generation");

    // The Secret child leaves the rule; both replicas reload it.
    let audit = Audit::mark();
    d.rule("shard.yaml", &rule_text(rule, kind, &[cm]));
    wait_for(
        T,
        "every Secret of the dropped kind to be pruned",
        || async { (ours().await? == 0).then_some(()) },
    )
    .await;
    // Both replicas reload the edit a moment apart; while their rule sets differ, the
    // ranges may move (the rolling-update rule) and come back. Then whoever held a
    // namespace at the time of a write is not known here: only the replica is checked.
    let moved = share(&a).await["generation"] != generation;

    let mut deletes: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ns in &spaces {
        let holder = ids
            .iter()
            .zip(&ranges)
            .find(|(_, r)| in_ranges(r, ns))
            .map(|(id, _)| id)
            .expect("a holder");
        for e in rulebook_writes(&audit, ns) {
            if e["verb"] != "delete" || e["objectRef"]["resource"] != "secrets" {
                continue;
            }
            let agent = e["userAgent"].as_str().unwrap_or("");
            let by = if moved {
                &ids[..]
            } else {
                std::slice::from_ref(holder)
            };
            assert!(
                by.iter().any(|id| agent.contains(&format!("({id})"))),
                "{test}: {} deleted by a replica whose share does not hold {ns} (holder {holder}, ranges moved: {moved})",
                describe_audit(&e)
            );
            deletes
                .entry(format!(
                    "{ns}/{}",
                    e["objectRef"]["name"].as_str().unwrap_or("")
                ))
                .or_default()
                .push(describe_audit(&e));
        }
    }
    assert_eq!(
        deletes.len(),
        spaces_n * per,
        "{test}: every Secret deleted by Rulebook: {deletes:#?}"
    );
    let twice: Vec<_> = deletes.values().filter(|v| v.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "{test}: deleted more than once: {twice:#?}"
    );
    no_two_writers(&audit, &spaces);
    eprintln!(
        "{test}: {} Secrets in {spaces_n} namespaces deleted, each once; the replicas held {held:?} of them; the ranges moved meanwhile: {moved}",
        deletes.len()
    );
    drop((a, b));
}
