//! The contenders as processes: start, readiness, their own write counters, and what
//! `/proc` says about them (CPU seconds, RSS).

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Which controller runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Rulebook,
    Reference,
    /// The reference with `--events`: the Events Rulebook writes, written by hand.
    ReferenceEvents,
    Kro,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Rulebook => "rulebook",
            Kind::Reference => "reference",
            Kind::ReferenceEvents => "reference-events",
            Kind::Kro => "kro",
        }
    }
    pub fn title(self) -> &'static str {
        match self {
            Kind::Rulebook => "Rulebook",
            Kind::Reference => "reference (kube-rs)",
            Kind::ReferenceEvents => "reference with Events (kube-rs)",
            Kind::Kro => "kro",
        }
    }
    pub fn parse(s: &str) -> Option<Kind> {
        match s.trim() {
            "rulebook" => Some(Kind::Rulebook),
            "reference" => Some(Kind::Reference),
            "reference-events" => Some(Kind::ReferenceEvents),
            "kro" => Some(Kind::Kro),
            _ => None,
        }
    }
    /// The user agent of the contender's requests (audit log filter).
    pub fn user_agent(self) -> &'static str {
        match self {
            Kind::Rulebook => "rulebook/",
            Kind::Reference | Kind::ReferenceEvents => "bench-reference/",
            Kind::Kro => "kro/",
        }
    }
    /// apiVersion of the parent kind this contender serves.
    pub fn parent_api_version(self) -> &'static str {
        match self {
            Kind::Kro => "kro.bench.rulebook.dev/v1",
            _ => "bench.rulebook.dev/v1",
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A running contender, killed when dropped.
pub struct Proc {
    pub kind: Kind,
    child: Option<Child>,
    pub pid: u32,
    pub metrics_url: String,
    pub ready_url: String,
    pub log: PathBuf,
}

pub struct Launch<'a> {
    pub kind: Kind,
    pub binary: &'a Path,
    pub kubeconfig: &'a Path,
    pub namespace: &'a str,
    pub concurrency: usize,
    pub rules: &'a Path,
    pub templates: &'a Path,
    pub log_dir: &'a Path,
    pub tag: &'a str,
}

impl Proc {
    pub fn start(l: &Launch<'_>) -> Result<Proc> {
        let port = free_port();
        let log = l.log_dir.join(format!("{}-{}.log", l.kind.name(), l.tag));
        let file = std::fs::File::create(&log)?;
        let mut cmd = Command::new(l.binary);
        let (metrics_url, ready_url);
        match l.kind {
            Kind::Rulebook => {
                cmd.arg("run")
                    .arg("--rules")
                    .arg(l.rules)
                    .arg("--templates")
                    .arg(l.templates)
                    .arg("--kubeconfig")
                    .arg(l.kubeconfig)
                    .arg("--namespace")
                    .arg(l.namespace)
                    .arg("--concurrency")
                    .arg(l.concurrency.to_string())
                    .arg("--metrics-addr")
                    .arg(format!("127.0.0.1:{port}"));
                metrics_url = format!("http://127.0.0.1:{port}/metrics");
                ready_url = format!("http://127.0.0.1:{port}/readyz");
            }
            Kind::Reference | Kind::ReferenceEvents => {
                if l.kind == Kind::ReferenceEvents {
                    cmd.arg("--events");
                }
                cmd.arg("--kubeconfig")
                    .arg(l.kubeconfig)
                    .arg("--namespace")
                    .arg(l.namespace)
                    .arg("--concurrency")
                    .arg(l.concurrency.to_string())
                    .arg("--requeue-seconds")
                    .arg("60")
                    .arg("--metrics-addr")
                    .arg(format!("127.0.0.1:{port}"));
                metrics_url = format!("http://127.0.0.1:{port}/metrics");
                ready_url = format!("http://127.0.0.1:{port}/readyz");
            }
            Kind::Kro => {
                let probe = free_port();
                cmd.arg("--kubeconfig")
                    .arg(l.kubeconfig)
                    .arg(format!("--metrics-bind-address=127.0.0.1:{port}"))
                    .arg(format!("--health-probe-bind-address=127.0.0.1:{probe}"))
                    .arg(format!(
                        "--dynamic-controller-concurrent-reconciles={}",
                        l.concurrency
                    ))
                    .arg("--dynamic-controller-default-resync-period=60")
                    // kube-rs has no client-side rate limits; lift kro's so that both
                    // are bound by the API server only.
                    .arg("--client-qps=100000")
                    .arg("--client-burst=100000")
                    .arg("--dynamic-controller-rate-limiter-rate-limit=100000")
                    .arg("--dynamic-controller-rate-limiter-burst-limit=100000")
                    // Production logging (info, JSON), like the others' defaults.
                    .arg("--zap-devel=false");
                metrics_url = format!("http://127.0.0.1:{port}/metrics");
                ready_url = format!("http://127.0.0.1:{probe}/readyz");
            }
        }
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", l.binary.display()))?;
        let pid = child.id();
        Ok(Proc {
            kind: l.kind,
            child: Some(child),
            pid,
            metrics_url,
            ready_url,
            log,
        })
    }

