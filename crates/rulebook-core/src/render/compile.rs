//! Compiling a rule: its templates and expressions into one sandboxed minijinja
//! environment, checked up front — forbidden filters, unknown variables, references to
//! children the rule does not have, JSONPath and durations — so that a rule that loads
//! can only fail at render time on what its parent holds.

use super::compile_exprs::{Diags, ExprReads};
use super::diags::line_of;
use super::names::{self, allowed_vars, may_read_parent_status, names_used};
use super::*;
use crate::rules::Rule;

/// What a rule's templates were found to do, for the render and the reconcile.
struct TemplateReads {
    /// Some template names `children`: the render context must carry the live children
    /// (converting them is most of the cost of building a context).
    children: bool,
    /// Some template may read the parent's status, which the reconcile itself writes
    /// (`CompiledRule::depends_on_own_writes`).
    parent_status: bool,
    /// Some template calls `ready()` (or a child waits for another).
    ready: bool,
    /// Every template is straight-line code (`slice.rs`).
    straight: bool,
}

impl CompiledRule {
    /// Compiles a parsed rule against the template sources with `limits`, in one
    /// environment (no slice environment: [`CompiledRule::compile`]). Every problem is
    /// reported: the templates' (found, allowed, parsed, naming what exists), then the
    /// expressions' (`compile_exprs.rs`).
    pub(super) fn compile_once(
        sr: &SourcedRule,
        templates: &BTreeMap<String, (String, String)>,
        limits: &Limits,
    ) -> Result<CompiledRule, Vec<Diagnostic>> {
        let rule = &sr.rule;
        let name = rule.metadata.name.value.clone();
        let at = Diags {
            file: sr.file.as_str(),
            name: &name,
        };
        let mut diags = Vec::new();
        let mut env = env::environment(limits);
        let used = used_templates(rule, templates, &at, &mut diags);
        let straight = add_templates(&mut env, &used, templates, &mut diags);
        let reads = inspect_templates(&env, rule, &used, templates, straight, &mut diags);
        let version = rule_version(rule, &used, templates);
        let depends_on =
            super::deps::with_rule_file(super::deps::depends_on(&env, rule, templates), &sr.file);
        diags.extend(super::deps::cycle(rule, &depends_on, &at));
        let resync = rule
            .spec
            .resync
            .as_ref()
            .and_then(|r| parse_duration(r).ok());
        diags.extend(super::admission::diagnostics(&env, rule, &at));
        diags.extend(super::admission_names::diagnostics(&env, rule, &at));
        diags.extend(
            super::role_refs::diagnostics(rule, &sr.file, &|t| templates.get(t).cloned()).0,
        );
        diags.extend(super::targets::diagnostics(rule, &sr.file));
        let rollout = match super::rollout::RolloutProgram::compile(rule, limits, &at) {
            Ok(p) => p.map(Arc::new),
            Err(mut d) => {
                diags.append(&mut d);
                None
            }
        };
        let template_sources = Arc::new(
            used.keys()
                .filter_map(|t| templates.get(t).map(|(_, src)| (t.clone(), src.clone())))
                .collect(),
        );
        let in_exprs = ExprReads::default();
        let compiled = Compiled::try_new(env, |env| {
            super::compile_exprs::programs(env, rule, &at, &in_exprs)
        });
        match compiled {
            Ok(compiled) if diags.is_empty() => Ok(CompiledRule {
                rule_value: super::val(&serde_json::json!({"name": name, "version": version})),
                name: name.clone(),
                file: sr.file.clone(),
                rule: rule.clone(),
                version,
                resync,
                template_files: used,
                compiled,
                slice: None,
                straight_line: reads.straight && in_exprs.straight.get(),
                limits: limits.clone(),
                uses_ready: reads.ready
                    || in_exprs.ready.get()
                    || depends_on.iter().any(|d| !d.is_empty()),
                depends_on,
                ref_waits: super::deps::ref_waits(rule),
                reads_children: reads.children || in_exprs.children.get(),
                reads_parent_status: reads.parent_status || in_exprs.parent_status.get(),
                messages: super::admission::message_templates(rule, limits),
                rollout,
                bindable: super::role_refs::bindable_by_child(rule, &|t| {
                    templates.get(t).map(|(_, src)| src.as_str())
                }),
                template_sources,
                role: crate::rules::decorators::KindRole::SOLE,
                peers: Vec::new(),
            }),
            Ok(_) => Err(diags),
            Err(mut more) => {
                diags.append(&mut more);
                Err(diags)
            }
        }
    }
}

