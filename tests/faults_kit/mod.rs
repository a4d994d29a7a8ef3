//! Shared scenarios of the fault and abuse tests (`tests/faults.rs`, light, run with the
//! other tests of `make test`; `tests/faults_heavy.rs`, heavy, `#[ignore]`d and run one at
//! a time by `make test` — those that restart the API server or etcd on a control plane of
//! their own (scripts/test-restarts.sh) — or alone by `make test-faults`).
//! See docs/faults.md.
//!
//! Every scenario runs its own `rulebook run` process on rules it writes into a temp dir,
//! for a parent kind of its own in group `faults.rulebook.dev`, in a namespace of its own.
//!
//! The kit's parts, by meaning: the tools every scenario uses (`rules` on disk, `api`
//! requests that ride out a restart, the `audit` log, the `control` levers: signals,
//! cluster.sh, a seeded Rng; `foreign` objects that must stay untouched), then one file
//! per scenario (`kill_restart`, `pause`, `restart`, `poison`, `teardown`, `memory`).
//! Many cluster tests use the tools without the scenarios.

#![allow(dead_code)] // each test binary uses a different part of the kit

pub mod memory;
pub mod teardown;

mod api;
mod audit;
mod control;
mod foreign;
mod kill_restart;
mod pause;
mod poison;
mod restart;
mod rules;
// One flat namespace for the tests (`use faults_kit::*`), as before the split.
#[allow(unused_imports)] // each test binary uses a different part of the kit
pub use self::{
    api::*, audit::*, control::*, foreign::*, kill_restart::*, pause::*, poison::*, restart::*,
    rules::*,
};

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchParams,
};
use kube::core::WatchEvent;
use serde_json::{Value as Json, json};

use crate::common::*;
