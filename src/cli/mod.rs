//! The `rulebook` command line: subcommands and their output. Everything here but
//! `run` works without a cluster.
//!
//! This file is the dispatch (which subcommand runs where) and the small helpers every
//! subcommand shares (reading and writing YAML streams, diffs). The argument types are in
//! `args.rs`; `check` in `check.rs`; `render` in `render_parent.rs`, with the lookups it
//! shares with `test` in `lookup.rs`; `crds` and `rbac`, which print manifests, in
//! `manifests.rs`; the other subcommands in their own modules.

mod args;
pub mod cel_dry_run;
mod check;
pub mod diff;
pub mod git_args;
mod lookup;
mod manifests;
pub mod observed;
pub mod release;
mod render_parent;
pub mod rollout;
pub mod roundtrip;
pub mod ruletest;
pub mod schemas;
pub mod webhook_args;

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;

pub use args::*;
pub use lookup::{offline_scope, rule_for, storage_spec_schema, with_render_defaults};

use crate::render::RuleSet;

/// Runs a subcommand that needs no cluster. Returns the process exit code.
pub fn run_offline(command: &Command, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    match command {
        Command::Check(args) => check::check(args, out, err),
        Command::Render(args) => render_parent::render(args, out, err),
        Command::Schema => {
            writeln!(out, "{}", schema_json()?)?;
            Ok(0)
        }
        Command::Crds(args) => manifests::crds(args, out, err),
        Command::Rbac(args) => manifests::rbac(args, out, err),
        Command::Test(args) => ruletest::run(args, out, err),
        Command::Run(_) | Command::Release(_) | Command::Diff(_) | Command::Rollout(_) => {
            bail!("this command needs the async runtime; call it from main")
        }
    }
}

/// Runs a subcommand that talks to a cluster (`diff`, `release`; others as
/// [`run_offline`]). Returns the process exit code.
pub async fn run_online(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    match command {
        // An error is exit 2, never 1 ("something would change").
        Command::Diff(args) => match diff::diff(args, out, err).await {
            Ok(code) => Ok(code),
            Err(e) => {
                writeln!(err, "rulebook diff: {e:#}")?;
                Ok(2)
            }
        },
        Command::Release(args) => release::release(args, out, err).await,
        Command::Rollout(args) => rollout::rollout(args, out, err).await,
        Command::Check(args) if args.kubeconfig.is_some() => {
            check::check_online(args, out, err).await
        }
        Command::Test(args) if args.kubeconfig.is_some() => {
            ruletest::run_online(args, out, err).await
        }
        other => run_offline(other, out, err),
    }
}

fn load_or_report(dirs: &RuleDirs, err: &mut dyn Write) -> Result<Option<RuleSet>> {
    match dirs.load(err)? {
        Ok(set) => Ok(Some(set)),
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            Ok(None)
        }
    }
}

fn write_stream(objects: &[Json], out: &mut dyn Write) -> Result<()> {
    for (i, o) in objects.iter().enumerate() {
        if i > 0 {
            writeln!(out, "---")?;
        }
        write!(out, "{}", to_yaml(o)?)?;
    }
    Ok(())
}

pub use crate::meta::is_cluster_scoped_builtin;

/// Every object of a YAML or JSON stream.
pub fn read_objects(path: &Path) -> Result<Vec<Json>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_objects(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Every object of a YAML or JSON stream's text.
pub fn parse_objects(text: &str) -> std::result::Result<Vec<Json>, String> {
    let docs: Vec<Json> = serde_saphyr::from_multiple(text).map_err(|e| e.to_string())?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// `o` without the annotations `keys` (and without `annotations` when none is left).
pub fn strip_annotations(o: &mut Json, keys: &[&str]) {
    if let Some(meta) = o.get_mut("metadata").and_then(Json::as_object_mut)
        && let Some(a) = meta.get_mut("annotations").and_then(Json::as_object_mut)
    {
        for k in keys {
            a.remove(*k);
        }
        if a.is_empty() {
            meta.remove("annotations");
        }
    }
}

/// A unified diff of two texts (`from` → `to`), empty when they are equal.
pub fn unified_diff(from: &str, to: &str, a: &str, b: &str) -> String {
    similar::TextDiff::from_lines(a, b)
        .unified_diff()
        .context_radius(3)
        .header(from, to)
        .to_string()
}

pub fn to_yaml(v: &Json) -> Result<String> {
    serde_saphyr::to_string(v).context("cannot write YAML")
}

pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub fn schema_json() -> Result<String> {
    let schema = schemars::schema_for!(crate::rules::Rule);
    Ok(serde_json::to_string_pretty(&schema)?)
}
