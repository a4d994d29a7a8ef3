//! `rulebook check` and `rulebook test` check every rendered child against its kind's
//! OpenAPI v3 schema (issue 44, part 1; docs/reference/schemas.md): a template that
//! renders `replicas: "three"`, an unknown field or a missing required field fails the
//! check with the template's `file:line` and the JSON path, before any parent gets it.
//!
//! The schemas come from the cluster (`--kubeconfig`: `/openapi/v3`, then the documents
//! of the group-versions the children use), from a directory (`--openapi DIR`: OpenAPI v3
//! documents, as `make openapi` saves them or as the API server serves them), or, without
//! either, from the built-in kinds' schemas of the Kubernetes version Rulebook is tested
//! against (`openapi/v1.36/`, built into the binary). Each rule's own CRD (generated from
//! its `spec.crd`) is a kind too, with its generated schema, whichever the source.
//!
//! The validator and the line lookup are the pure core's (`rulebook_core::openapi`); this
//! module picks the source, renders the examples, and words the findings.

mod builtin;
mod examples;
pub mod fetch;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value as Json;

use crate::openapi::{Catalog, lines};
use crate::render::{CompiledRule, DesiredChild, RuleSet};
pub use examples::{Report, check_examples};

/// Problems shown per child at most (the rest are the same mistake, mostly).
const PROBLEMS_PER_CHILD: usize = 20;

/// The schema source flag `check` and `test` share (`--kubeconfig` is each one's own).
#[derive(Args, Debug, Clone, Default)]
pub struct SchemaArgs {
    /// Check rendered children against the OpenAPI v3 documents in DIR (`*.json`, as
    /// `make openapi` saves them or `/openapi/v3/apis/<group>/<version>` serves them),
    /// instead of the built-in kinds' schemas built into rulebook (Kubernetes v1.36) or
    /// the cluster's (`--kubeconfig`).
    #[arg(long, value_name = "DIR")]
    pub openapi: Option<PathBuf>,
}

/// The schemas a check uses, and where they came from (said in the output).
pub struct Schemas {
    pub catalog: Catalog,
    pub origin: String,
}

impl Schemas {
    /// From `--openapi DIR` if given, else the built-in set; the rules' CRDs added.
    pub fn offline(args: &SchemaArgs, set: &RuleSet) -> Result<Self> {
        let (mut catalog, origin) = match &args.openapi {
            Some(dir) => (
                from_dir(dir)?,
                format!("the OpenAPI documents in {}", dir.display()),
            ),
            None => (
                builtin::catalog()?,
                format!(
                    "the built-in schemas of Kubernetes {} (--openapi DIR or --kubeconfig for others)",
                    builtin::VERSION
                ),
            ),
        };
        add_rules(&mut catalog, set);
        Ok(Self { catalog, origin })
    }

    /// From the cluster of `kubeconfig` (unless `--openapi DIR` says otherwise).
    pub async fn online(args: &SchemaArgs, kubeconfig: &Path, set: &RuleSet) -> Result<Self> {
        if args.openapi.is_some() {
            return Self::offline(args, set);
        }
        let mut catalog = fetch::catalog(kubeconfig, &child_api_versions(set)).await?;
        add_rules(&mut catalog, set);
        Ok(Self {
            catalog,
            origin: format!("the cluster's schemas ({})", kubeconfig.display()),
        })
    }

    /// The findings of `desired` (rendered by `rule` for the parent at `place`), one line
    /// each: `template:line: path: message (rule 'r', child 'c' of Kind/name, place)`.
    /// A child of a kind with no schema is added to `unknown` instead.
    pub fn check(
        &self,
        rule: &CompiledRule,
        desired: &[DesiredChild],
        place: &str,
        unknown: &mut BTreeSet<String>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for d in desired {
            // A Secret's values (and what a template put next to them) are not quoted.
            let show = d.kind() != "Secret";
            let Some(problems) = self.catalog.validate(&d.object, show, PROBLEMS_PER_CHILD) else {
                unknown.insert(format!(
                    "{} {} (rule '{}', child '{}')",
                    d.api_version(),
                    d.kind(),
                    rule.name,
                    d.name
                ));
                continue;
            };
            let template = rule.child_template(d.child);
            for p in problems {
                let at = match &template {
                    Some((file, text)) => format!("{file}:{}", lines::line_of(text, &p.path)),
                    None => rule.file.clone(),
                };
                out.push(format!(
                    "{at}: {} (rule '{}', child '{}' {}/{}, rendered for {place})",
                    p.describe(),
                    rule.name,
                    d.name,
                    d.kind(),
                    d.object_name()
                ));
            }
        }
        out
    }
}

/// Each rule's own kind: its generated CRD's schema for every version.
fn add_rules(catalog: &mut Catalog, set: &RuleSet) {
    for r in set.rules.values() {
        if let Some(crd) = crate::rules::crd::crd_for(&r.rule) {
            catalog.add_crd(&crd);
        }
    }
}

/// The apiVersions of every rule's children.
fn child_api_versions(set: &RuleSet) -> BTreeSet<String> {
    set.rules
        .values()
        .flat_map(|r| r.children().iter().map(|c| c.api_version.value.clone()))
        .collect()
}

/// The documents of `dir` (`*.json`, in name order).
fn from_dir(dir: &Path) -> Result<Catalog> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("--openapi {}: cannot read the directory", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        anyhow::bail!("--openapi {}: no *.json OpenAPI documents", dir.display());
    }
    let mut catalog = Catalog::new();
    for f in files {
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display()))?;
        let doc: Json =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", f.display()))?;
        catalog
            .add_document(doc)
            .with_context(|| f.display().to_string())?;
    }
    Ok(catalog)
}

/// The notes for kinds with no schema, one line each.
pub fn unknown_notes(unknown: &BTreeSet<String>, origin: &str) -> Vec<String> {
    unknown
        .iter()
        .map(|k| format!("note: no schema of {k} in {origin}: its children are not checked"))
        .collect()
}
