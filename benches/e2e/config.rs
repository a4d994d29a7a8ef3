//! The benchmark's knobs (`BENCH_*` environment variables) and where it finds its
//! binaries.

use super::*;

/// The benchmark's knobs, from the environment.
#[derive(Clone, Debug)]
pub struct Cfg {
    pub repo: PathBuf,
    pub out: PathBuf,
    pub kubeconfig: PathBuf,
    /// Parents of the converge, update, steady and template workloads.
    pub n: usize,
    /// Parents of the memory-at-scale workload, one run per size (none: skipped).
    pub scale_n: Vec<usize>,
    /// Rounds of the contender list (alternating order; `runs::order`).
    pub repeats: usize,
    /// Seconds of the steady-state window.
    pub steady_seconds: u64,
    /// Concurrent reconciles of every contender.
    pub concurrency: usize,
    /// Concurrency levels of the API server limit sweep.
    pub api_concurrency: Vec<usize>,
    /// Concurrent requests of the driver when it creates or updates parents.
    pub driver_concurrency: usize,
    pub contenders: Vec<Kind>,
    pub workloads: BTreeSet<String>,
    pub timeout: Option<Duration>,
    /// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the
    /// repository, where `make bench` runs cargo), else `target/`.
    pub target_dir: PathBuf,
    pub rulebook_bin: PathBuf,
    pub reference_bin: PathBuf,
    pub kro_dir: PathBuf,
    pub kro_bin: PathBuf,
}

/// Where cargo puts its build output: `CARGO_TARGET_DIR` when set (a relative one is
/// relative to the repository, where `make bench` runs cargo), else `<repo>/target`.
/// `.ci/run` sets it to a cache outside the clone.
pub(crate) fn target_dir(repo: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => repo.join(dir), // `join` keeps an absolute path as it is
        None => repo.join("target"),
    }
}

pub(crate) fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    match std::env::var(key) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{key}={v}: not a valid value")),
        _ => default,
    }
}

impl Cfg {
    pub(crate) fn from_env() -> Cfg {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let list = |key: &str, default: &str| -> Vec<String> {
            std::env::var(key)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| default.to_string())
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let cache = std::env::var_os("RULEBOOK_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/rulebook")
            });
        let kro_version = std::env::var("KRO_VERSION").unwrap_or_else(|_| "v0.9.4".into());
        let target_dir = target_dir(&repo);
        Cfg {
            out: repo.join("target/bench"),
            kubeconfig: std::env::var_os("BENCH_KUBECONFIG")
                .map(PathBuf::from)
                .unwrap_or_else(|| repo.join(".cluster/kubeconfig")),
            n: env("BENCH_N", 1000),
            scale_n: list("BENCH_SCALE_N", "1000,3000,10000")
                .iter()
                .map(|s| s.parse().expect("BENCH_SCALE_N: numbers"))
                .filter(|&m| m > 0)
                .collect(),
            repeats: env("BENCH_REPEATS", 3usize).max(1),
            steady_seconds: env("BENCH_STEADY_SECONDS", 300),
            concurrency: env("BENCH_CONCURRENCY", 4),
            api_concurrency: list("BENCH_API_CONCURRENCY", "1,4,16,64")
                .iter()
                .map(|s| s.parse().expect("BENCH_API_CONCURRENCY: numbers"))
                .collect(),
            driver_concurrency: env("BENCH_DRIVER_CONCURRENCY", 16),
            contenders: list("BENCH_CONTENDERS", "rulebook,reference,kro")
                .iter()
                .map(|s| {
                    Kind::parse(s).unwrap_or_else(|| panic!("BENCH_CONTENDERS: unknown '{s}'"))
                })
                .collect(),
            workloads: list(
                "BENCH_WORKLOADS",
                "api,converge,update,steady,template,scale,render",
            )
            .into_iter()
            .collect(),
            timeout: std::env::var("BENCH_TIMEOUT_SECONDS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_secs),
            // Another launcher of the same binary (scripts/heap-profile.sh wraps it).
            rulebook_bin: std::env::var_os("BENCH_RULEBOOK_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| target_dir.join("release/rulebook")),
            reference_bin: std::env::var_os("BENCH_REFERENCE_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| target_dir.join("release/examples/bench-reference")),
            target_dir,
            kro_bin: cache.join("kro").join(&kro_version).join("bin/controller"),
            kro_dir: cache.join("kro").join(kro_version),
            repo,
        }
    }

    pub(crate) fn wants(&self, w: &str) -> bool {
        self.workloads.contains(w)
    }

    pub(crate) fn timeout_for(&self, parents: usize) -> Duration {
        self.timeout
            .unwrap_or_else(|| Duration::from_secs((parents as u64 / 2).max(300)))
    }
}
