//! Loading: reads the rules and templates directories into memory, the only code that
//! touches their files.
//!
//! Tenants write these directories, so a file may only be read when its real path
//! (every symlink resolved) is inside the real rules or templates root: a link to the
//! operator's service-account token must never become a template, not even one reached
//! through an `include` (templates are all read here, none lazily). The links Kubernetes
//! and git-sync make keep working: a ConfigMap volume's `file -> ..data/file -> ..<stamp>/file`
//! stays inside its root, and a root that is itself a link (`current -> rev-abc`) is
//! resolved once per read, which also makes one read see one revision.
//!
//! Files that cannot be part of a rule set — dangling links, binary templates, and in
//! the rules directory anything but `*.yaml`/`*.yml` — are skipped; the first two with a
//! warning that `check` prints and the operator logs.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::{Diagnostic, Diagnostics};

/// Directories nest at most this deep below a root (symlinked directories included).
const MAX_DEPTH: usize = 32;

/// The inputs of a rule set: rule files and template sources, read into memory.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// `(display path, contents)` of every rule file, sorted by path.
    pub rule_files: Vec<(String, String)>,
    /// Template name (path relative to the templates directory, with `/`) → `(display path, source)`.
    pub templates: BTreeMap<String, (String, String)>,
    /// `(display path, contents)` of the operator-wide default rollout (`--default-rollout`):
    /// the `spec.rollout` of every rule with `spec.crd` and none of its own.
    pub default_rollout: Option<(String, String)>,
}

impl Sources {
    /// Reads both directories (see [`read`]); the problems of the read, if any.
    pub fn read(rules_dir: &Path, templates_dir: &Path) -> Result<Sources, Diagnostics> {
        let read = read(rules_dir, templates_dir);
        if read.errors.is_empty() {
            Ok(read.sources)
        } else {
            Err(Diagnostics(read.errors))
        }
    }

    /// A content hash of all inputs.
    pub fn fingerprint(&self) -> String {
        hash(self, &[])
    }
}

/// One read of the rules and templates directories.
#[derive(Clone, Debug, Default)]
pub struct Read {
    /// Everything that could be read.
    pub sources: Sources,
    /// Problems that make the rule set invalid: unreadable files, links out of the roots.
    pub errors: Vec<Diagnostic>,
    /// Files skipped without invalidating the rule set: dangling links, binary templates.
    pub warnings: Vec<Diagnostic>,
}

impl Read {
    /// A hash of exactly what this read saw: the contents, and the errors and warnings
    /// (so a new dangling link is a change). Without any, that of [`Sources::fingerprint`].
    pub fn fingerprint(&self) -> String {
        let notes: Vec<&Diagnostic> = self.errors.iter().chain(&self.warnings).collect();
        hash(&self.sources, &notes)
    }
}

