//! Compiling a rule: its templates and expressions into one sandboxed minijinja
//! environment, checked up front — forbidden filters, unknown variables, references to
//! children the rule does not have, JSONPath and durations — so that a rule that loads
//! can only fail at render time on what its parent holds.

use super::*;

impl CompiledRule {
    /// Compiles a parsed rule against the template sources with `limits`, in one
    /// environment (no slice environment: [`CompiledRule::compile`]). Every problem is
    /// reported.
    pub(super) fn compile_once(
        sr: &SourcedRule,
        templates: &BTreeMap<String, (String, String)>,
        limits: &Limits,
    ) -> Result<CompiledRule, Vec<Diagnostic>> {
        let rule = &sr.rule;
        let file = sr.file.as_str();
        let name = rule.metadata.name.value.clone();
        let mut diags = Vec::new();
        let child_names: BTreeSet<&str> =
            rule.spec.children.iter().map(|c| c.name.as_str()).collect();
        let ref_names: BTreeSet<&str> = rule
            .spec
            .references
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        let mut uses_ready = rule.spec.children.iter().any(|c| !c.wait_for.is_empty());
        // Whether any template or expression names `children`: if none does, the render
        // and status contexts leave the live children out (converting them is most of the
        // cost of building a context).
        let mut reads_children = false;
        // Whether any template or expression may read the parent's status (which the
        // reconcile itself writes): see `CompiledRule::depends_on_own_writes`.
        let mut reads_parent_status = false;
        let diag = |line: u64, col: u64, key: &str, msg: String| {
            Diagnostic::new(file, line, col, format!("rule '{name}': {key}: {msg}"))
        };

        // The templates this rule uses, and everything they include.
        let mut env = env::environment(limits);
        let mut used: BTreeMap<String, String> = BTreeMap::new();
        let mut queue: Vec<String> = Vec::new();
        for (i, c) in rule.spec.children.iter().enumerate() {
            if templates.contains_key(c.template.as_str()) {
                queue.push(c.template.value.clone());
            } else {
                diags.push(diag(
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
        let mut dynamic_include = false;
        // Whether every template and expression is straight-line code (`slice.rs`).
        let mut straight = true;
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
        for (t, path) in &used {
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
        // Unknown variables and unknown children in templates used directly by children.
        let allowed = allowed_vars(&env, &["item", "index"]);
        for (t, path) in &used {
            let Ok(tmpl) = env.get_template(t) else {
                reads_children = true; // not inspected: assume it does
                reads_parent_status = true;
                continue;
            };
            let source = tmpl.source();
            let vars = tmpl.undeclared_variables(false);
            reads_children |= vars.contains("children");
            reads_parent_status |= may_read_parent_status(&tmpl.undeclared_variables(true));
            for var in vars {
                if !allowed.contains(&var) {
                    let line = Regex::new(&format!(r"\b{}\b", regex::escape(&var)))
                        .ok()
                        .and_then(|r| r.find(source))
                        .map(|m| line_of(source, m.start()))
                        .unwrap_or(0);
                    diags.push(Diagnostic::new(
                        path.as_str(),
                        line,
                        0,
                        format!(
                            "unknown variable '{var}' (templates see parent, children, refs, rule, ready(), and item/index in forEach)"
                        ),
                    ));
                }
            }
            uses_ready |= READY_CALL.is_match(source);
            for (at, n) in names_used(&CHILD_REF, source) {
                if !child_names.contains(n) {
                    diags.push(Diagnostic::new(
                        path.as_str(),
                        line_of(source, at),
                        0,
                        format!("children.{n} is not a child of rule '{name}'"),
                    ));
                }
            }
            let finalize_template = rule
                .spec
                .finalize_child()
                .and_then(|i| rule.spec.children.get(i))
                .is_some_and(|c| c.template.value == *t);
            for (at, n) in names_used(&REFS_REF, source) {
                let message = if finalize_template {
                    format!(
                        "refs.{n} in the finalize child's template: it is rendered from the parent alone, without references"
                    )
                } else if !ref_names.contains(n) {
                    format!("refs.{n} is not a reference of rule '{name}' (spec.references)")
                } else {
                    continue;
                };
                diags.push(Diagnostic::new(
                    path.as_str(),
                    line_of(source, at),
                    0,
                    message,
                ));
            }
        }

        let version = {
            let mut h = Sha256::new();
            h.update(serde_json::to_vec(rule).unwrap_or_default());
            for t in used.keys() {
                h.update(t.as_bytes());
                h.update([0]);
                h.update(templates[t].1.as_bytes());
                h.update([0]);
            }
            hex::encode(&h.finalize()[..6])
        };
        let resync = rule
            .spec
            .resync
            .as_ref()
            .and_then(|r| parse_duration(r).ok());

        let uses_ready_in_exprs = std::cell::Cell::new(false);
        let children_in_exprs = std::cell::Cell::new(false);
        let status_in_exprs = std::cell::Cell::new(false);
        let straight_exprs = std::cell::Cell::new(true);
        let compiled = Compiled::try_new(env, |env| {
            let diags = std::cell::RefCell::new(Vec::new());
            let expr_vars = allowed_vars(env, &[]);
            let compile_expr = |src: &Loc<String>, key: String, extra: &[&str]| {
                let allowed: BTreeSet<String> = expr_vars
                    .iter()
                    .cloned()
                    .chain(extra.iter().map(|s| s.to_string()))
                    .collect();
                if !super::slice::straight_line(&src.value) {
                    straight_exprs.set(false);
                }
                match env.compile_expression_owned(src.value.clone()) {
                    Ok(expr) => {
                        let mut ok = true;
                        let vars = expr.undeclared_variables(false);
                        if vars.contains("children") {
                            children_in_exprs.set(true);
                        }
                        if may_read_parent_status(&expr.undeclared_variables(true)) {
                            status_in_exprs.set(true);
                        }
                        for var in vars {
                            if !allowed.contains(&var) {
                                ok = false;
                                diags.borrow_mut().push(diag(
                                    src.line,
                                    src.col,
                                    &key,
                                    format!(
                                        "unknown variable '{var}' (expressions see {})",
                                        allowed_list(&allowed, extra)
                                    ),
                                ));
                            }
                        }
                        let unknown = names_used(&CHILD_REF, &src.value)
                            .filter(|(_, n)| !child_names.contains(n))
                            .map(|(_, n)| format!("children.{n} is not a child of this rule"))
                            .chain(
                                names_used(&REFS_REF, &src.value)
                                    .filter(|(_, n)| !ref_names.contains(n))
                                    .map(|(_, n)| {
                                        format!(
                                            "refs.{n} is not a reference of this rule (spec.references)"
                                        )
                                    }),
                            );
                        for message in unknown {
                            ok = false;
                            diags
                                .borrow_mut()
                                .push(diag(src.line, src.col, &key, message));
                        }
                        if READY_CALL.is_match(&src.value) {
                            if key.ends_with(".readyWhen") {
                                ok = false;
                                diags.borrow_mut().push(diag(
                                    src.line,
                                    src.col,
                                    &key,
                                    "readyWhen cannot call ready(): it defines it".into(),
                                ));
                            } else {
                                uses_ready_in_exprs.set(true);
                            }
                        }
                        // Evaluated with the fuel probe at the end, so its fuel counts
                        // toward the parent's budget.
                        let probed = format!("({})|{}", src.value, guarded::FUEL_PROBE);
                        let expr = env.compile_expression_owned(probed).unwrap_or(expr);
                        ok.then_some(Expr {
                            expr,
                            key,
                            line: src.line,
                        })
                    }
                    Err(e) => {
                        diags.borrow_mut().push(diag(
                            src.line,
                            src.col,
                            &key,
                            format!("invalid expression: {}", describe(&e)),
                        ));
                        None
                    }
                }
            };
            let mut children = Vec::new();
            for (i, c) in rule.spec.children.iter().enumerate() {
                let key = |k: &str| format!("spec.children[{i}].{k}");
                let include_when = c
                    .include_when
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("includeWhen"), &[]));
                let for_each = c
                    .for_each
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("forEach"), &[]));
                let ready_when = c
                    .ready_when
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("readyWhen"), &["child", "index"]));
                children.push(ChildProgram {
                    include_when,
                    ready_when,
                    for_each,
                });
            }
            let mut references = Vec::new();
            for (i, r) in rule.spec.references.iter().enumerate() {
                let key = |k: &str| format!("spec.references[{i}].{k}");
                // A reference is found from the parent: it cannot read other references.
                let no_refs = |e: &Loc<String>, k: &str| {
                    if REFS_REF.is_match(&e.value) || e.value.contains("refs") {
                        diags.borrow_mut().push(diag(
                            e.line,
                            e.col,
                            &key(k),
                            "a reference is found from the parent; it cannot read refs".into(),
                        ));
                        false
                    } else {
                        true
                    }
                };
                if let Some(e) = &r.object_name
                    && let Some(lit) = refs::string_literal(e)
                    && let Err(why) = check_object_name("objectName", lit)
                {
                    diags
                        .borrow_mut()
                        .push(diag(e.line, e.col, &key("objectName"), why));
                }
                let object_name = r
                    .object_name
                    .as_ref()
                    .filter(|e| no_refs(e, "objectName"))
                    .and_then(|e| compile_expr(e, key("objectName"), &[]));
                let selector = r
                    .selector
                    .as_ref()
                    .filter(|e| no_refs(e, "selector"))
                    .and_then(|e| compile_expr(e, key("selector"), &[]));
                let namespace = match r.literal_namespace() {
                    Some(Err(e)) if no_refs(e, "namespace") => {
                        compile_expr(e, key("namespace"), &[])
                    }
                    _ => None,
                };
                references.push(refs::RefProgram {
                    object_name,
                    selector,
                    namespace,
                });
            }
            let mut status = Vec::new();
            for (field, v) in &rule.spec.status {
                let key = format!("spec.status.{field}");
                let at = |s: &str| Loc {
                    value: s.to_string(),
                    line: v.line,
                    col: v.col,
                };
                // A case's own position, or the status value's when it is unknown.
                let case_at = |s: &Loc<String>| if s.line > 0 { s.clone() } else { at(s) };
                let program = match &v.value {
                    StatusValue::JsonPath { path, default } => {
                        match jsonpath_rust::parser::parse_json_path(path) {
                            Ok(query) => {
                                if let Some(m) = JSONPATH_CHILD_REF.captures(path)
                                    && let Some(n) = m.get(1)
                                    && !child_names.contains(n.as_str())
                                {
                                    diags.borrow_mut().push(diag(
                                        v.line,
                                        v.col,
                                        &key,
                                        format!(
                                            "children.{} is not a child of this rule",
                                            n.as_str()
                                        ),
                                    ));
                                }
                                if let Some(m) = JSONPATH_REFS_REF.captures(path)
                                    && let Some(n) = m.get(1)
                                    && !ref_names.contains(n.as_str())
                                {
                                    diags.borrow_mut().push(diag(
                                        v.line,
                                        v.col,
                                        &key,
                                        format!(
                                            "refs.{} is not a reference of this rule",
                                            n.as_str()
                                        ),
                                    ));
                                }
                                let singular = super::is_singular(&query);
                                if path.contains("..") || path.contains('?') {
                                    straight_exprs.set(false);
                                }
                                Some(StatusProgram::JsonPath {
                                    query,
                                    singular,
                                    default: default.clone(),
                                    root: super::jsonpath_root(path),
                                    descends: path.contains(".."),
                                })
                            }
                            Err(e) => {
                                diags.borrow_mut().push(diag(
                                    v.line,
                                    v.col,
                                    &key,
                                    format!("invalid JSONPath '{path}': {}", one_line(&e)),
                                ));
                                None
                            }
                        }
                    }
                    StatusValue::Expr { expr } => {
                        compile_expr(&at(expr), key.clone(), &[]).map(StatusProgram::Expr)
                    }
                    StatusValue::Value { value } => Some(StatusProgram::Value(value.clone())),
                    StatusValue::Cases { cases } => {
                        let mut out = Vec::new();
                        let mut ok = true;
                        for (j, case) in cases.iter().enumerate() {
                            let ckey = format!("{key}.cases[{j}]");
                            let when = match &case.when {
                                Some(w) => {
                                    match compile_expr(&case_at(w), format!("{ckey}.when"), &[]) {
                                        Some(e) => Some(e),
                                        None => {
                                            ok = false;
                                            None
                                        }
                                    }
                                }
                                None => None,
                            };
                            let result = match (&case.value, &case.expr) {
                                (Some(_), Some(e)) => {
                                    let e = case_at(e);
                                    diags.borrow_mut().push(diag(
                                        e.line,
                                        e.col,
                                        &ckey,
                                        "a case has `value` or `expr`, not both".into(),
                                    ));
                                    ok = false;
                                    CaseResult::Unset
                                }
                                (Some(value), None) => CaseResult::Value(value.clone()),
                                (None, Some(e)) => {
                                    match compile_expr(&case_at(e), format!("{ckey}.expr"), &[]) {
                                        Some(e) => CaseResult::Expr(e),
                                        None => {
                                            ok = false;
                                            CaseResult::Unset
                                        }
                                    }
                                }
                                (None, None) => CaseResult::Unset,
                            };
                            out.push((when, result));
                        }
                        ok.then_some(StatusProgram::Cases(out))
                    }
                };
                if let Some(p) = program {
                    status.push((field.clone(), p));
                }
            }
            let done_when = rule
                .spec
                .deletion
                .as_ref()
                .and_then(|d| d.finalize.as_ref())
                .and_then(|f| {
                    compile_expr(
                        &f.done_when,
                        "spec.deletion.finalize.doneWhen".into(),
                        &["child"],
                    )
                });
            let diags = diags.into_inner();
            if diags.is_empty() {
                Ok(Programs {
                    children,
                    references,
                    done_when,
                    status,
                })
            } else {
                Err(diags)
            }
        });
        match compiled {
            Ok(compiled) if diags.is_empty() => Ok(CompiledRule {
                rule_value: super::val(&serde_json::json!({"name": name, "version": version})),
                name: name.clone(),
                file: file.to_string(),
                rule: rule.clone(),
                version,
                resync,
                template_files: used,
                compiled,
                slice: None,
                straight_line: straight && straight_exprs.get(),
                limits: limits.clone(),
                uses_ready: uses_ready || uses_ready_in_exprs.get(),
                reads_children: reads_children || children_in_exprs.get(),
                reads_parent_status: reads_parent_status || status_in_exprs.get(),
            }),
            Ok(_) => Err(diags),
            Err(mut more) => {
                diags.append(&mut more);
                Err(diags)
            }
        }
    }
}

