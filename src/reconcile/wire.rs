//! How watched objects are decoded from the API server's responses: one object at a time,
//! never failing a whole listing, and keeping only what Rulebook needs.
//!
//! kube-client decodes a LIST page (and each watch event) with serde_json into the watched
//! type. Into a `DynamicObject`, a single object nested deeper than serde_json's 128
//! levels — which the API server accepts in a free-form spec — fails the whole page, so
//! one tenant's parent stopped every later listing of its kind for all tenants (and
//! kube-client logs the whole failed body). [`Wire`] instead captures everything but
//! `metadata` as raw JSON text (serde_json skips raw values iteratively, with no depth
//! limit), which is also the packed form the caches keep ([`super::cache`]): nothing is
//! parsed into a tree until a reconcile reads it, and a too-deep object fails only there,
//! for its own parent.
//!
//! For watched children ([`Wire<true>`]) the content of an object that cannot be a child
//! (its `rulebook.dev/owner` label is not the UID of its controller ownerReference) is not
//! even copied: anyone may put Rulebook's labels on objects in their namespace, and their
//! content must not reach the operator's memory.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, ObjectMeta};
use kube::api::{ApiResource, DynamicObject, TypeMeta};
use kube::core::DynamicResourceScope;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value as Json;
use serde_json::value::RawValue;

use crate::meta::labels;

/// A watched object as decoded: typed metadata, the rest as raw JSON text. `CHILD`
/// objects that cannot be children keep no content (`content` is `None`).
#[derive(Clone, Debug)]
pub struct Wire<const CHILD: bool> {
    pub types: Option<TypeMeta>,
    pub metadata: ObjectMeta,
    /// Everything but `apiVersion`, `kind` and `metadata`, as one compact JSON object.
    pub content: Option<String>,
}

impl<const CHILD: bool> Wire<CHILD> {
    /// The cached form: a `DynamicObject` whose `data` is the content as a JSON string, or
    /// `null` when the content was not kept (a stub; see [`is_stub`]).
    pub fn into_packed(self) -> DynamicObject {
        DynamicObject {
            types: self.types,
            metadata: self.metadata,
            data: self.content.map_or(Json::Null, Json::String),
        }
    }
}

/// A cached object whose content was not kept: read it from the API server when needed.
pub fn is_stub(o: &DynamicObject) -> bool {
    o.data.is_null()
}

/// Whether an object's labels and ownerReferences agree that it is a Rulebook child:
/// its owner label is the UID of its controller reference.
pub fn could_be_child(meta: &ObjectMeta) -> bool {
    let Some(owner) = meta.labels.as_ref().and_then(|l| l.get(labels::OWNER)) else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && &r.uid == owner)
}

impl<const CHILD: bool> kube::Resource for Wire<CHILD> {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }
    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }
    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }
    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }
    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl<'de, const CHILD: bool> de::Deserialize<'de> for Wire<CHILD> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(WireVisitor::<CHILD>)
    }
}

struct WireVisitor<const CHILD: bool>;

impl<'de, const CHILD: bool> Visitor<'de> for WireVisitor<CHILD> {
    type Value = Wire<CHILD>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut api_version: Option<String> = None;
        let mut kind: Option<String> = None;
        let mut metadata: Option<ObjectMeta> = None;
        let mut content = String::from("{");
        let mut keep = true;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "apiVersion" => api_version = Some(map.next_value()?),
                "kind" => kind = Some(map.next_value()?),
                "metadata" => {
                    let raw: BTreeMap<String, Box<RawValue>> = map.next_value()?;
                    let meta = metadata_from(raw).map_err(de::Error::custom)?;
                    if CHILD && !could_be_child(&meta) {
                        keep = false;
                    }
                    metadata = Some(meta);
                }
                // The API server writes `metadata` before the content; should it not, the
                // content is captured and dropped below.
                _ if !keep => {
                    map.next_value::<IgnoredAny>()?;
                }
                other => {
                    let raw: Box<RawValue> = map.next_value()?;
                    if content.len() > 1 {
                        content.push(',');
                    }
                    content.push_str(&Json::String(other.to_string()).to_string());
                    content.push(':');
                    content.push_str(raw.get());
                }
            }
        }
        content.push('}');
        let metadata = metadata.unwrap_or_default();
        if CHILD && !could_be_child(&metadata) {
            keep = false;
        }
        let types = match (api_version, kind) {
            (Some(api_version), Some(kind)) => Some(TypeMeta { api_version, kind }),
            _ => None,
        };
        Ok(Wire {
            types,
            metadata,
            content: keep.then_some(content),
        })
    }
}

