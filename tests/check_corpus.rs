//! The broken-rules corpus: every case under `tests/corpus/broken/` must fail to load
//! with exactly the diagnostics its `expect.txt` lists.
//!
//! `expect.txt` has one line per diagnostic, `<path relative to the case>:<line>: <substring
//! of the message>`; blank lines and lines starting with `#` are comments.

use std::path::{Path, PathBuf};
use std::process::Command;

use rulebook::render::Limits;
use rulebook::rules::Diagnostic;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/broken")
}

fn cases() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(corpus())
        .expect("tests/corpus/broken exists")
        .map(|e| e.expect("readable corpus entry").path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    cases
}

#[derive(Debug)]
struct Expected {
    path: String,
    line: u64,
    needle: String,
}

fn expectations(case: &Path) -> Vec<Expected> {
    let file = case.join("expect.txt");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let parsed = l.split_once(':').and_then(|(path, rest)| {
                let (line, needle) = rest.split_once(": ")?;
                Some(Expected {
                    path: path.to_string(),
                    line: line.parse().ok()?,
                    needle: needle.to_string(),
                })
            });
            parsed.unwrap_or_else(|| panic!("{}: malformed expectation {l:?}", file.display()))
        })
        .collect()
}

fn matches(d: &Diagnostic, e: &Expected) -> bool {
    Path::new(&d.file).ends_with(&e.path) && d.line == e.line && d.message.contains(&e.needle)
}

