//! Rules from a git repository (`rulebook run --rules-git URL`): a task fetches the
//! configured ref every `--git-interval` (and at once on a signed `POST /hooks/git`),
//! writes a new commit's rules and templates out as files ([`fetch`]), and hands it to
//! the operator's loop, which loads it through the same path as the rules directory and
//! hot reload (`src/operator/rules.rs`): a commit goes live only if all its rules are
//! valid; otherwise the last good commit keeps serving and `/status` names the commit
//! that failed and its `file:line` errors. With `--git-verify` a commit must also be
//! signed by an allowed SSH key ([`verify`]).
//!
//! The library is gitoxide (`gix`), not `git2`: `git2` links libgit2 (C), and HTTPS and
//! SSH through it bring OpenSSL and libssh2 to build and to ship in the image; `gix` is
//! Rust throughout, shares rustls and ring with the API client, and compiles only what is
//! asked for (here: the blocking network client and reqwest for HTTPS; no worktree,
//! index, diff or status code). Its SSH transport runs the `ssh` program (as git does),
//! so SSH needs `ssh` in the image; `--git-ssh-key` becomes its `-i`. Measured build cost
//! (62 crates, 960 s of compile time summed over units on a 2-core machine loaded by
//! four builds; no C): docs/benchmarks.md ("Rules from git").
//!
//! Secrets: the token is read from its file at each fetch (a rotated Secret is picked
//! up) and handed to gitoxide's credential callback only; the URL shown on `/status` and
//! in metrics has any user information removed, and a URL with a password is refused.

pub mod fetch;
pub mod hook;
pub mod ssh_probe;
pub mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{Notify, mpsc};
use tracing::{info, warn};

pub use fetch::{Checkout, Fetched, Fetcher};

/// A fetch that takes longer is abandoned (and reported); the next interval tries again.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(120);

/// What `--rules-git` and its companion flags say.
#[derive(Clone, Debug)]
pub struct GitSettings {
    /// The remote, as given (`https://`, `ssh://`, `git@host:path`, `git://`, `file://`).
    pub url: String,
    /// A branch name, or a full ref (`refs/tags/v1`).
    pub reference: String,
    /// The rules directory inside the repository.
    pub rules_path: String,
    /// The templates directory inside the repository.
    pub templates_path: String,
    pub interval: Duration,
    /// HTTPS: a file holding the token (a mounted Secret's key).
    pub token_file: Option<PathBuf>,
    /// HTTPS: the user name sent with the token.
    pub token_user: String,
    /// SSH: the deploy key (private key file).
    pub ssh_key: Option<PathBuf>,
    /// SSH: a known_hosts file; without it, the host key is not checked.
    pub ssh_known_hosts: Option<PathBuf>,
    /// `--git-verify`: the allowed-signers file.
    pub allowed_signers: Option<PathBuf>,
    /// `POST /hooks/git`: a file holding the HMAC secret; `None`: no hook.
    pub hook_secret_file: Option<PathBuf>,
    /// Where the local repository and checkouts live.
    pub cache_dir: PathBuf,
}

/// The HTTPS credentials of one fetch.
pub struct Token {
    pub username: String,
    pub secret: String,
}

impl GitSettings {
    /// The ref to fetch, in full.
    pub fn full_ref(&self) -> String {
        if self.reference.starts_with("refs/") {
            self.reference.clone()
        } else {
            format!("refs/heads/{}", self.reference)
        }
    }

