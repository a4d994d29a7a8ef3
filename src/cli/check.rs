//! `rulebook check`: the rules and templates loaded and validated (`file:line` for each
//! error), the creation order of children that wait, conversions round-tripped, rendered
//! examples checked against their schemas; with `--kubeconfig`, the cluster's schemas and
//! server-side dry runs of the generated objects.

use std::io::Write;

use anyhow::{Result, bail};

use super::{CheckArgs, cel_dry_run, roundtrip, schemas};
use crate::render::RuleSet;

/// `rulebook check` without a cluster: rendered children checked against the schemas of
/// `--openapi DIR`, else the built-in ones.
pub(super) fn check(args: &CheckArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_for_check(args, err)? else {
        return Ok(1);
    };
    let schemas = schemas::Schemas::offline(&args.schema, &set)?;
    check_loaded(args, &set, &schemas, out, err)
}

/// `rulebook check --kubeconfig`: the cluster's schemas, then the dry runs of the
/// generated CRDs and admission objects.
pub(super) async fn check_online(
    args: &CheckArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    let Some(set) = load_for_check(args, err)? else {
        return Ok(1);
    };
    let Some(kc) = &args.kubeconfig else {
        bail!("check_online needs --kubeconfig");
    };
    let schemas = schemas::Schemas::online(&args.schema, kc, &set).await?;
    match check_loaded(args, &set, &schemas, out, err)? {
        0 => cel_dry_run::dry_run(&set, kc, out, err).await,
        code => Ok(code),
    }
}

/// The rule set, or `None` with its diagnostics written (and their count).
fn load_for_check(args: &CheckArgs, err: &mut dyn Write) -> Result<Option<RuleSet>> {
    match args.dirs.load(err)? {
        Ok(set) => Ok(Some(set)),
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            writeln!(err, "{} errors", diags.0.len())?;
            Ok(None)
        }
    }
}

fn check_loaded(
    args: &CheckArgs,
    set: &RuleSet,
    schemas: &schemas::Schemas,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    // Warnings do not fail the check: standard error, exit code 0.
    for w in &set.warnings {
        writeln!(err, "{w}")?;
    }
    if !set.warnings.is_empty() {
        writeln!(err, "{} warnings", set.warnings.len())?;
    }
    for (name, rule) in &set.rules {
        writeln!(
            out,
            "ok  {name}  {} {}  ({} children, version {})",
            rule.rule.spec.parent.api_version.value,
            rule.rule.spec.parent.kind.value,
            rule.rule.spec.children.len(),
            rule.version
        )?;
        if let Some(line) = order_line(name, rule) {
            writeln!(out, "{line}")?;
        }
    }
    let trips = roundtrip::check(set, &args.dirs);
    for (rule, n) in &trips.tried {
        if *n == 0 {
            writeln!(
                err,
                "warning: rule '{rule}': no example or RuleTest parent to prove its conversions round-trip on"
            )?;
        } else {
            writeln!(out, "ok  {rule}  conversions round-trip on {n} objects")?;
        }
    }
    let rendered = schemas::check_examples(set, &args.dirs, schemas);
    report_schemas(&rendered, schemas, out, err)?;
    let problems: Vec<&String> = trips.problems.iter().chain(&rendered.problems).collect();
    if !problems.is_empty() {
        for p in &problems {
            writeln!(err, "{p}")?;
        }
        writeln!(err, "{} errors", problems.len())?;
        return Ok(1);
    }
    for line in cel_dry_run::placement_lines(set) {
        writeln!(out, "{line}")?;
    }
    writeln!(out, "{} rules valid", set.rules.len())?;
    Ok(0)
}

/// `order  <rule>  a, b, c  (b waits for a: waitFor; c waits for b: reads children.b at
/// t.yaml:4)`: the order a rule's children are created in, for a rule where one waits for
/// another (spelled or inferred, `render::deps`) or for a reference (`waitFor:
/// [refs.x]`: `c waits for refs.x: waitFor`).
fn order_line(name: &str, rule: &crate::render::CompiledRule) -> Option<String> {
    let children = rule.children();
    let deps = rule.dependencies();
    let ref_waits = rule.reference_waits();
    if deps.iter().all(|d| d.is_empty()) && ref_waits.iter().all(|w| w.is_empty()) {
        return None;
    }
    let order: Vec<&str> = rule
        .creation_order()
        .into_iter()
        .map(|i| children[i].name.as_str())
        .collect();
    let why: Vec<String> = deps
        .iter()
        .enumerate()
        .flat_map(|(i, d)| {
            d.iter().map(move |(&j, why)| {
                let on = children[j].name.as_str();
                format!(
                    "{} waits for {on}: {}",
                    children[i].name.as_str(),
                    why.describe(on)
                )
            })
        })
        .chain(ref_waits.iter().enumerate().flat_map(|(i, w)| {
            w.iter()
                .map(move |r| format!("{} waits for refs.{r}: waitFor", children[i].name.as_str()))
        }))
        .collect();
    Some(format!(
        "order  {name}  {}  ({})",
        order.join(", "),
        why.join("; ")
    ))
}

/// The schema check's lines: per rule what was checked, where the schemas came from,
/// and the notes (parents not rendered, kinds without a schema).
fn report_schemas(
    report: &schemas::Report,
    schemas: &schemas::Schemas,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<()> {
    for (rule, (parents, children, problems)) in &report.checked {
        if *problems > 0 {
            continue;
        }
        writeln!(
            out,
            "ok  {rule}  {children} children of {parents} example and test parents checked against their schemas"
        )?;
    }
    writeln!(out, "schemas: {}", schemas.origin)?;
    for note in &report.notes {
        writeln!(err, "{note}")?;
    }
    for note in schemas::unknown_notes(&report.unknown, &schemas.origin) {
        writeln!(err, "{note}")?;
    }
    Ok(())
}
