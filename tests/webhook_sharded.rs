//! Webhooks and storage migration on sharded replicas (issue 43), on the local control
//! plane: two `rulebook run --sharding namespace` replicas serve the webhooks of two rules
//! — one with an `expr:` check and a computed default read from a ConfigMap in the
//! parent's namespace, one with `v1alpha1` and `v1` converted by templates — for parents
//! in a namespace of each replica's share. The check refuses a bad parent and the default
//! lands in both; objects read back in both versions in both. Then the storage version
//! switches to `v1`: the replica that takes the migration's Lease
//! (`rulebook-migration-<CRD>`) rewrites the objects of every namespace, its own share's
//! and the other's; it is SIGKILLed mid-way, the other (which showed it as the holder on
//! `/status`) takes the Lease over once it expires, resumes from the CRD's marker, and
//! finishes once: every object stored as `v1` (counted in etcd), each counted once,
//! `storedVersions: [v1]`, the Lease given up.

// A scenario test reads top to bottom as one story: set up, act, wait, assert. The
// function size limit (clippy.toml, issue 42) is for the product code in src/ and crates/.
#![allow(clippy::too_many_lines)]

mod common;
mod versions_kit;
mod webhook_kit;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value as Json, json};
use versions_kit::{Versioned, migration, migration_marker, stored_versions};
use webhook_kit::{Hooked, free_port, is_refusal};

/// Migrated objects per namespace: 2 × 200, four pages of the migration.
const PER_NAMESPACE: usize = 200;
/// The member and migration Leases' duration.
const LEASE: &str = "6";
const T: Duration = Duration::from_secs(180);

/// The admission rule: parents with more than 3 replicas refused, `spec.image` defaulted
/// from the ConfigMap `platform-defaults` of the parent's namespace.
fn admission_rule(h: &Hooked) -> String {
    h.rule_yaml(
        r#"    - name: platformDefaults
      apiVersion: v1
      kind: ConfigMap
      objectName: "'platform-defaults'"
      optional: true
"#,
        r#"    validate:
      - expr: "parent.spec.replicas <= 3"
        message: "replicas {{ parent.spec.replicas }} is more than 3"
    default:
      - path: spec.image
        expr: "refs.platformDefaults.data.image"
"#,
    )
}

/// This replica's share (`/status` `sharding.ranges`) once it holds one and waits for
/// no acknowledgement.
async fn settled_share(op: &Operator) -> Option<String> {
    let s: Json = serde_json::from_str(&op.get_opt("/status").await?).ok()?;
    let sharding = &s["sharding"];
    let ranges = sharding["ranges"].as_str()?.to_string();
    (!ranges.is_empty() && sharding["waitingFor"].as_array().is_some_and(Vec::is_empty))
        .then_some(ranges)
}

fn holds(ranges: &str, ns: &str) -> bool {
    rulebook::shard::Ranges::decode(ranges).is_ok_and(|r| r.holds_namespace(ns))
}

