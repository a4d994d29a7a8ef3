//! The one writer: every API write Rulebook makes — child applies (each with a
//! precondition: a create refused if the name is taken, or an apply to the UID that was
//! read), status applies,
//! deletions (pruning, teardown, and the cleanup after a rule drops a kind), patches
//! (finalizers, orphaned children), events — goes through
//! [`Writer`], which asks the write gate first and counts the write. (The API client
//! underneath refuses writes on a closed gate as well: [`super::gate::GateLayer`].)

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions};
use kube::runtime::events::Event;
use serde_json::Value as Json;
use tracing::debug;

use rulebook_core::meta::FIELD_MANAGER;

use super::gate::WriteGate;
use super::recorder::{Recorder, Unsent};
use super::send::send_as;
use crate::cache::wire::Wire;
use crate::counts::WriteCounts;

/// Why a write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("writes are paused (not the leader)")]
    NotLeader,
    #[error(transparent)]
    Api(kube::Error),
}

impl From<kube::Error> for WriteError {
    /// A write the gate refused in the client (it lapsed after [`Writer`]'s own check)
    /// is a `NotLeader` like any other, not an API failure with hyper's wording.
    fn from(e: kube::Error) -> WriteError {
        if super::gate::was_refused(&e) {
            WriteError::NotLeader
        } else {
            WriteError::Api(e)
        }
    }
}

/// What a delete found.
#[derive(Debug, PartialEq, Eq)]
pub enum Deleted {
    Deleted,
    /// Already gone.
    Gone,
    /// Not the object as the caller read it: replaced by another of the same name (another
    /// UID), or changed since (another resourceVersion), so not deleted. Whether it is
    /// still the caller's to delete is for a fresh read to say.
    Changed,
}

/// What a status apply answers, as far as Rulebook reads it: the metadata that tells
/// whether the parent changed in a way worth a reconcile (`memory::digest::identity`), its
/// resourceVersion, and the status. The spec and managedFields are skipped unread.
#[derive(Debug, serde::Deserialize)]
pub struct StatusApplied {
    pub metadata: AppliedMeta,
    #[serde(default)]
    pub status: Json,
}

/// The part of [`StatusApplied`]'s metadata Rulebook reads.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedMeta {
    pub resource_version: Option<String>,
    pub generation: Option<i64>,
    pub labels: Option<std::collections::BTreeMap<String, String>>,
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
    pub finalizers: Option<Vec<String>>,
    pub deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

impl AppliedMeta {
    /// As object metadata (the fields read, the rest empty).
    pub fn into_meta(self) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            resource_version: self.resource_version,
            generation: self.generation,
            labels: self.labels,
            annotations: self.annotations,
            finalizers: self.finalizers,
            deletion_timestamp: self.deletion_timestamp,
            ..Default::default()
        }
    }
}

/// What a create found.
#[derive(Debug)]
pub enum Created {
    Created(Box<DynamicObject>),
    /// The API server refused the create with 409 — an object of that name exists (or,
    /// rarely, something else conflicted: the caller reads the name to tell) — and wrote
    /// nothing. The refusal, for the caller to report if the name turns out free.
    Refused(kube::Error),
}

/// What a conditional patch found.
#[derive(Debug, PartialEq, Eq)]
pub enum Patched {
    Patched,
    /// The object changed since it was read (or is gone): read it again.
    Stale,
}

#[derive(Clone)]
pub struct Writer {
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
    /// The rule the writes are counted for.
    rule: String,
}

impl Writer {
    pub fn new(gate: Arc<dyn WriteGate>, metrics: Arc<dyn WriteCounts>, rule: &str) -> Writer {
        Writer {
            gate,
            metrics,
            rule: rule.to_string(),
        }
    }

    pub fn may_write(&self) -> bool {
        self.gate.may_write()
    }

    fn check(&self) -> Result<(), WriteError> {
        if self.gate.may_write() {
            Ok(())
        } else {
            // Counted like a refusal at the wire: the request never gets that far.
            self.metrics.count_refused();
            Err(WriteError::NotLeader)
        }
    }

