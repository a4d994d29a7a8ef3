//! A rule with cluster-scoped parents in a sharded group, against the local control
//! plane. Such a rule is not split: the member whose ranges hold the hash of the rule's
//! name runs it whole (its children may be in any namespace), and it moves like a
//! range. From the audit log: only that member writes the rule's children; after it is
//! killed, the survivor takes the rule over (timed and printed: issue 19 asks for the
//! Lease + 10 s), and from then on only the survivor writes them.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;
mod shards_kit;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use shards_kit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scoped_rule_runs_whole_on_one_member_and_moves() {
    let test = "a_cluster_scoped_rule_runs_whole_on_one_member_and_moves";
    let (kind, rule) = ("ShardSpread", "shardspread");
    let (cluster_kind, cluster_rule) = ("ShardGlobal", "shardglobal");
    const N: usize = 10;
    let client = client().await;
    let fleet = Fleet::new(kind, rule, kubeconfig_path());
    // The cluster-scoped rule's children all live in one namespace of the test's.
    let target = namespace(&client, "shard-global").await;
    fleet.dir().template(
        "global.yaml",
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-g\" }}}}\n  namespace: {target}\ndata:\n  gen: \"{{{{ parent.spec.gen | default(0) }}}}\"\n"
        ),
    );
    fleet.dir().rule(
        "global.yaml",
        &rule_text(
            cluster_rule,
            cluster_kind,
            &[child("g", "v1", "ConfigMap", "global.yaml", &[])],
        )
        .replace("  crd:\n", "  crd:\n    scope: Cluster\n"),
    );
    // Namespaced load too, so both members hold ranges.
    let spaces = namespaces(&client, &unique("spread"), 10).await;
    let ids = [unique("global-a"), unique("global-b")];
    let mut ops = vec![
        fleet.replica_as(Some(&ids[0])).await,
        fleet.replica_as(Some(&ids[1])).await,
    ];
    create_parents(&client, kind, &spaces, 2).await;
    all_ready(&client, kind, &spaces, 20, None, T).await;
    // Balanced and settled: the rule's owner is the member whose ranges hold the hash of
    // its name.
    let ranges = settled_ranges(&[&ops[0], &ops[1]], |r| {
        r.iter().any(|r| in_ranges(r, cluster_rule))
    })
    .await;
    let owner = ranges
        .iter()
        .position(|r| in_ranges(r, cluster_rule))
        .expect("an owner");
    let audit = Audit::mark();
    let globals = api(
        &client,
        None,
        API_VERSION,
        cluster_kind,
        &plural(cluster_kind),
    );
    wait_for(T, "the cluster-scoped CRD to be served", || async {
        globals.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    let names: Vec<String> = (0..N).map(|i| unique(&format!("g{i}"))).collect();
    for name in &names {
        let obj: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": API_VERSION, "kind": cluster_kind,
            "metadata": {"name": name}, "spec": {"gen": 0}
        }))
        .expect("parent");
        globals
            .create(&Default::default(), &obj)
            .await
            .expect("cluster-scoped parent");
    }
    let cms = api(&client, Some(&target), "v1", "ConfigMap", "configmaps");
    let children_at = |wave: u64| {
        let cms = cms.clone();
        async move {
            cms.list(&Default::default())
                .await
                .map(|l| {
                    l.items
                        .iter()
                        .filter(|c| {
                            c.data["data"]["gen"].as_str() == Some(wave.to_string().as_str())
                        })
                        .count()
                })
                .unwrap_or(0)
        }
    };
    wait_for(T, "every cluster-scoped parent's child", || async {
        (children_at(0).await == N).then_some(())
    })
    .await;
    let survivor = 1 - owner;
    let writers = |audit: &Audit| -> BTreeSet<String> {
        rulebook_writes(audit, &target)
            .iter()
            .filter_map(|e| {
                let agent = e["userAgent"].as_str()?;
                ids.iter()
                    .find(|id| agent.contains(&format!("({id})")))
                    .cloned()
            })
            .collect()
    };
    let before = writers(&audit);
    assert_eq!(
        before,
        BTreeSet::from([ids[owner].clone()]),
        "only the rule's owner writes its children"
    );

    // The owner dies; a change to every cluster-scoped parent reaches its child through
    // the survivor.
    let after_kill = Audit::mark();
    ops[owner].signal_and_wait("KILL");
    let killed = Instant::now();
    for name in &names {
        globals
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"gen": 1}})),
            )
            .await
            .expect("patch");
    }
    wait_for(
        Duration::from_secs(LEASE + 10 + 120),
        "the survivor to reconcile the cluster-scoped parents",
        || async { (children_at(1).await == N).then_some(()) },
    )
    .await;
    let took = killed.elapsed();
    eprintln!(
        "{test}: the rule's owner ({}) wrote its children; after SIGKILL the survivor reconciled \
         all {N} within {took:?} (lease {LEASE} s)",
        ids[owner]
    );
    // Issue 19 asks for the Lease + 10 s; the figure above is the measurement (it depends
    // on what else the 2 cores run), the bound catches a takeover that never comes.
    assert!(
        took <= Duration::from_secs(LEASE + 60),
        "the survivor never took the rule over (Lease + 60 s): {took:?}"
    );
    assert_eq!(
        writers(&after_kill),
        BTreeSet::from([ids[survivor].clone()]),
        "after the kill, only the survivor writes the rule's children"
    );
    no_two_writers(&audit, &[target.to_string()]);
    drop(ops);
    for name in &names {
        let _ = globals.delete(name, &Default::default()).await;
    }
}
