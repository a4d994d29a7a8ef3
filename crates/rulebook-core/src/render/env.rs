//! The minijinja environment every rule is compiled in: sandboxed, bounded, and with
//! output that a field value cannot escape from.
//!
//! * Every `{{ value }}` prints as one JSON scalar or flow collection (a string is
//!   quoted and escaped; a map prints as `{"a": 1}`), so no field value can change the
//!   YAML structure around it. The formatter ignores `{% autoescape %}` and the `safe`,
//!   `escape` and `e` filters are disabled; templates using them are rejected at load.
//! * Lookups chain (`a.b.c` on a missing `a` is undefined, so `is defined` and
//!   `default()` work on partial objects) but printing an undefined value is an error.
//! * Fuel bounds the instructions of one evaluation, a recursion limit bounds macro
//!   depth, the output of one template is capped, and nothing reads files, the
//!   environment or the cluster: templates see only the context they are given.
//! * One parent's whole render and status share a budget of fuel, bytes and time
//!   ([`super::budget`]); the built-ins that can build big values are bounded by it
//!   ([`super::guarded`]), and so are printing and the output writer.

use std::io;

use base64::Engine as _;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior};
use sha2::Digest;

use super::budget::{self, Charge};
use super::guarded;
use super::limits::Limits;

/// A new, empty environment with Rulebook's settings, filters and limits.
pub fn environment(limits: &Limits) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Chainable);
    env.set_fuel(Some(limits.fuel));
    env.set_recursion_limit(limits.recursion);
    env.set_formatter(format_value);
    env.set_debug(false);
    // One escaping mode whatever a template's file name: macro and `{% set %}` output
    // behaves the same in `x.yaml` and `x.j2`.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::Json);
    for name in ["safe", "escape", "e"] {
        env.add_filter(name, disabled_filter);
    }
    guarded::register(&mut env);
    env.add_filter("b64encode", b64encode);
    env.add_filter("b64decode", b64decode);
    env.add_filter("sha256", sha256);
    env.add_filter("to_yaml", to_yaml);
    env.add_filter("to_json", to_json);
    super::funcs::register(&mut env);
    env
}

/// The environment of a message shown to a person (an admission denial): the same
/// sandbox, fuel and filters as [`environment`], but a string prints as its text, not
/// as a JSON scalar, and nothing is escaped. What it prints is never parsed: the
/// webhook puts it in a JSON string, redacted and capped.
pub fn message_environment(limits: &Limits) -> Environment<'static> {
    let mut env = environment(limits);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_formatter(format_text);
    env
}

/// Prints a string as its text and anything else as compact JSON, each charged to the
/// active budget's output before it is written: a message is rendered into a plain
/// `String`, not the capped writer of a child, so without the charge a loop printing a
/// tenant's megabyte string would build gigabytes before the message is cut short.
fn format_text(
    out: &mut minijinja::Output<'_>,
    state: &mut State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    guarded::checkpoint(state)?;
    let write = |out: &mut minijinja::Output<'_>, text: &str| {
        budget::charge(Charge::Output, text.len())?;
        out.write_str(text)
            .map_err(|e| Error::new(ErrorKind::WriteFailure, "cannot write output").with_source(e))
    };
    if value.is_undefined() {
        return write(out, "<undefined>");
    }
    match value.as_str() {
        Some(s) => write(out, s),
        None => write(out, &json_capped(value)?),
    }
}

fn disabled_filter(_value: Value) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        "escaping filters are disabled: every value is already printed as a safe scalar",
    ))
}

/// Prints every value as JSON: a quoted string, a number, a flow collection.
fn format_value(
    out: &mut minijinja::Output<'_>,
    state: &mut State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    guarded::checkpoint(state)?;
    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::UndefinedError,
            "printed an undefined value (guard it with `is defined` or `| default(...)`)",
        ));
    }
    let text = if value.is_safe() {
        // Only Rulebook's own safe strings get here (macro output, `tojson`): already JSON.
        value.as_str().unwrap_or_default().to_string()
    } else {
        json_capped(value)?
    };
    out.write_str(&yaml_safe(&text))
        .map_err(|e| Error::new(ErrorKind::WriteFailure, "cannot write output").with_source(e))
}

/// A value as compact JSON.
pub fn json_scalar(value: &Value) -> Result<String, Error> {
    serde_json::to_string(value).map_err(|e| {
        Error::new(
            ErrorKind::BadSerialization,
            format!("cannot print value: {e}"),
        )
    })
}

/// A value as compact JSON, built only while it fits in the parent's output budget.
fn json_capped(value: &Value) -> Result<String, Error> {
    let mut c = guarded::Capped::new(budget::remaining_output(), true);
    match serde_json::to_writer(&mut c, value) {
        Ok(()) => Ok(c.text),
        Err(_) if c.over.is_some() => {
            budget::charge(Charge::Output, c.over.unwrap_or(usize::MAX)).map(|_| String::new())
        }
        Err(e) => Err(Error::new(
            ErrorKind::BadSerialization,
            format!("cannot print value: {e}"),
        )),
    }
}

