//! Issue 45: scripts and docs name Rulebook's example kinds by their fully qualified
//! resource names (`tenants.xyz.com/acme`), never by `tenant/acme`: a cluster may hold
//! another CRD whose kind is `Tenant` (Capsule's `tenants.capsule.clastix.io` is common),
//! and kubectl then resolves the short name to it (`make demo` failed with `tenants.<other
//! group> "acme" not found`). Every kubectl command line in scripts/, the Makefile, the
//! README and docs/ is read; a resource argument that is an example kind's singular or
//! plural without its group fails the test, naming the file and line.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The parent kinds of every shipped rule (rules/, examples/*/rules/), lower-cased:
/// singular and plural.
fn kind_names() -> Vec<String> {
    let mut dirs = vec![repo().join("rules")];
    for e in std::fs::read_dir(repo().join("examples")).unwrap() {
        let p = e.unwrap().path().join("rules");
        if p.is_dir() {
            dirs.push(p);
        }
    }
    let mut names = Vec::new();
    for d in dirs {
        for e in std::fs::read_dir(d).unwrap() {
            let text = std::fs::read_to_string(e.unwrap().path()).unwrap_or_default();
            let Some(at) = text.find("\n  parent:") else {
                continue;
            };
            let kind = text[at..]
                .lines()
                .find_map(|l| l.trim().strip_prefix("kind: "))
                .expect("the parent's kind")
                .to_lowercase();
            names.push(format!("{kind}s"));
            names.push(kind);
        }
    }
    assert!(names.len() >= 10, "the shipped rules' kinds: {names:?}");
    names
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "md" || x == "sh") {
            out.push(p);
        }
    }
}

/// The kubectl verbs whose arguments name resources.
const VERBS: &[&str] = &[
    "get", "wait", "describe", "delete", "edit", "patch", "annotate", "label", "scale",
];

/// The short resource names on one command line.
fn short_names<'a>(line: &'a str, kinds: &[String]) -> Vec<&'a str> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(verb) = words.iter().position(|w| VERBS.contains(w)) else {
        return Vec::new();
    };
    words[verb + 1..]
        .iter()
        .flat_map(|w| w.split(','))
        .filter(|w| {
            let resource = w.split('/').next().unwrap_or("");
            kinds.iter().any(|k| k == resource)
        })
        .collect()
}

#[test]
fn scripts_and_docs_name_the_example_kinds_by_their_full_resource_names() {
    let kinds = kind_names();
    let mut paths = vec![repo().join("Makefile"), repo().join("README.md")];
    files(&repo().join("scripts"), &mut paths);
    files(&repo().join("docs"), &mut paths);
    files(&repo().join("deploy"), &mut paths);
    let mut found = Vec::new();
    let mut lines_read = 0;
    for p in &paths {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            let is_kubectl = line.contains("kubectl ")
                || line.contains("\"${K[@]}\" ")
                || line.trim_start().starts_with("k ");
            if !is_kubectl {
                continue;
            }
            lines_read += 1;
            for name in short_names(line, &kinds) {
                found.push(format!("{}:{}: {name}", p.display(), n + 1));
            }
        }
    }
    assert!(lines_read > 20, "kubectl lines read: {lines_read}");
    assert!(
        found.is_empty(),
        "short resource names (use plural.group, e.g. tenants.xyz.com/acme):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_short_name_is_found() {
    let kinds = vec!["tenant".to_string(), "tenants".to_string()];
    assert_eq!(
        short_names("kubectl wait --for=condition=Ready tenant/acme", &kinds),
        ["tenant/acme"]
    );
    assert_eq!(
        short_names("kubectl get tenants,configmaps -A", &kinds),
        ["tenants"]
    );
    assert!(short_names("kubectl get tenants.xyz.com/acme", &kinds).is_empty());
    assert!(short_names("kubectl apply -f examples/tenant.yaml", &kinds).is_empty());
}