    /// The token of `--git-token-file`, read now.
    pub fn token(&self) -> Result<Option<Token>, fetch::FetchError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let secret = std::fs::read_to_string(path).map_err(|e| fetch::FetchError::Token {
            path: path.display().to_string(),
            message: e.kind().to_string(),
        })?;
        Ok(Some(Token {
            username: self.token_user.clone(),
            secret: secret.trim().to_string(),
        }))
    }

    /// `core.sshCommand` for a deploy key: only this key, no prompt, no ssh_config of
    /// the process's user (`-F /dev/null`), and the known_hosts file as the only one
    /// (the system's is not consulted either). [`GitSettings::check`] refuses paths
    /// with a `'`, which would break the shell quoting.
    pub fn ssh_command(&self) -> Option<String> {
        let key = self.ssh_key.as_ref()?;
        let hosts = match &self.ssh_known_hosts {
            Some(k) => format!(
                "-o UserKnownHostsFile='{}' -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes",
                k.display()
            ),
            None => "-o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no".into(),
        };
        Some(format!(
            "ssh -F /dev/null -i '{}' -o IdentitiesOnly=yes -o BatchMode=yes {hosts}",
            key.display()
        ))
    }

    /// Refuses what cannot work before anything starts.
    pub fn check(&self) -> Result<(), String> {
        let url = gix::url::parse(self.url.as_str())
            .map_err(|e| format!("--rules-git {}: {e}", display_url(&self.url)))?;
        if url.password().is_some() {
            return Err(
                "--rules-git: a password in the URL would show in logs; use --git-token-file"
                    .into(),
            );
        }
        for (flag, path) in [
            ("--git-ssh-key", &self.ssh_key),
            ("--git-ssh-known-hosts", &self.ssh_known_hosts),
        ] {
            if let Some(p) = path
                && p.to_string_lossy().contains('\'')
            {
                return Err(format!("{flag}: a path with ' cannot be passed to ssh"));
            }
        }
        if self.interval < Duration::from_secs(1) {
            return Err("--git-interval must be at least 1s".into());
        }
        Ok(())
    }
}

/// The URL without user information (`user:token@`), for `/status`, metrics and logs.
pub fn display_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        if path.is_empty() && !rest.contains('/') {
            return format!("{scheme}://{host}");
        }
        return format!("{scheme}://{host}/{path}");
    }
    // scp-like `user@host:path`: the user is not a secret, but strip it all the same.
    match url.split_once(':') {
        Some((left, path)) if !left.contains('/') => {
            let host = left.rsplit_once('@').map_or(left, |(_, h)| h);
            format!("{host}:{path}")
        }
        _ => url.to_string(),
    }
}

/// The commit that was refused, and why.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedCommit {
    pub commit: String,
    /// `invalid` (its rules) or `signature` (`--git-verify`).
    pub reason: String,
    /// Every error, `file:line:col: message` for rules, paths as in the repository.
    pub errors: Vec<String>,
}

/// The git source on `/status`.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GitStatus {
    /// The remote without credentials.
    pub url: String,
    #[serde(rename = "ref")]
    pub reference: String,
    /// The commit whose rules serve.
    pub live_commit: Option<String>,
    /// Who signed it (`--git-verify`).
    pub live_signer: Option<String>,
    /// The commit the ref named at the last successful fetch.
    pub fetched_commit: Option<String>,
    /// When the last fetch ended (RFC 3339), successful or not.
    pub last_fetch: Option<String>,
    /// The last fetch's error; `None` when it succeeded.
    pub last_fetch_error: Option<String>,
    /// The newest commit that did not go live, while it is the newest fetched.
    pub failed_commit: Option<FailedCommit>,
}

/// The git source as the operator and the HTTP endpoint see it.
pub struct GitSource {
    pub status: RwLock<GitStatus>,
    /// Wakes the fetch loop (push hook).
    pub trigger: Notify,
    /// `POST /hooks/git`, when a secret is configured.
    pub hook: Option<hook::Hook>,
    metrics: Arc<crate::metrics::Metrics>,
    checkouts: PathBuf,
    /// `--git-cache-dir`: where the live commit is remembered across restarts.
    cache_dir: PathBuf,
}

impl std::fmt::Debug for GitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitSource").finish_non_exhaustive()
    }
}

/// Why the git source cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Signers(#[from] verify::SignersFileError),
    #[error("the hook secret file {path}: {message}")]
    HookSecret { path: String, message: String },
}

impl GitSource {
    /// Starts the fetch loop; new commits arrive on the receiver.
    pub fn start(
        settings: GitSettings,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Result<(Arc<GitSource>, mpsc::Receiver<Checkout>), StartError> {
        settings.check().map_err(StartError::Settings)?;
        // reqwest (HTTPS fetches) is built without a crypto provider of its own: ring,
        // as for the API client. An error means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let signers = match &settings.allowed_signers {
            Some(p) => Some(verify::AllowedSigners::read(p)?),
            None => None,
        };
        let hook = match &settings.hook_secret_file {
            Some(p) => {
                let secret = std::fs::read(p).map_err(|e| StartError::HookSecret {
                    path: p.display().to_string(),
                    message: e.kind().to_string(),
                })?;
                Some(hook::Hook::new(secret.trim_ascii().to_vec()))
            }
            None => None,
        };
        let fetcher = Fetcher::new(settings.clone(), signers);
        let source = Arc::new(GitSource {
            status: RwLock::new(GitStatus {
                url: display_url(&settings.url),
                reference: settings.reference.clone(),
                ..GitStatus::default()
            }),
            trigger: Notify::new(),
            hook,
            metrics,
            checkouts: fetcher.checkouts(),
            cache_dir: settings.cache_dir.clone(),
        });
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(fetch_loop(source.clone(), fetcher, settings.interval, tx));
        Ok((source, rx))
    }

