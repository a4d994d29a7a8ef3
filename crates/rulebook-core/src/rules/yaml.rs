//! Reading rule files as YAML: splitting a stream into documents, reading one as a typed
//! value, and saying where and what the problem is when that fails.
//!
//! serde-saphyr reads a document as a stream of parser events and checks a mapping's
//! required fields when the mapping ends, before it asks the parser for the next event.
//! A key indented less than its siblings ends their mapping early and is itself a syntax
//! error (the parser rejects it, as YAML 1.2 does), but the typed read stops first, with
//! `missing field` on the line above. So when the typed read fails, the document is
//! read once more as bare YAML, and a syntax error found then wins, at its own line.

use serde::de::{DeserializeOwned, IgnoredAny};

/// Where a document failed and why: line and column (1-based, 0 when unknown), message.
pub(super) type Problem = (u64, u64, String);

/// Reads one document (from [`split_documents`]) as a `T`.
pub(super) fn parse_document<T: DeserializeOwned>(doc: &str) -> Result<T, Problem> {
    let typed = match serde_saphyr::from_str::<T>(doc) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    let (e, syntax) = match serde_saphyr::from_str::<IgnoredAny>(doc) {
        Err(syntax) => (syntax, true),
        Ok(_) => (typed, false),
    };
    let (line, col) = e
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((0, 0));
    let mut message = yaml_message(&e);
    if message.contains("found a tab") {
        let (line, col) = tab_position(doc, line).unwrap_or((line, col));
        return Err((line, col, message));
    }
    if syntax && let Some(hint) = indentation_hint(doc, line, &message) {
        message.push_str(&hint);
    }
    Err((line, col, message))
}

/// The first line of a YAML error, without the position (the diagnostic carries it).
pub fn yaml_message(e: &serde_saphyr::Error) -> String {
    // Without the source snippet, serde-saphyr prints "<message> at line X, column Y".
    let full = e.without_snippet().to_string();
    let first = full.lines().next().unwrap_or("").trim();
    // serde-saphyr appends " at line X, column Y"; the diagnostic says that already.
    let msg = match first.rfind(" at line ") {
        Some(i) => &first[..i],
        None => first,
    };
    let msg = msg.trim_start_matches("error: ");
    // Library advice that means nothing to a rule author.
    let msg = msg.split(", set DuplicateKeyPolicy").next().unwrap_or(msg);
    msg.to_string()
}

/// The YAML scanner reports a tab that indents the line after a plain scalar at the
/// scalar's start; the tab is on the next non-blank line.
fn tab_position(doc: &str, line: u64) -> Option<(u64, u64)> {
    let lines: Vec<&str> = doc.lines().collect();
    let here = lines.get(usize::try_from(line).ok()?.checked_sub(1)?)?;
    if here.contains('\t') {
        return None;
    }
    lines
        .iter()
        .enumerate()
        .skip(line as usize)
        .find(|(_, l)| !l.trim().is_empty())
        .and_then(|(i, l)| {
            let indent = &l[..l.len() - l.trim_start().len()];
            indent.find('\t').map(|col| (i as u64 + 1, col as u64 + 1))
        })
}

/// For a block-structure syntax error on a line whose indentation is that of no block
/// above it (and that does not start a new one), `" (check the indentation: …)"`. The parser's own words (`did not find
/// expected '-' indicator`) do not say that a space is missing or one too many.
pub(super) fn indentation_hint(doc: &str, line: u64, message: &str) -> Option<String> {
    let about_blocks = [
        "block collection",
        "block mapping",
        "mapping values are not allowed",
    ];
    if !about_blocks.iter().any(|m| message.contains(m)) {
        return None;
    }
    let lines: Vec<&str> = doc.lines().collect();
    let at = usize::try_from(line).ok()?.checked_sub(1)?;
    let here = *lines.get(at)?;
    if is_blank(here) {
        return None;
    }
    let indent = indentation(here);
    let above = &lines[..at];
    let open = open_blocks(above);
    let deepest = open.last().copied()?;
    if open.contains(&indent) {
        return None;
    }
    // After `key:` (or a bare `-`) a deeper line starts a new block, at any indentation.
    let opens_new = above
        .iter()
        .rev()
        .find(|l| !is_blank(l))
        .is_some_and(|l| l.trim_end().ends_with([':', '-']));
    if indent > deepest && opens_new {
        return None;
    }
    let mut listed: Vec<String> = open.iter().map(usize::to_string).collect();
    let last = listed.pop()?;
    let listed = if listed.is_empty() {
        last
    } else {
        format!("{} or {last}", listed.join(", "))
    };
    Some(format!(
        " (check the indentation: this line is indented {indent} spaces, the blocks above it {listed})"
    ))
}

