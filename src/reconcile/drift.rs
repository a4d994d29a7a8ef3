//! Whether a live child already is what Rulebook would apply, so that no write is needed.
//!
//! Two checks, both on the cached object, neither needing a request:
//!
//! 1. **Desired changed?** The child carries `rulebook.dev/desired-hash`, the hash of the
//!    object Rulebook last applied. A different desired hash means the template, the
//!    parent or the rule changed: apply.
//! 2. **Drifted?** When someone else changes a field Rulebook applied, the API server
//!    moves that field's ownership to them (server-side apply field management). So the
//!    child is intact exactly when Rulebook's own `managedFields` entry (operation
//!    `Apply`) still covers every field of the desired object. Values are never
//!    compared, so server-side defaulting and normalisation (`1000m` → `1`) cannot
//!    cause a write loop.
//!
//! Lists are matched by their `k:{...}` keys (list maps such as containers by name),
//! `v:` values (sets), or taken whole when the fieldset has no per-item entries
//! (atomic lists). If that reading ever disagrees with what the API server recorded
//! (the object right after an apply does not pass the check), the reconciler falls back
//! to the hash alone for that object rather than re-applying forever.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;
use kube::api::DynamicObject;
use serde_json::{Map, Value as Json};

use crate::meta::labels;

/// Why a child needs an apply, or `None` when it is up to date.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Drift {
    Missing,
    DesiredChanged,
    FieldsChanged,
}

/// Read from the typed metadata as cached: the annotation first, and Rulebook's own
/// fieldset only when the hash matches, so a changed child costs no JSON at all.
pub fn drift(
    live: Option<&DynamicObject>,
    desired_hash: &str,
    desired: &Json,
    manager: &str,
    hash_only: bool,
) -> Option<Drift> {
    let Some(live) = live else {
        return Some(Drift::Missing);
    };
    let live_hash = live
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(labels::DESIRED_HASH));
    if live_hash.map(String::as_str) != Some(desired_hash) {
        return Some(Drift::DesiredChanged);
    }
    if hash_only || fields_cover(live, desired, manager) {
        None
    } else {
        Some(Drift::FieldsChanged)
    }
}

/// `manager`'s Apply entry's fieldset (not a subresource's), as returned by the API
/// server or packed into a string by the cache. `Some(Err(()))`: packed and unreadable.
pub fn own_fields<'a>(o: &'a DynamicObject, manager: &str) -> Option<Result<Cow<'a, Json>, ()>> {
    let entry = o
        .metadata
        .managed_fields
        .as_ref()?
        .iter()
        .find(|e| crate::cache::is_apply_by(e, manager))?;
    let FieldsV1(fields) = entry.fields_v1.as_ref()?;
    Some(match fields {
        Json::String(text) => serde_json::from_str(text).map(Cow::Owned).map_err(|_| ()),
        other => Ok(Cow::Borrowed(other)),
    })
}

/// Whether `manager`'s Apply entry in the object's managedFields covers every field set
/// in `desired`.
pub fn fields_cover(live: &DynamicObject, desired: &Json, manager: &str) -> bool {
    match own_fields(live, manager) {
        Some(Ok(fields)) => fieldset_covers(&fields, desired),
        _ => false,
    }
}

/// Whether the fieldset `fields` (a `fieldsV1` tree) covers every field set in `desired`.
/// apiVersion, kind, metadata.name and metadata.namespace identify the object and are
/// never recorded as fields.
pub fn fieldset_covers(fields: &Json, desired: &Json) -> bool {
    let Some(desired) = desired.as_object() else {
        return false;
    };
    map_covered(fields, desired, &["apiVersion", "kind"], true)
}

/// Whether the fieldset `sub` (the entry for one field or list item) covers `v`.
fn covered(sub: &Json, v: &Json) -> bool {
    // `{}` owns the value whole: a leaf, or an atomic map, list or list item.
    if sub.as_object().is_some_and(|m| m.is_empty()) {
        return true;
    }
    match v {
        Json::Object(m) => map_covered(sub, m, &[], false),
        Json::Array(items) => list_covered(sub, items),
        _ => true,
    }
}

/// [`covered`] for a map, leaving out the keys in `skip`; at the `top` level of an
/// object, `metadata` leaves out `name` and `namespace`.
fn map_covered(fields: &Json, desired: &Map<String, Json>, skip: &[&str], top: bool) -> bool {
    let Some(fields) = fields.as_object() else {
        return false;
    };
    desired.iter().all(|(k, v)| {
        if v.is_null() || skip.contains(&k.as_str()) {
            return true; // a null in an apply configuration owns nothing
        }
        let Some(sub) = fields.get(&format!("f:{k}")) else {
            return false;
        };
        match v {
            Json::Object(meta) if top && k == "metadata" => {
                sub.as_object().is_some_and(|m| m.is_empty())
                    || map_covered(sub, meta, &["name", "namespace"], false)
            }
            _ => covered(sub, v),
        }
    })
}

