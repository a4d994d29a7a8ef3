//! One tenant's references against the operator's memory (issue 41, F3), in
//! `tests/faults_heavy.rs`: the operator runs inside a cgroup v1 memory limit of the
//! deploy's 512 MiB while 40 parents of one namespace select the same 1,000 ConfigMaps of
//! 15 KB (each parent reads ~15 MB, just under its 16 MiB, and fails on its render's
//! output), one of those ConfigMaps is edited every 0.5 s, and a parent of another
//! namespace must converge meanwhile. Then the operator is killed and started again on
//! all of it (the start-up sweep), in the same limit.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value as Json, json};

use super::teardown::condition;
use super::*;
use crate::common::*;

/// A cgroup v1 memory cgroup with a limit, removed when dropped (its processes moved
/// back to the root cgroup first).
pub struct MemoryCgroup {
    path: PathBuf,
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup/memory";

impl MemoryCgroup {
    /// A new cgroup `name` limited to `limit` bytes; fails the test when cgroup v1's
    /// memory controller is not there or cannot be written (this needs root).
    pub fn new(name: &str, limit: u64) -> MemoryCgroup {
        let path = Path::new(CGROUP_ROOT).join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| {
            panic!(
                "cannot create the memory cgroup {} (cgroup v1 and root are needed): {e}",
                path.display()
            )
        });
        let cg = MemoryCgroup { path };
        cg.write("memory.limit_in_bytes", &limit.to_string());
        assert_eq!(
            cg.read_u64("memory.limit_in_bytes"),
            limit,
            "the limit is set"
        );
        cg
    }

    fn write(&self, file: &str, value: &str) {
        std::fs::write(self.path.join(file), value)
            .unwrap_or_else(|e| panic!("write {value} to {file}: {e}"));
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.path.join(file)).unwrap_or_else(|e| panic!("read {file}: {e}"))
    }

    fn read_u64(&self, file: &str) -> u64 {
        self.read(file).trim().parse().expect("a number")
    }

    /// The `cgroup.procs` file a process writes its pid to, to join.
    pub fn procs(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// The highest memory use since the cgroup was made or [`Self::reset_peak`].
    pub fn peak(&self) -> u64 {
        self.read_u64("memory.max_usage_in_bytes")
    }

    pub fn reset_peak(&self) {
        self.write("memory.max_usage_in_bytes", "0");
    }

    /// How often the limit was hit (the kernel then reclaims, or kills).
    pub fn failcnt(&self) -> u64 {
        self.read_u64("memory.failcnt")
    }

    /// Processes the OOM killer killed in this cgroup (`oom_kill` of `memory.oom_control`).
    pub fn oom_kills(&self) -> u64 {
        self.read("memory.oom_control")
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .expect("memory.oom_control has oom_kill (kernel 4.13 or later)")
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let root = Path::new(CGROUP_ROOT).join("cgroup.procs");
        for _ in 0..50 {
            for pid in std::fs::read_to_string(self.procs())
                .unwrap_or_default()
                .lines()
            {
                let _ = std::fs::write(&root, pid);
            }
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("could not remove the cgroup {}", self.path.display());
    }
}

/// The rule: parents of `kind` read every ConfigMap labelled `refmem-team=<spec.team>`
/// of their namespace, and print all their data into one ConfigMap child.
fn rules(rule: &str, kind: &str) -> RuleDir {
    let d = RuleDir::new();
    let text = rule_text(
        rule,
        kind,
        &[child(
            "settings",
            "v1",
            "ConfigMap",
            "refmem/settings.yaml",
            &[],
        )],
    )
    .replace(
        "  children:\n",
        "  references:\n    - name: pool\n      apiVersion: v1\n      kind: ConfigMap\n      \
         selector: \"{'refmem-team': parent.spec.team}\"\n  children:\n",
    );
    d.rule(&format!("{rule}.yaml"), &text);
    d.template(
        "refmem/settings.yaml",
        &configmap_template(
            "settings",
            "{%- for cm in refs.pool %}\n{%- for key, value in (cm.data or {}) | items %}\n  \
             {{ cm.metadata.name ~ \".\" ~ key }}: {{ value }}\n{%- endfor %}\n{%- endfor %}\n",
        ),
    );
    d
}

fn pool_cm(ns: &str, name: &str, team: &str, blob: &str) -> Json {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": ns, "labels": {"refmem-team": team}},
           "data": {"blob": blob, "rev": "0"}})
}

