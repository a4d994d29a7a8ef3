//! The preconditions Rulebook's writes carry, against the real API server: a create
//! (`Writer::create`) is refused — nothing written — when any object has the name, and
//! an apply to an existing child (`Writer::apply_to`) is refused when the name now
//! belongs to another object, or to none; a delete (`Writer::delete`) is refused when the
//! object changed since it was read (its controller reference taken back, say) or was
//! replaced. The reconciler's ownership checks rest on them (docs/architecture.md, "A new
//! child costs one request").
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::sync::Arc;

use common::*;
use faults_kit::*;
use kube::ResourceExt;
use rulebook::metrics::Metrics;
use rulebook::reconcile::WriteGate;
use rulebook::write::writer::{Created, Deleted, WriteError, Writer};
use serde_json::json;

struct Open;
impl WriteGate for Open {
    fn may_write(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_applies_are_refused_when_the_name_is_not_what_was_read() {
    let test = "creates_and_applies_are_refused_when_the_name_is_not_what_was_read";
    let client = client().await;
    let ns = namespace(&client, "preconditions").await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let w = Writer::new(Arc::new(Open), Arc::new(Metrics::new()), "test");
    let desired = |v: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": ns, "labels": {"rulebook.dev/rule": "test"}},
            "data": {"v": v}})
    };

    // A free name: the create creates.
    let created = match w.create(&cms, "c", &desired("1")).await {
        Ok(Created::Created(o)) => *o,
        other => panic!("{test}: create of a free name: {other:?}"),
    };
    let uid = created.uid().expect("uid");
    // The name taken: refused with 409, nothing written.
    let rv = get_json(&cms, "c").await.unwrap()["metadata"]["resourceVersion"].clone();
    match w.create(&cms, "c", &desired("2")).await {
        Ok(Created::Refused(kube::Error::Api(s))) => assert_eq!(s.code, 409, "{test}"),
        other => panic!("{test}: create of a taken name: {other:?}"),
    }
    let now = get_json(&cms, "c").await.unwrap();
    assert_eq!(now["metadata"]["resourceVersion"], rv, "{test}: written");
    assert_eq!(now["data"]["v"], "1", "{test}");

    // The object read: the apply goes through.
    let applied = w.apply_to(&cms, "c", &desired("3"), &uid).await;
    assert!(
        applied.is_ok(),
        "{test}: apply to the object read: {applied:?}"
    );
    assert_eq!(get_json(&cms, "c").await.unwrap()["data"]["v"], "3");

    // Replaced by another object of the same name: refused, the newcomer untouched.
    cms.delete("c", &Default::default()).await.expect("delete");
    wait_for(T, "c to go", || async {
        get_json(&cms, "c").await.is_none().then_some(())
    })
    .await;
    let foreign = put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": ns}, "data": {"v": "theirs"}}),
    )
    .await;
    match w.apply_to(&cms, "c", &desired("4"), &uid).await {
        Err(WriteError::Api(kube::Error::Api(s))) => {
            eprintln!(
                "{test}: apply to a replaced object: {} {}",
                s.code, s.message
            );
            assert!(s.code == 409 || s.code == 422, "{test}: {s:?}");
        }
        other => panic!("{test}: apply to a replaced object went through: {other:?}"),
    }
    let now = get_json(&cms, "c").await.unwrap();
    assert_eq!(now["metadata"]["uid"], foreign.uid().unwrap(), "{test}");
    assert_eq!(
        now["metadata"]["resourceVersion"].as_str(),
        foreign.resource_version().as_deref(),
        "{test}: the newcomer was written"
    );
    assert!(now["metadata"]["labels"].is_null(), "{test}");

    // Gone: the apply does not create it again.
    cms.delete("c", &Default::default()).await.expect("delete");
    wait_for(T, "c to go", || async {
        get_json(&cms, "c").await.is_none().then_some(())
    })
    .await;
    let gone = w.apply_to(&cms, "c", &desired("5"), &uid).await;
    assert!(
        gone.is_err(),
        "{test}: an apply to a deleted object created one"
    );
    assert!(get_json(&cms, "c").await.is_none(), "{test}: created");
}

/// A delete is of the object as it was read: a change since (here, the controller
/// reference and Rulebook's labels taken back by the object's author) refuses it, and so
/// does a replacement; the object as read is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_are_refused_when_the_object_is_not_as_it_was_read() {
    let test = "deletes_are_refused_when_the_object_is_not_as_it_was_read";
    let client = client().await;
    let ns = namespace(&client, "preconditions-delete").await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let w = Writer::new(Arc::new(Open), Arc::new(Metrics::new()), "test");
    let read = put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "d", "namespace": ns, "labels": {"rulebook.dev/rule": "test"}},
            "data": {"v": "1"}}),
    )
    .await;
    // Taken back after it was read.
    let taken = put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "d", "namespace": ns, "labels": {}}, "data": {"v": "mine"}}),
    )
    .await;
    assert_ne!(taken.resource_version(), read.resource_version(), "{test}");
    let stale = w
        .delete(&cms, "d", read.uid(), read.resource_version())
        .await;
    assert!(
        matches!(stale, Ok(Deleted::Changed)),
        "{test}: a delete of the object as it was before: {stale:?}"
    );
    assert_eq!(
        get_json(&cms, "d").await.map(|o| o["data"]["v"].clone()),
        Some(json!("mine")),
        "{test}: deleted although it changed since it was read"
    );
    // Replaced: the newcomer stays.
    cms.delete("d", &Default::default()).await.expect("delete");
    wait_for(T, "d to go", || async {
        get_json(&cms, "d").await.is_none().then_some(())
    })
    .await;
    let newcomer = put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "d", "namespace": ns}, "data": {"v": "new"}}),
    )
    .await;
    let replaced = w.delete(&cms, "d", read.uid(), None).await;
    assert!(
        matches!(replaced, Ok(Deleted::Changed)),
        "{test}: a delete of a replaced object: {replaced:?}"
    );
    assert!(
        get_json(&cms, "d").await.is_some(),
        "{test}: the newcomer was deleted"
    );
    // As read: deleted.
    let exact = w
        .delete(&cms, "d", newcomer.uid(), newcomer.resource_version())
        .await;
    assert!(matches!(exact, Ok(Deleted::Deleted)), "{test}: {exact:?}");
    let gone = w
        .delete(&cms, "d", newcomer.uid(), newcomer.resource_version())
        .await;
    assert!(
        matches!(gone, Ok(Deleted::Gone | Deleted::Changed)),
        "{test}: a second delete: {gone:?}"
    );
}

const T: std::time::Duration = std::time::Duration::from_secs(60);
