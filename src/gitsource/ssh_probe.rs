//! Why an SSH fetch failed, in ssh's own words. gitoxide runs `ssh` as git does, but
//! reads only the stderr lines it knows ("Permission denied", "connect to host") as the
//! error; anything else, the host-key refusal included, goes to the operator's stderr
//! and the fetch error says only "Transport handshake failed: ... failed to fill whole
//! buffer". For whoever is on call that hides the one fact that matters, so after a
//! failed SSH handshake the fetcher runs the same `ssh` once more, as git would (the
//! read-only `git-upload-pack`, stdin closed), captures its stderr and appends ssh's
//! last words to the error on `/status` (`...; ssh: Host key verification failed.`).
//!
//! Bounds: one probe per failed fetch (so at most one per `--git-interval`), killed after
//! [`PROBE_TIMEOUT`]; at most [`MAX_STDERR`] bytes read, the rest drained; the text kept
//! is [`MAX_SAID`] characters of printable text. ssh prints no key material on stderr,
//! and HTTPS tokens never reach this path.

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
    if host.starts_with('-') || path.contains('\'') {
        return None;
    }
    let target = match url.user() {
        Some(user) if !user.starts_with('-') => format!("{user}@{host}"),
        Some(_) => return None,
        None => host.to_string(),
    };
    // BatchMode: never a prompt on a terminal (the first value of an option wins, so a
    // `--git-ssh-key` command's own options stand).
    let mut args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
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

/// Runs `cmd` for at most [`PROBE_TIMEOUT`]; what it wrote on stderr (capped).
fn run(mut cmd: Command) -> Option<Vec<u8>> {
    let mut child = cmd.spawn().ok()?;
    let mut stderr = child.stderr.take()?;
    let reader = std::thread::Builder::new()
        .name("ssh probe stderr".into())
        .spawn(move || {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(MAX_STDERR).read_to_end(&mut buf);
            let _ = std::io::copy(&mut stderr, &mut std::io::sink());
            buf
        })
        .ok();
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
    reader?.join().ok()
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
        .map(|c| if c.is_control() { ' ' } else { c })
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
        let url = gix::url::parse("ssh://h/it's.git").unwrap();
        assert_eq!(diagnose(&url, Some("false")), None);
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