/// `VmHWM` of a process (its peak resident set), in bytes.
fn vm_hwm(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// CPU seconds a process has used (user and system), from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the command.
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// Fails the test when the operator is no longer the process it was (OOM-killed, or
/// ended otherwise), naming the cgroup's OOM kills.
fn assert_alive(op: &mut Operator, cg: &MemoryCgroup, when: &str) {
    if let Some(status) = op.exited() {
        panic!(
            "the operator died {when}: {status}; OOM kills in its cgroup: {}; limit hit {} times; peak {:.0} MiB",
            cg.oom_kills(),
            cg.failcnt(),
            mib(cg.peak())
        );
    }
    assert_eq!(
        cg.oom_kills(),
        0,
        "no OOM kill in the operator's cgroup {when}"
    );
}

/// Sizes of the scenario.
pub struct Flood {
    pub configmaps: usize,
    pub bytes_each: usize,
    pub parents: usize,
    pub limit: u64,
    /// `run --concurrency`.
    pub concurrency: u16,
    /// How long a ConfigMap is edited every 0.5 s at least.
    pub edits_for: Duration,
}

/// What the scenario measured.
pub struct FloodReport {
    pub peak_flood: u64,
    pub hwm_flood: u64,
    pub peak_restart: u64,
    pub hwm_restart: u64,
    pub edits: usize,
    pub failed_during_edits: f64,
    pub other_ready_after: Duration,
}

/// Polls `probe` until it returns `Some`, failing the test when the operator dies first
/// or after `timeout`.
async fn while_alive<T, F, Fut>(
    op: &mut Operator,
    cg: &MemoryCgroup,
    timeout: Duration,
    what: &str,
    mut probe: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        assert_alive(op, cg, &format!("waiting for {what}"));
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How many of `names` report `Ready=False`, `RenderBudgetExceeded`.
async fn over_budget(parents: &Api<DynamicObject>, names: &BTreeSet<String>) -> usize {
    let Ok(items) = parents.list(&ListParams::default()).await else {
        return 0;
    };
    items
        .items
        .iter()
        .map(to_json)
        .filter(|o| {
            names.contains(&name_of(o))
                && condition(o, "Ready").is_some_and(|c| {
                    c["status"] == "False" && c["reason"] == "RenderBudgetExceeded"
                })
        })
        .count()
}

/// Edits one pool ConfigMap after another every 0.5 s, for `at_least`, and then until
/// `stop` is set (2 minutes at most); returns how many edits it made.
async fn edit_every_half_second(
    cms: &Api<DynamicObject>,
    configmaps: usize,
    at_least: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> usize {
    let start = tokio::time::Instant::now();
    let mut n = 0usize;
    while start.elapsed() < at_least
        || (!stop.load(std::sync::atomic::Ordering::SeqCst)
            && start.elapsed() < Duration::from_secs(120))
    {
        let name = format!("pool-{:04}", n % configmaps);
        merge(cms, &name, json!({"data": {"rev": n.to_string()}})).await;
        n += 1;
        tokio::time::sleep_until(start + Duration::from_millis(500) * n as u32).await;
    }
    n
}

/// A parent of namespace `other` reading 3 small ConfigMaps, created now: how long it
/// takes to be Ready (the operator must live meanwhile).
async fn converge_elsewhere(
    client: &kube::Client,
    other: &str,
    kind: &str,
    op: &mut Operator,
    cg: &MemoryCgroup,
) -> Duration {
    let small = api(client, Some(other), "v1", "ConfigMap", "configmaps");
    for i in 0..3 {
        put(&small, &pool_cm(other, &format!("small-{i}"), "small", "s")).await;
    }
    let others = api(client, Some(other), API_VERSION, kind, &plural(kind));
    put(
        &others,
        &parent(kind, other, "calm", json!({"team": "small"})),
    )
    .await;
    let t = Instant::now();
    let what = "the other namespace's parent to be Ready";
    while_alive(op, cg, Duration::from_secs(120), what, || async {
        get_json(&others, "calm").await.filter(is_ready)
    })
    .await;
    t.elapsed()
}

/// The scenario (see the module comment).
pub async fn reference_flood(kind: &str, f: Flood) -> FloodReport {
    let test = format!(
        "reference_flood({} ConfigMaps x {} KB, {} parents, limit {} MiB, concurrency {})",
        f.configmaps,
        f.bytes_each / 1000,
        f.parents,
        f.limit >> 20,
        f.concurrency
    );
    let client = client().await;
    let big = namespace(&client, "faults-refmem").await;
    let other = namespace(&client, "faults-refmem-other").await;
    let rule = kind.to_lowercase();
    let d = rules(&rule, kind);
    let cg = MemoryCgroup::new(&unique("rulebook-refmem"), f.limit);
    let concurrency = f.concurrency.to_string();
    let start = |cg: &MemoryCgroup| {
        let procs = cg.procs();
        let (d, concurrency) = (&d, &concurrency);
        async move {
            let args = ["--install-crds", "--concurrency", concurrency];
            d.operator().flags(&args).in_cgroup(&procs).start().await
        }
    };
    let mut op = start(&cg).await;
    let parents = kind_api(&client, &big, kind, Duration::from_secs(120)).await;
    let cms = api(&client, Some(&big), "v1", "ConfigMap", "configmaps");

    // 1. The tenant's pool, then the parents selecting all of it.
    let blob = "x".repeat(f.bytes_each);
    let pool = (0..f.configmaps)
        .map(|i| pool_cm(&big, &format!("pool-{i:04}"), "big", &blob))
        .collect();
    let t = Instant::now();
    put_all(&cms, pool, 16).await;
    println!(
        "{test}: {} ConfigMaps created in {:.1} s",
        f.configmaps,
        t.elapsed().as_secs_f64()
    );
    let names: BTreeSet<String> = (0..f.parents).map(|i| format!("hog-{i:02}")).collect();
    let objs = names
        .iter()
        .map(|n| parent(kind, &big, n, json!({"team": "big"})))
        .collect();
    put_all(&parents, objs, 8).await;
    let what = format!("{} parents to report RenderBudgetExceeded", f.parents);
    while_alive(&mut op, &cg, Duration::from_secs(600), &what, || async {
        (over_budget(&parents, &names).await == names.len()).then_some(())
    })
    .await;
    let peak_created = cg.peak();
    println!(
        "{test}: every parent failed its budget {:.1} s after the pool was there; peak {:.0} MiB",
        t.elapsed().as_secs_f64(),
        mib(peak_created)
    );

    // 2. Edits every 0.5 s; meanwhile a parent of another namespace converges.
    let failed = format!("rulebook_reconciles_total{{rule=\"{rule}\",result=\"render_failed\"}}");
    let [f0] = op.metrics_when_idle(&rule, [failed.as_str()]).await;
    let ready = std::sync::atomic::AtomicBool::new(false);
    let editing = edit_every_half_second(&cms, f.configmaps, f.edits_for, &ready);
    let converging = async {
        let took = converge_elsewhere(&client, &other, kind, &mut op, &cg).await;
        ready.store(true, std::sync::atomic::Ordering::SeqCst);
        took
    };
    let (edits, other_ready_after) = tokio::join!(editing, converging);
    assert_alive(&mut op, &cg, "after the edits");
    let failed_during_edits = op.metric(&failed).await - f0;
    let peak_flood = cg.peak();
    let hwm_flood = vm_hwm(op.pid()).unwrap_or(0);
    println!(
        "{test}: {edits} edits at 0.5 s: {failed_during_edits} render_failed reconciles ({:.2} per parent); the other namespace's parent Ready {:.2} s after its creation; peak {:.0} MiB (cgroup), VmHWM {:.0} MiB, limit hit {} times; {:.1} CPU-s since the start",
        failed_during_edits / f.parents as f64,
        other_ready_after.as_secs_f64(),
        mib(peak_flood),
        mib(hwm_flood),
        cg.failcnt(),
        cpu_seconds(op.pid()).unwrap_or(0.0)
    );
    let (peak_restart, hwm_restart) = restart_sweep(&test, op, &cg, start, &f, &rule).await;
    FloodReport {
        peak_flood: peak_flood.max(peak_created),
        hwm_flood,
        peak_restart,
        hwm_restart,
        edits,
        failed_during_edits,
        other_ready_after,
    }
}

/// The operator SIGKILLed and started again in the same cgroup, on everything the flood
/// left: its start-up sweep reconciles every parent once. Returns the cgroup's peak and
/// the process's VmHWM meanwhile.
async fn restart_sweep<S, Fut>(
    test: &str,
    mut op: Operator,
    cg: &MemoryCgroup,
    start: S,
    f: &Flood,
    rule: &str,
) -> (u64, u64)
where
    S: Fn(&MemoryCgroup) -> Fut,
    Fut: std::future::Future<Output = Operator>,
{
    op.signal_and_wait("KILL");
    cg.reset_peak();
    let t = Instant::now();
    let mut op = start(cg).await;
    let failed = format!("rulebook_reconciles_total{{rule=\"{rule}\",result=\"render_failed\"}}");
    let what = format!("the start-up sweep to reconcile the {} parents", f.parents);
    let metrics = format!("http://127.0.0.1:{}/metrics", op.metrics_port);
    while_alive(&mut op, cg, Duration::from_secs(300), &what, || async {
        let n = parse_metric(&http_get(&metrics).await.ok()?, &failed)?;
        (n >= f.parents as f64).then_some(())
    })
    .await;
    assert_alive(&mut op, cg, "after the start-up sweep");
    let peak = cg.peak();
    let hwm = vm_hwm(op.pid()).unwrap_or(0);
    println!(
        "{test}: restarted, every parent reconciled (and failed) again {:.1} s after the start; peak {:.0} MiB (cgroup), VmHWM {:.0} MiB; {:.1} CPU-s",
        t.elapsed().as_secs_f64(),
        mib(peak),
        mib(hwm),
        cpu_seconds(op.pid()).unwrap_or(0.0)
    );
    (peak, hwm)
}
