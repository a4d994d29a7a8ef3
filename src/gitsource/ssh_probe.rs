//! Why an SSH fetch failed, in ssh's own words. gitoxide runs `ssh` as git does, but
//! reads only the stderr lines it knows ("Permission denied", "connect to host") as the
//! error; anything else, the host-key refusal included, goes to the operator's stderr
//! and the fetch error says only "Transport handshake failed: ... failed to fill whole
//! buffer". For whoever is on call that hides the one fact that matters, so after a
//! failed SSH handshake the fetcher runs the same `ssh` once more, as git would (the
//! read-only `git-upload-pack`, stdin closed), captures its stderr and appends ssh's
//! last words to the error on `/status` (`...; ssh: Host key verification failed.`).
//!
//! Bounds: one probe per failed fetch (so at most one per `--git-interval`), none once
//! the fetch was abandoned, killed after [`PROBE_TIMEOUT`] (and not waited for longer,
//! whatever a `ProxyCommand` it started does); the last [`MAX_STDERR`] bytes kept (what a
//! server printed first cannot crowd out ssh's own last words); the text kept is
//! [`MAX_SAID`] characters of printable ASCII (no control, bidi or zero-width characters
//! reach `/status`). ssh prints no key material on stderr (`BatchMode`: no prompt), and
//! HTTPS tokens never reach this path. A path with `'` or `~` is not probed (git's own
//! quoting and home expansion are not repeated here).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The probe is killed after this long (its `ConnectTimeout` is shorter).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// Bytes of ssh's stderr read at most.
pub const MAX_STDERR: u64 = 16 << 10;
/// Characters of ssh's last words kept.
pub const MAX_SAID: usize = 300;

/// ssh's last words on connecting to `url` with `ssh_command` (`ssh` when `None`), or
/// `None` when the URL is not SSH, it cannot be probed safely, or ssh said nothing.
pub fn diagnose(url: &gix::url::Url, ssh_command: Option<&str>) -> Option<String> {
    if url.scheme != gix::url::Scheme::Ssh {
        return None;
    }
    let host = url.host()?;
    let path = url.path.to_string();
    if host.starts_with('-') || path.contains(['\'', '~']) {
        return None;
    }
    let target = match url.user() {
        Some(user) if !user.starts_with('-') => format!("{user}@{host}"),
        Some(_) => return None,
        None => host.to_string(),
    };
    // BatchMode: never a prompt on a terminal; LogLevel=ERROR: no "Permanently added"
    // noise (the first value of an option wins, so a `--git-ssh-key` command's own
    // options stand).
    let mut args = [
        "-o",
        "BatchMode=yes",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=10",
    ]
    .map(String::from)
    .to_vec();
    if let Some(port) = url.port {
        args.extend(["-p".to_string(), port.to_string()]);
    }
    args.extend([
        "--".to_string(),
        target,
        format!("git-upload-pack '{path}'"),
    ]);
    let script = format!("exec {} \"$@\"", ssh_command.unwrap_or("ssh"));
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).arg("sh").args(args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    last_words(&run(cmd)?)
}

/// Runs `cmd` for at most [`PROBE_TIMEOUT`]; the end of what it wrote on stderr.
fn run(mut cmd: Command) -> Option<Vec<u8>> {
    let mut child = cmd.spawn().ok()?;
    let stderr = child.stderr.take()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("ssh probe stderr".into())
        .spawn(move || {
            let _ = tx.send(tail(stderr));
        })
        .ok()?;
    let deadline = Instant::now() + PROBE_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
        }
    }
    // A grandchild (a ProxyCommand) may hold the pipe open after the kill: not waited for.
    rx.recv_timeout(Duration::from_secs(1)).ok()
}

