//! Rules from git (`run --rules-git`, issue 46) against real parts: Debian's `git
//! daemon` on 127.0.0.1 serves a bare rules repository, commits are made and signed by
//! the real `git` (`gpg.format=ssh`, `ssh-keygen -Y sign`, keys made here), and the
//! operator runs on the local control plane. Pushing a template change updates the
//! children; an invalid rule, an unsigned commit and a commit signed by another key
//! leave the last good commit serving (its children unchanged) and `/status` says which
//! commit failed and why; a killed git server is a fetch error until it returns. The
//! push hook (`POST /hooks/git`) triggers every fetch (the interval is an hour), so
//! commit → children latency is measured over several commits and printed.
//!
//! The transports with credentials, each against a real server on 127.0.0.1:
//! - SSH with a deploy key: Debian's `sshd` (openssh-server; `.ci/run` installs it when it
//!   is missing) started by the test on a free port with a config, host key and
//!   authorized_keys of its own; the operator's `ssh` pins the host key
//!   (`--git-ssh-known-hosts`), and a foreign host key is a fetch error;
//! - HTTPS with a token from a file: `git http-backend` behind tests/git_http/serve.py
//!   (TLS with a certificate made here, trusted by the operator through `SSL_CERT_FILE`),
//!   which checks the token; a wrong token is a fetch error while the live commit keeps
//!   serving, and the right one (the file rewritten: read at each fetch) loads again.
//!
//! And a restart: the operator started again on the same `--git-cache-dir` while the
//! ref's head is invalid serves the last good commit (`refs/rulebook/live`).
// A scenario test reads top to bottom as one story (the function size limit is for the
// product code).
#![allow(clippy::too_many_lines)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::reload::*;
use common::*;
use hmac::{KeyInit, Mac};
use kube::api::{Api, DynamicObject};
use serde_json::Value as Json;

const T: Duration = Duration::from_secs(60);
const KIND: &str = "GitSourced";
const SECRET: &str = "hook-secret-for-the-test";

/// Runs `git` in `dir` with a config of the test's own (no user or system config).
fn git(home: &Path, dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .current_dir(dir)
        .env("HOME", home)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "Tester")
        .env("GIT_AUTHOR_EMAIL", "tester@example.com")
        .env("GIT_COMMITTER_NAME", "Tester")
        .env("GIT_COMMITTER_EMAIL", "tester@example.com")
        .args(args)
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn keygen(path: &Path) -> String {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "test", "-f"])
        .arg(path)
        .output()
        .expect("ssh-keygen runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(path.with_extension("pub")).unwrap()
}

/// `git daemon` serving `base` on 127.0.0.1:`port`, pushes allowed; killed when dropped.
struct Daemon(Child);