/// The names `re` (a `children.<name>`-style pattern with the name as group 1) finds in
/// `text`, with the offset of each match.
fn names_used<'a>(re: &'a Regex, text: &'a str) -> impl Iterator<Item = (usize, &'a str)> + 'a {
    re.captures_iter(text).filter_map(|m| {
        let (whole, name) = (m.get(0)?, m.get(1)?);
        Some((whole.start(), name.as_str()))
    })
}

fn line_of(text: &str, offset: usize) -> u64 {
    text[..offset.min(text.len())].matches('\n').count() as u64 + 1
}

/// Names of every variable a template or expression may use without defining it.
fn allowed_vars(env: &Environment<'_>, extra: &[&str]) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = CONTEXT_VARS.iter().map(|s| s.to_string()).collect();
    set.extend(extra.iter().map(|s| s.to_string()));
    set.extend(env.globals().map(|(k, _)| k.to_string()));
    set
}

/// Whether a template or expression whose undeclared variables (minijinja's nested form:
/// `parent.spec.x` for a chain of attribute lookups, `parent` alone for any other use of
/// it) are `vars` may read the parent's `status`: any use of `parent` but a lookup under
/// `metadata`, `spec`, `apiVersion` or `kind` counts (`parent["status"]`, `parent.get(...)`,
/// `parent | tojson`, `{% set p = parent %}` all do).
fn may_read_parent_status(vars: &std::collections::HashSet<String>) -> bool {
    vars.iter().any(|v| {
        let mut parts = v.split('.');
        parts.next() == Some("parent")
            && !matches!(
                parts.next(),
                Some("metadata" | "spec" | "apiVersion" | "kind")
            )
    })
}

#[cfg(test)]
mod tests {
    use super::may_read_parent_status;

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
