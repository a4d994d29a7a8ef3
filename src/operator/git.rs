//! The operator's side of the git source (`--rules-git`, src/gitsource/): a fetched
//! commit is loaded through the same [`Rules`] path as the rules directory, so it goes
//! live only if every rule is valid; the outcome goes back to the git source for
//! `/status`, the metrics and the log line naming the commit and the rules it changed.
//! There is no Event: the rule set is no Kubernetes object (rules are files), and an
//! Event on the operator's own Pod would need a Pod identity `run` does not have
//! outside a cluster; the log line and `/status` carry it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::warn;

use super::Rules;
use crate::gitsource::{Checkout, FETCH_TIMEOUT, GitSource, StartError};
use crate::metrics::Metrics;

/// The git source and the channel its checkouts arrive on (none without `--rules-git`).
type Started = (Option<Arc<GitSource>>, Option<mpsc::Receiver<Checkout>>);

/// Starts the git source when `--rules-git` asks for it.
pub(super) fn start(
    settings: Option<&crate::gitsource::GitSettings>,
    metrics: &Arc<Metrics>,
) -> Result<Started, StartError> {
    match settings {
        Some(g) => {
            let (source, rx) = GitSource::start(g.clone(), metrics.clone())?;
            Ok((Some(source), Some(rx)))
        }
        None => Ok((None, None)),
    }
}

/// The first rule set: from the git source's first commit, else from the directories.
pub(super) async fn first_load(
    git: Option<&GitSource>,
    commits: Option<&mut mpsc::Receiver<Checkout>>,
    rules: &mut Rules,
) {
    match (git, commits) {
        (Some(g), Some(rx)) => first_commit(g, rx, rules).await,
        _ => {
            rules.reload();
        }
    }
}

/// Waits for the first fetch and loads its commit, so that the first rule set comes
/// from git; a first fetch that fails leaves the operator without rules (not ready)
/// until a later one succeeds.
pub(super) async fn first_commit(
    git: &GitSource,
    commits: &mut mpsc::Receiver<Checkout>,
    rules: &mut Rules,
) {
    let deadline = tokio::time::Instant::now() + FETCH_TIMEOUT + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(100), commits.recv()).await {
            Ok(Some(c)) => {
                load_commit(git, &c, rules);
                return;
            }
            Ok(None) => return,
            Err(_) => {
                let ended = git.status.read().last_fetch.is_some();
                if ended {
                    // The commit, if any, is sent right after the fetch is recorded.
                    if let Ok(Some(c)) =
                        tokio::time::timeout(Duration::from_millis(200), commits.recv()).await
                    {
                        load_commit(git, &c, rules);
                    }
                    return;
                }
            }
        }
    }
    warn!("the first fetch of the rules repository has not ended; starting without rules");
}

/// Loads one commit's rules; true when a new rule set now serves.
pub(super) fn load_commit(git: &GitSource, checkout: &Checkout, rules: &mut Rules) -> bool {
    let before = rules.versions();
    rules.set_dirs(checkout.rules.clone(), checkout.templates.clone());
    let changed = rules.reload();
    let strip = format!("{}/", checkout.root.display());
    let (valid, errors) = rules.outcome(&strip);
    let errors = if valid { Vec::new() } else { errors };
    let names = if valid {
        changed_rules(&before, &rules.versions())
    } else {
        Vec::new()
    };
    git.loaded(checkout, errors, &names);
    changed
}

/// The rules added, removed or changed between two sets of versions.
fn changed_rules(
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut out: Vec<String> = after
        .iter()
        .filter(|(name, v)| before.get(*name) != Some(*v))
        .map(|(name, _)| name.clone())
        .collect();
    out.extend(
        before
            .keys()
            .filter(|name| !after.contains_key(*name))
            .map(|name| format!("-{name}")),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_rules_are_the_added_changed_and_removed_ones() {
        let m = |v: &[(&str, &str)]| -> BTreeMap<String, String> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let before = m(&[("a", "1"), ("b", "1"), ("c", "1")]);
        let after = m(&[("a", "1"), ("b", "2"), ("d", "1")]);
        assert_eq!(changed_rules(&before, &after), ["b", "d", "-c"]);
    }
}