/// The indentations (in spaces) at which a line after `above` may continue a block:
/// the line just above and each enclosing line, with the column after each `- `, in
/// increasing order.
fn open_blocks(above: &[&str]) -> Vec<usize> {
    let mut open = Vec::new();
    let mut limit = usize::MAX;
    for l in above.iter().rev().filter(|l| !is_blank(l)) {
        let indent = indentation(l);
        if indent >= limit {
            continue;
        }
        limit = indent;
        open.push(indent);
        // `- - key: v` opens a sequence at each `-` and a block after the last one.
        let mut rest = &l[indent..];
        let mut col = indent;
        while let Some(after) = rest.strip_prefix('-') {
            let item = after.trim_start_matches(' ');
            if item.len() == after.len() || item.is_empty() || item.starts_with('#') {
                break; // `-x` is a scalar; `-` alone ends the line
            }
            col += rest.len() - item.len();
            open.push(col);
            rest = item;
        }
        if indent == 0 {
            break;
        }
    }
    open.sort_unstable();
    open.dedup();
    open
}

fn indentation(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

/// Blank or a comment: no part of the block structure.
fn is_blank(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

/// Each document of a YAML stream, padded with blank lines so that line numbers stay
/// those of the whole stream. A `---` or `...` at column 0 always ends a document (the
/// YAML spec forbids them inside content).
pub(super) fn split_documents(text: &str) -> Vec<String> {
    let is_marker = |line: &str, m: &str| {
        let bare = line.trim_end_matches(['\n', '\r']);
        bare == m || bare.starts_with(&format!("{m} ")) || bare.starts_with(&format!("{m}\t"))
    };
    let mut docs = Vec::new();
    let mut current = String::new();
    for (seen, line) in text.split_inclusive('\n').enumerate() {
        if is_marker(line, "---") {
            docs.push(std::mem::take(&mut current));
            // `--- {a: 1}` keeps its content, at its column
            current = "\n".repeat(seen);
            current.push_str("   ");
            current.push_str(&line[3..]);
        } else if is_marker(line, "...") {
            docs.push(std::mem::take(&mut current));
            current = "\n".repeat(seen + 1);
        } else {
            current.push_str(line);
        }
    }
    docs.push(current);
    docs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[allow(dead_code)]
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Item {
        name: String,
        kind: String,
        template: String,
    }

    fn parse(doc: &str) -> Result<Doc, Problem> {
        parse_document::<Doc>(doc)
    }

    #[test]
    fn documents_keep_their_line_numbers() {
        let text = "a: 1\n---\nb: 2\n\nc: 3\n--- \n# only a comment\n---\nd: 4\n";
        let docs = split_documents(text);
        let docs: Vec<_> = docs
            .into_iter()
            .filter(|d| {
                d.lines()
                    .any(|l| !l.trim().is_empty() && !l.trim().starts_with('#'))
            })
            .collect();
        assert_eq!(docs.len(), 3);
        let line_of = |doc: &str, needle: &str| {
            doc.lines()
                .position(|l| l.starts_with(needle))
                .map(|i| i + 1)
        };
        assert_eq!(line_of(&docs[0], "a:"), Some(1));
        assert_eq!(line_of(&docs[1], "b:"), Some(3));
        assert_eq!(line_of(&docs[1], "c:"), Some(5));
        assert_eq!(line_of(&docs[2], "d:"), Some(9));
    }

    #[test]
    fn a_key_indented_less_than_its_siblings_is_a_syntax_error_on_its_line() {
        // Without the second read: "missing field `kind`" on line 2.
        let (line, col, message) =
            parse("items:\n  - name: a\n   kind: b\n    template: c\n").unwrap_err();
        assert_eq!((line, col), (3, 4), "{message}");
        assert!(
            message.starts_with(
                "while parsing a block collection, did not find expected '-' indicator"
            ),
            "{message}"
        );
        assert!(
            message.ends_with(
                " (check the indentation: this line is indented 3 spaces, the blocks above it 0, 2 or 4)"
            ),
            "{message}"
        );
        // The last key of the item, and a key at the column of the `-`.
        let (line, _, message) =
            parse("items:\n  - name: a\n    kind: b\n   template: c\n").unwrap_err();
        assert_eq!(line, 4, "{message}");
        assert!(message.contains("indented 3 spaces"), "{message}");
        let (line, _, message) =
            parse("items:\n  - name: a\n    kind: b\n  template: c\n").unwrap_err();
        assert_eq!(line, 4, "{message}");
        assert!(
            message.contains("did not find expected '-' indicator"),
            "{message}"
        );
    }

    #[test]
    fn a_key_indented_more_than_its_siblings_is_a_syntax_error_on_its_line() {
        let (line, _, message) =
            parse("items:\n  - name: a\n     kind: b\n    template: c\n").unwrap_err();
        assert_eq!(line, 3, "{message}");
        assert!(
            message.starts_with("mapping values are not allowed"),
            "{message}"
        );
        assert!(
            message.contains("this line is indented 5 spaces, the blocks above it 0, 2 or 4"),
            "{message}"
        );
    }

    #[test]
    fn errors_of_well_formed_yaml_are_those_of_the_typed_read() {
        // serde-saphyr places a missing field where the mapping ends.
        let (line, _, message) = parse("items:\n  - name: a\n    kind: b\n").unwrap_err();
        assert_eq!(line, 3, "{message}");
        assert_eq!(message, "missing field `template`");
        let (line, _, message) =
            parse("items:\n  - name: a\n    kind: b\n    template: c\n    nope: d\n").unwrap_err();
        assert_eq!(line, 5, "{message}");
        assert!(message.starts_with("unknown field `nope`"), "{message}");
        assert!(parse("items:\n  - name: a\n    kind: b\n    template: c\n").is_ok());
        // Indentation that is unusual but valid YAML.
        assert!(parse("items:\n- name: a\n  kind: b\n  template: c\n").is_ok());
        assert!(
            parse("items:\n     -   name: a\n         kind: b\n         template: c\n").is_ok()
        );
    }

    #[test]
    fn open_blocks_are_the_line_above_and_its_enclosing_lines() {
        let above = ["a:", "  b: 1", "  c:", "    - - d: 1", "        e: 2"];
        assert_eq!(open_blocks(&above), [0, 2, 4, 6, 8]);
        // Blank lines, comments and siblings of an enclosing line do not count.
        let above = [
            "a:",
            "  x: 1",
            "",
            "# note",
            "  c:",
            "      # indented comment",
            "    d: 1",
        ];
        assert_eq!(open_blocks(&above), [0, 2, 4]);
        // `-1` is a scalar, not a sequence entry; a bare `-` opens only its sequence.
        assert_eq!(open_blocks(&["a:", "  -1"]), [0, 2]);
        assert_eq!(open_blocks(&["a:", "  -"]), [0, 2]);
        assert_eq!(open_blocks(&[]), Vec::<usize>::new());
    }

    #[test]
    fn the_hint_is_only_for_block_errors_at_an_indentation_no_block_has() {
        let doc = "a:\n  b: 1\n c: 2\n";
        let block = "while parsing a block mapping, did not find expected key";
        assert_eq!(
            indentation_hint(doc, 3, block).as_deref(),
            Some(
                " (check the indentation: this line is indented 1 spaces, the blocks above it 0 or 2)"
            )
        );
        assert_eq!(
            indentation_hint(doc, 3, "did not find expected ',' or '}'"),
            None
        );
        // At the indentation of an open block, or starting a new one: something else
        // is wrong.
        assert_eq!(indentation_hint("a:\n  b: 1\n  b: c: d\n", 3, block), None);
        assert_eq!(indentation_hint("a:\n  b: c: d\n", 2, block), None);
        assert_eq!(indentation_hint("a:\n  -\n     b: c: d\n", 3, block), None);
        // Deeper than a line with a value: a continuation, not a new block.
        assert!(indentation_hint("a:\n  b: 1\n   c: 2\n", 3, block).is_some());
        assert_eq!(indentation_hint(doc, 0, block), None);
        assert_eq!(indentation_hint(doc, 9, block), None);
    }
}
