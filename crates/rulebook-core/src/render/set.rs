//! A rule set ready to run: the rules read and validated by [`crate::rules`], each
//! compiled with its templates. What the operator serves, `check` checks and `render`
//! renders.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::{CompiledRule, Limits};
use crate::rules::{Diagnostic, Diagnostics, Read, Sources, parse_and_validate, read};

/// A loaded, validated, compiled rule set. Cheap to clone.
#[derive(Clone, Default)]
pub struct RuleSet {
    pub rules: BTreeMap<String, Arc<CompiledRule>>,
    /// Problems that do not stop the set from loading (`rulebook check` prints them),
    /// such as an adopted child whose name the parent's writer chooses.
    pub warnings: Vec<Diagnostic>,
    /// A hash of every input file, to notice when nothing changed.
    pub fingerprint: String,
    /// Files the read skipped with a warning (a dangling link): a rule that was in one
    /// is missing for a moment, not removed, and the operator leaves its children be.
    pub skipped: Vec<String>,
}

impl fmt::Debug for RuleSet {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("RuleSet")
            .field("rules", &self.rules.keys().collect::<Vec<_>>())
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

/// Parses, validates and compiles a rule set already in memory. The default rollout,
/// if any, becomes the `spec.rollout` of each rule with `spec.crd` and none of its own
/// (a rollout needs the rule's CRD: it reads each parent's `status.ruleVersion`).
pub fn compile(sources: &Sources, limits: &Limits) -> Result<RuleSet, Diagnostics> {
    let (mut valid, mut diags) = parse_and_validate(sources);
    if let Some((file, text)) = &sources.default_rollout {
        match crate::rules::rollout::parse_default(file, text) {
            Ok(ro) => {
                let mut d = super::rollout::RolloutProgram::check_default(file, &ro, limits);
                diags.append(&mut d);
                // Before compiling: the default is part of the rule as written, so of its
                // version, of what a rollout stores, and of what `diff` plans.
                for sr in valid
                    .iter_mut()
                    .filter(|sr| sr.rule.spec.crd.is_some() && sr.rule.spec.rollout.is_none())
                {
                    sr.rule.spec.rollout = Some(ro.clone());
                }
            }
            Err(mut d) => diags.append(&mut d),
        }
    }
    let mut rules = BTreeMap::new();
    for sr in &valid {
        match CompiledRule::compile(sr, &sources.templates, limits) {
            Ok(c) => {
                rules.insert(sr.rule.metadata.name.value.clone(), c);
            }
            Err(mut d) => diags.append(&mut d),
        }
    }
    // Each rule's part among the rules of its parent kind.
    let all: Vec<&crate::rules::Rule> = rules.values().map(|r: &CompiledRule| &r.rule).collect();
    let roles = crate::rules::decorators::roles(&all);
    let mut peers = crate::rules::decorators::peers(&all);
    let rules: BTreeMap<String, Arc<CompiledRule>> = rules
        .into_iter()
        .map(|(name, mut r)| {
            if let Some(role) = roles.get(&name) {
                r.role = *role;
            }
            r.peers = peers.remove(&name).unwrap_or_default();
            (name, Arc::new(r))
        })
        .collect();
    if diags.is_empty() {
        let mut warnings: Vec<Diagnostic> = rules
            .values()
            .flat_map(|r| {
                let mut w = super::adopt::warnings(r);
                w.extend(super::refs::warnings(r));
                w.extend(super::unwaited::warnings(r));
                w.extend(super::role_refs::warnings(r));
                w.extend(super::targets::warnings(r));
                w
            })
            .collect();
        warnings.sort();
        Ok(RuleSet {
            rules,
            warnings,
            fingerprint: sources.fingerprint(),
            skipped: Vec::new(),
        })
    } else {
        diags.sort();
        diags.dedup();
        Err(Diagnostics(diags))
    }
}

/// Validates and compiles what one read of the directories found. The set's
/// fingerprint is [`Read::fingerprint`].
pub fn compile_read(read: &Read, limits: &Limits) -> Result<RuleSet, Diagnostics> {
    if !read.errors.is_empty() {
        let mut errors = read.errors.clone();
        errors.sort();
        errors.dedup();
        return Err(Diagnostics(errors));
    }
    let mut set = compile(&read.sources, limits)?;
    set.fingerprint = read.fingerprint();
    set.skipped = read.warnings.iter().map(|w| w.file.clone()).collect();
    Ok(set)
}

/// Reads the rules and templates directories and validates them as a whole.
pub fn load(
    rules_dir: &Path,
    templates_dir: &Path,
    limits: &Limits,
) -> Result<RuleSet, Diagnostics> {
    compile_read(&read(rules_dir, templates_dir), limits)
}
