//! `--git-verify ALLOWED_SIGNERS`: a commit goes live only if it carries git's SSH
//! signature (`gpg.format=ssh`, an `SshSig` in the commit's `gpgsig` header, namespace
//! `git`) made by a key listed in an allowed-signers file (the format of git's
//! `gpg.ssh.allowedSignersFile` and of `ssh-keygen -Y verify -f`).
//!
//! The `ssh-key` crate (RustCrypto) parses the keys and the `SshSig` and checks the
//! signature; only its `ed25519` algorithm is compiled in (the usual deploy and signing
//! key, and the smallest build): a commit signed with an RSA or ECDSA key is refused as
//! unverifiable. Like `git verify-commit`, any listed principal's key is accepted: the
//! principal is not matched against the committer. Of the per-key options only
//! `namespaces=` is honoured; a line with `cert-authority`, `valid-after` or
//! `valid-before` is an error of the file rather than a key accepted without its limit.

use ssh_key::{PublicKey, SshSig};

/// The namespace git signs commits in.
const GIT_NAMESPACE: &str = "git";

/// One key of the allowed-signers file.
#[derive(Debug, Clone)]
struct Signer {
    principals: String,
    key: PublicKey,
}

/// The keys whose signatures make a commit loadable.
#[derive(Debug, Clone)]
pub struct AllowedSigners {
    signers: Vec<Signer>,
}

/// A line of the allowed-signers file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct SignersFileError {
    pub file: String,
    pub line: usize,
    pub message: String,
}

/// Why a commit is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the commit is not signed")]
    Unsigned,
    #[error("the commit's signature is not an SSH signature (only gpg.format=ssh is verified)")]
    NotSsh,
    #[error("the commit's SSH signature cannot be read: {0}")]
    Malformed(String),
    #[error("the commit is signed by a key that is not allowed ({0})")]
    UnknownKey(String),
    #[error("the commit's signature does not verify: {0}")]
    Invalid(String),
}

impl AllowedSigners {
    /// Parses an allowed-signers file's text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, SignersFileError> {
        let mut signers = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let error = |message: String| SignersFileError {
                file: file.to_string(),
                line: i + 1,
                message,
            };
            if let Some(s) = parse_line(line).map_err(error)? {
                signers.push(s);
            }
        }
        if signers.is_empty() {
            return Err(SignersFileError {
                file: file.to_string(),
                line: 0,
                message: "no key allows the namespace `git`: every commit would be refused".into(),
            });
        }
        Ok(Self { signers })
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &std::path::Path) -> Result<Self, SignersFileError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| SignersFileError {
            file: file.clone(),
            line: 0,
            message: e.to_string(),
        })?;
        Self::parse(&text, &file)
    }

    /// Checks a commit's signature over `payload` (the commit without its `gpgsig`
    /// header); the signing key's principals when it verifies.
    pub fn verify(&self, signature: Option<&[u8]>, payload: &[u8]) -> Result<String, Refused> {
        let signature = signature.ok_or(Refused::Unsigned)?;
        let text = std::str::from_utf8(signature).map_err(|_| Refused::NotSsh)?;
        if !text
            .trim_start()
            .starts_with("-----BEGIN SSH SIGNATURE-----")
        {
            return Err(Refused::NotSsh);
        }
        let sig = SshSig::from_pem(text.trim()).map_err(|e| Refused::Malformed(e.to_string()))?;
        let Some(signer) = self
            .signers
            .iter()
            .find(|s| s.key.key_data() == sig.public_key())
        else {
            let key = PublicKey::from(sig.public_key().clone());
            return Err(Refused::UnknownKey(
                key.fingerprint(ssh_key::HashAlg::Sha256).to_string(),
            ));
        };
        signer
            .key
            .verify(GIT_NAMESPACE, payload, &sig)
            .map_err(|e| Refused::Invalid(e.to_string()))?;
        Ok(signer.principals.clone())
    }
}

