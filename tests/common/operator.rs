//! The operator under test: a `rulebook run` child process, started by one builder
//! ("start an operator on these rules with these flags", [`Operator::on`]) that every
//! cluster test uses, read through its HTTP endpoint (`/healthz`, `/status`, `/metrics`)
//! and its log, signalled, and killed when dropped.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{http_get, kubeconfig_path, parse_metric, unique, wait_for};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The operator's `RUST_LOG` unless `RULEBOOK_TEST_LOG` says otherwise: the leader
/// election's debug lines tell a test when a standby has looked at the Lease
/// ([`Operator::wait_standing_by`]).
pub const DEFAULT_LOG: &str = "info,kube=warn,rulebook::leader=debug";

/// A `rulebook run` process, killed when dropped.
pub struct Operator {
    child: Option<Child>,
    pub metrics_port: u16,
    pub log: PathBuf,
}

/// What to start: `rulebook run` on a rule directory, with flags. Built by
/// [`Operator::on`] (or `RuleDir::operator`), started by [`OperatorBuilder::start`]:
///
/// ```ignore
/// let op = d.operator().namespace(&ns).flags(&["--install-crds"]).start().await;
/// ```
///
/// (that one, the most common, is `RuleDir::start_in(&ns)`).
pub struct OperatorBuilder {
    rules: PathBuf,
    templates: PathBuf,
    namespace: Option<String>,
    flags: Vec<String>,
    kubeconfig: PathBuf,
    rust_log: String,
    cgroup_procs: Option<PathBuf>,
    env: Vec<(String, String)>,
}

impl OperatorBuilder {
    /// Watches namespace `ns` only (`--namespace`); without it, every namespace.
    pub fn namespace(mut self, ns: &str) -> OperatorBuilder {
        self.namespace = Some(ns.to_string());
        self
    }

    /// Like [`OperatorBuilder::namespace`], for a test that decides at run time.
    pub fn namespace_opt(mut self, ns: Option<&str>) -> OperatorBuilder {
        self.namespace = ns.map(str::to_string);
        self
    }

    /// Further arguments of `rulebook run` (e.g. `--install-crds`).
    pub fn flags<S: AsRef<str>>(mut self, flags: &[S]) -> OperatorBuilder {
        self.flags
            .extend(flags.iter().map(|f| f.as_ref().to_string()));
        self
    }

    /// Runs as another identity: this kubeconfig instead of the admin's.
    pub fn kubeconfig(mut self, kubeconfig: &Path) -> OperatorBuilder {
        self.kubeconfig = kubeconfig.to_path_buf();
        self
    }

    /// Logs as `rust_log` says (`RUST_LOG`) instead of [`DEFAULT_LOG`] or
    /// `RULEBOOK_TEST_LOG`.
    pub fn logging(mut self, rust_log: &str) -> OperatorBuilder {
        self.rust_log = rust_log.to_string();
        self
    }

