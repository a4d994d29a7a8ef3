//! Several versions of a rule's CRD on the local control plane (issue 43): the API server
//! calls the conversion webhook Rulebook serves on 127.0.0.1, so an object created as
//! `v1alpha1` reads back as `v1` and the reverse, and children are rendered from the
//! storage version; switching the storage version migrates every stored object (counted
//! in etcd, before and after), through a SIGKILL of the operator mid-way, and ends with
//! `status.storedVersions` holding the new version alone.
// A scenario test reads top to bottom as one story (see tests/reconcile_examples.rs).
#![allow(clippy::too_many_lines)]

mod common;
mod versions_kit;

use std::time::{Duration, Instant};

use common::*;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::json;
use versions_kit::*;

/// A migration of [`migrated`] objects under a loaded `make test` (one took 40 s alone).
const MIGRATION_T: Duration = Duration::from_secs(300);

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_read_back_in_either_version_and_children_render_from_storage() {
    let client = client().await;
    let ns = namespace(&client, "vers-read").await;
    let v = Versioned::new("rd");
    v.write_rule("v1", true);
    let port = free_port();
    let op = v.operator(&ns, port).start().await;
    let crd = v.wait_crd(&client, &[port], "v1").await;
    assert_eq!(
        crd["spec"]["conversion"]["webhook"]["conversionReviewVersions"],
        json!(["v1"])
    );
    let alpha = v.api(&client, &ns, "v1alpha1");
    let one = v.api(&client, &ns, "v1");

    // Created as v1alpha1 (the API server converts it to v1 to store it), read as v1.
    wait_for(T, "a create as v1alpha1", || async {
        alpha
            .create(&PostParams::default(), &v.parent_v1alpha1("old"))
            .await
            .ok()
    })
    .await;
    let read = to_json(&one.get("old").await.unwrap());
    assert_eq!(read["apiVersion"], format!("{GROUP}/v1"));
    assert_eq!(
        read["spec"],
        json!({"replicas": 1, "container": {"image": "old:1", "port": 8080}})
    );
    // And back as v1alpha1, as written.
    let back = to_json(&alpha.get("old").await.unwrap());
    assert_eq!(
        back["spec"],
        json!({"replicas": 1, "image": "old:1", "port": 8080})
    );

    // Created as v1, read as v1alpha1.
    let new: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"), "kind": v.kind,
        "metadata": {"name": "new"},
        "spec": {"container": {"image": "new:2"}},
    }))
    .unwrap();
    one.create(&PostParams::default(), &new).await.unwrap();
    let read = to_json(&alpha.get("new").await.unwrap());
    assert_eq!(read["apiVersion"], format!("{GROUP}/v1alpha1"));
    assert_eq!(read["spec"], json!({"image": "new:2"}));
    // A list in v1alpha1 converts every object.
    let listed = alpha.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 2);

    // The children are rendered from the storage version (v1: spec.container.image).
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for (name, image) in [("old", "old:1"), ("new", "new:2")] {
        let cm = wait_for(T, &format!("the ConfigMap of {name}"), || async {
            Some(to_json(&cms.get_opt(name).await.ok()??))
        })
        .await;
        assert_eq!(cm["data"]["image"], image);
        assert_eq!(cm["data"]["readAs"], format!("{GROUP}/v1"));
    }

    // Conversion has no failure policy: with no replica answering, the kind cannot be
    // read in another version than it is stored in (a clear error); nothing is lost,
    // and reads come back with the operator.
    drop(op);
    let err = wait_for(T, "reads in v1alpha1 to fail", || async {
        match alpha.get("old").await {
            Err(kube::Error::Api(s)) => Some(s.message),
            _ => None,
        }
    })
    .await;
    println!("with no webhook: {err}");
    assert!(err.contains("conversion webhook"), "{err}");
    assert_eq!(
        to_json(&one.get("old").await.unwrap())["spec"]["container"]["image"],
        "old:1",
        "the storage version reads without conversion"
    );
    let _op = v.operator(&ns, port).start().await;
    let back = wait_for(T, "reads in v1alpha1 to come back", || async {
        alpha.get("old").await.ok()
    })
    .await;
    assert_eq!(to_json(&back)["spec"]["image"], "old:1");
    v.remove_crd(&client).await;
}

