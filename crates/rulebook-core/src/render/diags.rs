//! Where a rule's diagnostics point (its file) and the prefix they carry (its name): one
//! small type every compile step uses — the templates (compile.rs), the expressions
//! (compile_exprs.rs), admission (admission.rs) and conversion (convert.rs) — in a leaf
//! file so that none of them needs another for it.

use crate::rules::Diagnostic;

/// Where a rule's diagnostics point, and the prefix they carry.
pub(crate) struct Diags<'a> {
    pub file: &'a str,
    pub name: &'a str,
}

impl Diags<'_> {
    pub fn at(&self, line: u64, col: u64, key: &str, msg: String) -> Diagnostic {
        Diagnostic::new(
            self.file,
            line,
            col,
            format!("rule '{}': {key}: {msg}", self.name),
        )
    }
}

/// The 1-based line of byte `offset` in `text` (an offset inside a character counts from
/// that character's start: never a panic on a rule file's text).
pub(super) fn line_of(text: &str, offset: usize) -> u64 {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].matches('\n').count() as u64 + 1
}