    /// Server-side apply of `body` (forced, Rulebook's field manager) to the existing
    /// object with `uid` only — there is no apply of a child without a precondition: the body
    /// carries the UID, which the API server compares with the live object's, refusing
    /// the write (422, nothing written) when the name now belongs to another object, and
    /// refusing to create one when the object is gone. The ownership the caller checked
    /// on the object it read thus still holds at the moment of the write.
    pub async fn apply_to(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        body: &Json,
        uid: &str,
    ) -> Result<DynamicObject, WriteError> {
        self.check()?;
        let body = with_metadata(body, "uid", uid);
        let applied = apply_patch(api, name, body).await?;
        self.metrics.count_write(&self.rule, "apply");
        Ok(applied)
    }

    /// Server-side apply of a child that no cache holds, as a create: the body carries
    /// [`NO_OBJECT_RESOURCE_VERSION`] as a precondition, so the API server creates the
    /// object if the name is free and answers 409 — writing nothing — if any object has
    /// it. (A forced apply alone would take over a foreign object of that name; this
    /// saves the GET that otherwise has to look first, and closes the gap between them.)
    pub async fn create(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        body: &Json,
    ) -> Result<Created, WriteError> {
        self.check()?;
        let body = with_metadata(body, "resourceVersion", NO_OBJECT_RESOURCE_VERSION);
        match apply_patch(api, name, body).await {
            Ok(o) => {
                self.metrics.count_write(&self.rule, "apply");
                Ok(Created::Created(Box::new(o)))
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                debug!(name, message = %s.message, "create refused: the name is taken");
                Ok(Created::Refused(kube::Error::Api(s)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Server-side apply of a parent's status subresource. The answer is read for what
    /// the caller keeps of it (see [`StatusApplied`]), not as a whole object.
    pub async fn apply_status(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        body: &Json,
    ) -> Result<StatusApplied, WriteError> {
        self.apply_status_as(api, name, body, FIELD_MANAGER).await
    }

    /// [`Writer::apply_status`] under the field manager `manager`: a rule that is not
    /// its parent kind's main rule applies its own condition under its own manager, so
    /// that neither rule's apply removes what the other wrote
    /// ([`rulebook_core::meta::status_manager`]).
    pub async fn apply_status_as(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        body: &Json,
        manager: &str,
    ) -> Result<StatusApplied, WriteError> {
        self.check()?;
        let params = PatchParams::apply(manager).force();
        let patch = Patch::Apply(apply_body(body));
        // As `Api::patch_status` builds it, with another type to read the answer into.
        let req = kube::core::Request::new(api.resource_url())
            .patch_subresource("status", name, &params, &patch)
            .map_err(kube::Error::BuildRequest)?;
        let applied: StatusApplied = send_as(api, req, "patch_status").await?;
        self.metrics.count_write(&self.rule, "apply_status");
        Ok(applied)
    }

    /// A JSON merge patch of `name` (Rulebook's finalizer, the finalize marker, an
    /// orphaned child's ownership). `body` carries `metadata.resourceVersion`, so the patch
    /// applies only to the object as the caller saw it: the API server answers 409 when
    /// it has changed since, and `Patched::Stale` says so.
    pub async fn merge_patch(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        body: &Json,
    ) -> Result<Patched, WriteError> {
        self.check()?;
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        match api.patch(name, &params, &Patch::Merge(body)).await {
            Ok(_) => {
                self.metrics.count_write(&self.rule, "patch");
                Ok(Patched::Patched)
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Patched::Stale),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes exactly the object as the caller read it, in the background: `uid` and
    /// `resource_version` are preconditions, so neither a replacement of the same name nor
    /// an object that changed since it was read (its controller reference taken back, say)
    /// is deleted — the ownership the caller checked holds at the moment of the write.
    pub async fn delete(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        uid: Option<String>,
        resource_version: Option<String>,
    ) -> Result<Deleted, WriteError> {
        self.check()?;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version,
            }),
            ..DeleteParams::background()
        };
        match api.delete(name, &dp).await {
            Ok(_) => {
                self.metrics.count_write(&self.rule, "delete");
                Ok(Deleted::Deleted)
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Deleted::Gone),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Deleted::Changed),
            Err(e) => Err(e.into()),
        }
    }

    /// Publishes an event in the background, through the recorder's bounded outbox: an
    /// event is a record for people, and the reconcile need not wait for its round trip.
    /// `unsent` runs when it is not sent after all and sending it again may work: not
    /// the writer, the outbox full, no answer in time, a transport error, or a 429 or 5xx
    /// answer. Not after a 4xx: an event the API server refuses (a quota on Events in the
    /// namespace, say) would be refused again.
    pub fn publish(
        &self,
        recorder: &Recorder,
        event: Event,
        about: ObjectReference,
        unsent: impl FnOnce() + Clone + Send + 'static,
    ) {
        if !self.gate.may_write() {
            return unsent();
        }
        let metrics = self.metrics.clone();
        let rule = self.rule.clone();
        let failed = unsent.clone();
        let queued = recorder.post(event, about, move |sent| match sent {
            Ok(()) => metrics.count_write(&rule, "event"),
            Err(e) => {
                debug!(error = %e, "cannot publish event");
                let refused = matches!(&e, Unsent::Api(kube::Error::Api(s))
                    if s.code < 500 && s.code != 429);
                if !refused {
                    failed();
                }
            }
        });
        if !queued {
            unsent();
        }
    }
}

/// The resourceVersion a create's apply body carries as its precondition. The API server
/// ignores it when it creates the object and compares it with the live object's
/// otherwise; etcd revisions are signed 64-bit numbers, so no stored object carries this
/// one and the comparison always fails. (Server-side apply has no create-only mode: a
/// `metadata.uid` precondition is refused on create, and `creationTimestamp` is ignored.)
pub const NO_OBJECT_RESOURCE_VERSION: &str = "18446744073709551615";

/// [`apply_body`] of `value` with a precondition (`key: val`) in its metadata. Rendering
/// always gives an object with metadata; should one lack it, the precondition still goes
/// in (a `metadata` of its own), and a body that is no object or whose metadata is no
/// object is one the API server refuses whole: never an apply without the precondition.
/// A forced server-side apply of `body` to `name`, its answer read as the child caches
/// read a watched object ([`Wire`]: typed metadata, packed content). `Api::patch` reads
/// it into a `DynamicObject`, whose flattened content serde buffers whole before building
/// its tree, and an answer deeper than serde_json's limit would fail a write already done.
async fn apply_patch(
    api: &Api<DynamicObject>,
    name: &str,
    body: Box<serde_json::value::RawValue>,
) -> Result<DynamicObject, kube::Error> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let req = kube::core::Request::new(api.resource_url())
        .patch(name, &params, &Patch::Apply(body))
        .map_err(kube::Error::BuildRequest)?;
    let applied: Wire<false> = send_as(api, req, "patch").await?;
    Ok(applied.into_packed())
}

fn with_metadata(value: &Json, key: &str, val: &str) -> Box<serde_json::value::RawValue> {
    raw_body(serde_json::to_string(&WithMetadata { value, key, val }).unwrap_or_default())
}

/// `value` as JSON with `key: val` in its metadata, written without copying `value`.
struct WithMetadata<'a> {
    value: &'a Json,
    key: &'a str,
    val: &'a str,
}

impl serde::Serialize for WithMetadata<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Json::Object(top) = self.value else {
            return self.value.serialize(s);
        };
        let precondition = (self.key, self.val);
        let mut map = s.serialize_map(None)?;
        for (k, v) in top {
            match (k.as_str(), v) {
                ("metadata", Json::Object(meta)) => {
                    map.serialize_entry(k, &MetaWith { meta, precondition })?
                }
                _ => map.serialize_entry(k, v)?,
            }
        }
        if !top.contains_key("metadata") {
            map.serialize_entry(
                "metadata",
                &MetaWith {
                    meta: &serde_json::Map::new(),
                    precondition,
                },
            )?;
        }
        map.end()
    }
}

