//! A fast reader for the plain kind of YAML that child templates render, in front of the
//! full YAML parser.
//!
//! Parsing rendered text back with serde-saphyr was about half of a parent's render cost
//! (docs/benchmarks.md). Rendered children are almost always block mappings and
//! sequences, flow `{ }` / `[ ]` on one line, plain words and integers, and the
//! double-quoted JSON strings that every interpolated value is printed as. [`parse`]
//! reads exactly that and answers `None` for anything else — anchors, tags, block
//! scalars, multi-line or single-quoted-with-newline strings, floats, YAML 1.1 words,
//! duplicate keys, unusual characters, more than one document — so the caller hands the
//! text to the full parser, which decides (and words every error). Where it answers
//! `Some`, the value is the one serde-saphyr gives: the differential tests (`fastyaml_tests.rs`:
//! hand-picked cases and generated documents) and the injection corpus hold it to that.

use serde_json::{Map, Number, Value as Json};

/// Nesting beyond this is left to the full parser (its budget says 64).
const MAX_DEPTH: usize = 48;
/// Nodes (containers, keys, values, comments) beyond this are left to the full parser:
/// its budget counts up to 250,000 events, and one node can be three.
const MAX_NODES: usize = 60_000;
/// The full parser gives up on an implicit key longer than 1,024 characters; keys longer
/// than this (in bytes, so never more characters) are left to it.
const MAX_KEY: usize = 512;
/// The full parser buffers at most 32 comments in a row after a key or a `-`; runs
/// longer than this are left to it.
const MAX_COMMENT_RUN: usize = 16;

/// The rendered text as JSON, or `None` when it is not of the plain kind this reads.
pub fn parse(text: &str) -> Option<Json> {
    if has_unusual(text) {
        return None;
    }
    let mut lines = Vec::new();
    let (mut comments, mut run) = (0usize, 0usize);
    for raw in text.split('\n') {
        let indent = raw.len() - raw.trim_start_matches(' ').len();
        let (body, commented) = strip_comment(&raw[indent..])?;
        if commented {
            comments += 1;
            run += 1;
            if run > MAX_COMMENT_RUN {
                return None;
            }
        } else if !body.is_empty() {
            run = 0;
        }
        if body.is_empty() {
            continue;
        }
        if indent == 0 && (body.starts_with("---") || body.starts_with("...")) {
            return None;
        }
        lines.push(Line { indent, body });
    }
    let indent = lines.first()?.indent;
    let mut p = Parser {
        lines,
        at: 0,
        nodes: comments,
    };
    let value = p.block(indent, 0)?;
    // Anything left over (a line less indented than the first) is for the full parser.
    (p.at == p.lines.len() && value.is_object()).then_some(value)
}

/// Whether `text` holds an [`unusual`] character, read byte by byte: every one of them is
/// either an ASCII byte or starts with one of three lead bytes.
fn has_unusual(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.iter().enumerate().any(|(i, &b)| {
        (b < b' ' && b != b'\n')
            || b == 0x7f
            || (matches!(b, 0xc2 | 0xe2 | 0xef)
                && text
                    .get(i..)
                    .and_then(|t| t.chars().next())
                    .is_some_and(unusual))
    })
}

/// Characters the full parser may read differently (line breaks of YAML 1.1, non-printable
/// characters, a byte-order mark) or that this reader does not handle (tabs, CR).
fn unusual(c: char) -> bool {
    matches!(
        c,
        '\t' | '\r' | '\u{7f}'
            ..='\u{9f}' | '\u{2028}' | '\u{2029}' | '\u{feff}' | '\u{fffe}' | '\u{ffff}'
    ) || (c < ' ' && c != '\n')
}

struct Line<'a> {
    indent: usize,
    body: &'a str,
}

struct Parser<'a> {
    lines: Vec<Line<'a>>,
    at: usize,
    nodes: usize,
}

impl<'a> Parser<'a> {
    fn count(&mut self) -> Option<()> {
        self.nodes += 1;
        (self.nodes <= MAX_NODES).then_some(())
    }

