//! Where a `RuleTest` may read and write. `rulebook test` runs in the rules repo's CI on
//! pull requests from people who may not be trusted, and a failing step prints what it
//! read (a snapshot's text in the diff, a fixture's parse error): a test file that could
//! name `/proc/self/environ` or `../../.ssh/id_rsa` would print the CI's tokens, and
//! `--update` could write anywhere the CI user can. So every path a test file names is:
//!
//! - relative (an absolute path is refused, even one inside the repository);
//! - inside the repository root once resolved, links included (`..` may move within the
//!   repository: the shipped tests read `../../examples/…`), as the loader confines rules
//!   and templates to their directories;
//! - a regular file (no device, FIFO or `/proc` entry) of at most [`MAX_FIXTURE`] bytes;
//! - for a snapshot written by `--update`, a new file or a regular file that is not a link,
//!   in a directory inside the repository.
//!
//! The repository root is `--root` when given, else the nearest directory above the test
//! file that holds `.git`, else the test file's own directory. Refusals say `file:line`.

use std::path::{Component, Path, PathBuf};

use crate::rules::Loc;

/// The largest fixture or snapshot a test reads (a parent, live objects, a rendered set).
pub const MAX_FIXTURE: u64 = 4 * 1024 * 1024;

/// The directory a test file's paths stay in, resolved.
#[derive(Debug)]
pub struct Confined {
    root: PathBuf,
}

impl Confined {
    /// The root for `test_file`: `explicit` (which must hold the file), else the nearest
    /// directory holding `.git`, else the file's directory.
    pub fn for_test(test_file: &Path, explicit: Option<&Path>) -> Result<Confined, String> {
        let file = std::fs::canonicalize(test_file)
            .map_err(|e| format!("{}: {e}", test_file.display()))?;
        let dir = file.parent().unwrap_or(Path::new("/")).to_path_buf();
        let root = match explicit {
            Some(r) => {
                let r =
                    std::fs::canonicalize(r).map_err(|e| format!("--root {}: {e}", r.display()))?;
                if !file.starts_with(&r) {
                    return Err(format!(
                        "{} is not inside --root {}",
                        test_file.display(),
                        r.display()
                    ));
                }
                r
            }
            None => dir
                .ancestors()
                .find(|a| a.join(".git").exists())
                .map(Path::to_path_buf)
                .unwrap_or(dir),
        };
        Ok(Confined { root })
    }

    /// The text of the fixture `rel` names (relative to `dir`, the test file's directory).
    pub fn read(&self, dir: &Path, rel: &Loc<String>) -> Result<String, String> {
        let path = self.resolve(dir, rel)?;
        let real = std::fs::canonicalize(&path).map_err(|e| at(rel, format!("{e}")))?;
        self.inside(&real, rel)?;
        let meta = std::fs::metadata(&real).map_err(|e| at(rel, format!("{e}")))?;
        if !meta.is_file() {
            return Err(at(rel, "not a regular file".into()));
        }
        if meta.len() > MAX_FIXTURE {
            return Err(at(
                rel,
                format!("larger than {MAX_FIXTURE} bytes: not a test fixture"),
            ));
        }
        std::fs::read_to_string(&real).map_err(|e| at(rel, format!("{e}")))
    }