/// Checks one case; returns a description of every mismatch.
fn check_case(case: &Path) -> Vec<String> {
    let name = case.file_name().unwrap().to_string_lossy().to_string();
    let expected = expectations(case);
    let mut problems = Vec::new();
    if expected.is_empty() {
        problems.push(format!("{name}: expect.txt lists no diagnostics"));
        return problems;
    }
    let diags = match rulebook::render::load(
        &case.join("rules"),
        &case.join("templates"),
        &Limits::default(),
    ) {
        Ok(set) => {
            problems.push(format!(
                "{name}: loaded without errors ({} rules), expected {} diagnostics",
                set.rules.len(),
                expected.len()
            ));
            return problems;
        }
        Err(d) => d.0,
    };
    let shown = || {
        diags
            .iter()
            .map(|d| format!("    {d}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    // Every expectation claims its own diagnostic, so duplicates are noticed.
    let mut used = vec![false; diags.len()];
    for e in &expected {
        match diags
            .iter()
            .enumerate()
            .find(|(i, d)| !used[*i] && matches(d, e))
        {
            Some((i, _)) => used[i] = true,
            None => problems.push(format!(
                "{name}: no diagnostic {}:{}: ...{}... among\n{}",
                e.path,
                e.line,
                e.needle,
                shown()
            )),
        }
    }
    if diags.len() != expected.len() {
        problems.push(format!(
            "{name}: {} diagnostics, expected {}:\n{}",
            diags.len(),
            expected.len(),
            shown()
        ));
    }
    for d in &diags {
        if d.message.contains('\n') {
            problems.push(format!("{name}: a diagnostic spans several lines: {d:?}"));
        }
        if d.line == 0 {
            problems.push(format!("{name}: a diagnostic has no line: {d}"));
        }
    }
    problems
}

#[test]
fn broken_corpus() {
    let cases = cases();
    assert!(
        cases.len() >= 32,
        "the corpus has only {} cases",
        cases.len()
    );
    let mut problems = Vec::new();
    let mut diagnostics = 0;
    for case in &cases {
        diagnostics += expectations(case).len();
        problems.extend(check_case(case));
    }
    assert!(
        problems.is_empty(),
        "{} problems in the broken corpus:\n{}",
        problems.len(),
        problems.join("\n")
    );
    println!(
        "check corpus: {} cases, {diagnostics} diagnostics, all as expected",
        cases.len()
    );
}

/// `file:line:col: message`, or `file:line: message` for templates.
fn is_diagnostic_line(l: &str) -> bool {
    let re = regex::Regex::new(r"^[^:\s][^:]*:\d+(:\d+)?: \S.*$").unwrap();
    re.is_match(l)
}

fn rulebook(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RULEBOOK_RULES")
        .env_remove("RULEBOOK_TEMPLATES")
        .output()
        .expect("run rulebook");
    (
        out.status.code().expect("exited"),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

#[test]
fn binary_check_reports_every_error_and_exits_1() {
    let case = "tests/corpus/broken/41-several-errors-one-file";
    let (code, stdout, stderr) = rulebook(&[
        "check",
        "--rules",
        &format!("{case}/rules"),
        "--templates",
        &format!("{case}/templates"),
    ]);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    let expected = expectations(&corpus().join("41-several-errors-one-file"));
    assert_eq!(lines.len(), expected.len() + 1, "stderr:\n{stderr}");
    let (last, diags) = lines.split_last().unwrap();
    assert_eq!(*last, format!("{} errors", expected.len()));
    for (l, e) in diags.iter().zip(&expected) {
        assert!(is_diagnostic_line(l), "not file:line:col: message: {l:?}");
        let prefix = format!("{case}/{}:{}:", e.path, e.line);
        assert!(
            l.starts_with(&prefix) && l.contains(&e.needle),
            "{l:?} is not {prefix} ...{}...",
            e.needle
        );
    }
}

#[test]
fn binary_check_of_a_template_error_names_the_template_line() {
    let case = "tests/corpus/broken/21-template-syntax-error";
    let (code, _, stderr) = rulebook(&[
        "check",
        "--rules",
        &format!("{case}/rules"),
        "--templates",
        &format!("{case}/templates"),
    ]);
    assert_eq!(code, 1, "stderr:\n{stderr}");
    let first = stderr.lines().next().unwrap_or("");
    assert!(is_diagnostic_line(first), "{first:?}");
    assert!(
        first.starts_with(&format!("{case}/templates/cm.yaml:7: syntax error")),
        "{first:?}"
    );
}

#[test]
fn binary_check_reports_a_mis_indented_key_at_its_line_and_column() {
    let case = "tests/corpus/broken/54-key-indented-less";
    let (code, _, stderr) = rulebook(&[
        "check",
        "--rules",
        &format!("{case}/rules"),
        "--templates",
        &format!("{case}/templates"),
    ]);
    assert_eq!(code, 1, "stderr:\n{stderr}");
    assert_eq!(
        stderr,
        format!(
            "{case}/rules/r.yaml:12:6: while parsing a block collection, did not find expected \
             '-' indicator (check the indentation: this line is indented 5 spaces, the blocks \
             above it 0, 2, 4 or 6)\n1 errors\n"
        )
    );
}

#[test]
fn binary_check_accepts_the_repository_rules() {
    let (code, stdout, stderr) =
        rulebook(&["check", "--rules", "rules", "--templates", "templates"]);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.is_empty(), "stderr:\n{stderr}");
    for name in ["myapp", "myweb", "project", "teamapp", "tenant"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("ok  {name}  "))),
            "{name} missing from:\n{stdout}"
        );
    }
    assert!(stdout.ends_with("5 rules valid\n"), "stdout:\n{stdout}");
}

/// `rulebook check` of a warnings corpus case: it must exit 0 (warnings do not make a set
/// invalid); its standard output and error.
fn check_valid_with_warnings(case: &str) -> (String, String) {
    let (code, stdout, stderr) = rulebook(&[
        "check",
        "--rules",
        &format!("{case}/rules"),
        "--templates",
        &format!("{case}/templates"),
    ]);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

#[test]
fn binary_check_warns_about_an_adopted_child_named_from_the_spec() {
    let case = "tests/corpus/warnings/adopt-name-from-spec";
    // A warning, not an error: the set is valid.
    let (stdout, stderr) = check_valid_with_warnings(case);
    assert!(stdout.ends_with("1 rules valid\n"), "stdout:\n{stdout}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "stderr:\n{stderr}");
    assert!(is_diagnostic_line(lines[0]), "{:?}", lines[0]);
    assert!(
        lines[0].starts_with(&format!(
            "{case}/rules/adopt.yaml:14:13: warning: rule 'adopter': spec.children[0] 'taken' has adopt: true"
        )),
        "{:?}",
        lines[0]
    );
    for needle in [
        "depends on parent.spec.target",
        "which existing ConfigMap",
        "adoptUnsafe: true",
    ] {
        assert!(
            lines[0].contains(needle),
            "{needle:?} not in {:?}",
            lines[0]
        );
    }
    // Named after the parent: its writer chooses that name too (the red team's F7).
    assert!(
        lines[1].starts_with(&format!(
            "{case}/rules/adopt.yaml:19:13: warning: rule 'adopter': spec.children[1] 'own' has adopt: true"
        )) && lines[1].contains("depends on parent.metadata.name"),
        "{:?}",
        lines[1]
    );
    assert_eq!(lines[2], "2 warnings");
}

#[test]
fn binary_check_warns_about_a_reference_that_caches_a_whole_kind() {
    let case = "tests/corpus/warnings/reference-caches-every-secret";
    // A warning, not an error: the set is valid.
    let (_, stderr) = check_valid_with_warnings(case);
    let lines: Vec<&str> = stderr.lines().collect();
    // One warning: `creds` caches every Secret; `narrow` names its labels, `settings`
    // has a literal namespace.
    assert_eq!(lines.len(), 2, "stderr:\n{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{case}/rules/r.yaml:10:13: warning: rule 'reader': spec.references[0] ('creds'): Rulebook will cache every Secret"
        )),
        "{:?}",
        lines[0]
    );
    assert_eq!(lines[1], "1 warnings");
}

/// Issue 41, F6: a child that reads a sibling's Secret without `waitFor`ing it. The
/// ServiceAccount it waits for and the Secret that is no child are not warned about.
#[test]
fn binary_check_warns_about_a_child_naming_a_sibling_it_does_not_wait_for() {
    let case = "tests/corpus/warnings/child-names-a-sibling-it-does-not-wait-for";
    // A warning, not an error: the set is valid.
    let (_, stderr) = check_valid_with_warnings(case);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "stderr:\n{stderr}");
    assert!(is_diagnostic_line(lines[0]), "{:?}", lines[0]);
    assert!(
        lines[0].starts_with(&format!(
            "{case}/rules/app.yaml:17:13: warning: rule 'app': spec.children[1] 'app' names the \
             Secret of child 'creds' but does not wait for it; add `waitFor: [creds]`"
        )),
        "{:?}",
        lines[0]
    );
    assert_eq!(lines[1], "1 warnings");
}

