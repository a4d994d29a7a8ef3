//! Compiling a rule's expressions — `includeWhen`, `forEach`, `readyWhen`, the reference
//! targets and `readyWhen`, the status fields and `doneWhen` — in the rule's own environment, with the
//! checks its templates get (`compile.rs`): unknown variables, children and references
//! the rule does not have, `ready()` inside the `readyWhen` that defines it. Each problem
//! is a diagnostic at the expression's `file:line`; every expression is compiled, so one
//! `check` reports them all. While compiling it notes what the expressions read
//! ([`ExprReads`]), which decides what the render and status contexts carry.

use std::cell::{Cell, RefCell};

use super::*;
use crate::rules::Rule;

/// What the rule's expressions were found to read, noted while they compile.
pub(super) struct ExprReads {
    pub ready: Cell<bool>,
    pub children: Cell<bool>,
    pub parent_status: Cell<bool>,
    /// Every expression is straight-line code (`slice.rs`).
    pub straight: Cell<bool>,
}

impl Default for ExprReads {
    fn default() -> Self {
        ExprReads {
            ready: Cell::new(false),
            children: Cell::new(false),
            parent_status: Cell::new(false),
            straight: Cell::new(true),
        }
    }
}

pub(super) use super::diags::Diags;

/// Compiles one rule's expressions into `env`, collecting every problem.
struct ExprCompiler<'env, 'a> {
    env: &'env Environment<'static>,
    rule: &'a Rule,
    vars: BTreeSet<String>,
    child_names: BTreeSet<&'a str>,
    ref_names: BTreeSet<&'a str>,
    at: &'a Diags<'a>,
    diags: RefCell<Vec<Diagnostic>>,
    reads: &'a ExprReads,
}

/// Every expression of `rule`, compiled in `env`; or every problem found.
pub(super) fn programs<'env>(
    env: &'env Environment<'static>,
    rule: &Rule,
    at: &Diags<'_>,
    reads: &ExprReads,
) -> Result<Programs<'env>, Vec<Diagnostic>> {
    let c = ExprCompiler {
        env,
        rule,
        vars: super::names::allowed_vars(env, &[]),
        child_names: rule.spec.children.iter().map(|c| c.name.as_str()).collect(),
        ref_names: rule
            .spec
            .references
            .iter()
            .map(|r| r.name.as_str())
            .collect(),
        at,
        diags: RefCell::new(Vec::new()),
        reads,
    };
    let children = c.child_programs();
    let references = c.reference_programs();
    let status = c.status_programs();
    let done_when = rule
        .spec
        .deletion
        .as_ref()
        .and_then(|d| d.finalize.as_ref())
        .and_then(|f| {
            c.compile(
                &f.done_when,
                "spec.deletion.finalize.doneWhen".into(),
                &["child"],
            )
        });
    let selector = c.selector_program();
    let diags = c.diags.into_inner();
    if diags.is_empty() {
        Ok(Programs {
            selector,
            children,
            references,
            done_when,
            status,
            admission: super::admission::programs(env, rule),
        })
    } else {
        Err(diags)
    }
}