    /// The block node whose lines start at `indent`: a mapping or a sequence.
    fn block(&mut self, indent: usize, depth: usize) -> Option<Json> {
        if depth > MAX_DEPTH {
            return None;
        }
        let line = self.lines.get(self.at)?;
        if line.indent != indent {
            return None;
        }
        if is_entry(line.body) {
            self.sequence(indent, depth)
        } else {
            self.mapping(indent, None, depth)
        }
    }

    /// A block mapping at `indent`; `first` is the first entry's key and the text after
    /// it when it sits after a sequence entry's `- ` (a compact mapping).
    fn mapping(
        &mut self,
        indent: usize,
        first: Option<(String, &'a str)>,
        depth: usize,
    ) -> Option<Json> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.count()?;
        let mut map = Map::new();
        let mut pending = first;
        loop {
            let (key, rest) = match pending.take() {
                Some(first) => first,
                None => {
                    let Some(line) = self.lines.get(self.at) else {
                        break;
                    };
                    if line.indent < indent {
                        break;
                    }
                    if line.indent > indent || is_entry(line.body) {
                        return None;
                    }
                    self.at += 1;
                    split_key(line.body)?
                }
            };
            self.count()?;
            let value = if rest.is_empty() {
                self.nested(indent, true, depth)?
            } else {
                let v = inline_value(rest, depth, &mut self.nodes)?;
                // A plain or quoted scalar continued on a more indented line: full parser.
                if self.lines.get(self.at).is_some_and(|l| l.indent > indent) {
                    return None;
                }
                v
            };
            if map.insert(key, value).is_some() {
                return None; // a duplicate key: the full parser words it
            }
        }
        Some(Json::Object(map))
    }

    /// A block sequence at `indent`.
    fn sequence(&mut self, indent: usize, depth: usize) -> Option<Json> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.count()?;
        let mut items = Vec::new();
        while let Some(line) = self.lines.get(self.at) {
            if line.indent < indent {
                break;
            }
            if line.indent > indent {
                return None;
            }
            if !is_entry(line.body) {
                break; // the next key of a mapping whose value this sequence is
            }
            let rest = line.body[1..].trim_start_matches(' ');
            let gap = line.body.len() - rest.len();
            self.at += 1;
            let item = if rest.is_empty() {
                self.nested(indent, false, depth)?
            } else if is_entry(rest) || rest.starts_with('?') {
                return None; // `- - x`, `- ? x`: rare, for the full parser
            } else if let Some(first) = split_key(rest) {
                self.mapping(indent + gap, Some(first), depth + 1)?
            } else {
                let v = inline_value(rest, depth, &mut self.nodes)?;
                if self.lines.get(self.at).is_some_and(|l| l.indent > indent) {
                    return None;
                }
                v
            };
            items.push(item);
        }
        Some(Json::Array(items))
    }

    /// The value of a `key:` or `-` with nothing after it: the more indented block below,
    /// a sequence at the key's own indent (mappings only), or null.
    fn nested(&mut self, indent: usize, in_mapping: bool, depth: usize) -> Option<Json> {
        match self.lines.get(self.at) {
            Some(l) if l.indent > indent => {
                let i = l.indent;
                self.block(i, depth + 1)
            }
            Some(l) if in_mapping && l.indent == indent && is_entry(l.body) => {
                self.sequence(indent, depth + 1)
            }
            _ => {
                self.count()?;
                Some(Json::Null)
            }
        }
    }
}

/// `- x` or a lone `-`.
fn is_entry(body: &str) -> bool {
    body == "-" || body.starts_with("- ")
}

