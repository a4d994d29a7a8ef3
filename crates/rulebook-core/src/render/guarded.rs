//! minijinja's built-in filters and functions with a bound on what they build. A few
//! of them turn a small input into a huge one (`indent(10**9)`, `replace` with many
//! matches and a long replacement, `tojson(indent=10**9)`, `"%.999999999f"|format`,
//! `batch(10**9, fill_with=0)`, `debug()` of a big context); others copy their input, which a loop can repeat until
//! memory runs out. Each one here is the built-in with a check in front: it computes or
//! measures (without allocating) the size of its result and refuses, with the parent's
//! render budget error, before building more than the budget has left; the result is
//! then charged to the budget, so repeated copies add up. Every call is also a
//! checkpoint for the parent's fuel and deadline.
//!
//! The VM's own operators (`~`, `+`, `*`) cannot be intercepted: minijinja bounds
//! repetition (`"x" * n`) at 100 MB per operation, and their results are charged when
//! printed or passed to a filter.

use std::fmt::{self, Write as _};
use std::io;
use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, StringInput, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, filters, functions};

use super::budget::{self, Charge};

/// The filter that reports an expression's fuel (appended to every compiled expression).
pub const FUEL_PROBE: &str = "_rulebook_fuel";

/// What one value in a list costs, for list-building filters.
const VALUE_BYTES: usize = std::mem::size_of::<Value>();
/// What one short string in a list costs beyond its slot (a small allocation).
const PIECE_BYTES: usize = VALUE_BYTES + 16;
/// The most items `range` gives (minijinja's own bound).
pub const MAX_RANGE: usize = 100_000;

/// Replaces the risky built-ins of `env` with bounded ones.
pub fn register(env: &mut Environment<'static>) {
    env.add_filter("indent", indent);
    env.add_filter("replace", replace);
    env.add_filter("join", join);
    env.add_filter("batch", batch);
    env.add_filter("slice", slice);
    env.add_filter("list", list);
    env.add_filter("lines", lines);
    env.add_filter("split", split);
    env.add_filter("tojson", tojson);
    env.add_filter("pprint", pprint);
    env.add_filter("string", string);
    env.add_filter("format", format);
    // Filters that copy their input: charged afterwards, so repeated copies add up.
    let copying: [(&'static str, Value); 11] = [
        ("lower", Value::from_function(filters::lower)),
        ("upper", Value::from_function(filters::upper)),
        ("title", Value::from_function(filters::title)),
        ("capitalize", Value::from_function(filters::capitalize)),
        ("trim", Value::from_function(filters::trim)),
        ("reverse", Value::from_function(filters::reverse)),
        ("sort", Value::from_function(filters::sort)),
        ("unique", Value::from_function(filters::unique)),
        ("dictsort", Value::from_function(filters::dictsort)),
        ("items", Value::from_function(filters::items)),
        ("groupby", Value::from_function(filters::groupby)),
    ];
    for (name, builtin) in copying {
        env.add_filter(name, move |state: &mut State, args: Rest<Value>| {
            checkpoint(state)?;
            let rv = builtin.call(state, &args)?;
            charged(name, rv)
        });
    }
    env.add_function("range", range);
    env.add_function("debug", debug);
    env.add_filter(FUEL_PROBE, fuel_probe);
}

/// Fuel and deadline check from inside a running evaluation.
pub fn checkpoint(state: &State) -> Result<(), Error> {
    budget::checkpoint(state.fuel_levels().map(|(consumed, _)| consumed))
}

/// Refuses `bytes` that do not fit in what the budget has left (nothing is charged).
fn fits(name: &str, bytes: usize) -> Result<(), Error> {
    if bytes > budget::remaining_output() {
        // Fails, and marks the parent as over budget, with the size in the message.
        return budget::charge(Charge::Filter(name), bytes);
    }
    Ok(())
}

/// Charges a built result and hands it on.
fn charged(name: &str, rv: Value) -> Result<Value, Error> {
    budget::charge(Charge::Filter(name), approx_size(&rv))?;
    Ok(rv)
}

/// Bytes a value holds at its top level: a string's length, a list's slots.
fn approx_size(v: &Value) -> usize {
    match v.kind() {
        ValueKind::String | ValueKind::Bytes => v
            .as_str()
            .map(str::len)
            .or_else(|| v.as_bytes().map(<[u8]>::len))
            .unwrap_or(0),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            v.len().unwrap_or(0).saturating_mul(VALUE_BYTES)
        }
        _ => 0,
    }
}

