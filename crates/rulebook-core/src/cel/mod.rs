//! CEL without a cluster: compiling a rule's `cel:` expressions for `rulebook check`
//! (syntax, with the place of the error) and evaluating them for `rulebook test`'s
//! admission steps, with `self`/`oldSelf` (validation) or `object`/`oldObject` (defaults)
//! bound to the fixtures. The API server stays the judge of record: `rulebook check
//! --kubeconfig` asks it (a server-side dry-run of the generated CRD or policy), and
//! docs/reference/admission-cel.md ("Offline CEL") lists what differs.
//!
//! The crate: `cel` (cel-rust, 0.15), chosen over
//! - `cel-cxx` (bindings to Google's cel-cpp, which has the type checker the API server
//!   runs): it needs a C++ build of cel-cpp and abseil, minutes on 2 cores and a C++
//!   toolchain on every machine that builds Rulebook;
//! - `cel-interpreter`/`cel-parser`: the same project's older names, unmaintained since;
//! - a hand-written interpreter: CEL's macros, error semantics (`false && error` is
//!   false) and numeric rules are what a well-kept crate gets right.
//!
//! cel-rust parses the cel-spec grammar, has the standard macros (`has`, `all`, `exists`,
//! `exists_one`, `map`, `filter`), `matches` (RE2-like `regex` crate), and cel-go's
//! strings and lists extensions, which Kubernetes also enables. It has no type checker:
//! type errors show when an expression runs, not when it compiles. Built without its
//! `chrono` feature (no `duration`/`timestamp`: those expressions are not judged
//! offline), which keeps chrono-tz's time zone tables out of the build.
//!
//! Kubernetes' own library is added here as far as offline evaluation can be exact: the
//! regex functions `find`/`findAll`, the list functions `isSorted`/`sum`, and
//! `quantity()` with its comparisons ([`quantity`]). A call to anything else (`url`,
//! `ip`, `cidr`, `authorizer`, `format`, ...) is *not judged*: [`Outcome::NotJudged`],
//! which `rulebook test` reports as such and never counts as a pass.
//!
//! Cost: offline evaluation runs on the rule author's own fixtures, not on a tenant's
//! object, so it carries no budget; the API server applies its cost limits to the real
//! thing (and reports them in `check --kubeconfig`).

mod kube_lib;
pub mod quantity;

use std::sync::Arc;

use cel::objects::{Key, Map};
use cel::{Context, Env, ExecutionError, Program, Value};
use serde_json::Value as Json;

/// A compiled CEL expression.
pub struct Expr {
    program: Program,
    env: Arc<Env>,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cel::Expr")
    }
}

/// Why an expression does not compile: the parser's message (with the line and column
/// inside the expression).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CompileError(pub String);

/// What evaluating an expression gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The value, as JSON.
    Value(Json),
    /// An error the API server would also meet at run time (a missing field, an index
    /// out of range, a division by zero): the request is refused there.
    Error(String),
    /// The offline evaluator cannot judge it (a function or type it lacks): neither
    /// allowed nor refused.
    NotJudged(String),
}

/// The environment: the standard library, cel-go's strings and lists extensions (as in
/// Kubernetes), and the part of Kubernetes' library in [`kube_lib`].
fn env() -> Result<Env, CompileError> {
    let mut env = Env::stdlib();
    let declared =
        cel::extensions::strings(&mut env).and_then(|()| cel::extensions::lists(&mut env));
    declared.map_err(|e| CompileError(format!("the CEL environment: {e}")))?;
    Ok(env)
}

/// Compiles `source`.
pub fn compile(source: &str) -> Result<Expr, CompileError> {
    let env = env()?;
    let program = env
        .compile(source)
        .map_err(|e| CompileError(one_line(&e.to_string())))?;
    Ok(Expr {
        program,
        env: Arc::new(env),
    })
}

/// The parser's message on one line (a diagnostic is one line): its first error, with
/// the place in the expression, without the caret drawing.
fn one_line(message: &str) -> String {
    let first = message.trim().lines().next().unwrap_or("").trim();
    match first.strip_prefix("ERROR: <input>:") {
        Some(rest) => format!("at {rest}"),
        None => first.to_string(),
    }
}

impl Expr {
    /// Whether the expression reads variable `name` (e.g. `oldSelf`: a transition rule).
    pub fn reads(&self, name: &str) -> bool {
        self.program.references().has_variable(name)
    }

