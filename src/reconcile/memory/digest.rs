//! The fingerprint of a reconcile's inputs, and the identity of a parent: the keys by
//! which [`super::steady::Steady`] remembers a reconcile that had nothing to do, and by
//! which the status writes tell a parent changed by someone else from one changed only by
//! this process's own status write. Pure hashing of what the caches hold; nothing here
//! is remembered.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::Value as Json;

use crate::meta::JsonAt;

/// The fingerprint of a reconcile's inputs but the parent: its live children's and its
/// referenced objects' UIDs and resourceVersions.
pub fn observed(
    children: &[(usize, Arc<DynamicObject>)],
    refs: &std::collections::BTreeMap<String, Json>,
) -> u64 {
    observed_of(keys(children), refs)
}

/// A child as [`observed`] counts it: its kind (index in the rule context), UID and
/// resourceVersion.
pub type ChildKey = (usize, Option<String>, Option<String>);

/// The [`ChildKey`]s of `children`.
pub fn keys(children: &[(usize, Arc<DynamicObject>)]) -> Vec<ChildKey> {
    children
        .iter()
        .map(|(k, o)| (*k, o.uid(), o.resource_version()))
        .collect()
}

/// [`observed`] of children given by their keys.
pub fn observed_of(
    mut kids: Vec<ChildKey>,
    refs: &std::collections::BTreeMap<String, Json>,
) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    kids.sort();
    kids.hash(&mut h);
    for (name, v) in refs {
        name.hash(&mut h);
        let one = |o: &Json, h: &mut std::collections::hash_map::DefaultHasher| {
            o.at(&["metadata", "uid"]).and_then(Json::as_str).hash(h);
            o.at(&["metadata", "resourceVersion"])
                .and_then(Json::as_str)
                .hash(h);
        };
        match v {
            Json::Array(list) => {
                list.len().hash(&mut h);
                list.iter().for_each(|o| one(o, &mut h));
            }
            o => one(o, &mut h),
        }
    }
    h.finish()
}

/// The fingerprint of a reconcile's inputs: the parent (`parent_rv` is its
/// resourceVersion as this process knows it: its own last status write may not be in
/// the cache yet) and [`observed`].
pub fn fingerprint(parent: &DynamicObject, parent_rv: Option<u64>, observed: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.uid().hash(&mut h);
    parent_rv.hash(&mut h);
    observed.hash(&mut h);
    h.finish()
}

/// What makes a parent worth reconciling, as a hash: its generation, labels,
/// annotations, finalizers and deletion — `None` for kinds without a generation (any
/// change of theirs counts).
pub fn identity(o: &DynamicObject) -> Option<u64> {
    identity_of(&o.metadata)
}

/// [`identity`] of an object's metadata.
pub fn identity_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.generation?.hash(&mut h);
    m.labels.hash(&mut h);
    // As cached: without the last-applied annotation (see `cache::strip_parent`).
    m.annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != "kubectl.kubernetes.io/last-applied-configuration")
        .for_each(|kv| kv.hash(&mut h));
    m.finalizers.hash(&mut h);
    m.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}