impl Daemon {
    fn start(base: &Path, port: u16) -> Daemon {
        // `git-daemon` itself: `git daemon` runs it as a child, which a kill would leave
        // serving.
        let exec_path = git(base, base, &["--exec-path"]);
        let child = Command::new(Path::new(&exec_path).join("git-daemon"))
            .args(["--reuseaddr", "--export-all", "--enable=receive-pack"])
            .arg("--listen=127.0.0.1")
            .arg(format!("--port={port}"))
            .arg(format!("--base-path={}", base.display()))
            .arg(base)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("git daemon runs");
        let d = Daemon(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "git daemon does not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The work tree and how it commits and pushes.
struct Repo {
    home: PathBuf,
    work: PathBuf,
    url: String,
}

impl Repo {
    /// Commits everything, signed with `key` (or unsigned), pushes to `main`; the commit.
    fn commit(&self, message: &str, key: Option<&Path>) -> String {
        git(&self.home, &self.work, &["add", "-A"]);
        let mut args = vec!["-c".to_string(), "gpg.format=ssh".to_string()];
        match key {
            Some(k) => {
                args.extend(["-c".into(), format!("user.signingkey={}", k.display())]);
                args.extend(["commit", "-q", "-S", "-m", message].map(String::from));
            }
            None => args.extend(["commit", "-q", "--no-gpg-sign", "-m", message].map(String::from)),
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        git(&self.home, &self.work, &args);
        git(
            &self.home,
            &self.work,
            &["push", "-q", &self.url, "HEAD:refs/heads/main"],
        );
        git(&self.home, &self.work, &["rev-parse", "HEAD"])
    }
}

/// POSTs the push hook; the status code.
async fn hook(port: u16, signature: Option<&str>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = r#"{"ref":"refs/heads/main"}"#;
    let sig = signature
        .map(|s| format!("X-Hub-Signature-256: {s}\r\n"))
        .unwrap_or_default();
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let req = format!(
        "POST /hooks/git HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{sig}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A signed hook; over the hook's rate (429), again a little later.
async fn trigger(op: &Operator) {
    let body = r#"{"ref":"refs/heads/main"}"#;
    for _ in 0..30 {
        match hook(op.metrics_port, Some(&signed(body))).await {
            202 => return,
            429 => tokio::time::sleep(Duration::from_millis(500)).await,
            code => panic!("the hook answered {code}"),
        }
    }
    panic!("the hook kept answering 429");
}

fn signed(body: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

async fn git_status(op: &Operator) -> Json {
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap();
    s["git"].clone()
}

async fn marker(cms: &Api<DynamicObject>, name: &str) -> Option<String> {
    let o = cms.get_opt(name).await.ok().flatten()?;
    to_json(&o)["data"]["marker"].as_str().map(str::to_string)
}

/// Waits until `/status` names `commit` as failed; its entry.
async fn wait_failed(op: &Operator, commit: &str) -> Json {
    wait_for(T, &format!("commit {commit} to be refused"), || async {
        let g = git_status(op).await;
        (g["failedCommit"]["commit"] == commit).then(|| g["failedCommit"].clone())
    })
    .await
}

/// A temporary directory with `home` (git's HOME), `srv` (holding the bare repository
/// `rules.git`) and `work`, as every test here starts.
fn bare_repo() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let dir = tempfile::tempdir().unwrap();
    let (home, base, work) = (
        dir.path().join("home"),
        dir.path().join("srv"),
        dir.path().join("work"),
    );
    for d in [&home, &base, &work] {
        std::fs::create_dir_all(d).unwrap();
    }
    git(&home, &base, &["init", "-q", "--bare", "rules.git"]);
    (dir, home, base, work)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_from_a_git_server() {
    let client = client().await;
    let ns = namespace(&client, "gitsrc").await;
    let (dir, home, base, work) = bare_repo();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut daemon = Some(Daemon::start(&base, port));
    let url = format!("git://127.0.0.1:{port}/rules.git");
    git(&home, &work, &["init", "-q", "-b", "main"]);
    let repo = Repo {
        home: home.clone(),
        work: work.clone(),
        url: url.clone(),
    };

    // Keys: the allowed signer and a stranger.
    let (key, other) = (dir.path().join("signer"), dir.path().join("stranger"));
    let allowed = dir.path().join("allowed_signers");
    std::fs::write(&allowed, format!("tester@example.com {}", keygen(&key))).unwrap();
    keygen(&other);
    let secret = dir.path().join("hook-secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();

    let (rules, templates) = (work.join("rules"), work.join("templates"));
    write_rule(&rules, &templates, KIND, "v1");
    std::fs::write(work.join("README.md"), "rules\n").unwrap();
    let first = repo.commit("v1", Some(&key));

    let unused = dir.path().join("unused");
    let op = Operator::on(&unused, &unused)
        .namespace(&ns)
        .flags(&[
            "--install-crds",
            "--rules-git",
            &url,
            "--git-interval",
            "1h",
            "--git-verify",
            allowed.to_str().unwrap(),
            "--git-hook-secret-file",
            secret.to_str().unwrap(),
            "--git-cache-dir",
            dir.path().join("cache").to_str().unwrap(),
        ])
        .start()
        .await;
    let parents = parents_api(&client, &ns, KIND).await;
    apply(&parents, parent(KIND, &ns, "app")).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    wait_for(T, "the child of commit v1", || async {
        (marker(&cms, "app").await.as_deref() == Some("v1")).then_some(())
    })
    .await;
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], first.as_str(), "{g}");
    assert_eq!(g["liveSigner"], "tester@example.com", "{g}");
    assert_eq!(g["url"], url.as_str(), "{g}");
    assert_eq!(g["ref"], "main", "{g}");
    let series =
        format!("rulebook_git_commit_info{{url=\"{url}\",reference=\"main\",commit=\"{first}\"}}");
    assert_eq!(op.metric(&series).await, 1.0);

    // The hook: unsigned or wrongly signed requests are refused and fetch nothing.
    let fetched_at = git_status(&op).await["lastFetch"].clone();
    assert_eq!(hook(op.metrics_port, None).await, 401);
    assert_eq!(hook(op.metrics_port, Some("sha256=00ff")).await, 401);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        git_status(&op).await["lastFetch"],
        fetched_at,
        "a refused hook fetched"
    );

    // Template changes, each pushed and announced: commit → children latency.
    let mut took = Vec::new();
    let mut live = first.clone();
    for i in 2..=6 {
        write_template(&templates, KIND, &format!("v{i}"));
        let start = Instant::now();
        live = repo.commit(&format!("v{i}"), Some(&key));
        trigger(&op).await;
        let want = format!("v{i}");
        loop {
            if marker(&cms, "app").await.as_deref() == Some(want.as_str()) {
                break;
            }
            assert!(start.elapsed() < T, "the child of commit v{i}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        took.push(start.elapsed());
    }
    assert_eq!(git_status(&op).await["liveCommit"], live.as_str());
    took.sort();
    println!(
        "commit → children (push, hook, fetch, load, reconcile), {} commits: median {:.0} ms, min {:.0} ms, max {:.0} ms",
        took.len(),
        took[took.len() / 2].as_secs_f64() * 1e3,
        took[0].as_secs_f64() * 1e3,
        took[took.len() - 1].as_secs_f64() * 1e3
    );

    // An invalid rule (signed): refused with file:line, the last good commit serves.
    let rule_file = rules.join(format!("{}.yaml", KIND.to_lowercase()));
    let good_rule = std::fs::read_to_string(&rule_file).unwrap();
    std::fs::write(
        &rule_file,
        good_rule.replace(&format!("kind: {KIND}"), "kind: lowercase"),
    )
    .unwrap();
    write_template(&templates, KIND, "invalid");
    let bad = repo.commit("an invalid rule", Some(&key));
    trigger(&op).await;
    let failed = wait_failed(&op, &bad).await;
    assert_eq!(failed["reason"], "invalid", "{failed}");
    let errors = failed["errors"].to_string();
    let line = good_rule
        .lines()
        .position(|l| l.contains(&format!("kind: {KIND}")))
        .unwrap()
        + 1;
    assert!(
        errors.contains(&format!("rules/{}.yaml:{line}:", KIND.to_lowercase())),
        "file:line of the bad kind (line {line}): {errors}"
    );
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap();
    assert_eq!(s["ruleset"]["valid"], false, "{s}");
    assert_eq!(s["git"]["liveCommit"], live.as_str(), "{s}");
    std::fs::write(&rule_file, &good_rule).unwrap();

    // Unsigned, then signed by a stranger: refused, children unchanged, logged.
    write_template(&templates, KIND, "unsigned");
    let unsigned = repo.commit("unsigned", None);
    trigger(&op).await;
    let failed = wait_failed(&op, &unsigned).await;
    assert_eq!(failed["reason"], "signature", "{failed}");
    assert!(
        failed["errors"].to_string().contains("not signed"),
        "{failed}"
    );
    write_template(&templates, KIND, "stranger");
    let foreign = repo.commit("signed by a stranger", Some(&other));
    trigger(&op).await;
    let failed = wait_failed(&op, &foreign).await;
    assert!(
        failed["errors"].to_string().contains("not allowed"),
        "{failed}"
    );
    assert_eq!(marker(&cms, "app").await.as_deref(), Some("v6"));
    assert_eq!(git_status(&op).await["liveCommit"], live.as_str());
    let log = op.log_tail();
    assert!(
        log.contains(&format!(
            "commit {} refused by --git-verify",
            &unsigned[..12]
        )),
        "{log}"
    );

    // The git server goes away: a fetch error, the live commit keeps serving; it returns.
    daemon.take();
    trigger(&op).await;
    let g = wait_for(T, "the fetch error", || async {
        let g = git_status(&op).await;
        g["lastFetchError"].is_string().then_some(g)
    })
    .await;
    assert_eq!(g["liveCommit"], live.as_str(), "{g}");
    assert_eq!(op.metric("rulebook_git_fetch_ok").await, 0.0);
    let _daemon = Daemon::start(&base, port);
    write_template(&templates, KIND, "back");
    let back = repo.commit("back", Some(&key));
    trigger(&op).await;
    wait_for(T, "the child of the commit after the outage", || async {
        (marker(&cms, "app").await.as_deref() == Some("back")).then_some(())
    })
    .await;
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], back.as_str(), "{g}");
    assert!(g["lastFetchError"].is_null(), "{g}");
    assert!(g["failedCommit"].is_null(), "{g}");
}

/// A bare repository `srv/rules.git` and a work tree that commits and pushes to it by
/// path (the operator alone goes through the server under test).
struct Scratch {
    dir: tempfile::TempDir,
    base: PathBuf,
    repo: Repo,
}

impl Scratch {
    fn new() -> Scratch {
        let (dir, home, base, work) = bare_repo();
        git(&home, &work, &["init", "-q", "-b", "main"]);
        let url = base.join("rules.git").display().to_string();
        Scratch {
            dir,
            base,
            repo: Repo { home, work, url },
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn rules(&self) -> PathBuf {
        self.repo.work.join("rules")
    }

    fn templates(&self) -> PathBuf {
        self.repo.work.join("templates")
    }

    /// The operator on `url` with `flags`, fetching every second, in `ns`.
    async fn operator(&self, ns: &str, url: &str, flags: &[&str]) -> Operator {
        self.operator_with(ns, url, flags, None).await
    }

    /// [`Scratch::operator`], trusting the CA certificates in `ca` (`SSL_CERT_FILE`, which
    /// rustls's platform verifier reads on Linux) when given.
    async fn operator_with(
        &self,
        ns: &str,
        url: &str,
        flags: &[&str],
        ca: Option<&Path>,
    ) -> Operator {
        let unused = self.path("unused");
        let cache = self.path("cache");
        let mut all = vec![
            "--install-crds",
            "--rules-git",
            url,
            "--git-interval",
            "1s",
            "--git-cache-dir",
            cache.to_str().unwrap(),
        ];
        all.extend_from_slice(flags);
        let mut b = Operator::on(&unused, &unused).namespace(ns).flags(&all);
        if let Some(ca) = ca {
            b = b.env("SSL_CERT_FILE", ca.to_str().unwrap());
        }
        b.start().await
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until the child `app` carries `want`.
async fn wait_marker(cms: &Api<DynamicObject>, want: &str) {
    wait_for(T, &format!("the child to say {want}"), || async {
        (marker(cms, "app").await.as_deref() == Some(want)).then_some(())
    })
    .await;
}

/// Waits until `/status` reports a fetch error; the git object.
async fn wait_fetch_error(op: &Operator) -> Json {
    wait_for(T, "a fetch error on /status", || async {
        let g = git_status(op).await;
        g["lastFetchError"].is_string().then_some(g)
    })
    .await
}

/// Waits until a fetch that started after this call has ended; the git object. Fetches
/// run one at a time and `lastFetch` is stamped when one ends: the first change may be a
/// fetch already under way, the second is one that started after.
async fn wait_next_fetch(op: &Operator) -> Json {
    let mut g = git_status(op).await;
    for _ in 0..2 {
        let before = g["lastFetch"].clone();
        g = wait_for(T, "the next fetch", || async {
            let g = git_status(op).await;
            (g["lastFetch"] != before).then_some(g)
        })
        .await;
    }
    g
}

/// Debian's `sshd` on 127.0.0.1:`port` with a config of its own (host key, authorized
/// keys and log in `dir`); killed when dropped.
struct Sshd {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Sshd {
    fn start(dir: &Path, authorized: &str) -> Sshd {
        let sshd = ["/usr/sbin/sshd", "/usr/bin/sshd"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.exists())
            .expect("sshd is not installed (apt-get install openssh-server; .ci/run does)");
        // The privilege separation directory sshd insists on.
        std::fs::create_dir_all("/run/sshd").expect("create /run/sshd");
        keygen(&dir.join("host_key"));
        std::fs::write(dir.join("authorized_keys"), authorized).unwrap();
        let port = free_port();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\n\
                 AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nPidFile none\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let log = dir.join("sshd.log");
        let child = Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("sshd runs");
        let d = Sshd { child, port, log };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "sshd does not listen: {}",
                std::fs::read_to_string(&d.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// A known_hosts line pinning this server's host key.
    fn known_host(&self, host_key_pub: &str) -> String {
        let key: Vec<&str> = host_key_pub.split_whitespace().take(2).collect();
        format!("[127.0.0.1]:{} {}\n", self.port, key.join(" "))
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The user the test runs as (sshd logs it in with the deploy key).
fn user() -> String {
    let out = Command::new("id").arg("-un").output().expect("id runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// SSH with a deploy key: the operator runs `ssh` with `--git-ssh-key` against a real
/// sshd, pinning its host key; a template change pushed loads; a host key that does not
/// match the pin is a fetch error (the live commit keeps serving) until it matches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_over_ssh_with_a_deploy_key() {
    const KIND: &str = "GitOverSsh";
    let client = client().await;
    let ns = namespace(&client, "gitssh").await;
    let s = Scratch::new();
    let sshd_dir = s.path("sshd");
    std::fs::create_dir_all(&sshd_dir).unwrap();
    let deploy_key = s.path("deploy_key");
    let sshd = Sshd::start(&sshd_dir, &keygen(&deploy_key));
    let known_hosts = s.path("known_hosts");
    let host_pub = std::fs::read_to_string(sshd_dir.join("host_key.pub")).unwrap();
    std::fs::write(&known_hosts, sshd.known_host(&host_pub)).unwrap();

    write_rule(&s.rules(), &s.templates(), KIND, "v1");
    let first = s.repo.commit("v1", None);
    let url = format!(
        "ssh://{}@127.0.0.1:{}{}",
        user(),
        sshd.port,
        s.base.join("rules.git").display()
    );
    let op = s
        .operator(
            &ns,
            &url,
            &[
                "--git-ssh-key",
                deploy_key.to_str().unwrap(),
                "--git-ssh-known-hosts",
                known_hosts.to_str().unwrap(),
            ],
        )
        .await;
    let parents = parents_api(&client, &ns, KIND).await;
    apply(&parents, parent(KIND, &ns, "app")).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    wait_marker(&cms, "v1").await;
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], first.as_str(), "{g}");
    assert_eq!(
        g["url"],
        format!(
            "ssh://127.0.0.1:{}{}",
            sshd.port,
            s.base.join("rules.git").display()
        ),
        "{g}"
    );
    let sshd_log = std::fs::read_to_string(&sshd.log).unwrap();
    assert!(sshd_log.contains("Accepted publickey for"), "{sshd_log}");

    write_template(&s.templates(), KIND, "v2");
    let second = s.repo.commit("v2", None);
    wait_marker(&cms, "v2").await;
    assert_eq!(git_status(&op).await["liveCommit"], second.as_str());

    // Another host key than the pinned one: ssh refuses to connect.
    let stranger = s.path("stranger_host");
    let stranger_pub = keygen(&stranger);
    std::fs::write(&known_hosts, sshd.known_host(&stranger_pub)).unwrap();
    // gitoxide's error names the handshake; the operator adds ssh's own last words.
    // The refusal is awaited before v3 is pushed: a fetch whose handshake ran before the
    // pin changed could still list a ref pushed during it (seen in CI).
    let g = wait_fetch_error(&op).await;
    assert!(
        g["lastFetchError"]
            .as_str()
            .is_some_and(|e| e.contains("handshake")
                && e.contains("; ssh: Host key for [127.0.0.1]:")
                && e.ends_with("Host key verification failed.")),
        "{g}"
    );
    write_template(&s.templates(), KIND, "v3");
    let third = s.repo.commit("v3", None);
    let g = wait_next_fetch(&op).await;
    assert!(g["lastFetchError"].is_string(), "{g}");
    assert_eq!(g["liveCommit"], second.as_str(), "{g}");
    assert_eq!(marker(&cms, "app").await.as_deref(), Some("v2"));
    std::fs::write(&known_hosts, sshd.known_host(&host_pub)).unwrap();
    wait_marker(&cms, "v3").await;
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], third.as_str(), "{g}");
}

/// `git http-backend` behind tests/git_http/serve.py on 127.0.0.1:`port`, letting through
/// requests whose Basic password is the token in `token_file`; killed when dropped.
struct HttpGit(Child);

impl HttpGit {
    fn start(root: &Path, token_file: &Path, port: u16, cert: &Path, key: &Path) -> HttpGit {
        use std::io::BufRead;
        let mut child = Command::new("python3")
            .arg(repo().join("tests/git_http/serve.py"))
            .arg(port.to_string())
            .arg(root)
            .arg(token_file)
            .arg(cert)
            .arg(key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(root.join("serve.log")).unwrap())
            .spawn()
            .expect("python3 runs");
        let mut line = String::new();
        let stdout = child.stdout.take().unwrap();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line.trim(),
            "listening",
            "tests/git_http/serve.py did not start"
        );
        HttpGit(child)
    }
}

impl Drop for HttpGit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// HTTPS with a token from a file: the right token loads; a wrong one (the file rewritten)
/// is a fetch error on `/status` while the live commit keeps serving, and the token
/// shows nowhere; the right one again loads the newer commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_over_http_with_a_token_file() {
    const KIND: &str = "GitOverHttp";
    const TOKEN: &str = "tok-right-7f3a9c";
    const WRONG: &str = "tok-wrong-1b2c3d";
    let client = client().await;
    let ns = namespace(&client, "githttp").await;
    let s = Scratch::new();
    let server_token = s.path("server-token");
    std::fs::write(&server_token, TOKEN).unwrap();
    let port = free_port();
    // A self-signed certificate for 127.0.0.1, which the operator trusts (SSL_CERT_FILE).
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (cert_pem, key_pem) = (s.path("tls.crt"), s.path("tls.key"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.signing_key.serialize_pem()).unwrap();
    let _server = HttpGit::start(&s.base, &server_token, port, &cert_pem, &key_pem);
    let token_file = s.path("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();

    write_rule(&s.rules(), &s.templates(), KIND, "v1");
    let first = s.repo.commit("v1", None);
    let url = format!("https://127.0.0.1:{port}/rules.git");
    let op = s
        .operator_with(
            &ns,
            &url,
            &["--git-token-file", token_file.to_str().unwrap()],
            Some(&cert_pem),
        )
        .await;
    let parents = parents_api(&client, &ns, KIND).await;
    apply(&parents, parent(KIND, &ns, "app")).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    wait_marker(&cms, "v1").await;
    assert_eq!(git_status(&op).await["liveCommit"], first.as_str());

    std::fs::write(&token_file, WRONG).unwrap();
    // The refusal is awaited before v2 is pushed (a fetch that read the token before the
    // change could list a ref pushed during it); then a fetch after the push fails too.
    wait_fetch_error(&op).await;
    write_template(&s.templates(), KIND, "v2");
    let second = s.repo.commit("v2", None);
    let g = wait_next_fetch(&op).await;
    assert!(g["lastFetchError"].is_string(), "{g}");
    assert_eq!(g["liveCommit"], first.as_str(), "{g}");
    assert_eq!(marker(&cms, "app").await.as_deref(), Some("v1"));
    assert_eq!(op.metric("rulebook_git_fetch_ok").await, 0.0);
    let everything = format!(
        "{}{}{}",
        op.get("/status").await,
        op.get("/metrics").await,
        std::fs::read_to_string(&op.log).unwrap()
    );
    for t in [TOKEN, WRONG] {
        assert!(!everything.contains(t), "the token {t} leaked");
    }

    std::fs::write(&token_file, TOKEN).unwrap();
    wait_marker(&cms, "v2").await;
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], second.as_str(), "{g}");
    assert!(g["lastFetchError"].is_null(), "{g}");
}

/// A restart while the ref's head is invalid: the operator started again on the same
/// `--git-cache-dir` serves the last good commit (remembered as `refs/rulebook/live` in
/// its local repository) before its first fetch, then refuses the invalid head; `/status`
/// names both, and a deleted child comes back from the last good commit's rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_good_commit_serves_after_a_restart() {
    const KIND: &str = "GitRestarted";
    let client = client().await;
    let ns = namespace(&client, "gitrestart").await;
    let s = Scratch::new();
    write_rule(&s.rules(), &s.templates(), KIND, "good");
    let good = s.repo.commit("good", None);
    let url = format!("file://{}", s.base.join("rules.git").display());
    let op = s.operator(&ns, &url, &[]).await;
    let parents = parents_api(&client, &ns, KIND).await;
    apply(&parents, parent(KIND, &ns, "app")).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    wait_marker(&cms, "good").await;
    drop(op);

    // The head becomes invalid while no operator runs.
    let rule_file = s.rules().join(format!("{}.yaml", KIND.to_lowercase()));
    let rule = std::fs::read_to_string(&rule_file).unwrap();
    std::fs::write(
        &rule_file,
        rule.replace(&format!("kind: {KIND}"), "kind: lowercase"),
    )
    .unwrap();
    write_template(&s.templates(), KIND, "bad");
    let bad = s.repo.commit("an invalid rule", None);

    let op = s.operator(&ns, &url, &[]).await;
    let g = wait_failed(&op, &bad).await;
    assert_eq!(g["reason"], "invalid", "{g}");
    let g = git_status(&op).await;
    assert_eq!(g["liveCommit"], good.as_str(), "{g}");
    assert!(
        op.log_tail().contains("resuming with the last good commit"),
        "{}",
        op.log_tail()
    );
    // The last good commit's rules serve: a deleted child comes back from them.
    let uid = cms.get("app").await.unwrap().metadata.uid;
    cms.delete("app", &Default::default()).await.unwrap();
    wait_for(T, "the child to be made again", || async {
        let o = cms.get_opt("app").await.ok().flatten()?;
        (o.metadata.uid != uid && to_json(&o)["data"]["marker"] == "good").then_some(())
    })
    .await;
    assert_eq!(git_status(&op).await["liveCommit"], good.as_str());
}
