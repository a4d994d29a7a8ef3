//! Loading: reads the rules and templates directories into memory, the only code that
//! touches their files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Diagnostic, Diagnostics, RuleSet, compile};
use crate::render::Limits;

/// The inputs of a rule set: rule files and template sources, read into memory.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// `(display path, contents)` of every rule file, sorted by path.
    pub rule_files: Vec<(String, String)>,
    /// Template name (path relative to the templates directory, with `/`) → `(display path, source)`.
    pub templates: BTreeMap<String, (String, String)>,
}

impl Sources {
    /// Reads `*.yaml`/`*.yml` below `rules_dir` and every file below `templates_dir`
    /// (dot-files and dot-directories, such as a ConfigMap volume's `..data`, are reached
    /// through their visible links and never read twice).
    pub fn read(rules_dir: &Path, templates_dir: &Path) -> Result<Sources, Diagnostics> {
        let mut diags = Vec::new();
        let mut rule_files = Vec::new();
        match walk(rules_dir) {
            Ok(files) => {
                for path in files {
                    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                    if !matches!(ext, "yaml" | "yml") {
                        continue;
                    }
                    let display = path.display().to_string();
                    match std::fs::read_to_string(&path) {
                        Ok(text) => rule_files.push((display, text)),
                        Err(e) => diags.push(Diagnostic::new(display, 0, 0, e.to_string())),
                    }
                }
            }
            Err(e) => diags.push(Diagnostic::new(
                rules_dir.display().to_string(),
                0,
                0,
                format!("cannot read the rules directory: {e}"),
            )),
        }
        let mut templates = BTreeMap::new();
        match walk(templates_dir) {
            Ok(files) => {
                for path in files {
                    let Ok(rel) = path.strip_prefix(templates_dir) else {
                        continue;
                    };
                    let name = rel
                        .components()
                        .map(|c| c.as_os_str().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join("/");
                    let display = path.display().to_string();
                    match std::fs::read_to_string(&path) {
                        Ok(text) => {
                            templates.insert(name, (display, text));
                        }
                        Err(e) => diags.push(Diagnostic::new(display, 0, 0, e.to_string())),
                    }
                }
            }
            // A rule set may have no templates at all (status-only rules).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => diags.push(Diagnostic::new(
                templates_dir.display().to_string(),
                0,
                0,
                format!("cannot read the templates directory: {e}"),
            )),
        }
        if diags.is_empty() {
            rule_files.sort();
            Ok(Sources {
                rule_files,
                templates,
            })
        } else {
            Err(Diagnostics(diags))
        }
    }

    /// A content hash of all inputs.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for (path, text) in &self.rule_files {
            h.update(path.as_bytes());
            h.update([0]);
            h.update(text.as_bytes());
            h.update([0]);
        }
        for (name, (_, text)) in &self.templates {
            h.update(name.as_bytes());
            h.update([0]);
            h.update(text.as_bytes());
            h.update([0]);
        }
        hex::encode(&h.finalize()[..16])
    }
}

/// Files below `dir`, sorted, skipping names that start with `.`; symlinks are followed.
fn walk(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), 0usize)];
    while let Some((d, depth)) = stack.pop() {
        if depth > 32 {
            continue; // a symlink loop; nothing real is this deep
        }
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            let meta = std::fs::metadata(&path)?; // follows symlinks
            if meta.is_dir() {
                stack.push((path, depth + 1));
            } else if meta.is_file() {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Reads the rules and templates directories and validates them as a whole.
pub fn load(
    rules_dir: &Path,
    templates_dir: &Path,
    limits: &Limits,
) -> Result<RuleSet, Diagnostics> {
    let sources = Sources::read(rules_dir, templates_dir)?;
    compile(&sources, limits)
}
