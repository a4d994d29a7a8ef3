//! Reload: notices changes under the rules and templates directories and turns them
//! into new validated rule sets.
//!
//! Files change in many ways in Kubernetes: a ConfigMap volume swaps its `..data`
//! symlink and never touches the visible files, git-sync flips a symlink to a new
//! worktree, editors write a temp file and rename it. So any event under the watched
//! directories (or in their parents, where such links live) only says "look again":
//! everything is re-read through the stable paths, and a content fingerprint decides
//! whether anything changed. A periodic re-scan backs up missed events (network
//! filesystems send none), and a burst of events becomes one reload.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::render::Limits;
use crate::render::RuleSet;
use crate::rules::{self, Diagnostics};

/// Where rule sets come from.
#[derive(Clone, Debug)]
pub struct RuleSource {
    pub rules_dir: PathBuf,
    pub templates_dir: PathBuf,
    /// `--default-rollout`: read again with every look at the directories.
    pub default_rollout: Option<PathBuf>,
    pub limits: Limits,
}

/// The outcome of looking at the directories again. A changed outcome carries the
/// fingerprint of exactly what it read: reading the directories a second time to get one
/// could pick up a newer rule set and then take it as already seen.
#[derive(Debug)]
pub enum Reload {
    /// Same content as last time.
    Unchanged,
    /// Its `fingerprint` is that of the read.
    Valid(RuleSet),
    Invalid {
        diagnostics: Diagnostics,
        fingerprint: String,
    },
}

impl RuleSource {
    /// Reads the directories once and validates what it read; `last` is the fingerprint
    /// of the last outcome. Warnings (skipped files) are logged here, with every changed
    /// outcome.
    pub fn load(&self, last: Option<&str>) -> Reload {
        let read = rules::read(&self.rules_dir, &self.templates_dir)
            .with_default_rollout(self.default_rollout.as_deref());
        let fingerprint = read.fingerprint();
        if last == Some(fingerprint.as_str()) {
            return Reload::Unchanged;
        }
        for w in &read.warnings {
            warn!("{w}");
        }
        match crate::render::compile_read(&read, &self.limits) {
            Ok(set) => Reload::Valid(set),
            Err(diagnostics) => Reload::Invalid {
                diagnostics,
                fingerprint,
            },
        }
    }
}

/// The parent directory of `dir` and of every symlink on the way to `dir`.
fn link_parents(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        out.push(p.to_path_buf());
    }
    let mut prefix = PathBuf::new();
    for part in dir.components() {
        prefix.push(part);
        let is_link = std::fs::symlink_metadata(&prefix).is_ok_and(|m| m.file_type().is_symlink());
        if is_link
            && let Some(p) = prefix.parent().filter(|p| !p.as_os_str().is_empty())
            && !out.iter().any(|o| o == p)
        {
            out.push(p.to_path_buf());
        }
    }
    out
}

/// Watches the directories and sends one `()` per burst of changes. Rebuild it after a
/// change: a flipped symlink leaves the old watches on the old target.
pub struct ChangeWatcher {
    _watcher: RecommendedWatcher,
    pub changes: mpsc::Receiver<()>,
}

/// Quiet time that ends a burst of events.
pub const DEBOUNCE: Duration = Duration::from_millis(500);
/// A burst never delays a reload longer than this.
pub const MAX_DELAY: Duration = Duration::from_secs(5);

