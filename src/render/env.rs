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

use std::io;

use base64::Engine as _;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior};
use sha2::Digest;

/// Bounds on one rule's templates and expressions.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// minijinja fuel (instructions) for one template render or expression evaluation.
    pub fuel: u64,
    /// Maximum nesting of macro calls and includes.
    pub recursion: usize,
    /// Maximum bytes one template may render.
    pub max_output_bytes: usize,
    /// Maximum items of one `forEach`.
    pub max_for_each: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 1_000_000,
            recursion: 64,
            max_output_bytes: 1 << 20,
            max_for_each: 1000,
        }
    }
}

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
    env.add_filter("b64encode", b64encode);
    env.add_filter("b64decode", b64decode);
    env.add_filter("sha256", sha256);
    env.add_filter("to_yaml", to_yaml);
    env.add_filter("to_json", to_json);
    env
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
    _state: &mut State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
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
        json_scalar(value)?
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

fn b64encode(value: Value) -> Result<String, Error> {
    let bytes = match value.as_bytes() {
        Some(b) => b.to_vec(),
        None => value.to_string().into_bytes(),
    };
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn b64decode(value: &str) -> Result<String, Error> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("b64decode: {e}")))?;
    String::from_utf8(bytes).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            "b64decode: the decoded bytes are not UTF-8",
        )
    })
}

fn sha256(value: Value) -> String {
    let bytes = match value.as_bytes() {
        Some(b) => b.to_vec(),
        None => value.to_string().into_bytes(),
    };
    hex::encode(sha2::Sha256::digest(bytes))
}

/// A value as a YAML document in a string (to embed a config file as a string field).
fn to_yaml(value: Value) -> Result<String, Error> {
    serde_saphyr::to_string(&value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, format!("to_yaml: {e}")))
}

/// A value as compact JSON in a string.
fn to_json(value: Value) -> Result<String, Error> {
    json_scalar(&value)
}

/// An `io::Write` that fails once more than `limit` bytes were written.
pub struct CappedWriter {
    pub buf: Vec<u8>,
    pub limit: usize,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            return Err(io::Error::other(format!(
                "output is larger than the limit of {} bytes",
                self.limit
            )));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
