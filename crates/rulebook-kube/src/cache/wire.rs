//! How watched objects are decoded from the API server's responses: one object at a time,
//! never failing a whole listing, and keeping only what Rulebook needs.
//!
//! kube-client decodes a LIST page (and each watch event) with serde_json into the watched
//! type. Into a `DynamicObject`, a single object nested deeper than serde_json's 128
//! levels — which the API server accepts in a free-form spec — fails the whole page, so
//! one tenant's parent stopped every later listing of its kind for all tenants (and
//! kube-client logs the whole failed body). [`Wire`] instead captures everything but
//! `metadata` as raw JSON text (serde_json skips raw values iteratively, with no depth
//! limit), which is also the packed form the caches keep ([`super::packed`]): nothing is
//! parsed into a tree until a reconcile reads it, and a too-deep object fails only there,
//! for its own parent.
//!
//! For watched children ([`Wire<true>`]) the content of an object that cannot be a child
//! (its `rulebook.dev/owner` label is not the UID of its controller ownerReference) is not
//! even copied: anyone may put Rulebook's labels on objects in their namespace, and their
//! content must not reach the operator's memory.
//!
//! Measured against kube-client 5 (its `ObjectList<DynamicObject>` / `WatchEvent` decoding
//! with serde_json 1): a list page holding one parent nested 500 levels fails whole
//! there and decodes item by item here (`a_deep_object_does_not_fail_its_listing` below;
//! docs/faults.md, "Deep parent": no parent of the kind reconciled in 60 s before, the
//! others 0.5 s after a restart since). Kept hand-written: kube-client offers no per-item
//! decoding of a list.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    FieldsV1, ManagedFieldsEntry, ObjectMeta, OwnerReference, Time,
};
use kube::api::{ApiResource, DynamicObject, TypeMeta};
use kube::core::DynamicResourceScope;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value as Json;
use serde_json::value::RawValue;

use rulebook_core::meta::labels;
use rulebook_core::rules::DeletionPolicy;

use super::packed::is_own_apply;

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
/// its owner label is the UID of its controller reference, or it is an `Orphan` child
/// ([`orphan_owner`]).
pub fn could_be_child(meta: &ObjectMeta) -> bool {
    let Some(owner) = meta.labels.as_ref().and_then(|l| l.get(labels::OWNER)) else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && &r.uid == owner)
        || orphan_owner(meta).is_some()
        || remote_owner(meta).is_some()
}

/// The parent UID of a child a namespaced parent placed in another namespace (the
/// rule's `targetNamespaces`), which carries no ownerReference (a namespaced owner must
/// be in its dependent's namespace): its owner label, when it has no controller at all
/// and names its parent's namespace ([`labels::PARENT_NAMESPACE`]), another than its
/// own. As public as any label: whoever may write an object there can make it claim a
/// parent this way; what Rulebook does to such an object is confined to the namespaces
/// that parent records placing children in.
///
/// A claim alone is no child: [`remote_claim`] gives the parent's namespace with it, and
/// a child counts only for a parent of a rule that places children elsewhere, in that
/// very namespace, and only where the parent may place children.
pub fn remote_owner(meta: &ObjectMeta) -> Option<&str> {
    remote_claim(meta).map(|(owner, _)| owner)
}

/// [`remote_owner`], and the parent's namespace the child names.
pub fn remote_claim(meta: &ObjectMeta) -> Option<(&str, &str)> {
    let owner = meta.labels.as_ref()?.get(labels::OWNER)?;
    let home = meta.annotations.as_ref()?.get(labels::PARENT_NAMESPACE)?;
    let controlled = (meta.owner_references.iter().flatten()).any(|r| r.controller == Some(true));
    let elsewhere = meta.namespace.as_deref().is_some_and(|ns| ns != home);
    let recorded = DeletionPolicy::recorded(
        (meta.annotations.as_ref())
            .and_then(|a| a.get(labels::DELETION_POLICY))
            .map(String::as_str),
    );
    (elsewhere && !controlled && !owner.is_empty() && recorded != DeletionPolicy::Orphan)
        .then_some((owner.as_str(), home.as_str()))
}

