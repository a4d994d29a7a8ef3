//! Rulebook's pure core: the rule model, loading and validation ([`rules`]), rendering
//! children and status from templates and expressions ([`render`]), and the shared
//! vocabulary of labels and names ([`meta`]); rendered objects checked against their kinds'
//! OpenAPI schemas ([`openapi`]). A crate of its own so that the compiler,
//! not a test reading the sources, keeps it pure: it has no kube, k8s-openapi, hyper or
//! tokio among its dependencies, so nothing here can call the API server, spawn a task
//! or block a runtime — it can be tested with plain values and used by `check`, `render`
//! and `test` without a cluster. The operator crate (`rulebook`) builds the reconcile, the
//! engine and the command line on top of it (../shared/design/house.md, "crates by layer").

pub mod cel;
pub mod meta;
pub mod openapi;
pub mod render;
pub mod rollout;
pub mod rules;
