//! `rulebook release`: takes Rulebook's finalizer off every parent of a rule, for an
//! uninstall (the operator deleted before its parents) or a rule removed while the
//! operator was down. No deletion step runs; the garbage collector removes the children,
//! but for those with `deletionPolicy: Orphan`, which are let go of first.
//! Run as an administrator with a kubeconfig, without the operator. The parent kind comes
//! from the rule (`--rule NAME`, read from the rules directory) or is given
//! (`--api-version`, `--kind`) when the rule is gone from the directory too.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;

use super::{RuleDirs, load_or_report};
use crate::engine::{ParentsOf, release_parents};
use crate::metrics::Metrics;
use crate::write::gate::LeaseGate;
use crate::write::writer::Writer;

#[derive(Args, Debug)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// The rule whose parents are released (its parent kind is read from the rules).
    #[arg(long, required_unless_present = "kind", conflicts_with_all = ["kind", "api_version"])]
    pub rule: Option<String>,
    /// The parents' apiVersion, instead of `--rule` (with `--kind`).
    #[arg(long, requires = "kind")]
    pub api_version: Option<String>,
    /// The parents' kind, instead of `--rule` (with `--api-version`).
    #[arg(long, requires = "api_version")]
    pub kind: Option<String>,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Only parents in this namespace (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only parents with these labels (the operator's `--selector`).
    #[arg(long)]
    pub selector: Option<String>,
}

/// Runs `rulebook release`. Returns the exit code: 0 when every parent is released, 1
/// when some keep the finalizer (their `Orphan` children could not all be let go of), 2
/// when the rules cannot be read.
pub async fn release(args: &ReleaseArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let (api_version, kind, label, orphan_kinds) = match (&args.rule, &args.api_version, &args.kind)
    {
        (Some(name), _, _) => {
            let Some(set) = load_or_report(&args.dirs, err)? else {
                return Ok(2);
            };
            let Some(rule) = set.rules.get(name) else {
                bail!(
                    "no rule named '{name}' in {} (rules: {}); name the parents with --api-version and --kind instead",
                    args.dirs.rules.display(),
                    set.rules.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            };
            let p = &rule.rule.spec.parent;
            (
                p.api_version.value.clone(),
                p.kind.value.clone(),
                format!("rule '{name}'"),
                crate::engine::orphan_kinds(rule),
            )
        }
        // The kinds recorded on each parent (`rulebook.dev/orphan-kinds`) only.
        (None, Some(api_version), Some(kind)) => (
            api_version.clone(),
            kind.clone(),
            format!("{api_version} {kind}"),
            Vec::new(),
        ),
        _ => bail!("name the rule (--rule) or the parents' kind (--api-version and --kind)"),
    };
    let config = crate::operator::client_config(args.kubeconfig.as_ref(), "release").await?;
    let client = kube::Client::try_from(config).context("cannot build the API client")?;
    let writer = Writer::new(
        Arc::new(LeaseGate::open()),
        Arc::new(Metrics::new()),
        "release",
    );
    let of = ParentsOf {
        api_version,
        kind: kind.clone(),
        namespace: args.namespace.clone(),
        selector: args.selector.clone(),
        share: None,
        orphan_kinds,
    };
    let released = release_parents(&client, &of, &writer, None, "rulebook release").await?;
    for o in &released.orphaned {
        writeln!(out, "orphaned {o} (deletionPolicy: Orphan)")?;
    }
    for p in &released.released {
        writeln!(out, "released {kind} {p}")?;
    }
    for p in &released.kept {
        writeln!(
            err,
            "kept {kind} {p} (the finalizer stays; run again once that is resolved)"
        )?;
    }
    writeln!(
        out,
        "{label}: {} of {} parents carried {} and were released",
        released.released.len(),
        released.parents,
        crate::meta::FINALIZER
    )?;
    Ok(if released.kept.is_empty() { 0 } else { 1 })
}
