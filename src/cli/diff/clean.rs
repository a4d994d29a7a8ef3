//! The one place `rulebook diff`'s output is cleaned of Secret values before it is
//! printed. A pull request's templates and status expressions decide what the diff shows,
//! so any of its lines may quote a value the render saw: a Deployment annotation that
//! dumps `refs.creds.data`, a status field that `b64decode`s it, an API server's refusal
//! that quotes it. Rather than guess which fields might, every string printed — the text
//! output whole, every string (keys too) of the JSON output, every line on standard
//! error — goes through [`Redactor`], which knows every value of every Secret the run
//! read or rendered, in every form [`secret_values_in`] lists (as stored, decoded,
//! escaped, line by line), and also any run of [`FRAGMENT`] bytes or more of one of those
//! (a slice of a value).
//!
//! What it cannot see is a value transformed beyond that (reversed, hashed, spelt out a
//! character per line): that is why a pull request may only read what its base branch
//! reads (`--base-rules`), and never reads a Secret child.

use std::collections::{BTreeSet, HashSet};

use serde_json::Value as Json;

use crate::render::{redact, secret_values_in};

/// The shortest run of a Secret value's bytes that counts as a quote of it.
pub const FRAGMENT: usize = 8;

/// What replaces a value.
const MARK: &str = "[redacted]";

/// Cleans output of the values it was given.
pub struct Redactor {
    /// Longest first (as [`secret_values_in`] sorts them).
    values: Vec<String>,
    /// Every `FRAGMENT`-byte window of every value.
    windows: HashSet<[u8; FRAGMENT]>,
}

impl Redactor {
    /// A redactor for `values`, as [`secret_values`] collects them.
    pub fn new(values: &BTreeSet<String>) -> Redactor {
        let mut sorted: Vec<String> = values.iter().cloned().collect();
        sorted.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        let mut windows = HashSet::new();
        for v in &sorted {
            for w in v.as_bytes().windows(FRAGMENT) {
                let mut key = [0u8; FRAGMENT];
                key.copy_from_slice(w);
                windows.insert(key);
            }
        }
        Redactor {
            values: sorted,
            windows,
        }
    }

    /// `text` without any value or any run of `FRAGMENT` bytes of one.
    pub fn text(&self, text: &str) -> String {
        if self.values.is_empty() {
            return text.to_string();
        }
        let whole = redact(text, &self.values);
        self.fragments(&whole)
    }

    /// `v` with every string in it (object keys too) cleaned as [`Redactor::text`] does.
    pub fn json(&self, v: Json) -> Json {
        match v {
            Json::String(s) => Json::String(self.text(&s)),
            Json::Array(items) => Json::Array(items.into_iter().map(|i| self.json(i)).collect()),
            Json::Object(map) => Json::Object(
                map.into_iter()
                    .map(|(k, v)| (self.text(&k), self.json(v)))
                    .collect(),
            ),
            other => other,
        }
    }

    /// `text` with each run of bytes covered by a window of a value replaced, widened to
    /// whole characters.
    fn fragments(&self, text: &str) -> String {
        let bytes = text.as_bytes();
        if self.windows.is_empty() || bytes.len() < FRAGMENT {
            return text.to_string();
        }
        let mut covered = vec![false; bytes.len()];
        let mut any = false;
        for (i, w) in bytes.windows(FRAGMENT).enumerate() {
            let mut key = [0u8; FRAGMENT];
            key.copy_from_slice(w);
            if self.windows.contains(&key) {
                covered[i..i + FRAGMENT].iter_mut().for_each(|c| *c = true);
                any = true;
            }
        }
        if !any {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len());
        let mut i = 0;
        while i < bytes.len() {
            if !covered[i] {
                let end = covered[i..]
                    .iter()
                    .position(|c| *c)
                    .map_or(bytes.len(), |n| i + n);
                let end = ceil_char(text, end);
                out.push_str(&text[i..end]);
                i = end;
                continue;
            }
            let end = covered[i..]
                .iter()
                .position(|c| !*c)
                .map_or(bytes.len(), |n| i + n);
            out.push_str(MARK);
            i = ceil_char(text, end);
        }
        out
    }
}

/// The first character boundary of `s` at or after `i`.
fn ceil_char(s: &str, mut i: usize) -> usize {
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i.min(s.len())
}

/// The values of the Secrets among `objects`, for a [`Redactor`].
pub fn secret_values<'a>(objects: impl Iterator<Item = &'a Json>) -> BTreeSet<String> {
    secret_values_in(objects).into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn redactor(value: &str) -> Redactor {
        use base64::Engine;
        let data = base64::engine::general_purpose::STANDARD.encode(value);
        let secret = json!({"kind": "Secret", "data": {"x": data}});
        Redactor::new(&secret_values(std::iter::once(&secret)))
    }

    /// Plain, base64, a slice, a value cut across lines of YAML, and JSON keys.
    #[test]
    fn every_form_and_slice_of_a_value_is_cleaned() {
        use base64::Engine;
        let value = "correct-horse-battery-staple";
        let r = redactor(value);
        let b64 = base64::engine::general_purpose::STANDARD.encode(value);
        for text in [
            format!("annotation: {value}"),
            format!("env: {b64}\n"),
            format!("slice: {}", &value[3..17]),
            format!("slice of the stored form: {}", &b64[2..14]),
            format!("\"quoted: {value}\", ünïcode {value}ü"),
        ] {
            let clean = r.text(&text);
            assert!(clean.contains(MARK), "{text} -> {clean}");
            for part in [&value[3..11], &b64[2..10], "horse-ba"] {
                assert!(!clean.contains(part), "{text} -> {clean}");
            }
        }
        assert_eq!(r.text("nothing here"), "nothing here");
        let j = r.json(json!({value: [format!("x {value}")], "n": 1}));
        assert_eq!(j, json!({MARK: [format!("x {MARK}")], "n": 1}));
    }

    /// Short values are found whole but give no windows; other objects give nothing.
    #[test]
    fn short_values_and_other_kinds() {
        let r = redactor("s3cr3t");
        assert_eq!(r.text("a s3cr3t b"), format!("a {MARK} b"));
        let cm = json!({"kind": "ConfigMap", "data": {"x": "not-a-secret-at-all"}});
        assert!(secret_values(std::iter::once(&cm)).is_empty());
    }
}