/// Why an object's metadata does not read (the API server never sends such metadata).
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("invalid metadata: {0}")]
    Metadata(#[source] serde_json::Error),
    #[error("invalid managedFields: {0}")]
    ManagedFields(#[source] serde_json::Error),
}

/// Typed metadata from its raw fields. Every field the API server allows in `metadata`
/// is shallow but `managedFields[].fieldsV1`, which mirrors the object's own depth: only
/// Rulebook's own Apply entry keeps it (as JSON text, the form [`super::cache`] keeps);
/// other managers keep their name, operation and time.
fn metadata_from(mut raw: BTreeMap<String, Box<RawValue>>) -> Result<ObjectMeta, MetadataError> {
    let managed = raw.remove("managedFields");
    let text = object_text(raw.iter().map(|(k, v)| (k.as_str(), v.get())));
    let mut meta: ObjectMeta = serde_json::from_str(&text).map_err(MetadataError::Metadata)?;
    if let Some(managed) = managed {
        let entries: Vec<BTreeMap<String, Box<RawValue>>> =
            serde_json::from_str(managed.get()).map_err(MetadataError::ManagedFields)?;
        let mut out = Vec::with_capacity(entries.len());
        for mut e in entries {
            let fields = e.remove("fieldsV1");
            let text = object_text(e.iter().map(|(k, v)| (k.as_str(), v.get())));
            let mut entry: ManagedFieldsEntry =
                serde_json::from_str(&text).map_err(MetadataError::ManagedFields)?;
            match fields {
                Some(f) if super::cache::is_own_apply(&entry) => {
                    entry.fields_v1 = Some(FieldsV1(Json::String(f.get().into())))
                }
                _ => {
                    entry.fields_v1 = None;
                    entry.fields_type = None;
                }
            }
            out.push(entry);
        }
        meta.managed_fields = Some(out);
    }
    Ok(meta)
}

/// A JSON object's text from its fields' raw JSON texts.
fn object_text<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut text = String::from("{");
    for (k, v) in fields {
        if text.len() > 1 {
            text.push(',');
        }
        text.push_str(&Json::String(k.to_string()).to_string());
        text.push(':');
        text.push_str(v);
    }
    text.push('}');
    text
}

/// How deeply serde_json reads (its recursion limit): deeper content cannot be read.
pub const MAX_DEPTH: usize = 128;

/// How deeply `text` (JSON) nests objects and arrays, counted without parsing it.
pub fn nesting_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deep(levels: usize) -> String {
        let mut s = String::new();
        for _ in 0..levels {
            s.push_str("{\"a\":");
        }
        s.push('1');
        for _ in 0..levels {
            s.push('}');
        }
        s
    }

    fn object(name: &str, spec: &str) -> String {
        format!(
            r#"{{"apiVersion":"x.dev/v1","kind":"P","metadata":{{"name":"{name}","namespace":"n","uid":"u-{name}","resourceVersion":"5","managedFields":[{{"manager":"tenant","operation":"Update","fieldsType":"FieldsV1","fieldsV1":{fields}}}]}},"spec":{spec}}}"#,
            fields = deep(300)
        )
    }

    #[test]
    fn a_deep_object_does_not_fail_its_listing() {
        let list = format!(
            r#"{{"apiVersion":"v1","kind":"List","metadata":{{"resourceVersion":"9"}},"items":[{},{}]}}"#,
            object("deep", &deep(500)),
            object("ok", r#"{"size":3}"#)
        );
        // serde_json cannot read the deep object as a tree …
        assert!(serde_json::from_str::<Json>(&list).is_err());
        // … but the list decodes item by item, as kube-runtime's watcher reads it.
        let items: kube::core::ObjectList<Wire<false>> = serde_json::from_str(&list).unwrap();
        assert_eq!(items.items.len(), 2);
        let ok = items.items[1].clone().into_packed();
        assert_eq!(ok.metadata.name.as_deref(), Some("ok"));
        assert_eq!(
            super::super::cache::to_json(&ok).unwrap()["spec"],
            json!({"size": 3})
        );
        let deep_obj = items.items[0].clone().into_packed();
        assert!(nesting_depth(deep_obj.data.as_str().unwrap()) > 500);
        assert!(super::super::cache::to_json(&deep_obj).is_none());
        // Other managers' fields are not kept.
        let mf = deep_obj.metadata.managed_fields.unwrap();
        assert!(mf[0].fields_v1.is_none());
        assert_eq!(mf[0].manager.as_deref(), Some("tenant"));
    }

    #[test]
    fn a_watch_event_decodes_the_same_way() {
        let line = format!(
            r#"{{"type":"ADDED","object":{}}}"#,
            object("deep", &deep(400))
        );
        let ev: kube::core::WatchEvent<Wire<false>> = serde_json::from_str(&line).unwrap();
        assert!(matches!(ev, kube::core::WatchEvent::Added(_)));
    }

    #[test]
    fn only_plausible_children_keep_content() {
        let child = |owner: &str, controller_uid: &str| {
            json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "c", "namespace": "n",
                    "labels": {"rulebook.dev/owner": owner},
                    "ownerReferences": [{"apiVersion": "x/v1", "kind": "P", "name": "p",
                        "uid": controller_uid, "controller": true}],
                    "managedFields": [{"manager": "rulebook", "operation": "Apply",
                        "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:k": {}}}}]},
                "data": {"k": "v"}
            })
            .to_string()
        };
        let real: Wire<true> = serde_json::from_str(&child("u1", "u1")).unwrap();
        let packed = real.into_packed();
        assert!(!is_stub(&packed));
        let back = super::super::cache::to_json_with_managed_fields(&packed).unwrap();
        assert_eq!(back["data"], json!({"k": "v"}));
        assert_eq!(
            back["metadata"]["managedFields"][0]["fieldsV1"],
            json!({"f:data": {"f:k": {}}})
        );
        let spoofed: Wire<true> = serde_json::from_str(&child("u1", "u2")).unwrap();
        assert!(spoofed.content.is_none());
        assert!(is_stub(&spoofed.into_packed()));
    }

    #[test]
    fn depth_is_counted_outside_strings() {
        assert_eq!(nesting_depth(r#"{"a":"{{{[[[","b":[1,{"c":2}]}"#), 3);
        assert_eq!(nesting_depth(r#"{"a":"\"{"}"#), 1);
        assert_eq!(nesting_depth(&deep(1000)), 1000);
    }
}