    /// Sets an environment variable of the process (e.g. `SSL_CERT_FILE`).
    pub fn env(mut self, name: &str, value: &str) -> OperatorBuilder {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Places the process in the cgroup whose `cgroup.procs` is `procs` before it runs (a
    /// shell writes its own pid there, then execs the operator: the same pid, every byte
    /// the operator allocates charged to the cgroup).
    pub fn in_cgroup(mut self, procs: &Path) -> OperatorBuilder {
        self.cgroup_procs = Some(procs.to_path_buf());
        self
    }

    /// Starts the process and waits until it serves `/healthz`.
    pub async fn start(self) -> Operator {
        let mut cmd = match &self.cgroup_procs {
            None => Command::new(env!("CARGO_BIN_EXE_rulebook")),
            Some(procs) => {
                let mut cmd = Command::new("sh");
                cmd.arg("-c")
                    .arg(r#"echo $$ > "$0" && exec "$@""#)
                    .arg(procs)
                    .arg(env!("CARGO_BIN_EXE_rulebook"));
                cmd
            }
        };
        let metrics_port = free_port();
        let log = std::env::temp_dir().join(format!("{}.log", unique("rulebook-op")));
        let log_file = std::fs::File::create(&log).expect("log file");
        cmd.arg("run")
            .arg("--rules")
            .arg(&self.rules)
            .arg("--templates")
            .arg(&self.templates)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"));
        if let Some(ns) = &self.namespace {
            cmd.arg("--namespace").arg(ns);
        }
        cmd.args(&self.flags)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", &self.rust_log)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file);
        let child = cmd.spawn().expect("spawn rulebook run");
        let op = Operator {
            child: Some(child),
            metrics_port,
            log,
        };
        let url = format!("http://127.0.0.1:{metrics_port}/healthz");
        wait_for(
            Duration::from_secs(30),
            "the operator's /healthz",
            || async { http_get(&url).await.ok() },
        )
        .await;
        op
    }
}

impl Operator {
    /// The one way a test starts an operator: `rulebook run` on `rules`/`templates`, as
    /// the cluster's admin, every namespace, no further flags, until the builder's
    /// methods say otherwise.
    pub fn on(rules: &Path, templates: &Path) -> OperatorBuilder {
        OperatorBuilder {
            rules: rules.to_path_buf(),
            templates: templates.to_path_buf(),
            namespace: None,
            flags: Vec::new(),
            kubeconfig: kubeconfig_path(),
            rust_log: std::env::var("RULEBOOK_TEST_LOG").unwrap_or_else(|_| DEFAULT_LOG.into()),
            cgroup_procs: None,
            env: Vec::new(),
        }
    }

    /// Like [`Operator::get`], but `None` for an error status (e.g. `/readyz` answering
    /// 503 while the operator is still starting), for probes that wait.
    pub async fn get_opt(&self, path: &str) -> Option<String> {
        http_get(&format!("http://127.0.0.1:{}{path}", self.metrics_port))
            .await
            .ok()
    }

    pub async fn get(&self, path: &str) -> String {
        http_get(&format!("http://127.0.0.1:{}{path}", self.metrics_port))
            .await
            .unwrap_or_else(|e| {
                panic!("GET {path}: {e}\n--- operator log ---\n{}", self.log_tail())
            })
    }

    /// The value of one metric series, e.g. `rulebook_api_writes_total{rule="x",verb="apply"}`,
    /// or the sum of a family's series (`rulebook_reconciles_total`). Fails the test when
    /// `/metrics` has no such series: an absent series is not a 0 (a renamed metric or
    /// label gives one too), so `metric(..) == 0.0` holds only for a series that is there
    /// and counted nothing. [`Operator::metric_opt`] tells "absent" (`None`) apart.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.get("/metrics").await;
        parse_metric(&text, series).unwrap_or_else(|| {
            panic!("/metrics has no series {series} (a renamed metric or label?):\n{text}")
        })
    }

    /// Like [`Operator::metric`], but `None` when `/metrics` has no such series (a family
    /// without series is not listed at all, not even its `# TYPE`).
    pub async fn metric_opt(&self, series: &str) -> Option<f64> {
        parse_metric(&self.get("/metrics").await, series)
    }

    /// The values of `series`, read from one scrape of `/metrics` in which no reconcile of
    /// `rule` is in flight: a baseline that work under way cannot move later (a reconcile
    /// is counted after its status write, so one in flight when a bare [`Operator::metric`]
    /// reads would land in the window measured next). Fails the test when a series is
    /// absent.
    pub async fn metrics_when_idle<const N: usize>(
        &self,
        rule: &str,
        series: [&str; N],
    ) -> [f64; N] {
        let in_flight = format!("rulebook_reconciles_in_flight{{rule=\"{rule}\"}}");
        let text = wait_for(
            Duration::from_secs(60),
            &format!("no reconcile of {rule} in flight"),
            || async {
                let text = self.get("/metrics").await;
                (parse_metric(&text, &in_flight) == Some(0.0)).then_some(text)
            },
        )
        .await;
        series.map(|s| {
            parse_metric(&text, s).unwrap_or_else(|| {
                panic!("/metrics has no series {s} (a renamed metric or label?):\n{text}")
            })
        })
    }

    /// Waits until this operator, started with `--leader-elect`, has found the Lease held
    /// by another and stood by (its log says so; [`DEFAULT_LOG`] logs it) — instead of
    /// sleeping a while before checking that a standby does not lead.
    pub async fn wait_standing_by(&self, timeout: Duration) {
        wait_for(
            timeout,
            "the standby to look at the Lease and stand by",
            || async {
                std::fs::read_to_string(&self.log)
                    .ok()?
                    .contains("standing by: the lease is held")
                    .then_some(())
            },
        )
        .await;
    }

    pub fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends a signal (e.g. `TERM`, `KILL`) and waits for the process to exit.
    pub fn signal_and_wait(&mut self, signal: &str) -> std::process::ExitStatus {
        self.signal(signal);
        self.wait()
    }

    /// Sends a signal without waiting (see [`Operator::wait`]).
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status();
    }

    /// How the process ended, if it has (without waiting).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        child.wait().expect("wait")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- operator log ({}) ---\n{}",
                self.log.display(),
                self.log_tail()
            );
        }
    }
}