impl ChangeWatcher {
    pub fn new(dirs: &[&Path]) -> notify::Result<ChangeWatcher> {
        let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
                Ok(ev) if ev.kind.is_access() => {}
                Ok(_) => {
                    let _ = raw_tx.send(());
                }
                Err(e) => {
                    warn!(error = %e, "file watch error");
                    let _ = raw_tx.send(());
                }
            })?;
        for dir in dirs {
            // The directory itself (following a symlinked directory to its target) ...
            if let Err(e) = watcher.watch(dir, RecursiveMode::Recursive) {
                warn!(dir = %dir.display(), error = %e, "cannot watch directory; relying on the periodic re-scan");
            }
            // ... and the directories where a symlink on the way to it can be flipped
            // (git-sync's `current` link, a ConfigMap volume mounted through a link).
            for parent in link_parents(dir) {
                if let Err(e) = watcher.watch(&parent, RecursiveMode::NonRecursive) {
                    debug!(dir = %parent.display(), error = %e, "cannot watch directory");
                }
            }
        }
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            while raw_rx.recv().await.is_some() {
                let burst_start = tokio::time::Instant::now();
                loop {
                    let left = MAX_DELAY.saturating_sub(burst_start.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    match tokio::time::timeout(DEBOUNCE.min(left), raw_rx.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break, // quiet: the burst is over
                    }
                }
                // A full channel means a reload is already pending: nothing to add.
                let _ = tx.try_send(());
            }
        });
        Ok(ChangeWatcher {
            _watcher: watcher,
            changes: rx,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: &str = "apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: demo
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Demo
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: config.yaml
";
    const TEMPLATE: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n";

    fn source(dir: &Path) -> RuleSource {
        std::fs::create_dir_all(dir.join("rules")).unwrap();
        std::fs::create_dir_all(dir.join("templates")).unwrap();
        std::fs::write(dir.join("templates/config.yaml"), TEMPLATE).unwrap();
        RuleSource {
            rules_dir: dir.join("rules"),
            templates_dir: dir.join("templates"),
            default_rollout: None,
            limits: Limits::default(),
        }
    }

    /// The race of a second read: an invalid set is loaded, a valid one is written before
    /// the caller records what it saw. The fingerprint it records must be the invalid
    /// set's, so that the valid one is a change.
    #[test]
    fn an_invalid_outcome_carries_the_fingerprint_of_what_it_read() {
        let dir = tempfile::tempdir().unwrap();
        let source = source(dir.path());
        let rule = dir.path().join("rules/demo.yaml");
        std::fs::write(&rule, RULE.replace("kind: Demo", "kind: demo")).unwrap();
        let Reload::Invalid {
            diagnostics,
            fingerprint,
        } = source.load(None)
        else {
            panic!("a lower-case kind must be invalid");
        };
        assert!(
            diagnostics.to_string().contains("is not a kind"),
            "{diagnostics}"
        );
        let invalid = rules::read(&source.rules_dir, &source.templates_dir);
        assert_eq!(fingerprint, invalid.fingerprint());
        assert!(matches!(source.load(Some(&fingerprint)), Reload::Unchanged));

        // The valid set written "between the load and the second read".
        std::fs::write(&rule, RULE).unwrap();
        match source.load(Some(&fingerprint)) {
            Reload::Valid(set) => {
                assert_ne!(set.fingerprint, fingerprint);
                assert!(matches!(
                    source.load(Some(&set.fingerprint)),
                    Reload::Unchanged
                ));
            }
            other => panic!("the valid set must be loaded, got {other:?}"),
        }
    }

    /// A read error is an invalid outcome with a fingerprint too: it is reported once,
    /// and the fix is a change.
    #[test]
    fn an_unreadable_rule_set_has_a_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let source = source(dir.path());
        let rule = dir.path().join("rules/demo.yaml");
        std::fs::write(&rule, b"kind: \xff\xfe\n").unwrap();
        let Reload::Invalid {
            diagnostics,
            fingerprint,
        } = source.load(None)
        else {
            panic!("a binary rule file must be invalid");
        };
        assert!(
            diagnostics.to_string().contains("not UTF-8"),
            "{diagnostics}"
        );
        assert!(matches!(source.load(Some(&fingerprint)), Reload::Unchanged));
        std::fs::write(&rule, RULE).unwrap();
        assert!(matches!(source.load(Some(&fingerprint)), Reload::Valid(_)));
    }
}