    /// Waits until the contender's readiness endpoint answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                bail!(
                    "{} exited ({status}) before it was ready; log: {}\n{}",
                    self.kind.name(),
                    self.log.display(),
                    self.log_tail()
                );
            }
            if http_get(&self.ready_url).await.is_ok() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} not ready after {timeout:?}; log: {}\n{}",
                    self.kind.name(),
                    self.log.display(),
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Write requests the contender counted itself, by verb, and its reconciles.
    pub async fn counters(&self) -> (BTreeMap<String, f64>, Option<f64>) {
        let text = http_get(&self.metrics_url).await.unwrap_or_default();
        parse_counters(self.kind, &text)
    }

    pub fn usage(&self) -> Usage {
        usage_of(self.pid)
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after 20 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn parse_counters(kind: Kind, text: &str) -> (BTreeMap<String, f64>, Option<f64>) {
    let mut writes = BTreeMap::new();
    // A counter that has not counted anything yet is not printed at all.
    let mut reconciles = (!text.is_empty()).then_some(0.0);
    let label = |line: &str, k: &str| -> Option<String> {
        let pat = format!("{k}=\"");
        let i = line.find(&pat)? + pat.len();
        let rest = &line[i..];
        Some(rest[..rest.find('"')?].to_string())
    };
    let value = |line: &str| -> f64 {
        line.rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        match kind {
            Kind::Rulebook => {
                if line.starts_with("rulebook_api_writes_total{") {
                    if let Some(v) = label(line, "verb") {
                        *writes.entry(v).or_insert(0.0) += value(line);
                    }
                } else if line.starts_with("rulebook_reconciles_total{") {
                    *reconciles.get_or_insert(0.0) += value(line);
                }
            }
            Kind::Reference | Kind::ReferenceEvents => {
                if line.starts_with("reference_api_writes_total{") {
                    if let Some(v) = label(line, "verb") {
                        *writes.entry(v).or_insert(0.0) += value(line);
                    }
                } else if line.starts_with("reference_reconciles_total") {
                    reconciles = Some(value(line));
                }
            }
            Kind::Kro => {
                // client-go's counter of every request kro sent, by HTTP method.
                if line.starts_with("rest_client_requests_total{")
                    && let Some(m) = label(line, "method")
                    && m != "GET"
                {
                    *writes.entry(m.to_lowercase()).or_insert(0.0) += value(line);
                } else if line.starts_with("workqueue_adds_total{")
                    && line.contains("name=\"dynamic-controller-queue\"")
                {
                    // Items taken into the instance workqueue: kro's reconciles.
                    *reconciles.get_or_insert(0.0) += value(line);
                }
            }
        }
    }
    (writes, reconciles)
}

/// CPU and memory of one process, from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub rss_mib: f64,
    pub hwm_mib: f64,
}

pub fn clk_tck() -> f64 {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

pub fn usage_of(pid: u32) -> Usage {
    let mut u = Usage::default();
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            u.cpu_seconds = (ticks(11) + ticks(12)) / clk_tck();
        }
    }
    if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        for line in status.lines() {
            let kib = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
                    / 1024.0
            };
            if line.starts_with("VmRSS:") {
                u.rss_mib = kib(line);
            } else if line.starts_with("VmHWM:") {
                u.hwm_mib = kib(line);
            }
        }
    }
    u
}

/// Busy and total CPU seconds of the whole machine (all cores), from `/proc/stat`.
pub fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next() else {
        return (0.0, 0.0);
    };
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: f64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
    ((total - idle) / clk_tck(), total / clk_tck())
}

/// The pid of a control-plane component (`.cluster/pids/<name>.pid`).
pub fn component_pid(repo: &Path, name: &str) -> Option<u32> {
    std::fs::read_to_string(repo.join(".cluster/pids").join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub use crate::http_get::http_get;