/// How often `needle` is in the operator's whole log.
fn log_count(op: &Operator, needle: &str) -> usize {
    std::fs::read_to_string(&op.log)
        .unwrap_or_default()
        .matches(needle)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_serve_webhooks_for_every_share_and_migrate_once_through_a_sigkill() {
    let client = client().await;
    // The Leases' and the certificates' namespace (webhooks skip it).
    let home = namespace(&client, "ws-home").await;
    let h = Hooked::new("wsh", "Fail");
    std::fs::write(h.rules.join(format!("{}.yaml", h.rule)), admission_rule(&h)).unwrap();
    let v = Versioned::beside(&h.rules, &h.templates, "wsv");
    v.write_rule("v1alpha1", false);
    let group = unique("ws-group");
    let ids = [unique("ws-a"), unique("ws-b")];
    let ports = [free_port(), free_port()];
    let replica = |i: usize| {
        let sharding = [
            // Paced, so that the SIGKILL of the migration's holder lands mid-way.
            "--migration-rate",
            "50",
            "--sharding",
            "namespace",
            "--lease-name",
            &group,
            "--lease-namespace",
            home.name(),
            "--lease-duration",
            LEASE,
            "--shard-rebalance-seconds",
            "20",
            "--identity",
            &ids[i],
        ]
        .map(str::to_string);
        Operator::on(&h.rules, &h.templates)
            .flags(&h.flags(home.name(), ports[i]))
            .flags(&sharding)
    };
    let a = replica(0).start().await;
    wait_for(T, "the first replica's share", || settled_share(&a)).await;
    let b = replica(1).start().await;
    let mut ops = [Some(a), Some(b)];
    let shares = wait_for(T, "both replicas' shares", || async {
        let sa = settled_share(ops[0].as_ref()?).await?;
        let sb = settled_share(ops[1].as_ref()?).await?;
        (sa != sb).then_some([sa, sb])
    })
    .await;
    println!("shares: {shares:?}");

    // A namespace in each replica's share.
    let mut guards = Vec::new();
    let mut spaces: [Option<String>; 2] = [None, None];
    while spaces.iter().any(Option::is_none) {
        assert!(
            guards.len() < 16,
            "16 namespaces, none in one share: {shares:?}"
        );
        let ns = namespace(&client, "ws").await;
        for (i, share) in shares.iter().enumerate() {
            if spaces[i].is_none() && holds(share, ns.name()) {
                spaces[i] = Some(ns.name().to_string());
            }
        }
        guards.push(ns);
    }
    let spaces: Vec<String> = spaces.into_iter().flatten().collect();
    println!("namespaces by share: {spaces:?}");

    // Both CRDs, the conversion and admission webhooks published by one replica or the
    // other, with the shared CA.
    wait_established(&client, &h.crd_name()).await;
    v.wait_crd(&client, &ports, "v1alpha1").await;
    let config = h.wait_configuration(&client).await;
    println!(
        "admission webhook at {}",
        config["webhooks"][0]["clientConfig"]["url"]
    );

    // Admission, whichever share the parent's namespace is in.
    for ns in &spaces {
        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let defaults: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "platform-defaults"},
            "data": {"image": format!("img-{ns}")},
        }))
        .unwrap();
        maps.create(&PostParams::default(), &defaults)
            .await
            .unwrap();
        h.wait_enforced(&client, ns).await;
        let parents = h.parents(&client, ns);
        match parents
            .create(&PostParams::default(), &h.parent("too-big", 5))
            .await
        {
            Err(kube::Error::Api(s)) => assert!(is_refusal(&s.message), "{ns}: {}", s.message),
            other => panic!("{ns}: a parent with 5 replicas was not refused: {other:?}"),
        }
        let stored = to_json(
            &parents
                .create(&PostParams::default(), &h.parent("fine", 1))
                .await
                .unwrap_or_else(|e| panic!("{ns}: {e}")),
        );
        assert_eq!(
            stored["spec"]["image"],
            format!("img-{ns}"),
            "{ns}: the default"
        );
        // Reconciled by the replica whose share holds the namespace.
        let child = wait_for(T, &format!("{ns}: the child of fine"), || async {
            maps.get_opt("fine").await.ok()?
        })
        .await;
        assert_eq!(child.data.unwrap_or_default()["replicas"], "1");
    }

    // Conversion: created as v1alpha1, read as v1 and as v1alpha1, in both shares.
    for ns in &spaces {
        let (alpha, one) = (v.api(&client, ns, "v1alpha1"), v.api(&client, ns, "v1"));
        alpha
            .create(&PostParams::default(), &v.parent_v1alpha1("old"))
            .await
            .unwrap_or_else(|e| panic!("{ns}: {e}"));
        let read = to_json(&one.get("old").await.unwrap());
        assert_eq!(
            read["spec"],
            json!({"replicas": 1, "container": {"image": "old:1", "port": 8080}}),
            "{ns}"
        );
        let back = to_json(&alpha.get("old").await.unwrap());
        assert_eq!(
            back["spec"],
            json!({"replicas": 1, "image": "old:1", "port": 8080})
        );
    }

    // The objects to migrate, stored as v1alpha1 in both namespaces.
    let mut creates = tokio::task::JoinSet::new();
    for ns in &spaces {
        for w in 0..4 {
            let alpha = v.api(&client, ns, "v1alpha1");
            let objects: Vec<DynamicObject> = (0..PER_NAMESPACE - 1)
                .filter(|i| i % 4 == w)
                .map(|i| v.parent_v1alpha1(&format!("p-{i:03}")))
                .collect();
            creates.spawn(async move {
                for o in objects {
                    alpha
                        .create(&PostParams::default(), &o)
                        .await
                        .expect("create");
                }
            });
        }
    }
    while let Some(r) = creates.join_next().await {
        r.unwrap();
    }
    let alpha_version = format!("{}/v1alpha1", versions_kit::GROUP);
    let one_version = format!("{}/v1", versions_kit::GROUP);
    for ns in &spaces {
        assert_eq!(
            stored_versions(&v, ns).await,
            [(alpha_version.clone(), PER_NAMESPACE)].into(),
            "{ns}: stored before"
        );
    }
    let total = (PER_NAMESPACE * spaces.len()) as u64;

    // v1 becomes the storage version; the Lease holder is killed mid-way (its marker
    // past the first page, the last not reached).
    let started = Instant::now();
    v.write_rule("v1", false);
    let crds = v.crds(&client);
    let leases: Api<Lease> = Api::namespaced(client.clone(), home.name());
    let lease_name = format!("rulebook-migration-{}", v.crd_name());
    let (holder, marker) = wait_for(T, "the migration under way", || async {
        let crd = to_json(&crds.get(&v.crd_name()).await.ok()?);
        assert_ne!(
            crd["status"]["storedVersions"],
            json!(["v1"]),
            "the migration finished before the test could kill its holder"
        );
        let marker = migration_marker(&crd)?;
        let rewritten = marker["rewritten"].as_u64()?;
        assert!(
            rewritten < total,
            "the migration reached its last page before the test could kill its holder"
        );
        let lease = leases.get_opt(&lease_name).await.ok()??;
        let holder = lease.spec?.holder_identity?;
        (rewritten >= 100).then_some((holder, marker))
    })
    .await;
    let killed = ids
        .iter()
        .position(|id| *id == holder)
        .unwrap_or_else(|| panic!("the Lease holder {holder} is neither replica"));
    let survivor = 1 - killed;
    ops[killed].as_mut().unwrap().signal_and_wait("KILL");
    // The holder kept migrating until the KILL landed: the marker the survivor resumes
    // from is the one on the CRD now, not the one the wait above saw.
    let crd = to_json(&crds.get(&v.crd_name()).await.unwrap());
    let marker = migration_marker(&crd)
        .unwrap_or_else(|| panic!("no migration marker after the kill (seen {marker}): {crd}"));
    assert!(
        marker["rewritten"].as_u64().is_some_and(|n| n < total),
        "the migration reached its last page before the kill landed: {marker}"
    );
    println!("killed {holder} at {marker} after {:?}", started.elapsed());
    assert_eq!(
        crd["status"]["storedVersions"],
        json!(["v1alpha1", "v1"]),
        "not trimmed before every object is rewritten"
    );
    // (etcd may hold every object as v1 already: the reconciles that follow the rule
    // change write the parents' status, which stores them in the storage version too.
    // Mid-way is what the marker says: a page done, not the last.)
    let mut partly = std::collections::BTreeMap::new();
    for ns in &spaces {
        for (version, n) in stored_versions(&v, ns).await {
            *partly.entry(version).or_insert(0) += n;
        }
    }
    println!("stored after the kill: {partly:?}");
    assert!(
        partly.get(&one_version).copied().unwrap_or(0) as u64
            >= marker["rewritten"].as_u64().unwrap(),
        "every object up to the marker is stored as v1: {partly:?}"
    );

    // The survivor shows who holds the Lease, takes it over once it expires, resumes
    // and finishes.
    let op = ops[survivor].as_ref().unwrap();
    let seen = wait_for(T, "the survivor to show the holder", || async {
        let m = migration(op, &v.rule).await?;
        (m["holder"] == holder.as_str()).then_some(m)
    })
    .await;
    println!("the survivor, standing by: {seen}");
    let done = wait_for(T, "the migration to finish", || async {
        let m = migration(op, &v.rule).await?;
        (m["state"] == "done").then_some(m)
    })
    .await;
    println!("done: {done} after {:?}", started.elapsed());
    assert_eq!(done["holder"], ids[survivor].as_str());
    assert_eq!(done["rewritten"], total, "each object counted once");
    let crd = to_json(&crds.get(&v.crd_name()).await.unwrap());
    assert_eq!(crd["status"]["storedVersions"], json!(["v1"]));
    assert!(
        crd["metadata"]["annotations"]
            .get("rulebook.dev/storage-migration")
            .is_none()
    );
    for ns in &spaces {
        assert_eq!(
            stored_versions(&v, ns).await,
            [(one_version.clone(), PER_NAMESPACE)].into(),
            "{ns}: stored after"
        );
    }
    // Once: one pass finished, on the survivor, which took the Lease once; it gave the
    // Lease up.
    let dead = ops[killed].as_ref().unwrap();
    assert_eq!(log_count(dead, "storage migration: done"), 0);
    assert_eq!(
        log_count(op, "storage migration: done"),
        1,
        "{}",
        op.log_tail()
    );
    assert_eq!(log_count(op, "storage migration: holding its Lease"), 1);
    let resumed = format!("Some({})", marker["after"]);
    assert_eq!(
        log_count(op, &resumed),
        1,
        "resumed from the marker: {}",
        op.log_tail()
    );
    let lease = wait_for(T, "the Lease given up", || async {
        let l = leases.get_opt(&lease_name).await.ok()??;
        l.spec
            .as_ref()?
            .holder_identity
            .as_deref()
            .is_none_or(str::is_empty)
            .then_some(l)
    })
    .await;
    assert!(lease.spec.unwrap().lease_transitions.unwrap_or(0) >= 1);
    // Nothing lost: every object reads as written, in both versions.
    for ns in &spaces {
        let alpha = v.api(&client, ns, "v1alpha1");
        let o = to_json(&alpha.get("p-007").await.unwrap());
        assert_eq!(
            o["spec"],
            json!({"replicas": 1, "image": "p-007:1", "port": 8080})
        );
    }
    v.remove_crd(&client).await;
    h.remove_configurations(&client).await;
}