/// Key types an allowed-signers line can name (the options field comes before one).
fn is_key_type(word: &str) -> bool {
    word.starts_with("ssh-") || word.starts_with("ecdsa-") || word.starts_with("sk-")
}

/// One non-empty line: `principals [options] keytype base64 [comment]`. `None`: the key
/// does not sign in the `git` namespace.
fn parse_line(line: &str) -> Result<Option<Signer>, String> {
    let words = split_words(line);
    let mut words = words.iter().map(String::as_str);
    let principals = words.next().ok_or("no principals")?;
    let mut next = words.next().ok_or("no key")?;
    let mut for_git = true;
    if !is_key_type(next) {
        for_git = options_allow_git(next)?;
        next = words.next().ok_or("no key after the options")?;
    }
    let data = words.next().ok_or("no key data after the key type")?;
    let key = PublicKey::from_openssh(&format!("{next} {data}"))
        .map_err(|e| format!("the key cannot be read: {e}"))?;
    Ok(for_git.then(|| Signer {
        principals: principals.to_string(),
        key,
    }))
}

/// Whether an options field lets the key sign for git; an option whose limit is not
/// enforced here is an error.
fn options_allow_git(options: &str) -> Result<bool, String> {
    let mut allows = true;
    for opt in split_options(options) {
        let (name, value) = opt.split_once('=').unwrap_or((opt.as_str(), ""));
        match name.to_ascii_lowercase().as_str() {
            "namespaces" => {
                let value = value.trim_matches('"');
                allows = value
                    .split(',')
                    .any(|n| n.trim() == GIT_NAMESPACE || n.trim() == "*");
            }
            other => return Err(format!("the option `{other}` is not supported")),
        }
    }
    Ok(allows)
}

/// Splits at whitespace outside double quotes (runs of it are one separator).
fn split_words(line: &str) -> Vec<String> {
    split_unquoted(line, char::is_whitespace)
        .into_iter()
        .filter(|w| !w.is_empty())
        .collect()
}

/// Splits an options field at commas outside double quotes.
fn split_options(field: &str) -> Vec<String> {
    split_unquoted(field, |c| c == ',')
}

/// Splits `text` at every character `sep` accepts outside double quotes (the quotes
/// kept), empty parts included.
fn split_unquoted(text: &str, sep: impl Fn(char) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in text.chars() {
        if c == '"' {
            quoted = !quoted;
            cur.push(c);
        } else if sep(c) && !quoted {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINkqZv+Sfum+SrK6lfpliZ8TrO4RQbeY9EFxl9brWA2e";

    #[test]
    fn lines_with_and_without_options() {
        let text = format!(
            "# signers\nalice@example.com {KEY} alice\nbob namespaces=\"file,git\" {KEY}\ncarol namespaces=\"file\" {KEY}\n"
        );
        let s = AllowedSigners::parse(&text, "allowed").unwrap();
        let names: Vec<&str> = s.signers.iter().map(|s| s.principals.as_str()).collect();
        assert_eq!(names, ["alice@example.com", "bob"]);
    }

    #[test]
    fn unsupported_options_and_bad_keys_are_errors_with_their_line() {
        let e =
            AllowedSigners::parse(&format!("\nx valid-after=20200101 {KEY}\n"), "f").unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(e.to_string().contains("valid-after"), "{e}");
        let e = AllowedSigners::parse("x ssh-ed25519 AAAAnot-a-key\n", "f").unwrap_err();
        assert!(e.to_string().starts_with("f:1: "), "{e}");
        let e = AllowedSigners::parse("# nothing\n", "f").unwrap_err();
        assert!(e.to_string().contains("no key"), "{e}");
    }

    #[test]
    fn unsigned_and_pgp_signatures_are_refused() {
        let s = AllowedSigners::parse(&format!("a {KEY}\n"), "f").unwrap();
        assert_eq!(s.verify(None, b"tree x\n"), Err(Refused::Unsigned));
        assert_eq!(
            s.verify(Some(b"-----BEGIN PGP SIGNATURE-----\nxx\n"), b"tree x\n"),
            Err(Refused::NotSsh)
        );
    }
}
