//! Rulebook's kube layer: what sits between the pure core (`rulebook-core`: rules,
//! rendering) and the operator (`rulebook`: engine, reconcile stages, sharding, HTTP,
//! CLI), and needs the Kubernetes client and the async runtime.
//!
//! - [`cache`]: the form in which watched objects are decoded and cached (wire decoding,
//!   the packed form, the child store, admission to the cache under its budget);
//! - [`write`]: the one write path (the writer, its gate on the API client and on each
//!   request body, events through the recorder and its outbox).
//!
//! `write` reads `cache` (a write's answer is decoded as a watched object is); `cache`
//! knows nothing of writes. Neither knows the operator: what they count they count
//! through [`counts`]' traits, which the operator's metrics registry implements, and a
//! gate is any [`write::gate::WriteGate`] (the operator's shard gate is one). This crate
//! has no dependency on the operator crate, so an import of it does not compile.

pub mod cache;
pub mod counts;
pub mod write;