/// The parent UID of a child whose `deletionPolicy` is `Orphan`, which carries no
/// ownerReference (the garbage collector follows every one, foreground deletion whatever
/// its `blockOwnerDeletion`): its owner label, when it has no controller at all and
/// recorded `Orphan`. As public as the labels of any object: whoever may write an object
/// can make it claim a parent this way, as with a controller reference; what Rulebook
/// does to such an object is confined to where the parent places children (its
/// namespace, or the namespaces a cluster-scoped parent records).
pub fn orphan_owner(meta: &ObjectMeta) -> Option<&str> {
    let owner = meta.labels.as_ref()?.get(labels::OWNER)?;
    let recorded = (meta.annotations.as_ref()).and_then(|a| a.get(labels::DELETION_POLICY));
    let orphan = DeletionPolicy::recorded(recorded.map(String::as_str)) == DeletionPolicy::Orphan;
    let controlled = (meta.owner_references.iter().flatten()).any(|r| r.controller == Some(true));
    (orphan && !controlled && !owner.is_empty()).then_some(owner.as_str())
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
                    let meta = map.next_value::<MetaWire>()?.into_meta();
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

/// `metadata` as read in one pass: [`ObjectMeta`]'s fields, with each managedFields
/// entry's `fieldsV1` captured as raw text. Every field the API server allows in
/// `metadata` is shallow but `fieldsV1`, which mirrors the object's own depth: only
/// Rulebook's own Apply entry keeps it (as JSON text, the form [`super::packed`] keeps);
/// other managers keep their name, operation and time.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaWire {
    annotations: Option<BTreeMap<String, String>>,
    creation_timestamp: Option<Time>,
    deletion_grace_period_seconds: Option<i64>,
    deletion_timestamp: Option<Time>,
    finalizers: Option<Vec<String>>,
    generate_name: Option<String>,
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
    managed_fields: Option<Vec<ManagedWire>>,
    name: Option<String>,
    namespace: Option<String>,
    owner_references: Option<Vec<OwnerReference>>,
    resource_version: Option<String>,
    self_link: Option<String>,
    uid: Option<String>,
}

/// One managedFields entry, its `fieldsV1` unparsed.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManagedWire {
    api_version: Option<String>,
    fields_type: Option<String>,
    #[serde(rename = "fieldsV1")]
    fields_v1: Option<Box<RawValue>>,
    manager: Option<String>,
    operation: Option<String>,
    subresource: Option<String>,
    time: Option<Time>,
}

