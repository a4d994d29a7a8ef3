//! What the report says about the machine and the code it ran (CPU, memory, load, the
//! git revision, criterion's render estimates), and copying the rule files.

use super::*;

pub(crate) fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

pub(crate) fn machine() -> Json {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": (mem_gib * 10.0).round() / 10.0,
        "cpu_model": model,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn git_describe(repo: &Path) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["describe", "--always", "--dirty"])
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Criterion's estimates for the render benchmark, in nanoseconds, from where criterion
/// writes them: `CRITERION_HOME`, else `<target dir>/criterion`.
pub(crate) fn render_cost(target_dir: &Path) -> Json {
    let criterion = std::env::var_os("CRITERION_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir.join("criterion"));
    let mut out = json!({});
    for group in ["myweb", "bench"] {
        for f in ["render", "status", "render_status"] {
            let path = criterion.join(format!("{group}/{f}/new/estimates.json"));
            if let Ok(text) = std::fs::read_to_string(&path)
                && let Ok(v) = serde_json::from_str::<Json>(&text)
            {
                out[group][f] = json!({
                    "mean_ns": v["mean"]["point_estimate"],
                    "median_ns": v["median"]["point_estimate"],
                    "ci_low_ns": v["mean"]["confidence_interval"]["lower_bound"],
                    "ci_high_ns": v["mean"]["confidence_interval"]["upper_bound"],
                });
            }
        }
    }
    out
}
