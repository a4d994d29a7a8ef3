//! `rulebook test` admission steps (docs/reference/admission-cel.md): `cel:` checks and
//! defaults judged offline, a wrong expectation failing at its line, and a rule the
//! offline evaluator cannot judge reported as *not judged offline*, never passed. The
//! rules and the test are in tests/admission_cel/ (the test as `test.yaml.in`: the
//! repository's own `rulebook test` would otherwise run it against the shipped rules).

mod common;

use std::path::Path;
use std::process::Command;

use common::repo;

/// A rules repository in `dir` with `rules` as its rule file and `test` as its test
/// file: `rulebook test`'s (exit code, stdout).
fn run(dir: &Path, rules: &str, test: &str) -> (i32, String) {
    let fixtures = repo().join("tests/admission_cel");
    std::fs::create_dir_all(dir.join(".git")).unwrap();
    std::fs::create_dir_all(dir.join("rules")).unwrap();
    std::fs::create_dir_all(dir.join("templates")).unwrap();
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(dir.join("rules/app.yaml"), rules).unwrap();
    std::fs::copy(fixtures.join("cm.yaml"), dir.join("templates/cm.yaml")).unwrap();
    std::fs::write(dir.join("tests/app.yaml"), test).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args([
            "test",
            "--rules",
            "rules",
            "--templates",
            "templates",
            "tests",
        ])
        .current_dir(dir)
        .output()
        .expect("run rulebook test");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn fixture_test() -> String {
    std::fs::read_to_string(repo().join("tests/admission_cel/test.yaml.in")).unwrap()
}

fn fixture_rules() -> String {
    std::fs::read_to_string(repo().join("tests/admission_cel/rules.yaml")).unwrap()
}

#[test]
fn cel_checks_and_defaults_are_judged_offline() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = run(dir.path(), &fixture_rules(), &fixture_test());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("6 passed, 0 failed"), "{out}");
    assert!(
        out.contains("ok    an expr check refuses through admit"),
        "{out}"
    );
    assert!(out.contains("ok    the tier cannot change"), "{out}");
}

#[test]
fn a_wrong_expectation_fails_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let test = fixture_test().replace(
        "expect: {allowed: false, message: \"tier is immutable\"}",
        "expect: {allowed: true}",
    );
    let (code, out) = run(dir.path(), &fixture_rules(), &test);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("5 passed, 1 failed"), "{out}");
    let line = test
        .lines()
        .position(|l| l.contains("expect: {allowed: true}"))
        .unwrap()
        + 1;
    assert!(
        out.contains(&format!(
            "tests/app.yaml:{line}: expected the request allowed, but it is refused: tier is immutable"
        )),
        "{out}"
    );
}

#[test]
fn what_the_offline_evaluator_cannot_judge_is_never_passed() {
    let dir = tempfile::tempdir().unwrap();
    // A check calling Kubernetes' url library, which the offline evaluator lacks.
    let rules = fixture_rules().replace(
        "      - cel: \"self.spec.tier == oldSelf.spec.tier\"",
        "      - cel: \"url('https://' + self.metadata.name).getHost() != ''\"\n        message: \"a host\"\n      - cel: \"self.spec.tier == oldSelf.spec.tier\"",
    );
    let (code, out) = run(dir.path(), &rules, &fixture_test());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not judged offline"), "{out}");
    assert!(out.contains("url"), "{out}");
    assert!(!out.contains("6 passed"), "{out}");
}
