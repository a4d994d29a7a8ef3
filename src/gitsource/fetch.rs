//! One fetch of the rules repository, with gitoxide: a shallow fetch (depth 1) of one
//! ref into a bare repository of the operator's own, then the commit's rules and
//! templates trees written out as plain files under `checkouts/<commit>/`, which the
//! directory loader reads like any other rules directory (so a commit is validated by
//! exactly what `rulebook check` and hot reload run).
//!
//! What is written is bounded ([`MAX_FILES`], [`MAX_BYTES`], [`MAX_DEPTH`]) and only
//! regular files and directories are written: symbolic links and submodules in the
//! trees are skipped, so a commit cannot point the loader outside its checkout.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use gix::bstr::ByteSlice;
use gix::objs::tree::EntryKind;
use gix::remote::Direction;

use super::verify::{AllowedSigners, Refused};
use super::{GitSettings, Token};

/// Files written from one commit at most.
pub const MAX_FILES: usize = 10_000;
/// Bytes written from one commit at most.
pub const MAX_BYTES: u64 = 64 << 20;
/// Directory nesting at most.
pub const MAX_DEPTH: usize = 32;

/// The local ref the fetched commit is kept under.
const LOCAL_REF: &str = "refs/rulebook/fetched";
/// The local ref naming the commit whose rules serve ([`remember_live`]).
pub const LIVE_REF: &str = "refs/rulebook/live";

/// Why a fetch failed (the last good commit keeps serving).
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the local repository {path}: {message}")]
    Local { path: String, message: String },
    #[error("fetching {reference}: {message}")]
    Fetch { reference: String, message: String },
    #[error("the remote has no ref {0}")]
    NoRef(String),
    #[error("reading commit {commit}: {message}")]
    Read { commit: String, message: String },
    #[error("writing the checkout: {0}")]
    Io(#[from] std::io::Error),
    #[error("the token file {path}: {message}")]
    Token { path: String, message: String },
}

/// A commit's rules, written out.
#[derive(Debug, Clone)]
pub struct Checkout {
    /// The full commit id (hex).
    pub commit: String,
    /// The commit's first line.
    pub subject: String,
    /// `checkouts/<commit>`: the prefix to strip from file names in diagnostics.
    pub root: PathBuf,
    pub rules: PathBuf,
    pub templates: PathBuf,
    /// The principals of the key that signed it (`--git-verify`).
    pub signer: Option<String>,
}

/// What one fetch found.
#[derive(Debug)]
pub enum Fetched {
    /// The ref still names the commit last looked at.
    Unchanged,
    New(Checkout),
    /// The commit is not signed as `--git-verify` requires.
    Refused {
        commit: String,
        reason: Refused,
    },
}

/// The local repository and the commit last looked at.
pub struct Fetcher {
    settings: GitSettings,
    signers: Option<AllowedSigners>,
    last: Option<gix::ObjectId>,
}

impl Fetcher {
    pub fn new(settings: GitSettings, signers: Option<AllowedSigners>) -> Self {
        Self {
            settings,
            signers,
            last: None,
        }
    }

    fn repo_dir(&self) -> PathBuf {
        self.settings.cache_dir.join("repo.git")
    }

    /// The checkouts' directory.
    pub fn checkouts(&self) -> PathBuf {
        self.settings.cache_dir.join("checkouts")
    }

    /// The local bare repository, made on first use, with the SSH command of
    /// `--git-ssh-key` in its configuration (in memory: a restart with another key or
    /// known_hosts file uses those).
    fn open(&self) -> Result<gix::Repository, FetchError> {
        let dir = self.repo_dir();
        let local = |e: &dyn std::fmt::Display| FetchError::Local {
            path: dir.display().to_string(),
            message: e.to_string(),
        };
        if !dir.join("HEAD").exists() {
            std::fs::create_dir_all(&self.settings.cache_dir)?;
            gix::init_bare(&dir).map_err(|e| local(&e))?;
        }
        let mut repo = gix::open(&dir).map_err(|e| local(&e))?;
        if let Some(cmd) = self.settings.ssh_command() {
            let mut config = repo.config_snapshot_mut();
            config
                .set_value(&gix::config::tree::Core::SSH_COMMAND, cmd.as_str())
                .map_err(|e| local(&e))?;
            config.commit().map_err(|e| local(&e))?;
        }
        Ok(repo)
    }