/// The templates `rule` uses (name → file shown), and everything they include; every
/// template when one include is computed (it could name any).
fn used_templates(
    rule: &Rule,
    templates: &BTreeMap<String, (String, String)>,
    at: &Diags<'_>,
    diags: &mut Vec<Diagnostic>,
) -> BTreeMap<String, String> {
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    let mut queue: Vec<String> = Vec::new();
    for (i, c) in rule.spec.children.iter().enumerate() {
        if templates.contains_key(c.template.as_str()) {
            queue.push(c.template.value.clone());
        } else {
            diags.push(at.at(
                c.template.line,
                c.template.col,
                &format!("spec.children[{i}].template"),
                format!(
                    "template '{}' not found in the templates directory",
                    c.template.value
                ),
            ));
        }
    }
    queue.extend(super::convert::conversion_templates(
        rule, templates, at, diags,
    ));
    let mut dynamic_include = false;
    while let Some(t) = queue.pop() {
        if used.contains_key(&t) {
            continue;
        }
        let Some((path, source)) = templates.get(&t) else {
            continue;
        };
        used.insert(t.clone(), path.clone());
        for m in INCLUDE.captures_iter(source) {
            match m.get(1).or(m.get(2)) {
                Some(inc) if templates.contains_key(inc.as_str()) => {
                    queue.push(inc.as_str().to_string())
                }
                Some(inc) => diags.push(Diagnostic::new(
                    path.as_str(),
                    line_of(source, inc.start()),
                    0,
                    format!(
                        "template '{}' not found in the templates directory",
                        inc.as_str()
                    ),
                )),
                None => dynamic_include = true,
            }
        }
    }
    if dynamic_include {
        for (t, (path, _)) in templates {
            used.insert(t.clone(), path.clone());
        }
    }
    used
}

/// Adds the used templates to `env`, refusing the filters that would turn escaping off
/// and reporting syntax errors; returns whether every one is straight-line code.
fn add_templates(
    env: &mut Environment<'static>,
    used: &BTreeMap<String, String>,
    templates: &BTreeMap<String, (String, String)>,
    diags: &mut Vec<Diagnostic>,
) -> bool {
    let mut straight = true;
    for (t, path) in used {
        let source = &templates[t].1;
        straight &= super::slice::straight_template(source);
        for tag in TAG.find_iter(source) {
            if let Some(m) = FORBIDDEN.find(tag.as_str()) {
                diags.push(Diagnostic::new(
                    path.as_str(),
                    line_of(source, tag.start() + m.start()),
                    0,
                    format!(
                        "'{}' is not allowed: Rulebook prints every value as a safe scalar and \
                         escaping cannot be turned off",
                        m.as_str().trim_start_matches('|').trim()
                    ),
                ));
            }
        }
        if let Err(e) = env.add_template_owned(t.clone(), source.clone()) {
            diags.push(Diagnostic::new(
                path.as_str(),
                e.line().unwrap_or(0) as u64,
                0,
                describe(&e),
            ));
        }
    }
    straight
}