impl<'env> ExprCompiler<'env, '_> {
    fn push(&self, line: u64, col: u64, key: &str, msg: String) {
        self.diags
            .borrow_mut()
            .push(self.at.at(line, col, key, msg));
    }

    /// One expression at `key`, which may also use the variables `extra`; `None` (with
    /// the diagnostics pushed) when it does not compile or names what it may not.
    fn compile(&self, src: &Loc<String>, key: String, extra: &[&str]) -> Option<Expr<'env>> {
        if !super::slice::straight_line(&src.value) {
            self.reads.straight.set(false);
        }
        let expr = match self.env.compile_expression_owned(src.value.clone()) {
            Ok(expr) => expr,
            Err(e) => {
                let msg = format!("invalid expression: {}", describe(&e));
                self.push(src.line, src.col, &key, msg);
                return None;
            }
        };
        let vars = expr.undeclared_variables(false);
        if vars.contains("children") {
            self.reads.children.set(true);
        }
        if super::names::may_read_parent_status(&expr.undeclared_variables(true)) {
            self.reads.parent_status.set(true);
        }
        let mut ok = self.known_names(src, &key, extra, vars);
        if READY_CALL.is_match(&src.value) {
            if key.ends_with(".readyWhen") {
                ok = false;
                let msg = "readyWhen cannot call ready(): it defines it".into();
                self.push(src.line, src.col, &key, msg);
            } else {
                self.reads.ready.set(true);
            }
        }
        // Evaluated with the fuel probe at the end, so its fuel counts toward the
        // parent's budget.
        let probed = format!("({})|{}", src.value, guarded::FUEL_PROBE);
        let expr = self.env.compile_expression_owned(probed).unwrap_or(expr);
        ok.then_some(Expr {
            expr,
            key,
            line: src.line,
        })
    }

    /// Whether every variable, child and reference `src` names exists; pushes a
    /// diagnostic for each that does not.
    fn known_names(
        &self,
        src: &Loc<String>,
        key: &str,
        extra: &[&str],
        vars: std::collections::HashSet<String>,
    ) -> bool {
        let mut ok = true;
        let allowed: BTreeSet<String> = self
            .vars
            .iter()
            .cloned()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect();
        for var in vars {
            if !allowed.contains(&var) {
                ok = false;
                let msg = format!(
                    "unknown variable '{var}' (expressions see {})",
                    allowed_list(&allowed, extra)
                );
                self.push(src.line, src.col, key, msg);
            }
        }
        let children = super::names::names_used(&CHILD_REF, &src.value)
            .filter(|(_, n)| !self.child_names.contains(n))
            .map(|(_, n)| format!("children.{n} is not a child of this rule"));
        let refs = super::names::names_used(&REFS_REF, &src.value)
            .filter(|(_, n)| !self.ref_names.contains(n))
            .map(|(_, n)| format!("refs.{n} is not a reference of this rule (spec.references)"));
        for message in children.chain(refs) {
            ok = false;
            self.push(src.line, src.col, key, message);
        }
        ok
    }

    /// `spec.parent.selector.expr`: over `parent` (and `rule`) only — it decides
    /// whether the rule takes the parent before anything else is read.
    fn selector_program(&self) -> Option<Expr<'env>> {
        let src = self.rule.spec.parent.selector.as_ref()?.expr.as_ref()?;
        let key = "spec.parent.selector.expr";
        if let Ok(expr) = self.env.compile_expression(&src.value) {
            let mut others: Vec<String> = expr
                .undeclared_variables(false)
                .into_iter()
                .filter(|v| v != "parent" && v != "rule")
                .collect();
            others.sort();
            if !others.is_empty() {
                for v in others {
                    let msg = format!("unknown variable '{v}' (the selector sees parent and rule)");
                    self.push(src.line, src.col, key, msg);
                }
                return None;
            }
        }
        self.compile(src, key.into(), &[])
    }

    fn child_programs(&self) -> Vec<ChildProgram<'env>> {
        let mut children = Vec::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            let key = |k: &str| format!("spec.children[{i}].{k}");
            let one = |e: &Option<Loc<String>>, k: &str, extra: &[&str]| {
                e.as_ref().and_then(|e| self.compile(e, key(k), extra))
            };
            children.push(ChildProgram {
                include_when: one(&c.include_when, "includeWhen", &[]),
                for_each: one(&c.for_each, "forEach", &[]),
                ready_when: one(&c.ready_when, "readyWhen", &["child", "index"]),
            });
        }
        children
    }

    fn reference_programs(&self) -> Vec<refs::RefProgram<'env>> {
        let mut references = Vec::new();
        for (i, r) in self.rule.spec.references.iter().enumerate() {
            let key = |k: &str| format!("spec.references[{i}].{k}");
            // A reference is found from the parent: it cannot read other references.
            let no_refs = |e: &Loc<String>, k: &str| {
                let reads_refs = REFS_REF.is_match(&e.value) || e.value.contains("refs");
                if reads_refs {
                    let msg = "a reference is found from the parent; it cannot read refs".into();
                    self.push(e.line, e.col, &key(k), msg);
                }
                !reads_refs
            };
            if let Some(e) = &r.object_name
                && let Some(lit) = refs::string_literal(e)
                && let Err(why) = check_object_name("objectName", lit)
            {
                self.push(e.line, e.col, &key("objectName"), why);
            }
            let object_name = r
                .object_name
                .as_ref()
                .filter(|e| no_refs(e, "objectName"))
                .and_then(|e| self.compile(e, key("objectName"), &[]));
            let selector = r
                .selector
                .as_ref()
                .filter(|e| no_refs(e, "selector"))
                .and_then(|e| self.compile(e, key("selector"), &[]));
            let namespace = match r.literal_namespace() {
                Some(Err(e)) if no_refs(e, "namespace") => self.compile(e, key("namespace"), &[]),
                _ => None,
            };
            let ready_when = r.ready_when.as_ref().and_then(|e| {
                let reads_children = self
                    .env
                    .compile_expression(&e.value)
                    .is_ok_and(|x| x.undeclared_variables(false).contains("children"));
                if reads_children {
                    let msg = "a reference's readyWhen sees ref (the object), refs, parent \
                               and rule, not children"
                        .into();
                    self.push(e.line, e.col, &key("readyWhen"), msg);
                    return None;
                }
                self.compile(e, key("readyWhen"), &["ref"])
            });
            references.push(refs::RefProgram {
                object_name,
                selector,
                namespace,
                ready_when,
            });
        }
        references
    }

    fn status_programs(&self) -> Vec<(String, StatusProgram<'env>)> {
        let mut status = Vec::new();
        for (field, v) in &self.rule.spec.status {
            let key = format!("spec.status.{field}");
            let at = |s: &str| Loc {
                value: s.to_string(),
                line: v.line,
                col: v.col,
            };
            let program = match &v.value {
                StatusValue::JsonPath {
                    path,
                    default,
                    all_of,
                } => self.jsonpath_program(&key, v, path, default, *all_of),
                StatusValue::Expr { expr } => self
                    .compile(&at(expr), key.clone(), &[])
                    .map(StatusProgram::Expr),
                StatusValue::Value { value } => Some(StatusProgram::Value(value.clone())),
                StatusValue::Cases { cases } => self.cases_program(&key, v, cases),
            };
            if let Some(p) = program {
                status.push((field.clone(), p));
            }
        }
        status
    }

    fn jsonpath_program(
        &self,
        key: &str,
        v: &Loc<StatusValue>,
        path: &str,
        default: &Option<Json>,
        all_of: bool,
    ) -> Option<StatusProgram<'env>> {
        let query = match jsonpath_rust::parser::parse_json_path(path) {
            Ok(query) => query,
            Err(e) => {
                let msg = format!("invalid JSONPath '{path}': {}", one_line(&e));
                self.push(v.line, v.col, key, msg);
                return None;
            }
        };
        if let Some(m) = JSONPATH_CHILD_REF.captures(path)
            && let Some(n) = m.get(1)
            && !self.child_names.contains(n.as_str())
        {
            let msg = format!("children.{} is not a child of this rule", n.as_str());
            self.push(v.line, v.col, key, msg);
        }
        if let Some(m) = JSONPATH_REFS_REF.captures(path)
            && let Some(n) = m.get(1)
            && !self.ref_names.contains(n.as_str())
        {
            let msg = format!("refs.{} is not a reference of this rule", n.as_str());
            self.push(v.line, v.col, key, msg);
        }
        if path.contains("..") || path.contains('?') {
            self.reads.straight.set(false);
        }
        let all_of = if all_of {
            match super::status_eval::split_all_of(&query) {
                Ok((elements, each)) => Some(super::AllOf {
                    elements,
                    each,
                    child: JSONPATH_CHILD_REF
                        .captures(path)
                        .and_then(|m| m.get(1))
                        .and_then(|n| {
                            let name = n.as_str();
                            self.rule
                                .spec
                                .children
                                .iter()
                                .position(|c| c.name.value == name)
                        }),
                }),
                Err(why) => {
                    self.push(v.line, v.col, &format!("{key}.allOf"), why);
                    return None;
                }
            }
        } else {
            None
        };
        Some(StatusProgram::JsonPath {
            all_of,
            singular: super::is_singular(&query),
            query,
            default: default.clone(),
            root: super::jsonpath_root(path),
            descends: path.contains(".."),
        })
    }

    fn cases_program(
        &self,
        key: &str,
        v: &Loc<StatusValue>,
        cases: &[crate::rules::Case],
    ) -> Option<StatusProgram<'env>> {
        // A case's own position, or the status value's when it is unknown.
        let case_at = |s: &Loc<String>| {
            if s.line > 0 {
                s.clone()
            } else {
                Loc {
                    value: s.value.clone(),
                    line: v.line,
                    col: v.col,
                }
            }
        };
        let mut out = Vec::new();
        let mut ok = true;
        for (j, case) in cases.iter().enumerate() {
            let ckey = format!("{key}.cases[{j}]");
            let when = match &case.when {
                Some(w) => {
                    let e = self.compile(&case_at(w), format!("{ckey}.when"), &[]);
                    ok &= e.is_some();
                    e
                }
                None => None,
            };
            let result = match (&case.value, &case.expr) {
                (Some(_), Some(e)) => {
                    let e = case_at(e);
                    let msg = "a case has `value` or `expr`, not both".into();
                    self.push(e.line, e.col, &ckey, msg);
                    ok = false;
                    CaseResult::Unset
                }
                (Some(value), None) => CaseResult::Value(value.clone()),
                (None, Some(e)) => match self.compile(&case_at(e), format!("{ckey}.expr"), &[]) {
                    Some(e) => CaseResult::Expr(e),
                    None => {
                        ok = false;
                        CaseResult::Unset
                    }
                },
                (None, None) => CaseResult::Unset,
            };
            out.push((when, result));
        }
        ok.then_some(StatusProgram::Cases(out))
    }
}