    /// Where `--update` may write the snapshot `rel`: a path inside the repository whose
    /// directory exists, and that is not a link or anything but a regular file.
    pub fn writable(&self, dir: &Path, rel: &Loc<String>) -> Result<PathBuf, String> {
        let path = self.resolve(dir, rel)?;
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(at(rel, "names no file".into()));
        };
        let parent = std::fs::canonicalize(parent).map_err(|e| at(rel, format!("{e}")))?;
        self.inside(&parent, rel)?;
        let target = parent.join(name);
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.file_type().is_symlink() => Err(at(rel, "is a link: not written".into())),
            Ok(m) if !m.is_file() => Err(at(rel, "not a regular file: not written".into())),
            _ => Ok(target),
        }
    }

    /// `dir/rel`, refused when `rel` is absolute or leaves the root on its face.
    fn resolve(&self, dir: &Path, rel: &Loc<String>) -> Result<PathBuf, String> {
        let p = Path::new(&rel.value);
        if rel.value.is_empty() {
            return Err(at(rel, "an empty path".into()));
        }
        if p.is_absolute() || p.components().any(|c| matches!(c, Component::Prefix(_))) {
            return Err(at(
                rel,
                "an absolute path: a test names files relative to itself, inside the repository"
                    .into(),
            ));
        }
        let dir = std::fs::canonicalize(dir).map_err(|e| at(rel, format!("{e}")))?;
        // Lexically first, so that `..` out of the repository is refused whether or not
        // the place it names exists.
        let mut joined = dir.clone();
        for c in p.components() {
            match c {
                Component::ParentDir => {
                    joined.pop();
                }
                Component::Normal(n) => joined.push(n),
                _ => {}
            }
        }
        self.inside(&joined, rel)?;
        Ok(dir.join(p))
    }

    fn inside(&self, real: &Path, rel: &Loc<String>) -> Result<(), String> {
        if real.starts_with(&self.root) {
            Ok(())
        } else {
            Err(at(
                rel,
                format!(
                    "leaves the repository ({}): a test reads and writes only files inside it",
                    self.root.display()
                ),
            ))
        }
    }
}

fn at(rel: &Loc<String>, why: String) -> String {
    format!("line {}: {}: {why}", rel.line, rel.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(s: &str) -> Loc<String> {
        Loc {
            value: s.to_string(),
            line: 7,
            col: 1,
        }
    }

    fn repo() -> (tempfile::TempDir, Confined, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("repo/.git")).unwrap();
        std::fs::create_dir_all(d.path().join("repo/tests")).unwrap();
        std::fs::write(d.path().join("repo/tests/t.yaml"), "x").unwrap();
        std::fs::write(d.path().join("repo/fixture.yaml"), "a: 1").unwrap();
        std::fs::write(d.path().join("secret"), "token").unwrap();
        let c = Confined::for_test(&d.path().join("repo/tests/t.yaml"), None).unwrap();
        let dir = d.path().join("repo/tests");
        (d, c, dir)
    }

    #[test]
    fn inside_the_repository_is_read_dot_dot_included() {
        let (_d, c, dir) = repo();
        assert_eq!(c.read(&dir, &loc("../fixture.yaml")).unwrap(), "a: 1");
    }

    #[test]
    fn absolute_escaping_linked_and_special_paths_are_refused() {
        let (d, c, dir) = repo();
        std::os::unix::fs::symlink(d.path().join("secret"), dir.join("link.yaml")).unwrap();
        for (p, why) in [
            ("/etc/passwd", "absolute"),
            ("../../secret", "leaves the repository"),
            ("../../nothing/../secret", "leaves the repository"),
            ("link.yaml", "leaves the repository"),
            ("../.git", "not a regular file"),
        ] {
            let e = c.read(&dir, &loc(p)).unwrap_err();
            assert!(e.starts_with("line 7: "), "{p}: {e}");
            assert!(e.contains(why), "{p}: {e}");
            assert!(!e.contains("token"), "{p}: {e}");
        }
    }

    #[test]
    fn snapshots_are_written_only_inside() {
        let (d, c, dir) = repo();
        assert!(c.writable(&dir, &loc("snap.yaml")).is_ok());
        assert!(c.writable(&dir, &loc("../../out.yaml")).is_err());
        assert!(c.writable(&dir, &loc("/tmp/out.yaml")).is_err());
        std::os::unix::fs::symlink(d.path().join("secret"), dir.join("s.yaml")).unwrap();
        assert!(
            c.writable(&dir, &loc("s.yaml"))
                .unwrap_err()
                .contains("link")
        );
        std::os::unix::fs::symlink(d.path(), dir.join("out")).unwrap();
        assert!(c.writable(&dir, &loc("out/x.yaml")).is_err());
    }

    #[test]
    fn the_root_is_the_nearest_git_directory_or_the_file_s_own() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("t.yaml"), "x").unwrap();
        let c = Confined::for_test(&d.path().join("t.yaml"), None).unwrap();
        assert_eq!(c.root, std::fs::canonicalize(d.path()).unwrap());
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(Confined::for_test(&d.path().join("t.yaml"), Some(elsewhere.path())).is_err());
    }
}