    /// The chains of field names the expression selects from variable `root`, e.g.
    /// `[["metadata", "namespace"], ["spec", "replicas"]]` for
    /// `self.spec.replicas < 3 || self.metadata.namespace == 'x'` (also inside `has()`).
    pub fn paths_from(&self, root: &str) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        walk(self.program.expression(), root, &mut out);
        out.sort();
        out.dedup();
        out
    }

    /// Evaluates with `vars` bound (a `None` value is bound to `null`, as the API server
    /// binds `oldObject` on a create).
    pub fn eval(&self, vars: &[(&str, Option<&Json>)]) -> Outcome {
        let mut ctx = Context::with_env(self.env.clone());
        for (name, value) in vars {
            ctx.add_variable_from_value(*name, value.map_or(Value::Null, to_value));
        }
        if let Err(e) = kube_lib::define(&mut ctx) {
            return Outcome::NotJudged(format!("the CEL environment: {e}"));
        }
        match self.program.execute(&ctx) {
            Ok(v) => match from_value(&v) {
                Some(j) => Outcome::Value(j),
                None => Outcome::NotJudged(format!(
                    "the expression gives a {} value, which has no JSON form offline",
                    v.type_of()
                )),
            },
            Err(e) => classify(e),
        }
    }
}

/// Errors of the evaluator that a real API server would not have are *not judged*; the
/// others are errors of the expression on this object.
fn classify(e: ExecutionError) -> Outcome {
    match &e {
        ExecutionError::UndeclaredReference(_)
        | ExecutionError::NoSuchOverload(_)
        | ExecutionError::NotSupportedAsMethod { .. }
        | ExecutionError::UnsupportedTargetType { .. } => Outcome::NotJudged(format!(
            "{e} (a function or type the offline evaluator does not have)"
        )),
        _ => Outcome::Error(e.to_string()),
    }
}

/// The select chains from `root` in `e`, collected into `out`.
fn walk(e: &cel::IdedExpr, root: &str, out: &mut Vec<Vec<String>>) {
    use cel::common::ast::{EntryExpr, Expr as E};
    if let Some(path) = chain(e, root) {
        out.push(path);
        return;
    }
    match &e.expr {
        E::Call(c) => {
            c.target.iter().for_each(|t| walk(t, root, out));
            c.args.iter().for_each(|a| walk(a, root, out));
        }
        E::Comprehension(c) => {
            for part in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                walk(part, root, out);
            }
        }
        E::List(l) => l.elements.iter().for_each(|x| walk(x, root, out)),
        E::Map(m) => {
            for entry in &m.entries {
                if let EntryExpr::MapEntry(me) = &entry.expr {
                    walk(&me.key, root, out);
                    walk(&me.value, root, out);
                }
            }
        }
        E::Struct(s) => {
            for entry in &s.entries {
                if let EntryExpr::StructField(f) = &entry.expr {
                    walk(&f.value, root, out);
                }
            }
        }
        E::Select(s) => walk(&s.operand, root, out),
        E::Ident(_) | E::Literal(_) | E::Unspecified => {}
    }
}

/// `root.a.b.c` as `[a, b, c]` (`[]` for `root` alone); `None` for anything else.
fn chain(e: &cel::IdedExpr, root: &str) -> Option<Vec<String>> {
    use cel::common::ast::Expr as E;
    match &e.expr {
        E::Ident(name) if name == root => Some(Vec::new()),
        E::Select(s) => {
            let mut path = chain(&s.operand, root)?;
            path.push(s.field.clone());
            Some(path)
        }
        _ => None,
    }
}

/// A JSON value as CEL sees a Kubernetes object: integers as `int`, other numbers as
/// `double`.
pub fn to_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => match n.as_u64() {
                Some(u) => Value::UInt(u),
                None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
        },
        Json::String(s) => Value::String(Arc::new(s.clone())),
        Json::Array(a) => Value::List(Arc::new(a.iter().map(to_value).collect())),
        Json::Object(o) => Value::Map(Map {
            map: Arc::new(
                o.iter()
                    .map(|(k, v)| (Key::String(Arc::new(k.clone())), to_value(v)))
                    .collect(),
            ),
        }),
    }
}

/// A CEL value as JSON, when it has a JSON form.
pub fn from_value(v: &Value) -> Option<Json> {
    Some(match v {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::UInt(u) => Json::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f).map(Json::Number)?,
        Value::String(s) => Json::String(s.to_string()),
        Value::List(l) => Json::Array(l.iter().map(from_value).collect::<Option<_>>()?),
        Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m.map.iter() {
                let key = match k {
                    Key::String(s) => s.to_string(),
                    Key::Int(i) => i.to_string(),
                    Key::Uint(u) => u.to_string(),
                    Key::Bool(b) => b.to_string(),
                };
                out.insert(key, from_value(v)?);
            }
            Json::Object(out)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
