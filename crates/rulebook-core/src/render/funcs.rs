//! The function library platform teams compute with (issue 47 part 4): JSON parsing,
//! FNV-1a and SHA-256 digests in hex or base64, Kubernetes quantities, kro's seeded
//! random strings and semver comparison, each bounded like the rest of the sandbox.
//!
//! Why these shapes: a rule ported from kro must give the same values kro gave, so
//! `seeded_random_string` is a faithful port of kro's `random.seededString`
//! (pkg/cel/library/random.go: sha256 of the seed, 4 bytes per character, modulo 36
//! over `0-9a-z`), and `fnv64a` / `sha256` digest the same bytes as kro's
//! `hash.fnv64a` / `hash.sha256` (big-endian digest bytes). FNV-1a 64 is written by
//! hand (five lines; a crate would add a dependency for one loop); SHA-256 is `sha2`,
//! semver comparison is the `semver` crate (SemVer 2.0 precedence, already in the
//! lock file). Quantities are parsed here: the grammar is small and `k8s-openapi`'s
//! `Quantity` is only a string wrapper. Every input is capped in size, every output
//! is charged to the parent's budget, and errors never echo the tenant's value.

use base64::Engine as _;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};

use super::budget::{self, Charge};
use super::guarded;

/// The longest JSON text `from_json` parses (bytes).
pub const MAX_JSON_INPUT: usize = 1 << 20;
/// The deepest nesting `from_json` accepts (serde_json's own bound is 128).
pub const MAX_JSON_DEPTH: usize = 64;
/// The longest string `seeded_random_string` makes.
pub const MAX_SEEDED_LENGTH: i64 = 1024;
/// The longest quantity or version string parsed.
const MAX_SCALAR_TEXT: usize = 256;
const ALPHANUMERIC: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// Adds the library's filters and functions to `env`.
pub fn register(env: &mut Environment<'static>) {
    env.add_filter("from_json", from_json);
    env.add_filter("fnv64a", fnv64a);
    env.add_filter("quantity", quantity);
    env.add_function("quantity", quantity);
    env.add_function("seeded_random_string", seeded_random_string);
    env.add_function("semver_compare", semver_compare);
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// A digest's bytes as text: `hex` (default) or `base64` (standard, padded), as the
/// filter's `encoding=` keyword asks.
pub fn encode_digest(name: &str, digest: &[u8], kwargs: &Kwargs) -> Result<String, Error> {
    let encoding: Option<&str> = kwargs.get("encoding")?;
    kwargs.assert_all_used()?;
    match encoding.unwrap_or("hex") {
        "hex" => Ok(hex::encode(digest)),
        "base64" => Ok(base64::engine::general_purpose::STANDARD.encode(digest)),
        _ => Err(invalid(format!(
            "{name}: encoding must be \"hex\" or \"base64\""
        ))),
    }
}

/// FNV-1a, 64 bits (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h: u64, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `fnv64a`: FNV-1a 64 of a string's UTF-8 bytes (other values: their text form),
/// as kro's `hash.fnv64a`: the 8 digest bytes big-endian, printed as hex or base64.
fn fnv64a(state: &State, value: Value, kwargs: Kwargs) -> Result<String, Error> {
    guarded::checkpoint(state)?;
    let digest = match value.as_bytes() {
        Some(b) => fnv1a64(b),
        None => fnv1a64(
            guarded::build("fnv64a", |w| {
                use std::fmt::Write as _;
                write!(w, "{value}")
            })?
            .as_bytes(),
        ),
    };
    encode_digest("fnv64a", &digest.to_be_bytes(), &kwargs)
}

/// `from_json`: a JSON text as a value. At most [`MAX_JSON_INPUT`] bytes and
/// [`MAX_JSON_DEPTH`] levels; the value built is charged to the budget.
fn from_json(state: &State, text: &str) -> Result<Value, Error> {
    guarded::checkpoint(state)?;
    if text.len() > MAX_JSON_INPUT {
        return Err(invalid(format!(
            "from_json: the text is {} bytes, more than the limit of {MAX_JSON_INPUT}",
            text.len()
        )));
    }
    if crate::meta::nesting_depth(text) > MAX_JSON_DEPTH {
        return Err(invalid(format!(
            "from_json: the value nests deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    budget::charge(Charge::Filter("from_json"), text.len())?;
    let parsed: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        // Only the position: the parser's message can quote the text (a Secret's).
        invalid(format!(
            "from_json: not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        ))
    })?;
    Ok(Value::from(minijinja::value::Serde(parsed)))
}

/// `seeded_random_string(seed, length)`: kro's `random.seededString(length, seed)`,
/// the same characters for the same seed and length. 1 ≤ length ≤ [`MAX_SEEDED_LENGTH`].
fn seeded_random_string(seed: &str, length: i64) -> Result<String, Error> {
    if !(1..=MAX_SEEDED_LENGTH).contains(&length) {
        return Err(invalid(format!(
            "seeded_random_string: length must be between 1 and {MAX_SEEDED_LENGTH}, not {length}"
        )));
    }
    let n = usize::try_from(length).map_err(|_| invalid("seeded_random_string: bad length"))?;
    budget::charge(Charge::Filter("seeded_random_string"), n)?;
    Ok(seeded_string(seed.as_bytes(), n))
}

/// kro's algorithm: 4 bytes of the running hash per character, big-endian, modulo 36;
/// when a 4-byte window would run past the hash, the hash becomes sha256(hash ‖ the
/// characters so far). (With a 32-byte hash that never happens, so kro's strings
/// repeat every 8 characters; ported as is, for equal values.)
pub fn seeded_string(seed: &[u8], n: usize) -> String {
    use sha2::Digest;
    let mut hash: [u8; 32] = sha2::Sha256::digest(seed).into();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut start = (i * 4) % hash.len();
        if start + 4 > hash.len() {
            let mut h = sha2::Sha256::new();
            h.update(hash);
            h.update(&out);
            hash = h.finalize().into();
            start = 0;
        }
        let word = u32::from_be_bytes([
            hash[start],
            hash[start + 1],
            hash[start + 2],
            hash[start + 3],
        ]);
        out.push(ALPHANUMERIC[(word % 36) as usize]);
    }
    out.into_iter().map(char::from).collect()
}

/// `semver_compare(a, b)`: -1, 0 or 1 by SemVer 2.0 precedence (build metadata
/// ignored); an error naming which argument is not a version. A leading `v` is allowed.
fn semver_compare(a: &str, b: &str) -> Result<i64, Error> {
    let va = parse_version("first", a)?;
    let vb = parse_version("second", b)?;
    Ok(match va.cmp_precedence(&vb) {
        std::cmp::Ordering::Less => -1,
        std::cmp::Ordering::Equal => 0,
        std::cmp::Ordering::Greater => 1,
    })
}

fn parse_version(which: &str, text: &str) -> Result<semver::Version, Error> {
    let bad = || {
        invalid(format!(
            "semver_compare: the {which} argument is not a semantic version (MAJOR.MINOR.PATCH)"
        ))
    };
    if text.len() > MAX_SCALAR_TEXT {
        return Err(bad());
    }
    let t = text.trim();
    semver::Version::parse(t.strip_prefix('v').unwrap_or(t)).map_err(|_| bad())
}

/// `quantity`: a Kubernetes quantity ("500m", "2Gi", "1e3", "1.5") as a number to
/// compare or compute with: an integer when the value is whole and within ±9e18, a
/// float otherwise. Numbers pass through.
fn quantity(value: Value) -> Result<Value, Error> {
    if value.is_number() {
        return Ok(value);
    }
    let text = value
        .as_str()
        .ok_or_else(|| invalid("quantity: the value is not a string or number"))?;
    let q = parse_quantity(text).ok_or_else(|| {
        invalid("quantity: not a Kubernetes quantity (a number with an optional suffix such as m, k, Mi, Gi or e3)")
    })?;
    if q.fract() == 0.0 && q.abs() < 9.0e18 {
        Ok(Value::from(q as i64))
    } else {
        Ok(Value::from(q))
    }
}

/// Parses `<sign><digits>[.<digits>]<suffix>` as Kubernetes' resource.Quantity does:
/// suffix a binary SI (Ki…Ei), decimal SI (n, u, m, "", k, M, G, T, P, E) or an
/// exponent (e3, E-2). `None` when malformed or not finite.
pub fn parse_quantity(text: &str) -> Option<f64> {
    if text.is_empty() || text.len() > MAX_SCALAR_TEXT {
        return None;
    }
    let split = text
        .char_indices()
        .find(|(i, c)| !(c.is_ascii_digit() || *c == '.' || (*i == 0 && (*c == '+' || *c == '-'))))
        .map_or(text.len(), |(i, _)| i);
    let (number, suffix) = text.split_at(split);
    let digits = number.trim_start_matches(['+', '-']);
    if digits.is_empty() || digits == "." || digits.matches('.').count() > 1 {
        return None;
    }
    let n: f64 = number.parse().ok()?;
    let v = n * suffix_multiplier(suffix)?;
    v.is_finite().then_some(v)
}

fn suffix_multiplier(suffix: &str) -> Option<f64> {
    let binary = |p: i32| Some(1024f64.powi(p));
    match suffix {
        "" => Some(1.0),
        "n" => Some(1e-9),
        "u" => Some(1e-6),
        "m" => Some(1e-3),
        "k" => Some(1e3),
        "M" => Some(1e6),
        "G" => Some(1e9),
        "T" => Some(1e12),
        "P" => Some(1e15),
        "E" => Some(1e18),
        "Ki" => binary(1),
        "Mi" => binary(2),
        "Gi" => binary(3),
        "Ti" => binary(4),
        "Pi" => binary(5),
        "Ei" => binary(6),
        _ => {
            let exp = suffix.strip_prefix(['e', 'E'])?;
            let digits = exp.trim_start_matches(['+', '-']);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || exp.len() > 5 {
                return None;
            }
            Some(10f64.powi(exp.parse().ok()?))
        }
    }
}

#[cfg(test)]
#[path = "funcs_tests.rs"]
mod tests;
