//! `rulebook render`: one parent's children (or status) as `run` would produce them: the
//! parent read as stored (storage version, schema defaults), the rule set's own scopes,
//! the children checked against their schemas.

use std::io::Write;

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;

use super::lookup::{offline_scope, rule_for, with_render_defaults};
use super::{
    RenderArgs, cel_dry_run, now_rfc3339, observed, read_objects, ruletest, schemas, to_yaml,
    write_stream,
};
use crate::render::{RuleSet, status};

pub(super) fn render(args: &RenderArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let set = match args.dirs.load(err)? {
        Ok(set) => set,
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            return Ok(1);
        }
    };
    let parent = read_objects(&args.parent)?
        .into_iter()
        .next()
        .with_context(|| format!("{}: no object", args.parent.display()))?;
    let api_version = parent
        .get("apiVersion")
        .and_then(Json::as_str)
        .unwrap_or("");
    let kind = parent.get("kind").and_then(Json::as_str).unwrap_or("");
    let Some(rule) = rule_for(&set, api_version, kind) else {
        bail!("no rule has parent {api_version} {kind}");
    };
    if args.admission {
        write_stream(&cel_dry_run::admission_objects(&set, rule)?, out)?;
        return Ok(0);
    }
    // Read as the operator reads it: in the storage version, with the CRD schema's
    // defaults, refused where the API server would refuse it (as `rulebook test` does).
    let parent = match ruletest::as_stored(rule, &with_render_defaults(rule, parent)) {
        Ok(p) => p,
        Err(e) => {
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    // The documents after the parent in its own file count as observed objects too (an
    // example's referenced Secret and ConfigMaps, say).
    let mut objects: Vec<Json> = read_objects(&args.parent)?.into_iter().skip(1).collect();
    if let Some(p) = &args.observed {
        objects.extend(read_objects(p)?);
    }
    let scope = offline_scope(&set, rule);
    let observed::Matched {
        observed,
        desired,
        ignored,
    } = match observed::render_against(rule, &parent, objects, &scope) {
        Ok(m) => m,
        Err(e) => {
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    if let Some(file) = &args.observed {
        for note in &ignored {
            writeln!(err, "warning: {}: {note}", file.display())?;
        }
    }
    if !schema_checked(&set, rule, &desired, args, err)? {
        return Ok(1);
    }
    if args.status {
        let report = match rule.status(&parent, &observed, &desired) {
            Ok(r) => r,
            Err(e) => {
                writeln!(err, "{e}")?;
                return Ok(1);
            }
        };
        let now = args.now.clone().unwrap_or_else(now_rfc3339);
        let status =
            status::desired_status(&parent, &report.fields, &report.readiness.condition(), &now);
        write!(
            out,
            "{}",
            to_yaml(&serde_json::json!({ "status": status }))?
        )?;
    } else {
        let objects: Vec<Json> = desired.into_iter().map(|d| d.object).collect();
        write_stream(&objects, out)?;
    }
    Ok(0)
}

/// The rendered children checked against their kinds' schemas, as `rulebook test` checks
/// each step's: false (the problems written to `err`) when the API server would refuse one.
fn schema_checked(
    set: &RuleSet,
    rule: &crate::render::CompiledRule,
    desired: &[crate::render::DesiredChild],
    args: &RenderArgs,
    err: &mut dyn Write,
) -> Result<bool> {
    let schemas = schemas::Schemas::offline(&args.schema, set)?;
    let mut unknown = std::collections::BTreeSet::new();
    let place = args.parent.display().to_string();
    let problems = schemas.check(rule, desired, &place, &mut unknown);
    for note in schemas::unknown_notes(&unknown, &schemas.origin) {
        writeln!(err, "{note}")?;
    }
    for p in &problems {
        writeln!(err, "{p}")?;
    }
    Ok(problems.is_empty())
}