/// A `fmt::Write` that keeps (or only counts) text up to a limit, then fails.
pub struct Capped {
    pub text: String,
    pub len: usize,
    limit: usize,
    keep: bool,
    /// The length the text would have had when the limit stopped it.
    pub over: Option<usize>,
}

impl Capped {
    pub fn new(limit: usize, keep: bool) -> Capped {
        Capped {
            text: String::new(),
            len: 0,
            limit,
            keep,
            over: None,
        }
    }
}

impl fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let len = self.len.saturating_add(s.len());
        if len > self.limit {
            self.over = Some(len);
            return Err(fmt::Error);
        }
        self.len = len;
        if self.keep {
            self.text.push_str(s);
        }
        Ok(())
    }
}

impl io::Write for Capped {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let len = self.len.saturating_add(data.len());
        if len > self.limit {
            self.over = Some(len);
            return Err(io::Error::other("over the render budget"));
        }
        self.len = len;
        if self.keep {
            // serde_json writes valid UTF-8 in pieces that may split a character.
            self.text
                .push_str(std::str::from_utf8(data).map_err(io::Error::other)?);
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The length of what `write` produces, counted up to one byte past the budget.
fn measure(write: impl FnOnce(&mut Capped) -> fmt::Result) -> usize {
    let mut c = Capped::new(budget::remaining_output(), false);
    let _ = write(&mut c);
    c.over.unwrap_or(c.len)
}

/// The length of a value's text form (what `string` and `join` give for it).
fn display_len(v: &Value) -> usize {
    match v.as_str() {
        Some(s) => s.len(),
        None => measure(|w| write!(w, "{v}")),
    }
}

/// The length of a value as JSON, with `indent` (None: compact). Counted up to the
/// remaining budget; never allocates the text.
pub fn json_len(v: &Value, indent: Option<&[u8]>) -> usize {
    let mut c = Capped::new(budget::remaining_output(), false);
    let _ = match indent {
        None => serde_json::to_writer(&mut c, v),
        Some(i) => {
            let f = serde_json::ser::PrettyFormatter::with_indent(i);
            let mut ser = serde_json::Serializer::with_formatter(&mut c, f);
            serde::Serialize::serialize(v, &mut ser)
        }
    };
    c.over.unwrap_or(c.len)
}

/// Builds text into a buffer that stops at the remaining budget.
pub fn build(name: &str, write: impl FnOnce(&mut Capped) -> fmt::Result) -> Result<String, Error> {
    let mut c = Capped::new(budget::remaining_output(), true);
    let result = write(&mut c);
    if let Some(len) = c.over {
        return budget::charge(Charge::Filter(name), len).map(|_| String::new());
    }
    result.map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("{name}: cannot format"),
        )
    })?;
    budget::charge(Charge::Filter(name), c.text.len())?;
    Ok(c.text)
}

fn indent(
    value: StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    // (No room for the state in minijinja's five arguments: time and output only.)
    budget::checkpoint(None)?;
    let w = match width {
        Some(w) => w,
        None => kwargs.peek::<Option<usize>>("width")?.unwrap_or(4),
    };
    let s = value.as_str();
    let lines = s.bytes().filter(|b| *b == b'\n').count() + 1;
    fits("indent", lines.saturating_mul(w).saturating_add(s.len()))?;
    charged(
        "indent",
        filters::indent(value, width, first, blank, kwargs)?,
    )
}

fn replace(
    state: &mut State,
    value: StringInput<'_>,
    from: StringInput<'_>,
    to: StringInput<'_>,
) -> Result<Value, Error> {
    checkpoint(state)?;
    let (s, f) = (value.as_str(), from.as_str());
    let matches = if f.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(f).count()
    };
    let mut bound = matches
        .saturating_mul(to.as_str().len())
        .saturating_add(s.len());
    if value.is_safe() || from.is_safe() || to.is_safe() {
        // Escaped for the output format: a character becomes at most six.
        bound = bound.saturating_mul(6);
    }
    fits("replace", bound)?;
    charged("replace", filters::replace(state, value, from, to)?)
}