/// A metadata object with one key set (replacing the key if it is there).
struct MetaWith<'a> {
    meta: &'a serde_json::Map<String, Json>,
    precondition: (&'a str, &'a str),
}

impl serde::Serialize for MetaWith<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (key, val) = self.precondition;
        let mut map = s.serialize_map(None)?;
        for (k, v) in self.meta.iter().filter(|(k, _)| k.as_str() != key) {
            map.serialize_entry(k, v)?;
        }
        map.serialize_entry(key, val)?;
        map.end()
    }
}

/// A server-side apply body. The API server reads apply patches with its YAML reader,
/// which refuses DEL, C1 controls, U+FFFE/U+FFFF and takes NEL, LS and PS for line
/// breaks — characters JSON leaves unescaped — so they are sent as `\uXXXX` escapes,
/// which mean the same character to both readers.
pub fn apply_body(value: &Json) -> Box<serde_json::value::RawValue> {
    raw_body(value.to_string())
}

/// [`apply_body`] of a JSON text.
fn raw_body(text: String) -> Box<serde_json::value::RawValue> {
    let safe = rulebook_core::render::yaml_safe(&text).into_owned();
    match serde_json::value::RawValue::from_string(safe) {
        Ok(raw) => raw,
        // Unreachable (escaping inside JSON strings keeps valid JSON); send it unescaped.
        Err(_) => serde_json::value::RawValue::from_string(text)
            .unwrap_or_else(|_| Box::<serde_json::value::RawValue>::default()),
    }
}