/// `key: rest` or `key:` (rest empty), with a plain word or a quoted key no longer than
/// [`MAX_KEY`].
fn split_key(body: &str) -> Option<(String, &str)> {
    let key_len = match body.as_bytes().first()? {
        b'"' => quoted_end(body)?,
        b'\'' => single_quoted_end(body)?,
        _ => body.find(':')?,
    };
    if key_len > MAX_KEY {
        return None;
    }
    let (key, after) = if body.starts_with('"') {
        let end = quoted_end(body)?;
        (double_quoted(&body[..end])?, &body[end..])
    } else if body.starts_with('\'') {
        let end = single_quoted_end(body)?;
        (single_quoted(&body[..end])?, &body[end..])
    } else {
        let colon = body.find(':')?;
        let key = body[..colon].trim_end_matches(' ');
        match plain(key)? {
            Json::String(s) => (s, &body[colon..]),
            _ => return None, // `80:`, `true:`, `null:` keys: for the full parser
        }
    };
    let after = after.trim_start_matches(' ');
    let rest = after.strip_prefix(':')?;
    if rest.is_empty() {
        return Some((key, ""));
    }
    rest.starts_with(' ')
        .then(|| (key, rest.trim_start_matches(' ')))
}

/// The value after `key: ` or `- `, which must end the line.
fn inline_value(text: &str, depth: usize, nodes: &mut usize) -> Option<Json> {
    let mut cur = Cursor { s: text, at: 0 };
    let v = cur.flow_node(depth, nodes, false)?;
    cur.skip_spaces();
    (cur.at == text.len()).then_some(v)
}

/// Removes a comment (`#` at the start or after a space, outside quotes) and trailing
/// spaces, and says whether there was one. `None` when quotes do not close on the line
/// (a multi-line string).
fn strip_comment(body: &str) -> Option<(&str, bool)> {
    let bytes = body.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i += quoted_end(&body[i..])?,
            b'\'' => i += single_quoted_end(&body[i..])?,
            b'#' if i == 0 || bytes[i - 1] == b' ' => {
                return Some((body[..i].trim_end_matches(' '), true));
            }
            _ => i += 1,
        }
    }
    Some((body.trim_end_matches(' '), false))
}