fn join(
    state: &mut State,
    value: &Value,
    joiner: Option<StringInput<'_>>,
    attribute: Option<&str>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    checkpoint(state)?;
    let sep = match &joiner {
        Some(j) => j.as_str().len(),
        None => kwargs
            .peek::<Option<Value>>("d")?
            .map(|d| display_len(&d))
            .unwrap_or(0),
    };
    if let Ok(items) = value.try_iter() {
        let limit = budget::remaining_output();
        let mut bound = 0usize;
        for (i, item) in items.enumerate() {
            let piece = if i > 0 { sep } else { 0 };
            // The whole item, attribute or not: at least as long as the attribute.
            bound = bound
                .saturating_add(piece)
                .saturating_add(display_len(&item));
            if bound > limit {
                break;
            }
        }
        fits("join", bound)?;
    }
    charged(
        "join",
        filters::join(state, value, joiner, attribute, kwargs)?,
    )
}

fn batch(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    checkpoint(state)?;
    let items = value.len().unwrap_or(0);
    let fill = if fill_with.is_some() { count } else { 0 };
    fits(
        "batch",
        items.saturating_add(fill).saturating_mul(VALUE_BYTES),
    )?;
    charged("batch", filters::batch(state, value, count, fill_with)?)
}

fn slice(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    checkpoint(state)?;
    let items = value.len().unwrap_or(0);
    // One list per slice, even an empty one, plus a filler each.
    fits(
        "slice",
        count
            .saturating_mul(PIECE_BYTES * 2)
            .saturating_add(items.saturating_mul(VALUE_BYTES)),
    )?;
    charged("slice", filters::slice(state, value, count, fill_with)?)
}

fn list(state: &State, value: Value) -> Result<Value, Error> {
    checkpoint(state)?;
    let items = match value.len() {
        Some(n) => n,
        None => value.try_iter().map(|i| i.count()).unwrap_or(0),
    };
    fits("list", items.saturating_mul(VALUE_BYTES))?;
    charged("list", filters::list(state, value)?)
}

fn lines(state: &State, value: &Value) -> Result<Value, Error> {
    checkpoint(state)?;
    if let Some(s) = value.as_str() {
        let pieces = s.lines().count();
        fits(
            "lines",
            pieces.saturating_mul(PIECE_BYTES).saturating_add(s.len()),
        )?;
    }
    charged("lines", filters::lines(value)?)
}

fn split(
    state: &State,
    value: &Value,
    sep: Option<Arc<str>>,
    maxsplits: Option<i64>,
) -> Result<Value, Error> {
    checkpoint(state)?;
    if let Some(s) = value.as_str() {
        let mut pieces = match sep.as_deref() {
            None => s.split_whitespace().count(),
            Some("") => s.chars().count() + 2,
            Some(sep) => s.matches(sep).count() + 1,
        };
        if let Some(n) = maxsplits.and_then(|n| usize::try_from(n).ok()) {
            pieces = pieces.min(n.saturating_add(1));
        }
        fits(
            "split",
            pieces.saturating_mul(PIECE_BYTES).saturating_add(s.len()),
        )?;
    }
    charged("split", filters::split(value, sep, maxsplits)?)
}

fn tojson(
    state: &State,
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    checkpoint(state)?;
    let given = match &indent {
        Some(i) => Some(i.clone()),
        None => kwargs.peek::<Option<Value>>("indent")?,
    };
    let width = match given {
        None => None,
        Some(v) => match v.kind() {
            ValueKind::Bool => v.is_true().then_some(2),
            _ => Some(usize::try_from(v)?),
        },
    };
    // With no indentation the pretty form has the same length as the spaced one, and
    // every level of indentation adds the same bytes per line.
    let flat = json_len(value, Some(b""));
    let bound = match width {
        None | Some(0) => flat,
        Some(w) => {
            let per_space = json_len(value, Some(b" ")).saturating_sub(flat);
            per_space.saturating_mul(w).saturating_add(flat)
        }
    };
    fits("tojson", bound)?;
    charged("tojson", filters::tojson(value, indent, kwargs)?)
}

fn pprint(state: &State, value: &Value) -> Result<Value, Error> {
    checkpoint(state)?;
    Ok(Value::from(build("pprint", |w| write!(w, "{value:#?}"))?))
}

fn string(state: &State, value: &Value) -> Result<Value, Error> {
    checkpoint(state)?;
    if value.kind() != ValueKind::String {
        fits("string", display_len(value))?;
    }
    charged("string", filters::string(state, value)?)
}

