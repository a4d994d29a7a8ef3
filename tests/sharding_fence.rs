//! A sharded replica that stalls (SIGSTOP) past its member Lease while it converges its
//! share, against the local control plane: the other replica counts it dead, fences it
//! (deletes its Lease), takes its namespaces over and applies a change to every parent;
//! then the stalled one resumes. Its write gate must know by itself that its claims
//! lapsed: from the API server's audit log, it writes nothing from 1 s after it was
//! stopped until it has rejoined as a new member — and nothing is written by two
//! replicas in one second.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;
mod shards_kit;

use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use serde_json::Value as Json;
use shards_kit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_replica_never_writes_what_another_took_over() {
    let test = "a_stalled_replica_never_writes_what_another_took_over";
    let (kind, rule) = ("ShardFence", "shardfence");
    let spaces_n = size("SHARD_FENCE_NAMESPACES", 30);
    let per = size("SHARD_TEST_PER_NAMESPACE", 10);
    let total = spaces_n * per;
    let client = client().await;
    let fleet = Fleet::new(kind, rule, kubeconfig_path());
    let spaces = namespaces(&client, &unique("fence"), spaces_n).await;
    let audit = Audit::mark();
    // Distinct process identities: the audit log's user agents tell the two apart.
    let a_id = unique("fence-a");
    let b_id = unique("fence-b");
    let a = fleet.replica_as(Some(&a_id)).await;
    let b = fleet.replica_as(Some(&b_id)).await;
    // One parent per namespace first, so that the ranges follow the load (FNV-1a puts
    // names alike close together: an even split of the hash space could leave A none).
    create_parents(&client, kind, &spaces, 1).await;
    let ranges = settled_ranges(&[&a, &b], |r| {
        r.iter().all(|r| spaces.iter().any(|ns| in_ranges(r, ns)))
    })
    .await;
    let a_member = share(&a).await["identity"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let a_ranges = ranges[0].clone();
    let a_spaces: Vec<String> = spaces
        .iter()
        .filter(|ns| in_ranges(&a_ranges, ns))
        .cloned()
        .collect();
    assert!(
        !a_spaces.is_empty(),
        "replica A holds none of the {spaces_n} namespaces: {a_ranges}"
    );

    // A is stopped while it converges the rest: it has reconciles in flight.
    let writer = {
        let (client, spaces) = (client.clone(), spaces.to_vec());
        tokio::spawn(async move { create_parents(&client, kind, &spaces, per).await })
    };
    let parents = api(&client, None, API_VERSION, kind, &plural(kind));
    let ready_at_stop = wait_for(T, "A to be converging", || async {
        let items = parents.list(&Default::default()).await.ok()?.items;
        let ready = items
            .iter()
            .filter(|p| {
                p.metadata
                    .namespace
                    .as_ref()
                    .is_some_and(|ns| a_spaces.contains(ns))
            })
            .map(to_json)
            .filter(is_ready)
            .count();
        (ready >= a_spaces.len() + 3).then_some(ready)
    })
    .await;
    signal(a.pid(), "STOP");
    let stopped = jiff::Timestamp::now();
    let stopped_at = Instant::now();
    writer.await.expect("parents created");

    // B counts A dead after a lease, fences it and takes every namespace.
    wait_for(T, "B to hold every namespace", || async {
        let s = share(&b).await;
        (s["members"].as_array().map(Vec::len) == Some(1)
            && s["percentOfHashSpace"].as_f64().is_some_and(|p| p > 99.99))
        .then_some(())
    })
    .await;
    let took_over = stopped_at.elapsed();
    all_ready(&client, kind, &spaces, total, None, T).await;
    // A change only B applies: every parent's child moves to wave 1.
    let everything: Vec<(String, String)> = spaces
        .iter()
        .flat_map(|ns| (0..per).map(move |i| (ns.clone(), format!("p{i}"))))
        .collect();
    touch(&client, kind, &everything, 1).await;
    ready_at(&client, kind, &everything, 1, T).await;

    // A resumes: its caches still hold the parents at wave 0 and its children without
    // the change, so each reconcile it had queued would write — had its gate not lapsed.
    signal(a.pid(), "CONT");
    let resumed = Instant::now();
    let rejoined_as = wait_for(
        Duration::from_secs(60),
        "A to rejoin as a new member",
        || async {
            let s = share(&a).await;
            let id = s["identity"].as_str()?.to_string();
            (id != a_member).then_some(id)
        },
    )
    .await;
    let rejoined = jiff::Timestamp::now();
    let rejoin_took = resumed.elapsed();
    // Then both share the work again, and every parent is still at wave 1.
    wait_for(T, "A and B to share the namespaces again", || async {
        let s = share(&b).await;
        (s["members"].as_array().map(Vec::len) == Some(2)
            && s["waitingFor"].as_array().is_some_and(Vec::is_empty)
            && share(&a).await["ranges"]
                .as_str()
                .is_some_and(|r| !r.is_empty()))
        .then_some(())
    })
    .await;
    ready_at(&client, kind, &everything, 1, T).await;

    let refused = a
        .metric_opt("rulebook_writes_refused_total")
        .await
        .unwrap_or(0.0);
    let cutoff = stopped
        .checked_add(jiff::SignedDuration::from_secs(1))
        .expect("time");
    let by_a = writes_by(&audit, &spaces, &a_id);
    let stale: Vec<&Json> = by_a
        .iter()
        .filter(|e| audit_received(e).is_some_and(|t| t > cutoff && t < rejoined))
        .collect();
    eprintln!(
        "{test}: A stopped with {ready_at_stop} of its {} parents Ready; B held everything {:.1} s later \
         (lease {LEASE} s); A rejoined as {rejoined_as} {:.2} s after SIGCONT; A's writes: {} in all, \
         {} between 1 s after SIGSTOP and its rejoin; writes A's gate refused: {refused}",
        a_spaces.len() * per,
        took_over.as_secs_f64(),
        rejoin_took.as_secs_f64(),
        by_a.len(),
        stale.len(),
    );
    for e in stale.iter().take(20) {
        eprintln!("{test}:   stale write by A: {}", describe_audit(e));
    }
    assert!(
        !by_a.is_empty(),
        "A wrote nothing at all: the test did not watch it work"
    );
    assert!(
        stale.is_empty(),
        "A wrote {} time(s) after it stalled past its lease, before it rejoined",
        stale.len()
    );
    no_two_writers(&audit, &spaces);
    drop((a, b));
}