/// The length of the double-quoted string at the start of `s`, quotes included.
fn quoted_end(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// The length of the single-quoted string at the start of `s`, quotes included.
fn single_quoted_end(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        if bytes[i] == b'\'' {
            if bytes.get(i + 1) == Some(&b'\'') {
                i += 2;
                continue;
            }
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

/// A double-quoted scalar whose escapes mean the same in JSON and YAML; surrogate escapes
/// (`\ud83d`) and YAML-only escapes are left to the full parser.
fn double_quoted(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            match bytes.get(i + 1)? {
                b'u' => {
                    let hex = s.get(i + 2..i + 6)?;
                    let code = u32::from_str_radix(hex, 16).ok()?;
                    if (0xd800..0xe000).contains(&code) {
                        return None;
                    }
                    i += 6;
                }
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                _ => return None,
            }
        } else {
            i += 1;
        }
    }
    if !s.contains('\\') {
        // No escapes (most strings): the text between the quotes is the value. (What JSON
        // would refuse in it — control characters, a line break — `parse` has refused
        // already, and `quoted_end` found no other quote.)
        return s.get(1..s.len().checked_sub(1)?).map(str::to_string);
    }
    serde_json::from_str(s).ok()
}

fn single_quoted(s: &str) -> Option<String> {
    Some(s.get(1..s.len() - 1)?.replace("''", "'"))
}

/// A plain (unquoted) scalar this reader is sure of: a decimal integer, `true`, `false`,
/// `null`, or a word of letters, digits, `_ . / -` (spaces inside). Anything else (floats,
/// `0x1f`, `yes`, `~`, `.inf`, `12:30`, …) is `None`.
fn plain(s: &str) -> Option<Json> {
    let first = s.chars().next()?;
    match s {
        "true" => return Some(Json::Bool(true)),
        "false" => return Some(Json::Bool(false)),
        "null" => return Some(Json::Null),
        _ => {}
    }
    if first.is_ascii_digit() || first == '-' {
        let digits = s.strip_prefix('-').unwrap_or(s);
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        if !canonical || s == "-0" {
            return None;
        }
        return s.parse::<i64>().ok().map(|n| Json::Number(Number::from(n)));
    }
    if !first.is_ascii_alphabetic() && first != '_' && first != '/' {
        return None;
    }
    const SPECIAL: [&str; 12] = [
        "true", "false", "null", "yes", "no", "on", "off", "y", "n", "inf", "infinity", "nan",
    ];
    if SPECIAL.iter().any(|w| s.eq_ignore_ascii_case(w)) || s.ends_with(' ') || s.contains("  ") {
        return None;
    }
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-' | b' '))
        .then(|| Json::String(s.to_string()))
}

/// Reads flow values (`{ a: b }`, `[1, "x"]`, scalars) from one line.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_spaces(&mut self) {
        while self.s.as_bytes().get(self.at) == Some(&b' ') {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.at).copied()
    }

    /// One node; `in_flow` is whether it sits inside `[ ]` or `{ }` (where `,` ends a
    /// plain scalar).
    fn flow_node(&mut self, depth: usize, nodes: &mut usize, in_flow: bool) -> Option<Json> {
        if depth > MAX_DEPTH {
            return None;
        }
        *nodes += 1;
        if *nodes > MAX_NODES {
            return None;
        }
        self.skip_spaces();
        let rest = &self.s[self.at..];
        match self.peek()? {
            b'{' => self.flow_mapping(depth, nodes),
            b'[' => self.flow_sequence(depth, nodes),
            b'"' => {
                let end = quoted_end(rest)?;
                self.at += end;
                double_quoted(&rest[..end]).map(Json::String)
            }
            b'\'' => {
                let end = single_quoted_end(rest)?;
                self.at += end;
                single_quoted(&rest[..end]).map(Json::String)
            }
            _ => {
                // A plain scalar runs to the end of the line (block) or to `,]}:` (flow);
                // a `:` or `#` in it, or `[]{}` in block context, is for the full parser.
                let len = if in_flow {
                    rest.find([',', ']', '}', ':']).unwrap_or(rest.len())
                } else {
                    rest.len()
                };
                let word = rest[..len].trim_end_matches(' ');
                if word.contains([':', '#', '[', ']', '{', '}', ',']) {
                    return None;
                }
                self.at += word.len();
                plain(word)
            }
        }
    }

    fn flow_sequence(&mut self, depth: usize, nodes: &mut usize) -> Option<Json> {
        self.at += 1; // [
        let mut items = Vec::new();
        self.skip_spaces();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Some(Json::Array(items));
        }
        loop {
            items.push(self.flow_node(depth + 1, nodes, true)?);
            self.skip_spaces();
            match self.peek()? {
                b',' => self.at += 1,
                b']' => {
                    self.at += 1;
                    return Some(Json::Array(items));
                }
                _ => return None,
            }
            self.skip_spaces();
            if self.peek() == Some(b']') {
                return None; // a trailing comma: for the full parser
            }
        }
    }

    fn flow_mapping(&mut self, depth: usize, nodes: &mut usize) -> Option<Json> {
        self.at += 1; // {
        let mut map = Map::new();
        self.skip_spaces();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Some(Json::Object(map));
        }
        loop {
            self.skip_spaces();
            // After a quoted key (JSON's `{"a":1}`) the value may follow the `:` at once.
            let quoted = matches!(self.peek()?, b'"' | b'\'');
            let start = self.at;
            let key = match self.flow_node(depth + 1, nodes, true)? {
                Json::String(k) => k,
                _ => return None,
            };
            if self.at - start > MAX_KEY {
                return None;
            }
            self.skip_spaces();
            if self.peek()? != b':' {
                return None;
            }
            self.at += 1;
            if !quoted && self.peek()? != b' ' {
                return None; // `{a:b}`: for the full parser
            }
            let value = self.flow_node(depth + 1, nodes, true)?;
            if map.insert(key, value).is_some() {
                return None;
            }
            self.skip_spaces();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(Json::Object(map));
                }
                _ => return None,
            }
            self.skip_spaces();
            if self.peek() == Some(b'}') {
                return None;
            }
        }
    }
}

#[cfg(test)]
#[path = "fastyaml_tests.rs"]
mod tests;
