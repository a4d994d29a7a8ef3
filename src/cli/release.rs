//! `rulebook release --rule NAME`: takes Rulebook's finalizer off every parent of a rule,
//! for an uninstall (the operator deleted before its CRs, or a rule removed while the
//! operator was down). No deletion step runs; the garbage collector removes the
//! children. Run as an administrator with a kubeconfig, without the operator.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;

use super::{RuleDirs, load_or_report};
use crate::engine::release_rule;
use crate::metrics::Metrics;
use crate::reconcile::gate::LeaseGate;
use crate::reconcile::writer::Writer;

#[derive(Args, Debug)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// The rule whose parents are released (its parent kind is read from the rules).
    #[arg(long)]
    pub rule: String,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Only parents in this namespace (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
}

/// Runs `rulebook release`. Returns the exit code: 0 when every parent is released.
pub async fn release(args: &ReleaseArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(2);
    };
    let Some(rule) = set.rules.get(&args.rule) else {
        bail!(
            "no rule named '{}' in {} (rules: {})",
            args.rule,
            args.dirs.rules.display(),
            set.rules.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    };
    let config = crate::operator::client_config(args.kubeconfig.as_ref(), "release").await?;
    let client = kube::Client::try_from(config).context("cannot build the API client")?;
    let writer = Writer::new(
        Arc::new(LeaseGate::open()),
        Arc::new(Metrics::new()),
        &rule.name,
    );
    let released = release_rule(
        &client,
        rule,
        args.namespace.as_deref(),
        &writer,
        None,
        "rulebook release",
    )
    .await?;
    for p in &released.released {
        writeln!(out, "released {} {p}", rule.rule.spec.parent.kind.value)?;
    }
    writeln!(
        out,
        "rule '{}': {} of {} parents carried {} and were released",
        rule.name,
        released.released.len(),
        released.parents,
        crate::meta::FINALIZER
    )?;
    Ok(0)
}
