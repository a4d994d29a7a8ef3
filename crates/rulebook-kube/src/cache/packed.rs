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
//! Children, most of what is cached, are leaner still in their store ([`Packed`]): the
//! metadata is packed too, as JSON text in the same allocation as the content. Typed
//! metadata is a struct of ~350 bytes, mostly empty fields, and each of its strings, maps
//! and lists is an allocation of its own (a B-tree node of labels is ~500 bytes however
//! few they are). The watch stream still carries the typed form (the owner index and
//! kube-runtime's owner mapping read it once per event), and a reconcile reads a child
//! through [`Packed::unpack`], which restores it.
//!
//! Measured against kube-rs 5's `DynamicObject` (serde_json `Value` content) with
//! `cargo bench --bench cache_memory`: 8.4 KB of heap per cached ConfigMap as kube-runtime
//! caches it, 3.7 KB packed, 1.7 KB as a [`Packed`] child (docs/benchmarks/history/2026-11-25.md, "Lean child cache").
//!
//! Also the lowest module of [`crate::cache`]: [`wire`](super::wire) decodes into this
//! form, so what both need (whose managedFields entry is Rulebook's, how deep JSON text
//! nests) is here.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
use kube::api::{DynamicObject, TypeMeta};
use serde_json::{Map, Value as Json};

use rulebook_core::meta::FIELD_MANAGER;

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

/// A child of a kind whose content no rule reads (`rulebook_core::render::CompiledRule::reads_child_content`)
/// keeps only its metadata: its content becomes `{}`, which is not a stub (a stub is read
/// from the API server when a reconcile needs it). Drift is told from managedFields.
pub fn without_content(o: &mut DynamicObject) {
    if !o.data.is_null() {
        o.data = Json::String("{}".to_string());
    }
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

/// A child as its store holds it (see the module comment): its metadata and its packed
/// content as JSON text, one after the other in one allocation. A typed `ObjectMeta`
/// is a struct of about 350 bytes of mostly empty fields, with every name, UID and
/// label in an allocation of its own; as text, a child's metadata costs what it says.
pub struct Packed {
    text: Box<str>,
    /// Where the metadata ends and the content begins; no content marks a stub.
    split: u32,
}

impl Packed {
    /// The store's form of a packed child ([`strip_child`]); `None` only for an object
    /// too large to be one (4 GiB).
    pub fn new(o: &DynamicObject) -> Option<Packed> {
        let mut text = serde_json::to_string(&o.metadata).ok()?;
        let split = u32::try_from(text.len()).ok()?;
        match &o.data {
            Json::Null => {}
            Json::String(content) => text.push_str(content),
            other => text.push_str(&other.to_string()),
        }
        u32::try_from(text.len()).ok()?;
        Some(Packed {
            text: text.into_boxed_str(),
            split,
        })
    }

    /// Whether the child was cached without its content (over the cache budget).
    pub fn is_stub(&self) -> bool {
        self.text.len() == self.split as usize
    }

    /// The child as reconciles read it: typed metadata, content still packed. `None`
    /// only if the metadata written by [`Packed::new`] does not read back (a bug), which
    /// every caller treats as a child not cached.
    pub fn unpack(&self, types: Option<&TypeMeta>) -> Option<DynamicObject> {
        let (meta, content) = self.text.split_at(self.split as usize);
        let metadata: ObjectMeta = serde_json::from_str(meta).ok()?;
        Some(DynamicObject {
            types: types.cloned(),
            metadata,
            data: if content.is_empty() {
                Json::Null
            } else {
                Json::String(content.to_owned())
            },
        })
    }

    /// Whether this is the version `resource_version` of the object `uid`, read without
    /// unpacking the metadata (the two fields are scanned for, nothing else is built).
    pub fn holds(&self, uid: &str, resource_version: &str) -> bool {
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Version<'a> {
            #[serde(borrow)]
            uid: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            resource_version: Option<std::borrow::Cow<'a, str>>,
        }
        let meta = &self.text[..self.split as usize];
        serde_json::from_str::<Version>(meta).is_ok_and(|v| {
            v.uid.as_deref() == Some(uid) && v.resource_version.as_deref() == Some(resource_version)
        })
    }

    /// The bytes this form holds.
    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }
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