#[test]
fn binary_check_of_a_missing_directory_fails_cleanly() {
    let (code, _, stderr) = rulebook(&[
        "check",
        "--rules",
        "tests/corpus/no-such-dir",
        "--templates",
        "templates",
    ]);
    assert_eq!(code, 1, "stderr:\n{stderr}");
    assert!(
        stderr.contains("tests/corpus/no-such-dir: cannot read the rules directory"),
        "stderr:\n{stderr}"
    );
}

/// docs/rule.schema.json is what `rulebook schema` prints: editors validate rule files
/// against it, so a new key must reach it (regenerate with `cargo run -q -- schema >
/// docs/rule.schema.json`).
#[test]
fn the_published_schema_is_current() {
    let (code, out, err) = rulebook(&["schema"]);
    assert_eq!(code, 0, "{err}");
    let published = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/rule.schema.json"),
    )
    .expect("docs/rule.schema.json");
    assert!(
        out == published,
        "docs/rule.schema.json is stale: run `cargo run -q -- schema > docs/rule.schema.json`"
    );
}

/// Issue 45: a RoleBinding whose `roleRef` the parent computes, with `allowedRoleRefs`:
/// `check` warns (the risk, at the template's line), `render` refuses a role outside the
/// list before anything exists, and `rbac` grants `bind` on exactly the listed roles and
/// the literal one of the other binding, by name.
#[test]
fn binary_role_refs_are_warned_about_refused_outside_the_list_and_bound_by_name() {
    let case = "tests/corpus/warnings/role-ref-from-spec-allowed";
    let (_, stderr) = check_valid_with_warnings(case);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "stderr:\n{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{case}/rules/r.yaml:10:13: warning: rule 'team': spec.children[0] 'access': {case}/templates/team/access.yaml:8: roleRef.name is computed"
        )),
        "{:?}",
        lines[0]
    );
    let dirs = [
        "--rules",
        &format!("{case}/rules"),
        "--templates",
        &format!("{case}/templates"),
    ];
    let render = |parent: &str| {
        let file = format!("{case}/parents/{parent}.yaml");
        let mut args = vec!["render", "-f", file.as_str()];
        args.extend(dirs.iter().map(|s| &**s));
        rulebook(&args)
    };
    let (code, stdout, stderr) = render("view");
    assert_eq!(code, 0, "stderr:\n{stderr}");
    assert!(
        stdout.contains("kind: ClusterRole\n  name: view\n"),
        "{stdout}"
    );
    let (code, stdout, stderr) = render("cluster-admin");
    assert_eq!(code, 1, "stdout:\n{stdout}");
    assert!(
        stderr.contains("the rendered roleRef ClusterRole/cluster-admin is not one this child may bind (allowed: ClusterRole/edit, ClusterRole/view)"),
        "{stderr}"
    );
    let mut args = vec!["rbac"];
    args.extend(dirs.iter().map(|s| &**s));
    let (code, stdout, stderr) = rulebook(&args);
    assert_eq!(code, 0, "stderr:\n{stderr}");
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stdout).expect("rbac YAML");
    let binds: Vec<&serde_json::Value> = docs
        .iter()
        .flat_map(|d| d["rules"].as_array().into_iter().flatten())
        .filter(|r| {
            r["verbs"]
                .as_array()
                .is_some_and(|v| v.iter().any(|v| v == "bind"))
        })
        .collect();
    assert_eq!(binds.len(), 1, "{binds:?}");
    assert_eq!(binds[0]["verbs"], serde_json::json!(["bind"]));
    assert_eq!(binds[0]["resources"], serde_json::json!(["clusterroles"]));
    assert_eq!(
        binds[0]["resourceNames"],
        serde_json::json!(["admin", "edit", "view"])
    );
    assert!(!stdout.contains("escalate"));
}