/// Checks the used templates' variables, children and references, and notes what they
/// read.
fn inspect_templates(
    env: &Environment<'static>,
    rule: &Rule,
    used: &BTreeMap<String, String>,
    templates: &BTreeMap<String, (String, String)>,
    straight: bool,
    diags: &mut Vec<Diagnostic>,
) -> TemplateReads {
    let mut reads = TemplateReads {
        children: false,
        parent_status: false,
        ready: rule.spec.children.iter().any(|c| !c.wait_for.is_empty()),
        straight,
    };
    let allowed = allowed_vars(env, &["item", "index"]);
    // Conversion templates (and what they include) see `object`, `parent` and `rule`.
    let (for_children, for_conversion) = super::convert::template_roles(rule, used, templates);
    let converting = names::conversion_vars(env);
    for (t, path) in used {
        let Ok(tmpl) = env.get_template(t) else {
            reads.children = true; // not inspected: assume it does
            reads.parent_status = true;
            continue;
        };
        let source = tmpl.source();
        let vars = tmpl.undeclared_variables(false);
        let (child, conversion) = (for_children.contains(t), for_conversion.contains(t));
        if child {
            reads.children |= vars.contains("children");
            reads.parent_status |= may_read_parent_status(&tmpl.undeclared_variables(true));
            reads.ready |= READY_CALL.is_match(source);
        }
        let known =
            |v: &String| (child && allowed.contains(v)) || (conversion && converting.contains(v));
        for var in vars.into_iter().filter(|v| !known(v)) {
            let line = Regex::new(&format!(r"\b{}\b", regex::escape(&var)))
                .ok()
                .and_then(|r| r.find(source))
                .map(|m| line_of(source, m.start()))
                .unwrap_or(0);
            diags.push(Diagnostic::new(
                path.as_str(),
                line,
                0,
                if child {
                    format!(
                        "unknown variable '{var}' (templates see parent, children, refs, rule, ready(), and item/index in forEach)"
                    )
                } else {
                    format!(
                        "unknown variable '{var}' (conversion templates see object, parent (the same object) and rule)"
                    )
                },
            ));
        }
        if !child {
            continue;
        }
        diags.extend(names_in_template(rule, t, source).map(|(offset, message)| {
            Diagnostic::new(path.as_str(), line_of(source, offset), 0, message)
        }));
    }
    reads
}

/// `(offset, message)` for each child and reference a template names that the rule does
/// not have (and any reference in the finalize child's, which renders without them).
fn names_in_template<'a>(
    rule: &'a Rule,
    t: &'a str,
    source: &'a str,
) -> impl Iterator<Item = (usize, String)> + 'a {
    let name = rule.metadata.name.as_str();
    let finalize_template = rule
        .spec
        .finalize_child()
        .and_then(|i| rule.spec.children.get(i))
        .is_some_and(|c| c.template.value == *t);
    let children = names_used(&CHILD_REF, source)
        .filter(|(_, n)| !rule.spec.children.iter().any(|c| c.name.as_str() == *n))
        .map(move |(at, n)| (at, format!("children.{n} is not a child of rule '{name}'")));
    let refs = names_used(&REFS_REF, source).filter_map(move |(at, n)| {
        let message = if finalize_template {
            format!(
                "refs.{n} in the finalize child's template: it is rendered from the parent alone, without references"
            )
        } else if !rule.spec.references.iter().any(|r| r.name.as_str() == n) {
            format!("refs.{n} is not a reference of rule '{name}' (spec.references)")
        } else {
            return None;
        };
        Some((at, message))
    });
    children.chain(refs)
}

/// The rule's version: a hash of the rule and of every template it uses.
fn rule_version(
    rule: &Rule,
    used: &BTreeMap<String, String>,
    templates: &BTreeMap<String, (String, String)>,
) -> String {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(rule).unwrap_or_default());
    for t in used.keys() {
        h.update(t.as_bytes());
        h.update([0]);
        h.update(templates[t].1.as_bytes());
        h.update([0]);
    }
    hex::encode(&h.finalize()[..6])
}

#[cfg(test)]
mod tests {
    use super::super::names::may_read_parent_status;

    #[test]
    fn what_may_read_the_parents_status() {
        let env = minijinja::Environment::new();
        let reads = |src: &str| {
            let e = env.compile_expression(src).unwrap();
            may_read_parent_status(&e.undeclared_variables(true))
        };
        for no in [
            "parent.metadata.name",
            "parent.spec.replicas > 1 and parent.kind == 'X'",
            "children.a is defined",
            "parent.metadata.labels['tier']",
        ] {
            assert!(!reads(no), "{no}");
        }
        for yes in [
            "parent.status.ready",
            "parent['status']",
            "parent | tojson",
            "parent.metadata.name ~ parent.status.x",
            "parent.items()",
        ] {
            assert!(reads(yes), "{yes}");
        }
    }
}
