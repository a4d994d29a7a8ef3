//! A rolling update of a sharded group, against the local control plane: two replicas
//! run rule set v1; a v2 replica surges in, one v1 replica leaves, a second v2 replica
//! comes, the last v1 replica leaves. Only members running the rule set most members run
//! hold ranges, so the two versions never share the work: from the audit log, every
//! object is written by v1 replicas and then by v2 replicas, never back and forth; a
//! v2 replica in the minority writes nothing; in the end every child has v2's content.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;
mod shards_kit;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use kube::api::ListParams;
use shards_kit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_never_lets_two_rule_versions_fight() {
    let test = "a_rolling_update_never_lets_two_rule_versions_fight";
    let (kind, rule) = ("ShardRoll", "shardroll");
    let spaces_n = size("SHARD_ROLL_NAMESPACES", 20);
    let per = size("SHARD_TEST_PER_NAMESPACE", 5);
    let client = client().await;
    let v1 = Fleet::new(kind, rule, kubeconfig_path());
    let v2 = v1.next_version(kind, rule, "  version: \"2\"\n");
    let spaces = namespaces(&client, &unique("roll"), spaces_n).await;
    let everything: Vec<(String, String)> = spaces
        .iter()
        .flat_map(|ns| (0..per).map(move |i| (ns.clone(), format!("p{i}"))))
        .collect();
    let audit = Audit::mark();
    let ids: Vec<String> = ["a1", "b1", "c2", "d2"]
        .iter()
        .map(|n| unique(&format!("roll-{n}")))
        .collect();
    let version_of = |agent: &str| -> Option<u8> {
        ids.iter()
            .position(|id| agent.contains(&format!("({id})")))
            .map(|i| if i < 2 { 1 } else { 2 })
    };

    let a = v1.replica_as(Some(&ids[0])).await;
    let b = v1.replica_as(Some(&ids[1])).await;
    create_parents(&client, kind, &spaces, per).await;
    ready_at(&client, kind, &everything, 0, T).await;

    // v2 surges in: one of three, it holds nothing, through two leases and a change.
    let c = v2.replica_as(Some(&ids[2])).await;
    wait_for(T, "the v2 replica to be a member", || async {
        let s = share(&a).await;
        (s["members"].as_array().map(Vec::len) == Some(3)).then_some(())
    })
    .await;
    touch(&client, kind, &everything, 1).await;
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(2 * LEASE) {
        let s = share(&c).await;
        assert_eq!(
            s["ranges"].as_str(),
            Some(""),
            "a v2 replica in the minority holds ranges: {s}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ready_at(&client, kind, &everything, 1, T).await;
    let by_c = writes_by(&audit, &spaces, &ids[2]);
    assert!(
        by_c.is_empty(),
        "the v2 replica wrote while v1 ran the group: {:?}",
        by_c.iter().map(describe_audit).collect::<Vec<_>>()
    );

    // One v1 replica leaves (1:1, the greater fingerprint runs), a second v2 comes (2:1).
    let mut a = a;
    a.signal_and_wait("TERM");
    let d = v2.replica_as(Some(&ids[3])).await;
    let switched = Instant::now();
    wait_for(T, "the v2 replicas to hold everything", || async {
        let (sb, sc, sd) = (share(&b).await, share(&c).await, share(&d).await);
        let pc = sc["percentOfHashSpace"].as_f64()?;
        let pd = sd["percentOfHashSpace"].as_f64()?;
        (sb["ranges"].as_str() == Some("")
            && sc["waitingFor"].as_array().is_some_and(Vec::is_empty)
            && pc + pd > 99.99)
            .then_some(())
    })
    .await;
    let took = switched.elapsed();
    // Every child gets v2's content (and a change after the switch reaches them all).
    touch(&client, kind, &everything, 2).await;
    ready_at(&client, kind, &everything, 2, T).await;
    let cms = api(&client, None, "v1", "ConfigMap", "configmaps");
    wait_for(T, "every child to carry v2's content", || async {
        let at_v2 = cms
            .list(&ListParams::default().labels(&format!("rulebook.dev/rule={rule}")))
            .await
            .ok()?
            .items
            .iter()
            .filter(|c| {
                c.metadata
                    .namespace
                    .as_ref()
                    .is_some_and(|ns| spaces.contains(ns))
                    && c.data["data"]["version"] == "2"
            })
            .count();
        (at_v2 == everything.len()).then_some(())
    })
    .await;
    let mut b = b;
    b.signal_and_wait("TERM");

    // From the audit log: per object, the versions of its writers in time order.
    let mut order: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut writes = Vec::new();
    for ns in &spaces {
        writes.extend(rulebook_writes(&audit, ns));
    }
    writes.sort_by_key(audit_time);
    let mut unknown = 0;
    for e in &writes {
        let Some(v) = version_of(e["userAgent"].as_str().unwrap_or("")) else {
            unknown += 1;
            continue;
        };
        let object = format!(
            "{}/{}/{}/{}",
            e["objectRef"]["namespace"].as_str().unwrap_or(""),
            e["objectRef"]["resource"].as_str().unwrap_or(""),
            e["objectRef"]["subresource"].as_str().unwrap_or(""),
            e["objectRef"]["name"].as_str().unwrap_or("")
        );
        let seq = order.entry(object).or_default();
        if seq.last() != Some(&v) {
            seq.push(v);
        }
    }
    let back_and_forth: Vec<(&String, &Vec<u8>)> = order
        .iter()
        .filter(|(_, seq)| seq.windows(2).any(|w| w[0] > w[1]))
        .collect();
    let by_version = |v: u8| {
        writes
            .iter()
            .filter(|e| version_of(e["userAgent"].as_str().unwrap_or("")) == Some(v))
            .count()
    };
    eprintln!(
        "{test}: {} writes ({} by v1 replicas, {} by v2, {unknown} by no replica of this test); \
         the v2 replicas held everything {:.1} s after the second one started; objects written \
         by v2 after v1: {}",
        writes.len(),
        by_version(1),
        by_version(2),
        took.as_secs_f64(),
        order.values().filter(|s| s == &&vec![1, 2]).count(),
    );
    assert_eq!(unknown, 0, "writes by a process this test did not start");
    assert!(
        by_version(1) > 0 && by_version(2) > 0,
        "both versions wrote: the test watched a handover"
    );
    assert!(
        back_and_forth.is_empty(),
        "objects written by v1 after v2 wrote them: {back_and_forth:#?}"
    );
    no_two_writers(&audit, &spaces);
    drop((c, d));
}
