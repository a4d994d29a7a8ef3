//! Rulebook: a generic Kubernetes operator driven by rule files.
//!
//! The flow, pure core first: [`rules`] (model, loading, validation) → [`render`]
//! (templates → desired children, status) → [`cache`] and [`write`] (the kube layer: the
//! cached object form, the one write path) → `reconcile` (the only API writes) →
//! `engine` (one controller per rule) → `reload` (new rule sets from disk) and
//! `gitsource` (from a git repository).

pub mod cli;
pub mod crds;
pub mod engine;
pub mod gitsource;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod operator;
pub mod policies;
pub mod rbac;
pub mod reconcile;
pub mod reload;
pub mod shard;
pub mod webhook;

// The pure core, a crate of its own (crates/rulebook-core): `crate::rules`, `crate::render`
// and `crate::meta` name it as before.
pub use rulebook_core::{cel, meta, openapi, render, rollout, rules};
// The kube layer, a crate of its own (crates/rulebook-kube): `crate::cache` (the cached
// object form) and `crate::write` (the one write path) name it.
pub use rulebook_kube::{cache, write};
