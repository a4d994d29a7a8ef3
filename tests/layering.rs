//! The layers, checked. The pure core (meta, rules, render) is a crate of its own,
//! `crates/rulebook-core`, whose dependency tree (read from Cargo.lock) holds no
//! Kubernetes client, HTTP stack or async runtime: the compiler keeps its code from
//! calling them. The kube layer (cache, write) is `crates/rulebook-kube`, which cannot
//! name the operator crate. Across the three crates each top-level module may use only
//! modules of lower layers (imports point down: meta → rules → render → cache → write →
//! reconcile → engine → operator → cli), read from the sources as text, so an upward `crate::` path anywhere
//! outside tests and comments fails it. Size is measured in functions (clippy's `too_many_lines`, threshold in `clippy.toml`,
//! in `make lint`); a file past 900 lines is named as a hint, not failed. No two files
//! import each other, directly or round a circle (`scripts/import-cycles.py`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module's layer. A module may use modules of lower layers only.
const LAYERS: &[(&str, u32)] = &[
    ("meta", 0),
    // Offline CEL (rulebook-core's cel/): imports nothing of Rulebook's.
    ("cel", 0),
    // Schema checks of rendered objects (issue 44): pure, imports nothing of Rulebook's.
    ("openapi", 0),
    ("rules", 1),
    ("render", 2),
    ("rollout", 3),
    ("rbac", 3),
    // The kube layer, crates/rulebook-kube (re-exported by the operator crate); `counts`
    // is what it counts, as traits the operator's `metrics` implements.
    ("counts", 0),
    ("cache", 3),
    ("write", 4),
    ("metrics", 5),
    // All of sharding (pure plan, write gate, cache filter, membership): on the kube layer.
    ("shard", 5),
    ("reconcile", 6),
    ("engine", 7),
    // The webhook server (issue 43): reads the rule set and the caches' references; the
    // operator, the CLI, `http` (readiness) and `crds` (the conversion endpoint) use it.
    ("webhook", 7),
    // Rules from git (issue 46): fetches and verifies; `http` (the push hook, /status) and
    // the operator use it.
    ("gitsource", 7),
    ("crds", 8),
    ("policies", 8),
    ("http", 8),
    ("leader", 8),
    ("reload", 8),
    ("operator", 9),
    ("cli", 10),
];

const MAX_LINES: usize = 900;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without comments and without `#[cfg(test)] mod tests { … }` at its end.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules `code` uses: `crate::x` paths and `use crate::{x, y}` groups.
fn uses(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.insert(name);
        }
    }
    out
}

/// Every import that points up or sideways: `(file, from, to)`.
fn violations(files: &[(String, String)]) -> Vec<(String, String, String)> {
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut out = Vec::new();
    for (file, text) in files {
        let top = file.split('/').next().unwrap_or("").trim_end_matches(".rs");
        if top == "lib" || top == "main" {
            continue;
        }
        let Some(&mine) = layer.get(top) else {
            out.push((file.clone(), top.to_string(), "(no layer assigned)".into()));
            continue;
        };
        for used in uses(&code(text)) {
            if used == top {
                continue;
            }
            match layer.get(used.as_str()) {
                Some(&theirs) if theirs < mine => {}
                _ => out.push((file.clone(), top.to_string(), used)),
            }
        }
    }
    out
}

/// Every source file of the three crates, by its path below its crate's `src/` (the
/// core's `rules/…`, `render/…` and `meta.rs`, the kube layer's `cache/…` and `write/…`
/// are top-level modules as the operator's are).
fn read_src() -> Vec<(String, String)> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for root in [
        manifest.join("src"),
        manifest.join("crates/rulebook-core/src"),
        manifest.join("crates/rulebook-kube/src"),
    ] {
        let mut paths = Vec::new();
        sources(&root, &mut paths);
        out.extend(paths.into_iter().map(|p| {
            let rel = p
                .strip_prefix(&root)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            (rel, std::fs::read_to_string(&p).expect("readable"))
        }));
    }
    out
}