/// The widths and precisions in a printf-style format string, and whether one of them
/// is taken from the arguments (`*`).
fn format_widths(fmt: &str) -> (usize, bool) {
    let b = fmt.as_bytes();
    let (mut sum, mut star, mut i) = (0usize, false, 0);
    while i < b.len() {
        if b[i] != b'%' {
            i += 1;
            continue;
        }
        i += 1;
        if b.get(i) == Some(&b'(') {
            while i < b.len() && b[i] != b')' {
                i += 1;
            }
            i += 1;
        }
        while i < b.len() && matches!(b[i], b'#' | b'0' | b'-' | b' ' | b'+' | b'.' | b'*')
            || i < b.len() && b[i].is_ascii_digit()
        {
            if b[i] == b'*' {
                star = true;
            }
            if b[i].is_ascii_digit() {
                let start = i;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                let n = fmt[start..i].parse::<usize>().unwrap_or(usize::MAX);
                sum = sum.saturating_add(n);
                continue;
            }
            i += 1;
        }
        i += 1;
    }
    (sum, star)
}

fn format(state: &mut State, format_str: &Value, args: Rest<Value>) -> Result<Value, Error> {
    checkpoint(state)?;
    let fmt = format_str.as_str().unwrap_or_default();
    let (widths, star) = format_widths(fmt);
    let mut bound = widths.saturating_add(fmt.len());
    for a in args.iter() {
        bound = bound.saturating_add(display_len(a));
        if star && let Some(n) = a.as_i64() {
            bound = bound.saturating_add(n.unsigned_abs() as usize);
        }
    }
    fits("format", bound)?;
    let f = Value::from_function(filters::format);
    let mut all = vec![format_str.clone()];
    all.extend(args.0);
    charged("format", f.call(state, &all)?)
}

fn range(lower: isize, upper: Option<isize>, step: Option<isize>) -> Result<Value, Error> {
    let (start, end) = match upper {
        Some(u) => (lower as i128, u as i128),
        None => (0, lower as i128),
    };
    let step = step.unwrap_or(1) as i128;
    let len = match step {
        0 => 0,
        s if s > 0 && end > start => (end - start + s - 1) / s,
        s if s < 0 && start > end => (start - end - s - 1) / -s,
        _ => 0,
    };
    if len > MAX_RANGE as i128 {
        let message = format!("range has too many elements: {len} (at most {MAX_RANGE})");
        budget::trip(message.clone());
        return Err(Error::new(ErrorKind::InvalidOperation, message));
    }
    functions::range(lower, upper, step.try_into().ok())
}

fn debug(state: &State, args: Rest<Value>) -> Result<String, Error> {
    checkpoint(state)?;
    build("debug", |w| match args.len() {
        0 => write!(w, "{state:#?}"),
        1 => write!(w, "{:#?}", args[0]),
        _ => write!(w, "{:#?}", &args[..]),
    })
}

/// Passes the value through and reports the fuel the expression has used so far.
fn fuel_probe(state: &State, value: Value) -> Value {
    budget::set_probe(
        state
            .fuel_levels()
            .map(|(consumed, _)| consumed)
            .unwrap_or(0),
    );
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_widths_are_found() {
        assert_eq!(format_widths("%s-%s"), (0, false));
        assert_eq!(format_widths("%10s|%-5d"), (15, false));
        assert_eq!(format_widths("%.1000000000f"), (1_000_000_000, false));
        assert_eq!(format_widths("%*d and 100%%"), (0, true));
        assert_eq!(format_widths("%(name)20s"), (20, false));
        assert_eq!(format_widths("year 2026: %s"), (0, false));
    }

    #[test]
    fn capped_text_stops_at_the_limit() {
        let mut c = Capped::new(5, true);
        assert!(write!(c, "abc").is_ok());
        assert!(write!(c, "def").is_err());
        assert_eq!(c.text, "abc");
        assert_eq!(c.over, Some(6));
    }

    #[test]
    fn json_length_is_linear_in_the_indent() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [1, {"b": 2}], "c": "x"}),
        ));
        let flat = json_len(&v, Some(b""));
        let one = json_len(&v, Some(b" "));
        let four = json_len(&v, Some(b"    "));
        assert_eq!(four - flat, 4 * (one - flat));
    }
}