/// Whether [`to_json_with_managed_fields`] can read the object (its packed content and
/// field sets are not nested beyond serde_json's limit), without building the tree: a
/// scan of the nesting depth, and the full parse only for the rare deep object.
pub fn readable(o: &DynamicObject) -> bool {
    let shallow = |text: &str| nesting_depth(text) < 100;
    let mut packed = std::iter::once(&o.data).chain(
        o.metadata
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|e| e.fields_v1.as_ref().map(|FieldsV1(f)| f)),
    );
    packed.all(|v| match v {
        Json::String(text) => shallow(text) || serde_json::from_str::<Json>(text).is_ok(),
        _ => true,
    })
}

/// The object as templates, expressions and status paths see it, whether cached
/// (packed) or as the API server returned it: everything but `metadata.managedFields`,
/// which is the API server's bookkeeping (as `kubectl get` leaves it out) and, for an
/// object Rulebook applied, a field set as large as the object itself.
pub fn to_json(o: &DynamicObject) -> Option<Json> {
    json_of(o, Fields::Without)
}

/// [`to_json`] with `metadata.managedFields` (each `fieldsV1` as JSON again): for the
/// drift check's report of who else changed an object.
pub fn to_json_with_managed_fields(o: &DynamicObject) -> Option<Json> {
    json_of(o, Fields::With)
}

fn json_of(o: &DynamicObject, fields: Fields) -> Option<Json> {
    let content = match &o.data {
        Json::String(text) => serde_json::from_str(text).ok()?,
        other => other.clone(),
    };
    assemble(o.types.as_ref(), &o.metadata, content, fields)
}

/// [`to_json`] of an object no one else holds (an API server's response to a write): its
/// content moves into the JSON rather than being copied.
pub fn into_json(o: DynamicObject) -> Option<Json> {
    let content = match o.data {
        Json::String(text) => serde_json::from_str(&text).ok()?,
        other => other,
    };
    assemble(o.types.as_ref(), &o.metadata, content, Fields::Without)
}

/// Whether [`assemble`] writes `metadata.managedFields`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fields {
    With,
    Without,
}

fn assemble(
    types: Option<&TypeMeta>,
    metadata: &ObjectMeta,
    content: Json,
    fields: Fields,
) -> Option<Json> {
    let mut out = Map::new();
    if let Some(t) = types {
        out.insert("apiVersion".into(), Json::String(t.api_version.clone()));
        out.insert("kind".into(), Json::String(t.kind.clone()));
    }
    let meta = match fields {
        Fields::With => {
            let mut meta = serde_json::to_value(metadata).ok()?;
            if let Some(entries) = meta.get_mut("managedFields").and_then(Json::as_array_mut) {
                for e in entries {
                    if let Some(f) = e.get_mut("fieldsV1")
                        && let Json::String(text) = f
                    {
                        *f = serde_json::from_str(text).ok()?;
                    }
                }
            }
            meta
        }
        Fields::Without => serde_json::to_value(WithoutManagedFields(metadata)).ok()?,
    };
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

/// Object metadata as the API server writes it, less `managedFields`: written field by
/// field, so that the field sets are neither copied nor turned into JSON.
struct WithoutManagedFields<'a>(&'a ObjectMeta);

impl serde::Serialize for WithoutManagedFields<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        // Every field named (no `..`), so that a field k8s-openapi adds is not left out
        // unnoticed.
        let ObjectMeta {
            annotations,
            creation_timestamp,
            deletion_grace_period_seconds,
            deletion_timestamp,
            finalizers,
            generate_name,
            generation,
            labels,
            managed_fields: _,
            name,
            namespace,
            owner_references,
            resource_version,
            self_link,
            uid,
        } = self.0;
        let mut map = s.serialize_map(None)?;
        macro_rules! field {
            ($name:literal, $value:expr) => {
                if let Some(v) = $value {
                    map.serialize_entry($name, v)?;
                }
            };
        }
        field!("annotations", annotations);
        field!("creationTimestamp", creation_timestamp);
        field!("deletionGracePeriodSeconds", deletion_grace_period_seconds);
        field!("deletionTimestamp", deletion_timestamp);
        field!("finalizers", finalizers);
        field!("generateName", generate_name);
        field!("generation", generation);
        field!("labels", labels);
        field!("name", name);
        field!("namespace", namespace);
        field!("ownerReferences", owner_references);
        field!("resourceVersion", resource_version);
        field!("selfLink", self_link);
        field!("uid", uid);
        map.end()
    }
}

