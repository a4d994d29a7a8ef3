//! The cached object form: how watched parents, children and referenced objects are
//! decoded from the API server, kept in memory, and read back as JSON by a reconcile.
//!
//! Watch caches hold every parent and child of every rule, so their form decides most of
//! Rulebook's memory, and what a tenant can make the operator hold. Bottom up:
//!
//! - [`packed`] (re-exported here: `cache::to_json`, `cache::Packed`, …): the form kept,
//!   content as one JSON string, Rulebook's own field set only, and the way back to JSON;
//! - [`wire`]: decoding one object at a time from a list page or a watch event into that
//!   form, without building a tree, so a too-deep object fails only its own parent;
//! - [`store`]: the store of a rule's children of one kind, indexed by owner;
//! - [`admission`]: the budget on what the caches may hold, per namespace and in all
//!   (past it, an object is cached as a stub).
//!
//! Imports run one way: `admission`, `store` and `wire` read `packed`; nothing here reads
//! the write path or the operator. `wire` and `store` are hand-written against kube-rs
//! (serde_json's `DynamicObject`, kube-runtime's reflector store); their headers give the
//! measurements.

pub mod admission;
pub mod packed;
pub mod store;
pub mod wire;

pub use packed::{
    MAX_DEPTH, Packed, into_json, is_apply_by, is_own_apply, nesting_depth, readable, strip_child,
    strip_parent, to_json, to_json_as, to_json_with_managed_fields, without_content,
};
