//! The form in which parents and children are cached, and the way back to JSON.
//!
//! Watch caches hold every parent and child of every rule, so their form decides most of
//! Rulebook's memory. A `DynamicObject` keeps its content as a `serde_json::Value` tree,
//! where every non-empty map is a B-tree node of several hundred bytes, however few keys
//! it has: a 1.3 KB ConfigMap took ~9.6 KB, 5 KB of it for Rulebook's `managedFields`
//! entry alone. Cached objects therefore keep their typed metadata, and hold their
//! content (everything but `apiVersion`, `kind` and `metadata`) and Rulebook's
//! `fieldsV1` as one compact JSON string each; [`to_json`] restores the full object when
//! a reconcile reads it. Nothing else reads cached content: kube-runtime uses only the
//! metadata.
//!
//! Children, most of what is cached, are leaner still in the store ([`lean_child`]):
//! their labels, annotations, ownerReferences and managedFields move into the same
//! string. Each of those maps and lists is a separate allocation in typed metadata (a
//! B-tree node of labels is ~500 bytes however few they are), and together they were
//! about half of a cached ConfigMap. The watch stream still carries the typed form (the
//! owner index and kube-runtime's owner mapping read it once per event), and a
//! reconcile reads a child through [`unpack`], which restores them.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    FieldsV1, ManagedFieldsEntry, OwnerReference,
};
use kube::api::{DynamicObject, TypeMeta};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::meta::FIELD_MANAGER;

/// Rulebook's own Apply entry of an object's managedFields (not the status
/// subresource's): the field set the drift check reads.
pub fn is_own_apply(e: &ManagedFieldsEntry) -> bool {
    is_apply_by(e, FIELD_MANAGER)
}

/// `manager`'s Apply entry of an object's managedFields (not a subresource's).
pub fn is_apply_by(e: &ManagedFieldsEntry, manager: &str) -> bool {
    e.manager.as_deref() == Some(manager)
        && e.operation.as_deref() == Some("Apply")
        && e.subresource.as_deref().unwrap_or("").is_empty()
}

/// Parents are cached without managedFields and the last-applied annotation.
pub fn strip_parent(o: &mut DynamicObject) {
    o.metadata.managed_fields = None;
    drop_last_applied(o);
    pack_content(o);
}

/// Children keep Rulebook's own managedFields entry (the drift check reads it); other
/// managers keep only their name, operation and time (to name them in a conflict).
pub fn strip_child(o: &mut DynamicObject) {
    if let Some(entries) = o.metadata.managed_fields.as_mut() {
        for e in entries.iter_mut() {
            if is_own_apply(e) {
                if let Some(FieldsV1(f)) = e.fields_v1.as_mut()
                    && !f.is_string()
                {
                    *f = Json::String(f.to_string());
                }
            } else {
                e.fields_v1 = None;
                e.fields_type = None;
            }
        }
    }
    drop_last_applied(o);
    pack_content(o);
}