/// How deeply serde_json reads (its recursion limit): deeper content cannot be read.
pub const MAX_DEPTH: usize = 128;

/// How deeply `text` (JSON) nests objects and arrays (one scanner for every layer).
pub use rulebook_core::meta::nesting_depth;

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
        let back = to_json_with_managed_fields(&o).unwrap();
        let mut want = child();
        want["metadata"]["annotations"] = json!({"x": "y"});
        want["metadata"]["managedFields"][1] =
            json!({"manager": "kubectl-edit", "operation": "Update"});
        assert_eq!(back, want);
        // What rules see: the same less managedFields.
        want["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("managedFields");
        assert_eq!(to_json(&o).unwrap(), want);
    }

    #[test]
    fn an_unpacked_object_reads_as_serde_would_write_it() {
        let mut full = child();
        // Every metadata field, so that the field-by-field writer is checked against
        // serde's for each.
        full["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        full["metadata"]["deletionTimestamp"] = json!("2026-01-02T00:00:00Z");
        full["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        full["metadata"]["finalizers"] = json!(["f"]);
        full["metadata"]["generateName"] = json!("c-");
        full["metadata"]["generation"] = json!(3);
        full["metadata"]["selfLink"] = json!("/x");
        full["metadata"]["ownerReferences"] = json!([{"apiVersion": "x/v1", "kind": "P", "name": "p", "uid": "pu", "controller": true}]);
        let o: DynamicObject = serde_json::from_value(full).unwrap();
        let serde = serde_json::to_value(&o).unwrap();
        assert_eq!(to_json_with_managed_fields(&o).unwrap(), serde);
        let mut want = serde;
        want["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("managedFields");
        assert_eq!(want["metadata"].as_object().unwrap().len(), 14);
        assert_eq!(to_json(&o).unwrap(), want);
        assert_eq!(into_json(o).unwrap(), want);
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

    fn unpacked(o: &DynamicObject) -> DynamicObject {
        Packed::new(o).unwrap().unpack(o.types.as_ref()).unwrap()
    }

    #[test]
    fn a_stored_child_unpacks_as_the_packed_one() {
        let mut packed: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut packed);
        let stored = Packed::new(&packed).unwrap();
        assert!(!stored.is_stub());
        let back = stored.unpack(packed.types.as_ref()).unwrap();
        assert_eq!(back.metadata, packed.metadata);
        assert_eq!(back.data, packed.data);
        assert_eq!(to_json(&back), to_json(&packed));
        assert!(readable(&back));
        // Content that is not packed is packed; empty content stays empty content.
        let plain: DynamicObject = serde_json::from_value(child()).unwrap();
        assert_eq!(to_json(&unpacked(&plain)), to_json(&plain));
        packed.data = Json::String("{}".into());
        assert_eq!(unpacked(&packed).data, packed.data);
    }

    #[test]
    fn a_stored_child_tells_its_version_without_unpacking() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        let (uid, rv) = (
            o.metadata.uid.clone().unwrap(),
            o.metadata.resource_version.clone().unwrap(),
        );
        let stored = Packed::new(&o).unwrap();
        assert!(stored.holds(&uid, &rv));
        assert!(!stored.holds(&uid, "1"));
        assert!(!stored.holds("other", &rv));
        // A name or label that reads like the fields is not them.
        o.metadata.name = Some(rv.clone());
        o.metadata.labels = Some([("uid".to_string(), "other".to_string())].into());
        o.metadata.resource_version = Some("8".into());
        assert!(!Packed::new(&o).unwrap().holds(&uid, &rv));
        o.metadata.uid = None;
        assert!(!Packed::new(&o).unwrap().holds(&uid, "8"));
    }

    #[test]
    fn a_stub_stays_a_stub() {
        let mut o: DynamicObject = serde_json::from_value(child()).unwrap();
        strip_child(&mut o);
        o.data = Json::Null;
        let stored = Packed::new(&o).unwrap();
        assert!(stored.is_stub());
        let back = stored.unpack(None).unwrap();
        assert_eq!(back.metadata, o.metadata);
        assert!(back.data.is_null());
    }

    #[test]
    fn a_stored_child_with_a_too_deep_fieldset_is_not_readable() {
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
        let back = unpacked(&o);
        assert!(!readable(&back));
        assert_eq!(
            readable(&back),
            to_json_with_managed_fields(&back).is_some()
        );
    }
}
