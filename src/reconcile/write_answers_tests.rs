//! Unit tests that the writer's lean reading of a write's answer (rulebook-kube's
//! `write::writer`: a status apply's metadata, a child apply decoded as a cached child)
//! reads, for the reconcile's memo and drift check, as the whole object would. They live
//! here because the memo and the drift check do; the answers' own decoding is tested in
//! rulebook-kube.

use kube::api::DynamicObject;
use serde_json::json;

use crate::cache::wire::Wire;
use crate::meta::FIELD_MANAGER;
use crate::write::writer::StatusApplied;

#[test]
fn a_status_answer_has_the_identity_of_the_whole_object() {
    let answer = json!({
        "apiVersion": "x.dev/v1", "kind": "P",
        "metadata": {"name": "p", "namespace": "n", "uid": "u", "resourceVersion": "42",
            "generation": 3, "labels": {"a": "b"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "c": "d"},
            "finalizers": ["rulebook.dev/finalize"],
            "managedFields": [{"manager": "rulebook", "operation": "Apply",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:x": {}}}}]},
        "spec": {"big": "x".repeat(1000)},
        "status": {"x": 1}
    })
    .to_string();
    let lean: StatusApplied = serde_json::from_str(&answer).unwrap();
    let whole: DynamicObject = serde_json::from_str(&answer).unwrap();
    let meta = lean.metadata.into_meta();
    assert!(super::memory::digest::identity_of(&meta).is_some());
    assert_eq!(
        super::memory::digest::identity_of(&meta),
        super::memory::digest::identity(&whole)
    );
}

#[test]
fn an_apply_answer_covers_the_fields_the_whole_object_covers() {
    let answer = crate::write::writer::sample_apply_answer();
    let lean = serde_json::from_str::<Wire<false>>(&answer)
        .unwrap()
        .into_packed();
    let whole: DynamicObject = serde_json::from_str(&answer).unwrap();
    let desired = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "c", "labels": {"rulebook.dev/owner": "p"}}, "data": {"k": "v"}});
    assert!(super::drift::fields_cover(&lean, &desired, FIELD_MANAGER));
    assert!(super::drift::fields_cover(&whole, &desired, FIELD_MANAGER));
    let more = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "c"}, "data": {"k": "v", "z": "w"}});
    assert!(!super::drift::fields_cover(&lean, &more, FIELD_MANAGER));
    assert!(!super::drift::fields_cover(&whole, &more, FIELD_MANAGER));
}