    /// The operator loaded `checkout`: `errors` empty means it is live. Updates
    /// `/status` and the metrics, logs the change, and removes old checkouts.
    pub fn loaded(&self, checkout: &Checkout, errors: Vec<String>, changed: &[String]) {
        let mut s = self.status.write();
        if errors.is_empty() {
            if let Some(old) = &s.live_commit {
                self.metrics.git_commit.remove(&self.commit_label(&s, old));
            }
            info!(
                commit = %checkout.commit,
                subject = %checkout.subject,
                signer = checkout.signer.as_deref().unwrap_or("-"),
                rules_changed = %changed.join(","),
                "rules from git: commit {} is live", short(&checkout.commit)
            );
            s.live_commit = Some(checkout.commit.clone());
            s.live_signer.clone_from(&checkout.signer);
            s.failed_commit = None;
            self.metrics
                .git_commit
                .get_or_create(&self.commit_label(&s, &checkout.commit))
                .set(1);
        } else {
            warn!(
                commit = %checkout.commit,
                errors = errors.len(),
                "rules from git: commit {} is invalid; {}", short(&checkout.commit),
                match &s.live_commit {
                    Some(c) => format!("commit {} keeps serving", short(c)),
                    None => "no commit serves yet".into(),
                }
            );
            self.count_refused("invalid");
            s.failed_commit = Some(FailedCommit {
                commit: checkout.commit.clone(),
                reason: "invalid".into(),
                errors,
            });
        }
        let keep = [s.live_commit.clone(), Some(checkout.commit.clone())];
        let live = s.live_commit.clone();
        drop(s);
        if let Some(live) = live.filter(|c| *c == checkout.commit)
            && let Err(e) = fetch::remember_live(&self.cache_dir, &live)
        {
            warn!(error = %e, "rules from git: cannot remember the live commit for a restart");
        }
        prune_checkouts(&self.checkouts, &keep);
    }

    fn commit_label(&self, s: &GitStatus, commit: &str) -> crate::metrics::GitCommitLabels {
        crate::metrics::GitCommitLabels {
            url: s.url.clone(),
            reference: s.reference.clone(),
            commit: commit.to_string(),
        }
    }