impl MetaWire {
    fn into_meta(self) -> ObjectMeta {
        let managed_fields = self.managed_fields.map(|entries| {
            entries
                .into_iter()
                .map(|e| {
                    let mut entry = ManagedFieldsEntry {
                        api_version: e.api_version,
                        fields_type: e.fields_type,
                        fields_v1: None,
                        manager: e.manager,
                        operation: e.operation,
                        subresource: e.subresource,
                        time: e.time,
                    };
                    match e.fields_v1 {
                        Some(f) if is_own_apply(&entry) => {
                            entry.fields_v1 = Some(FieldsV1(Json::String(f.get().into())))
                        }
                        _ => entry.fields_type = None,
                    }
                    entry
                })
                .collect()
        });
        ObjectMeta {
            annotations: self.annotations,
            creation_timestamp: self.creation_timestamp,
            deletion_grace_period_seconds: self.deletion_grace_period_seconds,
            deletion_timestamp: self.deletion_timestamp,
            finalizers: self.finalizers,
            generate_name: self.generate_name,
            generation: self.generation,
            labels: self.labels,
            managed_fields,
            name: self.name,
            namespace: self.namespace,
            owner_references: self.owner_references,
            resource_version: self.resource_version,
            self_link: self.self_link,
            uid: self.uid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::nesting_depth;
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
            super::super::packed::to_json(&ok).unwrap()["spec"],
            json!({"size": 3})
        );
        let deep_obj = items.items[0].clone().into_packed();
        assert!(nesting_depth(deep_obj.data.as_str().unwrap()) > 500);
        assert!(super::super::packed::to_json(&deep_obj).is_none());
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
        let back = super::super::packed::to_json_with_managed_fields(&packed).unwrap();
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
    fn metadata_reads_as_kubernetes_reads_it_less_other_managers_field_sets() {
        let meta = json!({
            "annotations": {"a": "1"}, "creationTimestamp": "2026-01-02T03:04:05Z",
            "deletionGracePeriodSeconds": 30, "deletionTimestamp": "2026-01-02T03:04:06Z",
            "finalizers": ["f"], "generateName": "g-", "generation": 7,
            "labels": {"l": "2"}, "name": "n", "namespace": "ns",
            "ownerReferences": [{"apiVersion": "x/v1", "kind": "P", "name": "p",
                "uid": "u", "controller": true, "blockOwnerDeletion": true}],
            "resourceVersion": "42", "selfLink": "/x", "uid": "u9", "unknownField": {"x": 1},
            "managedFields": [
                {"apiVersion": "v1", "manager": "rulebook", "operation": "Apply",
                 "time": "2026-01-02T03:04:07Z", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:data": {"f:k": {}}}},
                {"apiVersion": "v1", "manager": "kubectl", "operation": "Update",
                 "subresource": "status", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:status": {}}}]
        });
        let text = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta});
        let ours: Wire<false> = serde_json::from_str(&text.to_string()).unwrap();
        let mut theirs: ObjectMeta = serde_json::from_value(meta).unwrap();
        let managed = theirs.managed_fields.as_mut().unwrap();
        managed[0].fields_v1 = Some(FieldsV1(Json::String(r#"{"f:data":{"f:k":{}}}"#.into())));
        managed[1].fields_v1 = None;
        managed[1].fields_type = None;
        assert_eq!(ours.metadata, theirs);
    }

    #[test]
    fn depth_is_counted_outside_strings() {
        assert_eq!(nesting_depth(r#"{"a":"{{{[[[","b":[1,{"c":2}]}"#), 3);
        assert_eq!(nesting_depth(r#"{"a":"\"{"}"#), 1);
        assert_eq!(nesting_depth(&deep(1000)), 1000);
    }
    /// A child's metadata: in `ns`, with the owner label, these annotations and, when
    /// `controller` is given, a controller reference with that UID.
    fn meta(ns: &str, annotations: &[(&str, &str)], controller: Option<&str>) -> ObjectMeta {
        serde_json::from_value(json!({
            "name": "c", "namespace": ns,
            "labels": {labels::OWNER: "u1"},
            "annotations": annotations.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "ownerReferences": controller.map(|uid| vec![json!({"apiVersion": "x.dev/v1", "kind": "P", "name": "p", "uid": uid, "controller": true})]).unwrap_or_default(),
        }))
        .expect("metadata")
    }

    #[test]
    fn a_child_elsewhere_is_owned_by_its_labels_only_outside_its_parents_namespace() {
        let home = [
            (labels::PARENT_NAMESPACE, "home"),
            (labels::PARENT_NAME, "p"),
        ];
        // Placed elsewhere: the owner label.
        assert_eq!(remote_owner(&meta("shared", &home, None)), Some("u1"));
        assert!(could_be_child(&meta("shared", &home, None)));
        // In the namespace it names as its parent's: no such child (the parent's own
        // children there carry its controller reference).
        assert_eq!(remote_owner(&meta("home", &home, None)), None);
        assert!(!could_be_child(&meta("home", &home, None)));
        // With a controller, the controller decides; an `Orphan` one is an orphan.
        assert_eq!(remote_owner(&meta("shared", &home, Some("u2"))), None);
        let orphan = [
            (labels::PARENT_NAMESPACE, "home"),
            (labels::DELETION_POLICY, "Orphan"),
        ];
        assert_eq!(remote_owner(&meta("shared", &orphan, None)), None);
        assert_eq!(orphan_owner(&meta("shared", &orphan, None)), Some("u1"));
        // Without the annotation: nobody's.
        assert_eq!(remote_owner(&meta("shared", &[], None)), None);
        assert!(!could_be_child(&meta("shared", &[], None)));
    }
}
