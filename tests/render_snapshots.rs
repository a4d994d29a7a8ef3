//! Snapshots of `rulebook render` for every example parent: the children, the status
//! with no live children, and the status against live children (`--observed`).
//!
//! Run with `UPDATE_SNAPSHOTS=1` to (re)write `tests/snapshots/*.yaml`; then read the
//! diff: a snapshot is only worth what its review was.

use std::path::{Path, PathBuf};
use std::process::Command;

const NOW: &str = "2026-01-01T00:00:00Z";

struct Snapshot {
    /// The file under `tests/snapshots/`.
    name: String,
    args: Vec<String>,
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn examples() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("examples"))
        .expect("examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

fn snapshots() -> Vec<Snapshot> {
    let mut out = Vec::new();
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for x in examples() {
        let parent = format!("examples/{x}.yaml");
        out.push(Snapshot {
            name: format!("{x}.yaml"),
            args: s(&["render", "-f", &parent]),
        });
        out.push(Snapshot {
            name: format!("{x}.status.yaml"),
            args: s(&["render", "-f", &parent, "--status", "--now", NOW]),
        });
        let observed = format!("tests/snapshots/observed/{x}.yaml");
        assert!(
            root().join(&observed).exists(),
            "examples/{x}.yaml has no {observed}"
        );
        out.push(Snapshot {
            name: format!("{x}.status-ready.yaml"),
            args: s(&[
                "render",
                "-f",
                &parent,
                "--status",
                "--now",
                NOW,
                "--observed",
                &observed,
            ]),
        });
        // The children do not change when live children exist — unless the rule has a
        // child that waits for others (`waitFor`): it appears once they are live and ready.
        let waits = std::fs::read_to_string(root().join(format!("rules/{x}.yaml")))
            .is_ok_and(|rule| rule.contains("waitFor:"));
        out.push(Snapshot {
            name: if waits {
                format!("{x}.observed.yaml")
            } else {
                format!("{x}.yaml")
            },
            args: s(&["render", "-f", &parent, "--observed", &observed]),
        });
    }
    out.push(Snapshot {
        name: "myweb.status-partial.yaml".into(),
        args: s(&[
            "render",
            "-f",
            "examples/myweb.yaml",
            "--status",
            "--now",
            NOW,
            "--observed",
            "tests/snapshots/observed/myweb-partial.yaml",
        ]),
    });
    out
}

fn run(args: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(root())
        .env_remove("RULEBOOK_RULES")
        .env_remove("RULEBOOK_TEMPLATES")
        .output()
        .expect("run rulebook");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "rulebook {} failed ({}):\n{stderr}",
        args.join(" "),
        out.status
    );
    assert!(
        stderr.is_empty(),
        "rulebook {} wrote to stderr:\n{stderr}",
        args.join(" ")
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The first differing line, for a readable failure.
fn first_difference(want: &str, got: &str) -> String {
    let (w, g): (Vec<_>, Vec<_>) = (want.lines().collect(), got.lines().collect());
    for i in 0..w.len().max(g.len()) {
        if w.get(i) != g.get(i) {
            return format!(
                "line {}:\n  snapshot: {:?}\n  rendered: {:?}",
                i + 1,
                w.get(i),
                g.get(i)
            );
        }
    }
    "only line endings differ".into()
}

#[test]
fn render_matches_the_snapshots() {
    let update = std::env::var_os("UPDATE_SNAPSHOTS").is_some_and(|v| v == "1");
    let dir: PathBuf = root().join("tests/snapshots");
    let mut problems = Vec::new();
    let mut written = std::collections::BTreeMap::new();
    let snapshots = snapshots();
    assert!(snapshots.len() >= 9);
    for snap in &snapshots {
        let got = run(&snap.args);
        let path = dir.join(&snap.name);
        let cmd = format!("rulebook {}", snap.args.join(" "));
        if update {
            // Two commands share a snapshot only when they print the same.
            if let Some(first) = written.insert(snap.name.clone(), got.clone())
                && first != got
            {
                problems.push(format!(
                    "{}: {cmd} differs from the first command with this snapshot at {}",
                    snap.name,
                    first_difference(&first, &got)
                ));
                continue;
            }
            let old = std::fs::read_to_string(&path).ok();
            if old.as_deref() != Some(got.as_str()) {
                std::fs::write(&path, &got).expect("write snapshot");
                eprintln!("updated {}  ({cmd})", path.display());
            }
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(want) if want == got => {}
            Ok(want) => problems.push(format!(
                "{}: {cmd} differs at {}",
                snap.name,
                first_difference(&want, &got)
            )),
            Err(e) => problems.push(format!(
                "{}: {e} (run with UPDATE_SNAPSHOTS=1 to create it)",
                snap.name
            )),
        }
    }
    assert!(
        problems.is_empty(),
        "{} snapshots differ (UPDATE_SNAPSHOTS=1 rewrites them; review the diff):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn rendering_is_deterministic() {
    // Twice the same command, byte for byte (map order, hashes, no clock without --now).
    let args: Vec<String> = ["render", "-f", "examples/myweb.yaml"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(run(&args), run(&args));
}