    fn count_refused(&self, reason: &str) {
        self.metrics
            .git_refused
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Records one fetch's outcome on `/status` and in the metrics.
    fn fetched(&self, outcome: &Result<Fetched, String>) {
        let now = jiff::Timestamp::now();
        let mut s = self.status.write();
        s.last_fetch = Some(now.to_string());
        match outcome {
            Ok(fetched) => {
                s.last_fetch_error = None;
                self.metrics.git_fetch_ok.set(1);
                self.metrics.git_last_fetch.set(now.as_second());
                match fetched {
                    Fetched::New(c) => s.fetched_commit = Some(c.commit.clone()),
                    Fetched::Refused { commit, reason } => {
                        s.fetched_commit = Some(commit.clone());
                        warn!(%commit, %reason, "rules from git: commit {} refused by --git-verify; {}", short(commit),
                            match &s.live_commit { Some(c) => format!("commit {} keeps serving", short(c)), None => "no commit serves yet".into() });
                        self.count_refused("signature");
                        s.failed_commit = Some(FailedCommit {
                            commit: commit.clone(),
                            reason: "signature".into(),
                            errors: vec![reason.to_string()],
                        });
                    }
                    Fetched::Unchanged => {}
                }
            }
            Err(e) => {
                warn!(url = %s.url, error = %e, "rules from git: fetch failed; the live commit keeps serving");
                s.last_fetch_error = Some(e.clone());
                self.metrics.git_fetch_ok.set(0);
                self.metrics.git_fetch_errors.inc();
            }
        }
    }
}

fn short(commit: &str) -> &str {
    commit.get(..12).unwrap_or(commit)
}

/// Removes every checkout but those in `keep`.
fn prune_checkouts(dir: &Path, keep: &[Option<String>]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !keep.iter().flatten().any(|k| *k == name) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Fetches at once, then every `interval` or when triggered; new commits go to `tx`.
async fn fetch_loop(
    source: Arc<GitSource>,
    fetcher: Fetcher,
    interval: Duration,
    tx: mpsc::Sender<Checkout>,
) {
    let fetcher = Arc::new(Mutex::new(fetcher));
    if let Some(c) = resume(&fetcher).await
        && tx.send(c).await.is_err()
    {
        return;
    }
    loop {
        let outcome = fetch_once(&fetcher).await;
        source.fetched(&outcome);
        if let Ok(Fetched::New(c)) = outcome
            && tx.send(c).await.is_err()
        {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = source.trigger.notified() => {}
        }
    }
}

/// The commit that was live before a restart ([`Fetcher::resume`]), to serve before the
/// first fetch.
async fn resume(fetcher: &Arc<Mutex<Fetcher>>) -> Option<Checkout> {
    let f = fetcher.clone();
    let out = tokio::task::spawn_blocking(move || f.lock().resume())
        .await
        .ok()
        .flatten()?;
    match out {
        Ok(Fetched::New(c)) => {
            info!(commit = %c.commit, "rules from git: resuming with the last good commit {} of the cache", short(&c.commit));
            Some(c)
        }
        Ok(Fetched::Refused { commit, reason }) => {
            warn!(%commit, %reason, "rules from git: the last good commit of the cache is refused by --git-verify; not serving it");
            None
        }
        Ok(Fetched::Unchanged) => None,
        Err(e) => {
            warn!(error = %e, "rules from git: cannot read the last good commit of the cache");
            None
        }
    }
}

/// One fetch on the blocking pool, abandoned after [`FETCH_TIMEOUT`].
async fn fetch_once(fetcher: &Arc<Mutex<Fetcher>>) -> Result<Fetched, String> {
    let interrupt = Arc::new(AtomicBool::new(false));
    let (f, flag) = (fetcher.clone(), interrupt.clone());
    let task = tokio::task::spawn_blocking(move || {
        let Some(mut f) = f.try_lock() else {
            return Err("the previous fetch is still running".to_string());
        };
        f.fetch(&flag).map_err(|e| e.to_string())
    });
    match tokio::time::timeout(FETCH_TIMEOUT, task).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(format!("the fetch task failed: {e}")),
        Err(_) => {
            interrupt.store(true, Ordering::SeqCst);
            Err(format!(
                "the fetch took longer than {}s",
                FETCH_TIMEOUT.as_secs()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials() {
        for (given, shown) in [
            (
                "https://x-access-token:ghp_secret@github.com/org/rules.git",
                "https://github.com/org/rules.git",
            ),
            (
                "https://github.com/org/rules.git",
                "https://github.com/org/rules.git",
            ),
            (
                "ssh://git@example.com:2222/org/rules.git",
                "ssh://example.com:2222/org/rules.git",
            ),
            ("git@github.com:org/rules.git", "github.com:org/rules.git"),
            (
                "git://127.0.0.1:9418/rules.git",
                "git://127.0.0.1:9418/rules.git",
            ),
            ("/srv/git/rules.git", "/srv/git/rules.git"),
        ] {
            assert_eq!(display_url(given), shown);
        }
    }

    #[test]
    fn a_password_in_the_url_is_refused() {
        let settings = GitSettings {
            url: "https://u:secret@example.com/r.git".into(),
            reference: "main".into(),
            rules_path: "rules".into(),
            templates_path: "templates".into(),
            interval: Duration::from_secs(30),
            token_file: None,
            token_user: "git".into(),
            ssh_key: None,
            ssh_known_hosts: None,
            allowed_signers: None,
            hook_secret_file: None,
            cache_dir: PathBuf::from("/nonexistent"),
        };
        let e = settings.check().unwrap_err();
        assert!(!e.contains("secret"), "{e}");
        assert!(e.contains("--git-token-file"), "{e}");
    }
}