/// The packages `name` depends on, directly or not, as Cargo.lock lists them.
fn dependency_tree(lock: &str, name: &str) -> BTreeSet<String> {
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for block in lock.split("[[package]]").skip(1) {
        let Some(pkg) = block
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .map(|n| n.trim_end_matches('"').to_string())
        else {
            continue;
        };
        let list = block
            .split_once("dependencies = [")
            .map(|(_, rest)| rest.split(']').next().unwrap_or(""))
            .unwrap_or("");
        let names = list
            .split(',')
            .filter_map(|d| d.trim().trim_matches('"').split(' ').next())
            .filter(|d| !d.is_empty())
            .map(str::to_string);
        deps.entry(pkg).or_default().extend(names);
    }
    let mut seen = BTreeSet::new();
    let mut todo = vec![name.to_string()];
    while let Some(p) = todo.pop() {
        for d in deps.get(&p).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn the_core_crate_has_no_kubernetes_client_http_or_runtime_below_it() {
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock"))
        .expect("Cargo.lock");
    let core = dependency_tree(&lock, "rulebook-core");
    assert!(
        core.contains("minijinja"),
        "the core's tree was not read: {core:?}"
    );
    let operator = dependency_tree(&lock, "rulebook");
    for forbidden in [
        "kube",
        "kube-client",
        "k8s-openapi",
        "hyper",
        "tokio",
        "tower",
    ] {
        assert!(
            operator.contains(forbidden),
            "{forbidden}: the check would not see it"
        );
        assert!(
            !core.contains(forbidden),
            "rulebook-core depends on {forbidden}"
        );
    }
}

#[test]
fn imports_only_point_down() {
    let files = read_src();
    assert!(files.len() > 20, "found only {} source files", files.len());
    let bad = violations(&files);
    assert!(
        bad.is_empty(),
        "imports that do not point down the layers:\n{}",
        bad.iter()
            .map(|(f, from, to)| format!("  {f}: {from} uses {to}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_check_catches_an_upward_import() {
    let files = vec![
        (
            "render/x.rs".to_string(),
            "//! a file\nuse crate::meta::labels;\nfn f() { crate::engine::start(); }\n"
                .to_string(),
        ),
        (
            "rules/y.rs".to_string(),
            "use crate::{meta, reconcile::plan};\n// crate::cli in a comment is fine\n".to_string(),
        ),
        (
            "reconcile/z.rs".to_string(),
            "use crate::render::x;\n#[cfg(test)]\nmod tests { use crate::cli; }\n".to_string(),
        ),
    ];
    let bad = violations(&files);
    assert_eq!(
        bad,
        vec![
            ("render/x.rs".into(), "render".into(), "engine".into()),
            ("rules/y.rs".into(), "rules".into(), "reconcile".into()),
        ]
    );
}

/// Files are as long as their one meaning needs (issue 42): a file past 900 lines is
/// printed as a hint that it may hold more than one thing, not failed. Functions are
/// the unit of size, checked by clippy's `too_many_lines` in `make lint`.
#[test]
fn files_over_900_lines_are_named() {
    for (f, text) in read_src() {
        let n = text.lines().count();
        if n > MAX_LINES {
            println!("warning: {f} has {n} lines (more than {MAX_LINES}): one thing or two?");
        }
    }
}

/// Runs `scripts/import-cycles.py` on `roots` (`NAME=DIR`; none: the workspace).
fn import_cycles(roots: &[String]) -> (bool, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/import-cycles.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(roots)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| panic!("python3 {}: {e}", script.display()));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// No import circle between files, in any of the three crates (the graph and what
/// counts as an edge: `scripts/import-cycles.py`'s header).
#[test]
fn the_file_level_import_graph_has_no_circle() {
    let (ok, text) = import_cycles(&[]);
    println!("{text}");
    assert!(ok && text.contains("import circles: 0"), "{text}");
}

/// The check sees a circle between two siblings, one through a re-export, and one
/// between a child and a file outside its module; and does not count a module's own
/// file naming its children.
#[test]
fn the_import_graph_check_catches_a_planted_circle() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let write = |rel: &str, text: &str| {
        let path = dir.path().join(rel);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    let root = format!("demo={}", dir.path().display());
    // A façade and its children, no circle.
    write(
        "lib.rs",
        "mod a;\nmod b;\npub use a::Thing;\nfn f() { a::go(); b::go(); }\n",
    );
    write("a.rs", "pub struct Thing;\npub fn go() {}\n");
    write("b.rs", "use super::Thing;\npub fn go() {}\n");
    let (ok, text) = import_cycles(std::slice::from_ref(&root));
    assert!(ok && text.contains("import circles: 0"), "{text}");
    // b names a through the façade's re-export, a names b: a circle of two siblings.
    write(
        "a.rs",
        "pub struct Thing;\npub fn go() { crate::b::go(); }\n",
    );
    let (ok, text) = import_cycles(std::slice::from_ref(&root));
    assert!(!ok && text.contains("circle of 2 files"), "{text}");
    assert!(text.contains("a.rs") && text.contains("b.rs"), "{text}");
    // Test code may reach anywhere.
    write(
        "a.rs",
        "pub struct Thing;\npub fn go() {}\n#[cfg(test)]\nmod tests { use crate::b::go; }\n",
    );
    let (ok, text) = import_cycles(std::slice::from_ref(&root));
    assert!(ok, "{text}");
}

#[test]
fn every_source_file_opens_with_a_why_comment() {
    let bare: Vec<String> = read_src()
        .into_iter()
        .filter(|(_, text)| !text.trim_start().starts_with("//!"))
        .map(|(f, _)| f)
        .collect();
    assert!(bare.is_empty(), "files without a //! header: {bare:?}");
}