/// How many objects the migration test stores: `RULEBOOK_TEST_MIGRATED`, default 500
/// (five pages of the migration's 100; docs/reference/crd.md says so). 1,000 doubled this
/// binary's share of a warm `make test` on 2 cores and proved nothing 500 does not: the
/// kill still lands after two pages and before the last (the migration is paced).
fn migrated() -> usize {
    std::env::var("RULEBOOK_TEST_MIGRATED")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 300)
        .unwrap_or(500)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_the_storage_version_migrates_every_object_through_a_sigkill() {
    let client = client().await;
    let ns = namespace(&client, "vers-mig").await;
    // The objects live in a namespace the operator does not reconcile: a reconcile's
    // status write stores its parent in the storage version too, and would migrate
    // them before the migration does (every one of 500 within seconds of the switch).
    // The migration covers every namespace of the kind, watched or not.
    let stored = namespace(&client, "vers-mig-store").await;
    let v = Versioned::new("mig");
    v.write_rule("v1alpha1", false);
    let port = free_port();
    // Paced, so that the SIGKILL below lands mid-way whatever the machine's speed:
    // unpaced, 300 rewrites fit between a /status poll and the kill.
    let paced = ["--migration-rate", "50"];
    let mut op = v.operator(&ns, port).flags(&paced).start().await;
    v.wait_crd(&client, &[port], "v1alpha1").await;
    let alpha = v.api(&client, &stored, "v1alpha1");

    // `n` objects, stored as v1alpha1.
    let n = migrated();
    let started = Instant::now();
    let mut creates = tokio::task::JoinSet::new();
    for w in 0..8 {
        let (alpha, objects): (Api<DynamicObject>, Vec<DynamicObject>) = (
            alpha.clone(),
            (0..n)
                .filter(|i| i % 8 == w)
                .map(|i| v.parent_v1alpha1(&format!("p-{i:04}")))
                .collect(),
        );
        creates.spawn(async move {
            for o in objects {
                alpha
                    .create(&PostParams::default(), &o)
                    .await
                    .expect("create");
            }
        });
    }
    while let Some(r) = creates.join_next().await {
        r.unwrap();
    }
    println!("{n} objects created in {:?}", started.elapsed());
    let before = stored_versions(&v, &stored).await;
    assert_eq!(
        before,
        [(format!("{GROUP}/v1alpha1"), n)].into(),
        "stored before"
    );

    // v1 becomes the storage version: the migration starts; the operator is killed
    // mid-way (after at least two pages).
    let started = Instant::now();
    v.write_rule("v1", false);
    let seen = wait_for(MIGRATION_T, "the migration to be under way", || async {
        let m = migration(&op, &v.rule).await?;
        (m["state"] == "running" && m["rewritten"].as_u64()? >= 200).then_some(m)
    })
    .await;
    op.signal_and_wait("KILL");
    println!("killed at {seen} after {:?}", started.elapsed());
    assert_eq!(seen["from"], json!(["v1alpha1"]));
    assert_eq!(seen["to"], "v1");
    let crd = to_json(&v.crds(&client).get(&v.crd_name()).await.unwrap());
    assert_eq!(
        crd["status"]["storedVersions"],
        json!(["v1alpha1", "v1"]),
        "not trimmed before every object is rewritten"
    );
    let marker = migration_marker(&crd).expect("the resume marker");
    assert_eq!(marker["to"], "v1");
    let partly = stored_versions(&v, &stored).await;
    println!("stored after the kill: {partly:?}");
    assert!(
        partly.get(&format!("{GROUP}/v1")).copied().unwrap_or(0)
            >= marker["rewritten"].as_u64().unwrap() as usize,
        "every object up to the marker is stored as v1: {partly:?}, {marker}"
    );
    assert!(
        partly.contains_key(&format!("{GROUP}/v1alpha1")),
        "killed mid-way: {partly:?}"
    );

    // A new operator resumes and finishes; every object is stored as v1, and v1alpha1
    // leaves storedVersions.
    let op2 = v.operator(&ns, port).start().await;
    let done = wait_for(MIGRATION_T, "the migration to finish", || async {
        let m = migration(&op2, &v.rule).await?;
        (m["state"] == "done").then_some(m)
    })
    .await;
    println!("done: {done} after {:?}", started.elapsed());
    assert_eq!(done["rewritten"], n, "each object counted once");
    let crd = to_json(&v.crds(&client).get(&v.crd_name()).await.unwrap());
    assert_eq!(crd["status"]["storedVersions"], json!(["v1"]));
    assert!(
        crd["metadata"]["annotations"]
            .get("rulebook.dev/storage-migration")
            .is_none()
    );
    let after = stored_versions(&v, &stored).await;
    assert_eq!(after, [(format!("{GROUP}/v1"), n)].into(), "stored after");
    // Nothing lost, nothing changed: every object reads as it was written.
    let listed = alpha.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), n);
    for o in &listed.items {
        let o = to_json(o);
        let name = o["metadata"]["name"].as_str().unwrap();
        assert_eq!(
            o["spec"],
            json!({"replicas": 1, "image": format!("{name}:1"), "port": 8080})
        );
    }
    assert!(op2.log_tail().contains("storage migration: done"));
    v.remove_crd(&client).await;
}
