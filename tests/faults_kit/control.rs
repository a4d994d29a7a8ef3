//! The scenarios' levers: signals to a process, the local control plane's cluster.sh
//! (restarts), and a seeded random number generator (FAULTS_SEED) to replay a run.

use super::*;

/// Sends a signal to a process (e.g. `STOP`, `CONT`).
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// `tests/cluster/cluster.sh <cmd>` (restart-apiserver, restart-etcd) on the cluster the
/// tests run on ([`cluster_sh_command`]); returns how long it took.
pub async fn cluster_sh(cmd: &str) -> Duration {
    let start = Instant::now();
    let mut command = cluster_sh_command(cmd);
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .expect("cluster.sh");
    assert!(
        out.status.success(),
        "cluster.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    start.elapsed()
}

/// A small xorshift generator; the seed is printed so a run can be repeated
/// (`FAULTS_SEED=<n>`).
pub struct Rng(u64);

impl Rng {
    pub fn new(test: &str) -> Rng {
        let seed = std::env::var("FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        println!("{test}: FAULTS_SEED={seed}");
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}
