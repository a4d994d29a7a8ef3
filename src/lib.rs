//! Rulebook: a generic Kubernetes operator driven by rule files.
//!
//! The flow, pure core first: [`rules`] (model, loading, validation) → [`render`]
//! (templates → desired children, status) → `reconcile` (the only API writes) →
//! `engine` (one controller per rule) → `reload` (new rule sets from disk).

pub mod cli;
pub mod crds;
pub mod engine;
pub mod http;
pub mod leader;
pub mod members;
pub mod meta;
pub mod metrics;
pub mod operator;
pub mod rbac;
pub mod reconcile;
pub mod reload;
pub mod render;
pub mod rules;
pub mod shard;