/// An apply's answer for a ConfigMap child: Rulebook's fields and another manager's, as
/// the API server sends it. The writer's tests decode it here; the operator's tests
/// (`reconcile::write_answers_tests`) check that the memo and the drift check read it
/// as they read the whole object.
#[doc(hidden)]
pub fn sample_apply_answer() -> String {
    serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "n", "uid": "u", "resourceVersion": "42",
            "labels": {"rulebook.dev/owner": "p"},
            "managedFields": [
                {"manager": "rulebook", "operation": "Apply", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:data": {"f:k": {}}, "f:metadata": {"f:labels": {"f:rulebook.dev/owner": {}}}}},
                {"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:data": {"f:z": {}}}}]},
        "data": {"k": "v", "z": "w"}
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_refusal_in_the_client_is_not_leader_and_other_failures_stay_api_errors() {
        let refused = kube::Error::Service(Box::new(crate::write::gate::WriteRefused));
        assert!(matches!(WriteError::from(refused), WriteError::NotLeader));
        let io = kube::Error::Service(Box::new(std::io::Error::other("connection reset")));
        assert!(matches!(WriteError::from(io), WriteError::Api(_)));
    }

    #[test]
    fn apply_bodies_escape_what_a_yaml_reader_would_change() {
        let v =
            json!({"data": {"v": "a\u{7f}b\u{85}c\u{9f}d\u{2028}e\u{fffe}f\u{ffff}g\"h\u{1f600}"}});
        let body = apply_body(&v);
        let text = body.get();
        assert!(
            !text.chars().any(|c| matches!(
                c,
                '\u{7f}'..='\u{9f}' | '\u{2028}' | '\u{fffe}' | '\u{ffff}'
            )),
            "{text}"
        );
        assert!(
            text.contains("\\u007f") && text.contains("\\u0085") && text.contains("\\ufffe"),
            "{text}"
        );
        let back: Json = serde_json::from_str(text).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn a_create_carries_a_resource_version_no_object_has() {
        let v = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        let sent = with_metadata(&v, "resourceVersion", NO_OBJECT_RESOURCE_VERSION);
        let sent: Json = serde_json::from_str(sent.get()).unwrap();
        assert_eq!(
            sent["metadata"]["resourceVersion"],
            NO_OBJECT_RESOURCE_VERSION
        );
        assert_eq!(sent["metadata"]["name"], "c");
        // No metadata: the precondition goes in all the same.
        let sent = with_metadata(&json!({"kind": "ConfigMap"}), "uid", "u");
        let sent: Json = serde_json::from_str(sent.get()).unwrap();
        assert_eq!(sent["metadata"]["uid"], "u");
        // A key already there is replaced, not repeated; the rest is as it was.
        let v = json!({"kind": "ConfigMap", "metadata": {"uid": "old", "labels": {"a": "b"}}, "data": {"k": "v"}});
        let sent = with_metadata(&v, "uid", "u");
        assert_eq!(sent.get().matches("\"uid\"").count(), 1, "{}", sent.get());
        let sent: Json = serde_json::from_str(sent.get()).unwrap();
        assert_eq!(
            sent,
            json!({"kind": "ConfigMap", "metadata": {"uid": "u", "labels": {"a": "b"}}, "data": {"k": "v"}})
        );
        // Metadata that is no object is sent as it is (and refused whole by the API server).
        let v = json!({"kind": "ConfigMap", "metadata": "x"});
        let sent: Json = serde_json::from_str(with_metadata(&v, "uid", "u").get()).unwrap();
        assert_eq!(sent, v);
        // Above every etcd revision (an i64), still a valid uint64 for the API server.
        let rv: u64 = NO_OBJECT_RESOURCE_VERSION.parse().unwrap();
        assert!(rv > i64::MAX as u64);
    }

    #[test]
    fn a_status_answer_reads_as_the_whole_object_would() {
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
        assert_eq!(lean.status, whole.data["status"]);
        let meta = lean.metadata.into_meta();
        assert_eq!(meta.resource_version.as_deref(), Some("42"));
        assert_eq!(meta.generation, whole.metadata.generation);
        assert_eq!(meta.labels, whole.metadata.labels);
        assert_eq!(meta.annotations, whole.metadata.annotations);
        assert_eq!(meta.finalizers, whole.metadata.finalizers);
        // The reconcile's memo reads this metadata as the whole object's: tested where
        // the memo lives (`reconcile::write_answers_tests`).

        // No status yet: null, as the whole object's missing field reads.
        let lean: StatusApplied = serde_json::from_str(r#"{"metadata": {}}"#).unwrap();
        assert!(lean.status.is_null());
    }

    #[test]
    fn an_apply_answer_reads_as_a_cached_child_and_as_the_whole_object_would() {
        let answer = sample_apply_answer();
        let lean = serde_json::from_str::<Wire<false>>(&answer)
            .unwrap()
            .into_packed();
        let whole: DynamicObject = serde_json::from_str(&answer).unwrap();
        assert_eq!(lean.types, whole.types);
        assert_eq!(lean.metadata.uid, whole.metadata.uid);
        assert_eq!(
            lean.metadata.resource_version,
            whole.metadata.resource_version
        );
        assert_eq!(crate::cache::to_json(&lean), crate::cache::to_json(&whole));
        assert_eq!(lean.metadata.managed_fields, {
            let mut w = whole.clone();
            crate::cache::strip_child(&mut w);
            w.metadata.managed_fields
        });
        // The drift check reads this field set as the whole object's: tested where the
        // drift check lives (`reconcile::write_answers_tests`).
    }

    #[tokio::test]
    async fn a_closed_gate_stops_every_write_before_the_client() {
        struct Closed;
        impl WriteGate for Closed {
            fn may_write(&self) -> bool {
                false
            }
        }
        // A client that would fail loudly if it were ever asked: nothing reaches it.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let ar = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        let api: Api<DynamicObject> = Api::namespaced_with(client, "ns", &ar);
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let w = Writer::new(Arc::new(Closed), metrics.clone(), "r");
        let body = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        assert!(matches!(
            w.apply_status(&api, "c", &body).await,
            Err(WriteError::NotLeader)
        ));
        assert!(matches!(
            w.delete(&api, "c", None, None).await,
            Err(WriteError::NotLeader)
        ));
        assert!(matches!(
            w.create(&api, "c", &body).await,
            Err(WriteError::NotLeader)
        ));
        assert!(matches!(
            w.apply_to(&api, "c", &body, "u").await,
            Err(WriteError::NotLeader)
        ));
        assert_eq!(metrics.writes(), 0, "no write is counted as sent");
        assert_eq!(metrics.refused(), 4, "each refusal is counted");
    }
}