/// The last [`MAX_STDERR`] bytes `r` gives until it ends (the buffer is cut back only
/// when it holds twice that, so a long stream is not moved chunk by chunk).
fn tail(mut r: impl Read) -> Vec<u8> {
    let cap = usize::try_from(MAX_STDERR).unwrap_or(usize::MAX);
    let mut kept: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match r.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                kept.extend_from_slice(&chunk[..n]);
                if kept.len() > 2 * cap {
                    kept.drain(..kept.len() - cap);
                }
            }
        }
    }
    if kept.len() > cap {
        kept.drain(..kept.len() - cap);
    }
    kept
}

/// The last two lines of `stderr` that say something (not ssh's `@@@` banner), printable
/// characters only, at most [`MAX_SAID`] of them; `None` when there are none.
pub fn last_words(stderr: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('@'))
        .collect();
    let said = lines[lines.len().saturating_sub(2)..].join(" ");
    let said: String = said
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { ' ' })
        .take(MAX_SAID)
        .collect();
    (!said.is_empty()).then_some(said)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_key_refusal_is_ssh_s_last_two_lines() {
        let stderr = b"@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n\
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\n\
Offending ED25519 key in /tmp/known_hosts:1\n\
Host key for [127.0.0.1]:39159 has changed and you have requested strict checking.\n\
Host key verification failed.\n";
        assert_eq!(
            last_words(stderr).as_deref(),
            Some(
                "Host key for [127.0.0.1]:39159 has changed and you have requested strict checking. Host key verification failed."
            )
        );
    }

    #[test]
    fn nothing_said_is_none_and_what_is_said_is_bounded() {
        assert_eq!(last_words(b""), None);
        assert_eq!(last_words(b"\n  \n@@@@\n"), None);
        let long = format!("{}\x1b[31m\n", "x".repeat(1000));
        let said = last_words(long.as_bytes()).unwrap();
        assert_eq!(said.chars().count(), MAX_SAID);
        assert!(!said.contains('\x1b'));
    }

    #[test]
    fn only_ssh_urls_are_probed_and_never_with_an_option_for_a_host() {
        for url in [
            "https://example.com/r.git",
            "file:///tmp/r.git",
            "git://h/r.git",
        ] {
            let url = gix::url::parse(url).unwrap();
            assert_eq!(diagnose(&url, None), None, "{url:?}");
        }
        // A command that prints its arguments: what would be probed is probed...
        let echo = Some("printf '%s|' >&2");
        let url = gix::url::parse("ssh://git@h:2222/srv/r.git").unwrap();
        assert_eq!(
            diagnose(&url, echo).as_deref(),
            Some(
                "-o|BatchMode=yes|-o|LogLevel=ERROR|-o|ConnectTimeout=10|-p|2222|--|git@h|git-upload-pack '/srv/r.git'|"
            )
        );
        // ... and a path git would quote or expand otherwise is not.
        for url in ["ssh://h/it's.git", "ssh://h/~/r.git", "git@h:~/r.git"] {
            let url = gix::url::parse(url).unwrap();
            assert_eq!(diagnose(&url, echo), None, "{url:?}");
        }
    }

    #[test]
    fn the_end_of_stderr_is_kept_and_only_printable_ascii() {
        let mut long = vec![b'x'; 3 * MAX_STDERR as usize];
        long.extend_from_slice(b"\nHost key verification failed.\n");
        let kept = tail(long.as_slice());
        assert_eq!(kept.len() as u64, MAX_STDERR);
        assert!(kept.ends_with(b"failed.\n"));
        assert_eq!(
            last_words("a\u{202e}b\u{200b}c".as_bytes()).as_deref(),
            Some("a b c")
        );
    }

    #[test]
    fn a_refused_connection_is_reported_in_ssh_s_words() {
        // A port nothing listens on: ssh itself says so.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = gix::url::parse(format!("ssh://127.0.0.1:{port}/r.git").as_str()).unwrap();
        let said = diagnose(&url, Some("ssh -F /dev/null"))
            .expect("ssh said nothing: is the ssh client installed? (.ci/run installs it)");
        assert!(said.contains("Connection refused"), "{said}");
    }
}
