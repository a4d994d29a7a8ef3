//! `POST /hooks/git`: a push hook that makes the git source fetch at once instead of at
//! its next interval. The request must carry `X-Hub-Signature-256: sha256=<hex>`, the
//! HMAC-SHA256 of its body under the shared secret (the form GitHub, Gitea and Forgejo
//! send; GitLab users point a hook at it through a relay, or rely on the interval). The
//! body itself is not read beyond the signature: whatever it says, the fetch asks the
//! remote for the configured ref. The `hmac` crate (RustCrypto, on the `sha2` already
//! used) computes and compares in constant time.
//!
//! A wrong or missing signature is 401 and fetches nothing. Signed requests are limited
//! to [`BURST`] per [`WINDOW`] (429 beyond); bad ones are not counted, so a stranger
//! cannot use up the owner's allowance. Triggers coalesce: however many arrive while a
//! fetch runs, one more fetch follows.

use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};
use parking_lot::Mutex;

/// Signed requests accepted per window.
pub const BURST: usize = 10;
/// The window of [`BURST`].
pub const WINDOW: Duration = Duration::from_secs(10);

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// What the endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Signed: a fetch is triggered.
    Accepted,
    /// No or a wrong signature.
    Unauthorized,
    /// Signed, but over the rate.
    TooMany,
}

/// The secret and the recent accepted requests.
pub struct Hook {
    secret: Vec<u8>,
    recent: Mutex<Vec<Instant>>,
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hook").finish_non_exhaustive()
    }
}

impl Hook {
    pub fn new(secret: Vec<u8>) -> Self {
        Self {
            secret,
            recent: Mutex::new(Vec::new()),
        }
    }

    /// Judges one request from its signature header and body.
    pub fn judge(&self, header: Option<&str>, body: &[u8]) -> Verdict {
        if !self.signed(header, body) {
            return Verdict::Unauthorized;
        }
        let now = Instant::now();
        let mut recent = self.recent.lock();
        recent.retain(|t| now.duration_since(*t) < WINDOW);
        if recent.len() >= BURST {
            return Verdict::TooMany;
        }
        recent.push(now);
        Verdict::Accepted
    }

    /// Whether `header` is `sha256=` and the hex HMAC of `body`.
    fn signed(&self, header: Option<&str>, body: &[u8]) -> bool {
        let Some(hex_sig) = header.and_then(|h| h.trim().strip_prefix("sha256=")) else {
            return false;
        };
        let Ok(sig) = hex::decode(hex_sig) else {
            return false;
        };
        let Ok(mut mac) = HmacSha256::new_from_slice(&self.secret) else {
            return false;
        };
        mac.update(body);
        mac.verify_slice(&sig).is_ok()
    }
}

#[cfg(test)]
pub(crate) fn sign(secret: &[u8], body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret).unwrap();
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_signature_is_accepted() {
        let hook = Hook::new(b"s3cret".to_vec());
        let body = br#"{"ref":"refs/heads/main"}"#;
        assert_eq!(hook.judge(None, body), Verdict::Unauthorized);
        assert_eq!(hook.judge(Some("sha256=00"), body), Verdict::Unauthorized);
        assert_eq!(
            hook.judge(Some(&sign(b"other", body)), body),
            Verdict::Unauthorized
        );
        assert_eq!(
            hook.judge(Some(&sign(b"s3cret", b"{}")), body),
            Verdict::Unauthorized
        );
        let good = sign(b"s3cret", body);
        assert_eq!(
            hook.judge(Some(good.trim_start_matches("sha256=")), body),
            Verdict::Unauthorized
        );
        assert_eq!(hook.judge(Some(&good), body), Verdict::Accepted);
    }

    #[test]
    fn signed_requests_beyond_the_burst_are_refused_and_bad_ones_do_not_count() {
        let hook = Hook::new(b"k".to_vec());
        let good = sign(b"k", b"x");
        for _ in 0..50 {
            assert_eq!(hook.judge(Some("sha256=ff"), b"x"), Verdict::Unauthorized);
        }
        for _ in 0..BURST {
            assert_eq!(hook.judge(Some(&good), b"x"), Verdict::Accepted);
        }
        assert_eq!(hook.judge(Some(&good), b"x"), Verdict::TooMany);
    }
}