fn list_covered(fields: &Json, items: &[Json]) -> bool {
    let Some(fields) = fields.as_object() else {
        return false;
    };
    let per_item = fields
        .keys()
        .any(|k| k.starts_with("k:") || k.starts_with("v:") || k.starts_with("i:"));
    if !per_item {
        return true; // an atomic list: owned whole
    }
    items.iter().all(|item| match item {
        Json::Object(m) => fields.iter().any(|(key, sub)| {
            key.strip_prefix("k:")
                .and_then(|k| serde_json::from_str::<Map<String, Json>>(k).ok())
                .is_some_and(|k| k.iter().all(|(kk, kv)| key_matches(m.get(kk), kv)))
                && covered(sub, item)
        }),
        Json::Null => true,
        scalar => {
            let Ok(text) = serde_json::to_string(scalar) else {
                return false;
            };
            fields.contains_key(&format!("v:{text}"))
        }
    })
}

/// A list-map key field matches the item's value; the server may have normalised a
/// number written as a string or the other way round (ports), so compare loosely.
fn key_matches(item: Option<&Json>, key: &Json) -> bool {
    match (item, key) {
        (Some(a), b) if a == b => true,
        (Some(Json::String(a)), Json::Number(b)) | (Some(Json::Number(b)), Json::String(a)) => {
            a == &b.to_string()
        }
        // A key field the template leaves out is defaulted by the server (e.g. protocol: TCP).
        (None, _) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(j: Json) -> DynamicObject {
        serde_json::from_value(j).unwrap()
    }

    fn live_with(fields: Json, hash: &str) -> DynamicObject {
        object(json!({
            "metadata": {
                "name": "x",
                "annotations": {"rulebook.dev/desired-hash": hash},
                "managedFields": [
                    {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
                    {"manager": "rulebook", "operation": "Apply", "fieldsV1": fields}
                ]
            }
        }))
    }

    fn desired() -> Json {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "x", "namespace": "ns", "labels": {"a": "1"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "P", "name": "p", "uid": "u1", "controller": true}]},
            "spec": {
                "replicas": 2,
                "template": {"spec": {"containers": [{"name": "app", "image": "nginx", "ports": [{"containerPort": 80}]}]}},
                "args": ["a", "b"],
                "atomic": [1, 2],
                "selector": {"matchLabels": {"app": "x"}}
            }
        })
    }

    fn full_fields() -> Json {
        json!({
            "f:metadata": {"f:labels": {"f:a": {}}, "f:ownerReferences": {"k:{\"uid\":\"u1\"}": {}}},
            "f:spec": {
                "f:replicas": {},
                "f:template": {"f:spec": {"f:containers": {
                    "k:{\"name\":\"app\"}": {".": {}, "f:name": {}, "f:image": {},
                        "f:ports": {"k:{\"containerPort\":80,\"protocol\":\"TCP\"}": {".": {}, "f:containerPort": {}}}}
                }}},
                "f:args": {"v:\"a\"": {}, "v:\"b\"": {}},
                "f:atomic": {},
                "f:selector": {}
            }
        })
    }

    #[test]
    fn intact_child_needs_nothing() {
        let live = live_with(full_fields(), "h1");
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            None
        );
    }

    #[test]
    fn changed_desired_or_missing_child_needs_apply() {
        let live = live_with(full_fields(), "h0");
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            Some(Drift::DesiredChanged)
        );
        assert_eq!(
            drift(None, "h1", &desired(), "rulebook", false),
            Some(Drift::Missing)
        );
    }

    #[test]
    fn a_field_taken_by_another_manager_is_drift() {
        let mut fields = full_fields();
        fields["f:spec"]
            .as_object_mut()
            .unwrap()
            .remove("f:replicas");
        let live = live_with(fields.clone(), "h1");
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            Some(Drift::FieldsChanged)
        );
        // ... unless the object is checked by hash only
        assert_eq!(drift(Some(&live), "h1", &desired(), "rulebook", true), None);
    }

    #[test]
    fn a_field_inside_a_list_item_taken_is_drift() {
        let mut fields = full_fields();
        fields["f:spec"]["f:template"]["f:spec"]["f:containers"]["k:{\"name\":\"app\"}"]
            .as_object_mut()
            .unwrap()
            .remove("f:image");
        let live = live_with(fields, "h1");
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            Some(Drift::FieldsChanged)
        );
    }

    #[test]
    fn a_set_value_lost_is_drift() {
        let mut fields = full_fields();
        fields["f:spec"]["f:args"]
            .as_object_mut()
            .unwrap()
            .remove("v:\"b\"");
        let live = live_with(fields, "h1");
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            Some(Drift::FieldsChanged)
        );
    }

    #[test]
    fn no_apply_entry_is_drift() {
        let live =
            object(json!({"metadata": {"annotations": {"rulebook.dev/desired-hash": "h1"}}}));
        assert_eq!(
            drift(Some(&live), "h1", &desired(), "rulebook", false),
            Some(Drift::FieldsChanged)
        );
    }
}