    /// The commit that was live when the process last ran ([`remember_live`]), written
    /// out again from the local repository (no network): the operator serves it before
    /// the first fetch, so a restart while the ref's head is invalid (or the server is
    /// down) keeps the last good commit. `None` when there is none; a commit that no
    /// longer passes `--git-verify` is `Refused` and not served.
    pub fn resume(&mut self) -> Option<Result<Fetched, FetchError>> {
        if !self.repo_dir().join("HEAD").exists() {
            return None;
        }
        let repo = match self.open() {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let id = repo
            .try_find_reference(LIVE_REF)
            .ok()
            .flatten()?
            .try_id()?
            .detach();
        let out = self.checkout(&repo, id);
        if !matches!(out, Ok(Fetched::New(_))) {
            // Not served: the first fetch must look at the ref's head afresh.
            self.last = None;
        }
        Some(out)
    }

    /// Fetches the ref and, if it names a new commit, verifies and writes it out.
    pub fn fetch(&mut self, interrupt: &AtomicBool) -> Result<Fetched, FetchError> {
        let repo = self.open()?;
        let id = self.fetch_ref(&repo, interrupt)?;
        if self.last == Some(id) {
            return Ok(Fetched::Unchanged);
        }
        self.checkout(&repo, id)
    }

    /// Verifies commit `id` (`--git-verify`) and writes its rules and templates out.
    fn checkout(
        &mut self,
        repo: &gix::Repository,
        id: gix::ObjectId,
    ) -> Result<Fetched, FetchError> {
        let hex = id.to_string();
        let read = |e: &dyn std::fmt::Display| FetchError::Read {
            commit: hex.clone(),
            message: e.to_string(),
        };
        let commit = repo
            .find_object(id)
            .and_then(gix::Object::peel_to_commit)
            .map_err(|e| read(&e))?;
        let mut signer = None;
        if let Some(signers) = &self.signers {
            let signature = commit.signature().map_err(|e| read(&e))?;
            let verdict = match &signature {
                Some((sig, payload)) => signers.verify(Some(sig.as_bytes()), &payload.to_bstring()),
                None => signers.verify(None, b""),
            };
            match verdict {
                Ok(principals) => signer = Some(principals),
                Err(reason) => {
                    self.last = Some(id);
                    return Ok(Fetched::Refused {
                        commit: commit.id.to_string(),
                        reason,
                    });
                }
            }
        }
        let commit_hex = commit.id.to_string();
        let subject = commit
            .message_raw()
            .map(|m| {
                m.lines()
                    .next()
                    .unwrap_or_default()
                    .to_str_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        let tree = commit.tree().map_err(|e| read(&e))?;
        let root = self.checkouts().join(&commit_hex);
        if root.exists() {
            std::fs::remove_dir_all(&root)?;
        }
        let mut budget = Budget::default();
        let rules = root.join(&self.settings.rules_path);
        let templates = root.join(&self.settings.templates_path);
        for (path, out) in [
            (&self.settings.rules_path, &rules),
            (&self.settings.templates_path, &templates),
        ] {
            write_subtree(&tree, path, out, &mut budget).map_err(|e| match e {
                WriteError::Io(e) => FetchError::Io(e),
                WriteError::Git(m) => read(&m),
            })?;
        }
        self.last = Some(id);
        Ok(Fetched::New(Checkout {
            commit: commit_hex,
            subject,
            root,
            rules,
            templates,
            signer,
        }))
    }

    /// One shallow fetch of the ref; the commit (or tag) it names.
    fn fetch_ref(
        &self,
        repo: &gix::Repository,
        interrupt: &AtomicBool,
    ) -> Result<gix::ObjectId, FetchError> {
        let reference = self.settings.full_ref();
        let fetch_error = |e: &dyn std::error::Error| FetchError::Fetch {
            reference: reference.clone(),
            message: with_causes(e),
        };
        let url = gix::url::parse(self.settings.url.as_str()).map_err(|e| fetch_error(&e))?;
        // A failed SSH handshake says why in ssh's words, not only gitoxide's.
        let handshake_error = |e: &dyn std::error::Error| {
            let mut err = fetch_error(e);
            if let FetchError::Fetch { message, .. } = &mut err
                && !interrupt.load(std::sync::atomic::Ordering::SeqCst)
                && let Some(said) =
                    super::ssh_probe::diagnose(&url, self.settings.ssh_command().as_deref())
            {
                message.push_str("; ssh: ");
                message.push_str(&said);
            }
            err
        };
        let remote = repo
            .remote_at(url.clone())
            .and_then(|r| {
                r.with_fetch_tags(gix::remote::fetch::Tags::None)
                    .with_refspecs(
                        [format!("+{reference}:{LOCAL_REF}").as_str()],
                        Direction::Fetch,
                    )
            })
            .map_err(|e| fetch_error(&e))?;
        let connection = remote
            .connect(Direction::Fetch)
            .map_err(|e| fetch_error(&e))?;
        let token = self.settings.token()?;
        let connection = match token {
            Some(token) => connection.with_credentials(move |action| credentials(&token, action)),
            None => connection.with_credentials(|_| Ok(None)),
        };
        let depth = NonZeroU32::MIN;
        let outcome = connection
            .prepare_fetch(gix::progress::Discard, Default::default())
            .map_err(|e| handshake_error(&e))?
            .with_shallow(gix::remote::fetch::Shallow::DepthAtRemote(depth))
            .receive(gix::progress::Discard, interrupt)
            .map_err(|e| fetch_error(&e))?;
        outcome
            .ref_map
            .mappings
            .iter()
            .find_map(|m| m.remote.as_id().map(ToOwned::to_owned))
            .ok_or(FetchError::NoRef(reference))
    }
}

/// An error with its causes, `outer: inner: ...`: gitoxide's outer errors alone say
/// "Transport handshake failed" where the cause says why (the host key, a 401). The
/// URL in them carries no credentials ([`GitSettings::check`] refuses a password).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    let mut depth = 0;
    while let Some(c) = cause
        && depth < 8
    {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
        depth += 1;
    }
    out
}

/// Points [`LIVE_REF`] of the local repository in `cache_dir` at `commit`, the commit
/// that just went live, for [`Fetcher::resume`] after a restart. The ref also keeps the
/// commit's objects reachable in the local repository.
pub fn remember_live(cache_dir: &Path, commit: &str) -> Result<(), FetchError> {
    let dir = cache_dir.join("repo.git");
    let local = |e: &dyn std::fmt::Display| FetchError::Local {
        path: dir.display().to_string(),
        message: e.to_string(),
    };
    let repo = gix::open(&dir).map_err(|e| local(&e))?;
    let id = gix::ObjectId::from_hex(commit.as_bytes()).map_err(|e| local(&e))?;
    repo.reference(
        LIVE_REF,
        id,
        gix::refs::transaction::PreviousValue::Any,
        "rulebook: live",
    )
    .map_err(|e| local(&e))?;
    Ok(())
}

/// Answers gitoxide's credential requests with the token (HTTPS); stores and erases
/// nothing.
fn credentials(
    token: &Token,
    action: gix::credentials::helper::Action,
) -> gix::Result<Option<gix::credentials::protocol::Outcome>> {
    match action {
        gix::credentials::helper::Action::Get(ctx) => {
            Ok(Some(gix::credentials::protocol::Outcome {
                identity: gix::sec::identity::Account {
                    username: token.username.clone(),
                    password: token.secret.clone(),
                    oauth_refresh_token: None,
                },
                next: ctx.into(),
            }))
        }
        _ => Ok(None),
    }
}

/// What a commit has written so far.
#[derive(Default)]
struct Budget {
    files: usize,
    bytes: u64,
}

enum WriteError {
    Io(std::io::Error),
    Git(String),
}

impl From<std::io::Error> for WriteError {
    fn from(e: std::io::Error) -> Self {
        WriteError::Io(e)
    }
}

/// Writes the tree at `path` of `root` into `out` (an empty directory when the commit
/// has no such path: the loader then reports the missing rules or templates).
fn write_subtree(
    root: &gix::Tree<'_>,
    path: &str,
    out: &Path,
    budget: &mut Budget,
) -> Result<(), WriteError> {
    std::fs::create_dir_all(out)?;
    let git = |e: &dyn std::fmt::Display| WriteError::Git(e.to_string());
    let trimmed = path.trim_matches('/');
    let tree = if trimmed.is_empty() || trimmed == "." {
        root.clone()
    } else {
        match root.lookup_entry_by_path(trimmed).map_err(|e| git(&e))? {
            Some(entry) if entry.mode().is_tree() => entry
                .object()
                .and_then(gix::Object::peel_to_tree)
                .map_err(|e| git(&e))?,
            Some(_) => return Err(WriteError::Git(format!("`{trimmed}` is not a directory"))),
            None => return Ok(()),
        }
    };
    write_tree(&tree, out, budget, 0)
}

fn write_tree(
    tree: &gix::Tree<'_>,
    out: &Path,
    budget: &mut Budget,
    depth: usize,
) -> Result<(), WriteError> {
    let git = |e: &dyn std::fmt::Display| WriteError::Git(e.to_string());
    if depth > MAX_DEPTH {
        return Err(WriteError::Git(format!(
            "directories nest deeper than {MAX_DEPTH}"
        )));
    }
    for entry in tree.iter() {
        let entry = entry.map_err(|e| git(&e))?;
        let Ok(name) = entry.filename().to_str() else {
            continue;
        };
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            continue;
        }
        let target = out.join(name);
        match entry.mode().kind() {
            EntryKind::Tree => {
                std::fs::create_dir_all(&target)?;
                let sub = entry
                    .object()
                    .and_then(gix::Object::peel_to_tree)
                    .map_err(|e| git(&e))?;
                write_tree(&sub, &target, budget, depth + 1)?;
            }
            EntryKind::Blob | EntryKind::BlobExecutable => {
                let blob = entry.object().map_err(|e| git(&e))?;
                budget.files += 1;
                budget.bytes += blob.data.len() as u64;
                if budget.files > MAX_FILES || budget.bytes > MAX_BYTES {
                    return Err(WriteError::Git(format!(
                        "the rules and templates exceed {MAX_FILES} files or {} MiB",
                        MAX_BYTES >> 20
                    )));
                }
                std::fs::write(&target, &blob.data)?;
            }
            // Links and submodules are not followed.
            EntryKind::Link | EntryKind::Commit => {}
        }
    }
    Ok(())
}
