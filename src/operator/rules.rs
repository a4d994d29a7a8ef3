//! The rule set `rulebook run` serves, and how it is read again from disk: each reload is
//! counted in `rulebook_ruleset_reloads_total`, reported on /status and /readyz, and an
//! invalid rule set on disk never replaces the last good one.

use std::sync::{Arc, RwLock};

use tracing::{error, info, warn};

use crate::http::RuleSetState;
use crate::metrics::{Metrics, ReloadLabel};
use crate::reload::{Reload, RuleSource};
use crate::render::RuleSet;

/// The rules directories, the rule set being served, and the fingerprint of what was
/// last read from them (valid or not).
pub(super) struct Rules {
    source: RuleSource,
    metrics: Arc<Metrics>,
    /// What /status and /readyz report.
    state: Arc<RwLock<RuleSetState>>,
    /// The last valid rule set, if any was ever read.
    pub(super) serving: Option<RuleSet>,
    last_seen: Option<String>,
}

impl Rules {
    pub(super) fn new(
        source: RuleSource,
        metrics: Arc<Metrics>,
        state: Arc<RwLock<RuleSetState>>,
    ) -> Self {
        Self {
            source,
            metrics,
            state,
            serving: None,
            last_seen: None,
        }
    }

    /// Reads the directories again; true when a new valid rule set now serves.
    pub(super) fn reload(&mut self) -> bool {
        match self.source.load(self.last_seen.as_deref()) {
            Reload::Unchanged => {
                self.count("unchanged");
                false
            }
            Reload::Valid(set) => {
                info!(rules = set.rules.len(), fingerprint = %set.fingerprint, "rule set loaded");
                self.last_seen = Some(set.fingerprint.clone());
                self.metrics.ruleset_valid.set(1);
                self.count("applied");
                if let Ok(mut s) = self.state.write() {
                    s.loaded = true;
                    s.valid = true;
                    s.serving = Some(set.fingerprint.clone());
                    s.errors.clear();
                }
                self.serving = Some(set);
                true
            }
            Reload::Invalid {
                diagnostics: diags,
                fingerprint,
            } => {
                self.last_seen = Some(fingerprint);
                self.metrics.ruleset_valid.set(0);
                self.count("invalid");
                for d in &diags.0 {
                    error!("{d}");
                }
                warn!(
                    errors = diags.0.len(),
                    "the rules on disk are invalid; {}",
                    if self.serving.is_some() {
                        "the last good rule set keeps serving"
                    } else {
                        "waiting for a valid rule set"
                    }
                );
                if let Ok(mut s) = self.state.write() {
                    s.valid = false;
                    s.errors = diags.0.iter().map(ToString::to_string).collect();
                }
                false
            }
        }
    }

    /// Reads from these directories from now on (a new commit of the git source).
    pub(super) fn set_dirs(&mut self, rules: std::path::PathBuf, templates: std::path::PathBuf) {
        self.source.rules_dir = rules;
        self.source.templates_dir = templates;
    }

    /// Whether the last read was valid, and its errors with `strip` removed from file
    /// names (on `/status` too: a checkout's directory becomes the repository's path).
    pub(super) fn outcome(&self, strip: &str) -> (bool, Vec<String>) {
        let Ok(mut s) = self.state.write() else {
            return (false, Vec::new());
        };
        for e in &mut s.errors {
            *e = e.replace(strip, "");
        }
        (s.valid, s.errors.clone())
    }

    /// Each serving rule's version (content hash).
    pub(super) fn versions(&self) -> std::collections::BTreeMap<String, String> {
        self.serving
            .iter()
            .flat_map(|set| set.rules.iter())
            .map(|(name, r)| (name.clone(), r.version.clone()))
            .collect()
    }

    /// Counts one reload with its `result` label.
    fn count(&self, result: &str) {
        self.metrics
            .reloads
            .get_or_create(&ReloadLabel {
                result: result.into(),
            })
            .inc();
    }
}