/// Escapes the characters that a YAML reader may take as line breaks or markers, or
/// rejects as non-printable, but JSON leaves alone (NEL, LINE/PARAGRAPH SEPARATOR, BOM,
/// C1 controls, DEL, the non-characters U+FFFE and U+FFFF). They only occur inside JSON
/// strings, where `\uXXXX` means the same character.
pub fn yaml_safe(json: &str) -> std::borrow::Cow<'_, str> {
    let needs = |c: char| {
        matches!(
            c,
            '\u{7f}'..='\u{9f}' | '\u{2028}' | '\u{2029}' | '\u{feff}' | '\u{fffe}' | '\u{ffff}'
        )
    };
    if !json.chars().any(needs) {
        return std::borrow::Cow::Borrowed(json);
    }
    let mut s = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if needs(c) {
            s.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            s.push(c);
        }
    }
    std::borrow::Cow::Owned(s)
}

fn b64encode(state: &State, value: Value) -> Result<String, Error> {
    guarded::checkpoint(state)?;
    let text;
    let bytes = match value.as_bytes() {
        Some(b) => b,
        None => {
            text = guarded::build("b64encode", |w| {
                use std::fmt::Write as _;
                write!(w, "{value}")
            })?;
            text.as_bytes()
        }
    };
    let len = bytes.len().div_ceil(3).saturating_mul(4);
    budget::charge(Charge::Filter("b64encode"), len)?;
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn b64decode(value: &str) -> Result<String, Error> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        // Not the decoder's own message: it names the offending byte, which may be a
        // Secret's.
        .map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "b64decode: the value is not valid base64",
            )
        })?;
    String::from_utf8(bytes).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            "b64decode: the decoded bytes are not UTF-8",
        )
    })
}

fn sha256(state: &State, value: Value, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    guarded::checkpoint(state)?;
    /// Hashes text as it is formatted, so a big value is never copied.
    struct Hashing(sha2::Sha256);
    impl std::fmt::Write for Hashing {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.update(s.as_bytes());
            Ok(())
        }
    }
    let mut h = Hashing(sha2::Sha256::new());
    match value.as_bytes() {
        Some(b) => h.0.update(b),
        None => {
            use std::fmt::Write as _;
            write!(h, "{value}").map_err(|_| {
                Error::new(ErrorKind::InvalidOperation, "sha256: cannot format value")
            })?;
        }
    }
    super::funcs::encode_digest("sha256", &h.0.finalize(), &kwargs)
}

/// A value as a YAML document in a string (to embed a config file as a string field).
fn to_yaml(state: &State, value: Value) -> Result<String, Error> {
    guarded::checkpoint(state)?;
    let mut c = guarded::Capped::new(budget::remaining_output(), true);
    match serde_saphyr::to_fmt_writer(&mut c, &value) {
        Ok(()) => {
            budget::charge(Charge::Filter("to_yaml"), c.text.len())?;
            Ok(c.text)
        }
        Err(_) if c.over.is_some() => {
            budget::charge(Charge::Filter("to_yaml"), c.over.unwrap_or(usize::MAX))
                .map(|_| String::new())
        }
        Err(e) => Err(Error::new(
            ErrorKind::BadSerialization,
            format!("to_yaml: {e}"),
        )),
    }
}

/// A value as compact JSON in a string.
fn to_json(state: &State, value: Value) -> Result<String, Error> {
    guarded::checkpoint(state)?;
    let text = json_capped(&value)?;
    budget::charge(Charge::Filter("to_json"), text.len())?;
    Ok(text)
}

/// An `io::Write` that fails once more than `limit` bytes were written, or once the
/// parent's output budget is spent.
pub struct CappedWriter {
    pub buf: Vec<u8>,
    pub limit: usize,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            let message = format!("output is larger than the limit of {} bytes", self.limit);
            budget::trip(format!("{message} per template"));
            return Err(io::Error::other(message));
        }
        budget::charge(Charge::Output, data.len()).map_err(|e| {
            io::Error::other(e.detail().unwrap_or("over the render budget").to_string())
        })?;
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::ParentBudget;

    /// A message printing a big string in a loop stops at the budget's output bound,
    /// with a budget error, instead of building the whole text.
    #[test]
    fn a_message_charges_what_it_prints_to_the_budget() {
        let limits = Limits {
            parent_output_bytes: 1 << 20,
            ..Limits::default()
        };
        let env = message_environment(&limits);
        let big = "x".repeat(100 << 10);
        let mut budget = ParentBudget::new(&limits);
        let out = {
            let _active = budget.enter();
            env.render_str(
                "{% for i in range(1000) %}{{ big }}{% endfor %}",
                minijinja::context! { big => big },
            )
        };
        let e = out.expect_err("rendered 100 MB of message");
        assert!(
            budget.exceeded().is_some_and(|m| m.contains("of output")),
            "{e}: {:?}",
            budget.exceeded()
        );
        assert!(budget.output_used() <= 1 << 20, "{}", budget.output_used());
        // A short message renders as text.
        let mut budget = ParentBudget::new(&limits);
        let _active = budget.enter();
        let text = env
            .render_str(
                "plan {{ p }} ({{ n }})",
                minijinja::context! { p => "gold", n => 3 },
            )
            .unwrap();
        assert_eq!(text, "plan gold (3)");
    }
}