fn drop_last_applied(o: &mut DynamicObject) {
    if let Some(a) = o.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

fn pack_content(o: &mut DynamicObject) {
    if o.data.is_object() {
        o.data = Json::String(o.data.to_string());
    }
}

/// How the packed text of a lean child starts: the moved metadata comes first.
const MOVED: &str = "{\"metadata\":";

/// The metadata a lean child keeps in its packed text.
#[derive(Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
struct Moved {
    #[serde(skip_serializing_if = "Option::is_none")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    owner_references: Option<Vec<OwnerReference>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    managed_fields: Option<Vec<ManagedFieldsEntry>>,
}

fn is_lean(o: &DynamicObject) -> bool {
    matches!(&o.data, Json::String(text) if text.starts_with(MOVED))
}

/// The store's form of a packed child (see the module comment): the same object with its
/// labels, annotations, ownerReferences and managedFields moved into the packed text. A
/// child cached without content (a stub) or already lean is cloned as it is.
pub fn lean_child(o: &DynamicObject) -> DynamicObject {
    let Json::String(content) = &o.data else {
        return o.clone();
    };
    let Some(rest) = content.strip_prefix('{') else {
        return o.clone();
    };
    if content.starts_with(MOVED) {
        return o.clone();
    }
    let m = &o.metadata;
    let moved = Moved {
        labels: m.labels.clone(),
        annotations: m.annotations.clone(),
        owner_references: m.owner_references.clone(),
        managed_fields: m.managed_fields.clone(),
    };
    let Ok(head) = serde_json::to_string(&moved) else {
        return o.clone();
    };
    let mut text = String::with_capacity(MOVED.len() + head.len() + content.len() + 1);
    text.push_str(MOVED);
    text.push_str(&head);
    if !rest.trim_start().starts_with('}') {
        text.push(',');
    }
    text.push_str(rest);
    let mut metadata = o.metadata.clone();
    metadata.labels = None;
    metadata.annotations = None;
    metadata.owner_references = None;
    metadata.managed_fields = None;
    DynamicObject {
        types: o.types.clone(),
        metadata,
        data: Json::String(text),
    }
}

/// The moved metadata of a lean child, read without parsing the content after it.
fn moved(o: &DynamicObject) -> Option<Moved> {
    let Json::String(text) = &o.data else {
        return None;
    };
    let head = text.strip_prefix(MOVED)?;
    Moved::deserialize(&mut serde_json::Deserializer::from_str(head)).ok()
}

/// A cached child as reconciles read it: a lean child with its typed metadata restored
/// (its content stays packed); any other object as it is. A lean child whose moved
/// metadata cannot be read (it was written by [`lean_child`], so only a bug) comes back
/// with none, which no check takes for a child of any parent.
pub fn unpack(o: Arc<DynamicObject>) -> Arc<DynamicObject> {
    if !is_lean(&o) {
        return o;
    }
    let m = moved(&o).unwrap_or_default();
    let mut full = (*o).clone();
    full.metadata.labels = m.labels;
    full.metadata.annotations = m.annotations;
    full.metadata.owner_references = m.owner_references;
    full.metadata.managed_fields = m.managed_fields;
    Arc::new(full)
}

/// [`to_json`], with `apiVersion` and `kind` from `ar` where the object has none (the
/// items of a list of a built-in kind come without them), so that what reads the JSON
/// can tell a Secret by its kind.
pub fn to_json_as(o: &DynamicObject, ar: &kube::api::ApiResource) -> Option<Json> {
    let mut j = to_json(o)?;
    if let Some(m) = j.as_object_mut() {
        m.entry("apiVersion")
            .or_insert_with(|| Json::String(ar.api_version.clone()));
        m.entry("kind")
            .or_insert_with(|| Json::String(ar.kind.clone()));
    }
    Some(j)
}

/// Whether [`to_json`] can read the object (its packed content and fieldset are not
/// nested beyond serde_json's limit), without building the tree: a scan of the nesting
/// depth, and the full parse only for the rare deep object.
pub fn readable(o: &DynamicObject) -> bool {
    let shallow = |text: &str| super::wire::nesting_depth(text) < 100;
    let moved = moved(o).and_then(|m| m.managed_fields).unwrap_or_default();
    let mut packed = std::iter::once(&o.data).chain(
        o.metadata
            .managed_fields
            .iter()
            .flatten()
            .chain(&moved)
            .filter_map(|e| e.fields_v1.as_ref().map(|FieldsV1(f)| f)),
    );
    packed.all(|v| match v {
        Json::String(text) => shallow(text) || serde_json::from_str::<Json>(text).is_ok(),
        _ => true,
    })
}

/// The object as JSON, whether cached (packed) or as the API server returned it.
pub fn to_json(o: &DynamicObject) -> Option<Json> {
    let content = match &o.data {
        Json::String(text) => serde_json::from_str(text).ok()?,
        other => other.clone(),
    };
    assemble(o.types.as_ref(), &o.metadata, content)
}

/// [`to_json`] of an object no one else holds (an API server's response to a write): its
/// content moves into the JSON rather than being copied.
pub fn into_json(o: DynamicObject) -> Option<Json> {
    let content = match o.data {
        Json::String(text) => serde_json::from_str(&text).ok()?,
        other => other,
    };
    assemble(o.types.as_ref(), &o.metadata, content)
}

fn assemble(types: Option<&TypeMeta>, metadata: &ObjectMeta, mut content: Json) -> Option<Json> {
    let mut out = Map::new();
    if let Some(t) = types {
        out.insert("apiVersion".into(), Json::String(t.api_version.clone()));
        out.insert("kind".into(), Json::String(t.kind.clone()));
    }
    let mut meta = serde_json::to_value(metadata).ok()?;
    // A lean child's moved metadata.
    if let (Some(Json::Object(moved)), Some(typed)) = (
        content.as_object_mut().and_then(|c| c.remove("metadata")),
        meta.as_object_mut(),
    ) {
        for (k, v) in moved {
            typed.entry(k).or_insert(v);
        }
    }
    if let Some(entries) = meta.get_mut("managedFields").and_then(Json::as_array_mut) {
        for e in entries {
            if let Some(f) = e.get_mut("fieldsV1")
                && let Json::String(text) = f
            {
                *f = serde_json::from_str(text).ok()?;
            }
        }
    }
    out.insert("metadata".into(), meta);
    if let Json::Object(fields) = content {
        for (k, v) in fields {
            if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                out.insert(k, v);
            }
        }
    }
    Some(Json::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn child() -> Json {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {
                "name": "c", "namespace": "n", "uid": "u", "resourceVersion": "7",
                "labels": {"a": "b"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "x": "y"},
                "managedFields": [
                    {"manager": "rulebook", "operation": "Apply", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:data": {"f:k": {}}}},
                    {"manager": "kubectl-edit", "operation": "Update", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:data": {"f:z": {}}}}
                ]
            },
            "data": {"k": "v", "z": "w"}
        })
    }

    #[test]
    fn a_packed_child_reads_back_as_it_was_minus_what_is_stripped() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        assert!(o.data.is_string());
        // Packing twice (a re-delivered object) changes nothing.
        strip_child(&mut o);
        let back = to_json(&o).unwrap();
        let mut want = child();
        want["metadata"]["annotations"] = json!({"x": "y"});
        want["metadata"]["managedFields"][1] =
            json!({"manager": "kubectl-edit", "operation": "Update"});
        assert_eq!(back, want);
    }

    #[test]
    fn an_unpacked_object_reads_as_serde_would_write_it() {
        let o: DynamicObject = serde_json::from_value(child()).unwrap();
        assert_eq!(to_json(&o).unwrap(), serde_json::to_value(&o).unwrap());
    }

    #[test]
    fn readable_is_what_to_json_can_read() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        assert!(readable(&o) && to_json(&o).is_some());
        for depth in [99, 100, 126, 127, 128, 200] {
            let deep = format!(
                "{{\"data\":{}\"x\"{}}}",
                "[".repeat(depth),
                "]".repeat(depth)
            );
            o.data = Json::String(deep);
            assert_eq!(readable(&o), to_json(&o).is_some(), "depth {depth}");
        }
        // Brackets inside strings do not count.
        o.data = Json::String(format!("{{\"data\":\"{}\\\"\"}}", "[".repeat(300)));
        assert!(readable(&o) && to_json(&o).is_some());
    }

    #[test]
    fn a_packed_parent_has_no_managed_fields() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_parent(&mut o);
        let back = to_json(&o).unwrap();
        assert!(back["metadata"].get("managedFields").is_none());
        assert_eq!(back["data"], json!({"k": "v", "z": "w"}));
    }

    #[test]
    fn a_lean_child_reads_back_and_unpacks_as_the_packed_one() {
        let mut packed: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut packed);
        let lean = lean_child(&packed);
        assert!(lean.metadata.labels.is_none() && lean.metadata.managed_fields.is_none());
        assert!(lean.metadata.owner_references.is_none() && is_lean(&lean));
        assert_eq!(lean.metadata.name, packed.metadata.name);
        assert_eq!(to_json(&lean), to_json(&packed));
        // Leaning twice changes nothing; unpacking restores the typed metadata.
        assert_eq!(lean_child(&lean).data, lean.data);
        let back = unpack(Arc::new(lean.clone()));
        assert_eq!(back.metadata, packed.metadata);
        assert_eq!(to_json(&back), to_json(&packed));
        assert!(readable(&lean) && readable(&back));
        // An object with empty content, and one that is not lean, unpack as they are.
        packed.data = Json::String("{}".into());
        let empty = lean_child(&packed);
        assert_eq!(to_json(&empty), to_json(&packed));
        assert_eq!(unpack(Arc::new(empty)).metadata, packed.metadata);
        let plain = Arc::new(packed.clone());
        assert!(Arc::ptr_eq(&unpack(plain.clone()), &plain));
    }

    #[test]
    fn a_stub_stays_as_it_is() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        o.data = Json::Null;
        let lean = lean_child(&o);
        assert_eq!(lean.metadata, o.metadata);
        assert!(lean.data.is_null());
    }

    #[test]
    fn a_lean_child_with_a_too_deep_fieldset_is_not_readable() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        let deep = format!(
            "{}{}",
            "{\"f:a\":".repeat(200),
            "{}".to_string() + &"}".repeat(200)
        );
        if let Some(e) = o
            .metadata
            .managed_fields
            .as_mut()
            .and_then(|m| m.first_mut())
        {
            e.fields_v1 = Some(FieldsV1(Json::String(deep)));
        }
        assert!(!readable(&o));
        let lean = lean_child(&o);
        assert!(!readable(&lean));
        assert_eq!(readable(&lean), to_json(&lean).is_some());
    }
}