fn hash(sources: &Sources, notes: &[&Diagnostic]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (path, text) in &sources.rule_files {
        h.update(path.as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
        h.update([0]);
    }
    for (name, (_, text)) in &sources.templates {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
        h.update([0]);
    }
    if let Some((path, text)) = &sources.default_rollout {
        h.update([2]);
        h.update(path.as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
    }
    for note in notes {
        h.update([1]);
        h.update(note.to_string().as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

impl Read {
    /// Adds the default rollout file (`--default-rollout`): its contents, or an error at
    /// its path when it cannot be read. A file outside the rules directory, so no root
    /// check: the operator's own command line names it, no tenant.
    pub fn with_default_rollout(mut self, file: Option<&Path>) -> Read {
        let Some(file) = file else {
            return self;
        };
        let shown = file.display().to_string();
        match std::fs::read(file).map(String::from_utf8) {
            Ok(Ok(text)) => self.sources.default_rollout = Some((shown, text)),
            Ok(Err(_)) => self.errors.push(Diagnostic::new(
                shown,
                0,
                0,
                "not UTF-8 text: the default rollout is YAML",
            )),
            Err(e) => self.errors.push(Diagnostic::new(
                shown,
                0,
                0,
                format!("cannot read the default rollout: {e}"),
            )),
        }
        self
    }
}

/// Reads `*.yaml`/`*.yml` below `rules_dir` and every file below `templates_dir`.
/// Names starting with `.` are skipped (a ConfigMap volume's `..data` is reached through
/// its visible links, and never read twice). Never fails: problems are in the result.
pub fn read(rules_dir: &Path, templates_dir: &Path) -> Read {
    let mut out = Read::default();
    let rules_root = std::fs::canonicalize(rules_dir);
    let templates_root = std::fs::canonicalize(templates_dir);
    let roots: Vec<PathBuf> = [&rules_root, &templates_root]
        .into_iter()
        .filter_map(|r| r.as_ref().ok().cloned())
        .collect();

    match &rules_root {
        Ok(root) => {
            let is_rule_file = |name: &str| name.ends_with(".yaml") || name.ends_with(".yml");
            let walk = Walk {
                shown: rules_dir,
                roots: &roots,
                keep: &is_rule_file,
            };
            for file in walk.files(root, &mut out) {
                let shown = rules_dir.join(&file.rel).display().to_string();
                match walk.read(&file) {
                    Ok(bytes) => match String::from_utf8(bytes) {
                        Ok(text) => out.sources.rule_files.push((shown, text)),
                        Err(_) => out.errors.push(Diagnostic::new(
                            shown,
                            0,
                            0,
                            "not UTF-8 text: a rule file is YAML",
                        )),
                    },
                    Err(message) => out.errors.push(Diagnostic::new(shown, 0, 0, message)),
                }
            }
        }
        Err(e) => out.errors.push(Diagnostic::new(
            rules_dir.display().to_string(),
            0,
            0,
            format!("cannot read the rules directory: {e}"),
        )),
    }

    match &templates_root {
        Ok(root) => {
            let walk = Walk {
                shown: templates_dir,
                roots: &roots,
                keep: &|_| true,
            };
            for file in walk.files(root, &mut out) {
                let shown = templates_dir.join(&file.rel).display().to_string();
                let Some(name) = template_name(&file.rel) else {
                    out.warnings.push(Diagnostic::new(
                        shown,
                        0,
                        0,
                        "the file name is not UTF-8: skipped (a template is named by its path)",
                    ));
                    continue;
                };
                match walk.read(&file) {
                    Ok(bytes) => match String::from_utf8(bytes) {
                        Ok(text) => {
                            out.sources.templates.insert(name, (shown, text));
                        }
                        Err(_) => out.warnings.push(Diagnostic::new(
                            shown,
                            0,
                            0,
                            "not UTF-8 text: skipped (a template is text)",
                        )),
                    },
                    Err(message) => out.errors.push(Diagnostic::new(shown, 0, 0, message)),
                }
            }
        }
        // A rule set may have no templates at all (status-only rules).
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => out.errors.push(Diagnostic::new(
            templates_dir.display().to_string(),
            0,
            0,
            format!("cannot read the templates directory: {e}"),
        )),
    }
    out.sources.rule_files.sort();
    out
}

/// `a/b.yaml` for the relative path `a/b.yaml`; `None` when a part is not UTF-8.
fn template_name(rel: &Path) -> Option<String> {
    let parts: Option<Vec<&str>> = rel.components().map(|c| c.as_os_str().to_str()).collect();
    parts.map(|p| p.join("/"))
}

/// A file found below a root.
struct Found {
    /// The path below the root, as the user sees it (through links, not resolved).
    rel: PathBuf,
    /// The path walked to (may be a link).
    walked: PathBuf,
    /// The resolved path, inside a root.
    real: PathBuf,
}

/// One directory tree to walk.
struct Walk<'a> {
    /// The root as given, for diagnostics.
    shown: &'a Path,
    /// Every resolved root: the files read must be inside one of them.
    roots: &'a [PathBuf],
    /// Which file names to read.
    keep: &'a dyn Fn(&str) -> bool,
}

impl Walk<'_> {
    fn inside(&self, real: &Path) -> bool {
        self.roots.iter().any(|r| real.starts_with(r))
    }

    fn outside(&self, target: &Path) -> String {
        format!(
            "links to {}, which is outside the rules and templates directories: refused",
            target.display()
        )
    }

    /// The files below `root` (resolved) to read, sorted by relative path. Links are
    /// followed only to inside the roots; skipped and refused entries go to `out`.
    fn files(&self, root: &Path, out: &mut Read) -> Vec<Found> {
        let mut found = Vec::new();
        // (path below the root, resolved directory, resolved directories above it)
        let mut stack = vec![(PathBuf::new(), root.to_path_buf(), Vec::<PathBuf>::new())];
        while let Some((rel, dir, above)) = stack.pop() {
            let dir_shown = || self.shown.join(&rel).display().to_string();
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) => {
                    out.errors
                        .push(Diagnostic::new(dir_shown(), 0, 0, e.to_string()));
                    continue;
                }
            };
            for entry in entries {
                let entry = match entry {
                    Ok(entry) => entry,
                    Err(e) => {
                        out.errors
                            .push(Diagnostic::new(dir_shown(), 0, 0, e.to_string()));
                        continue;
                    }
                };
                let name = entry.file_name();
                if name.to_string_lossy().starts_with('.') {
                    continue;
                }
                let keep = (self.keep)(&name.to_string_lossy());
                let rel = rel.join(&name);
                let walked = dir.join(&name);
                let shown = self.shown.join(&rel).display().to_string();
                let real = match std::fs::canonicalize(&walked) {
                    Ok(real) => real,
                    Err(e) if e.kind() == ErrorKind::NotFound => {
                        // Listed a moment ago, so a link to nothing (or just deleted).
                        if let Ok(target) = std::fs::read_link(&walked) {
                            out.warnings.push(Diagnostic::new(
                                shown,
                                0,
                                0,
                                format!("dangling symlink to {}: skipped", target.display()),
                            ));
                        }
                        continue;
                    }
                    Err(e) if keep => {
                        out.errors.push(Diagnostic::new(shown, 0, 0, e.to_string()));
                        continue;
                    }
                    Err(_) => continue,
                };
                let meta = match std::fs::metadata(&real) {
                    Ok(meta) => meta,
                    Err(e) if keep => {
                        out.errors.push(Diagnostic::new(shown, 0, 0, e.to_string()));
                        continue;
                    }
                    Err(_) => continue,
                };
                if meta.is_dir() {
                    if !self.inside(&real) {
                        out.errors
                            .push(Diagnostic::new(shown, 0, 0, self.outside(&real)));
                    } else if real == dir || above.contains(&real) {
                        out.warnings.push(Diagnostic::new(
                            shown,
                            0,
                            0,
                            "links to a directory above it: skipped",
                        ));
                    } else if above.len() >= MAX_DEPTH {
                        out.warnings.push(Diagnostic::new(
                            shown,
                            0,
                            0,
                            format!("more than {MAX_DEPTH} directories deep: skipped"),
                        ));
                    } else {
                        let mut above = above.clone();
                        above.push(dir.clone());
                        stack.push((rel, real, above));
                    }
                } else if keep && meta.is_file() {
                    if self.inside(&real) {
                        found.push(Found { rel, walked, real });
                    } else {
                        out.errors
                            .push(Diagnostic::new(shown, 0, 0, self.outside(&real)));
                    }
                } else if keep {
                    out.warnings
                        .push(Diagnostic::new(shown, 0, 0, "not a regular file: skipped"));
                }
            }
        }
        found.sort_by(|a, b| a.rel.cmp(&b.rel));
        found
    }

    /// The contents of a found file. A ConfigMap volume update can delete the resolved
    /// file between the walk and the read; then the link is resolved once more.
    fn read(&self, file: &Found) -> Result<Vec<u8>, String> {
        match std::fs::read(&file.real) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let real = std::fs::canonicalize(&file.walked).map_err(|e| e.to_string())?;
                if !self.inside(&real) {
                    return Err(self.outside(&real));
                }
                if !std::fs::metadata(&real).is_ok_and(|m| m.is_file()) {
                    return Err("not a regular file any more".into());
                }
                std::fs::read(&real).map_err(|e| e.to_string())
            }
            read => read.map_err(|e| e.to_string()),
        }
    }
}
