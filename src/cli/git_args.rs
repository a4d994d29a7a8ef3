//! `rulebook run`'s git flags (docs/reference/git-source.md): `--rules-git URL` takes the
//! rules from a git repository instead of the `--rules`/`--templates` directories, which
//! it replaces; the other flags only mean something with it.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::webhook_args::duration;
use crate::gitsource::GitSettings;

#[derive(Args, Debug, Clone)]
pub struct GitArgs {
    /// Take the rules from this git repository (`https://`, `ssh://`, `git@host:path`,
    /// `git://`, `file://`) instead of the rules and templates directories.
    #[arg(long, env = "RULEBOOK_RULES_GIT")]
    pub rules_git: Option<String>,
    /// The branch (or full ref, e.g. `refs/tags/v3`) to follow.
    #[arg(long, default_value = "main", requires = "rules_git")]
    pub git_ref: String,
    /// The rules directory inside the repository.
    #[arg(long, default_value = "rules", requires = "rules_git")]
    pub git_path: String,
    /// The templates directory inside the repository.
    #[arg(long, default_value = "templates", requires = "rules_git")]
    pub git_templates_path: String,
    /// Time between fetches (`POST /hooks/git` fetches at once).
    #[arg(long, default_value = "30s", value_parser = duration, requires = "rules_git")]
    pub git_interval: Duration,
    /// HTTPS: a file holding the access token (mount a Secret's key as a file).
    #[arg(long, requires = "rules_git")]
    pub git_token_file: Option<PathBuf>,
    /// HTTPS: the user name sent with the token.
    #[arg(long, default_value = "x-access-token", requires = "rules_git")]
    pub git_token_user: String,
    /// SSH: the deploy key (a private key file; the `ssh` program is run with it).
    #[arg(long, requires = "rules_git")]
    pub git_ssh_key: Option<PathBuf>,
    /// SSH: a known_hosts file to check the server's host key against (without it the
    /// host key is not checked).
    #[arg(long, requires = "rules_git")]
    pub git_ssh_known_hosts: Option<PathBuf>,
    /// Load only commits signed by a key of this allowed-signers file (git's SSH
    /// signatures, `gpg.format=ssh`).
    #[arg(long, value_name = "ALLOWED_SIGNERS", requires = "rules_git")]
    pub git_verify: Option<PathBuf>,
    /// A file holding the secret of `POST /hooks/git` (HMAC-SHA256 of the body in
    /// `X-Hub-Signature-256`); without it the hook is off.
    #[arg(long, requires = "rules_git")]
    pub git_hook_secret_file: Option<PathBuf>,
    /// Where the local repository and the checked-out commits live (default: a
    /// directory of this process under the temporary directory).
    #[arg(long, requires = "rules_git")]
    pub git_cache_dir: Option<PathBuf>,
}

impl GitArgs {
    /// The git source's settings, or `None` without `--rules-git`.
    pub fn settings(&self) -> Option<GitSettings> {
        let url = self.rules_git.clone()?;
        Some(GitSettings {
            url,
            reference: self.git_ref.clone(),
            rules_path: self.git_path.clone(),
            templates_path: self.git_templates_path.clone(),
            interval: self.git_interval,
            token_file: self.git_token_file.clone(),
            token_user: self.git_token_user.clone(),
            ssh_key: self.git_ssh_key.clone(),
            ssh_known_hosts: self.git_ssh_known_hosts.clone(),
            allowed_signers: self.git_verify.clone(),
            hook_secret_file: self.git_hook_secret_file.clone(),
            cache_dir: self.git_cache_dir.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("rulebook-git-{}", std::process::id()))
            }),
        })
    }
}
