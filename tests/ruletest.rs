//! `rulebook test`: the shipped tests of the example rules pass; a broken expectation
//! fails with its `file:line` and a diff; a snapshot that differs fails until `--update`
//! writes it; a parent the CRD schema refuses is the error a step can expect.

mod common;

use std::path::Path;
use std::process::Command;

use common::repo;

/// `rulebook test ARGS` in the repository: (exit code, stdout).
fn rulebook_test(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .arg("test")
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run rulebook test");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn the_shipped_tests_pass() {
    let (code, out) = rulebook_test(&[]);
    assert_eq!(code, 0, "{out}");
    let last = out.lines().last().unwrap_or("");
    assert!(last.ends_with(" passed, 0 failed"), "{out}");
    let passed: usize = last.split(' ').next().unwrap().parse().unwrap();
    assert!(passed >= 12, "{out}");
    for rule in ["myweb", "myapp", "project"] {
        assert!(
            out.contains(&format!("tests/rules/{rule}.yaml:")),
            "{rule}: {out}"
        );
    }
}

/// A copy of tests/rules/myweb.yaml in `dir` with `from` replaced by `to`, its paths made
/// absolute; returns the copy's path.
fn variant(dir: &Path, from: &str, to: &str) -> String {
    let root = repo();
    let text = std::fs::read_to_string(root.join("tests/rules/myweb.yaml"))
        .unwrap()
        .replace(from, to)
        .replace("../../examples/", &format!("{}/examples/", root.display()))
        .replace(
            "fixtures/",
            &format!("{}/tests/rules/fixtures/", root.display()),
        )
        .replace(
            "snapshot: snapshots/",
            &format!("snapshot: {}/", dir.display()),
        );
    assert!(text.contains(to), "the replacement must apply: {from}");
    let path = dir.join("myweb.yaml");
    std::fs::write(&path, text).unwrap();
    std::fs::copy(
        root.join("tests/rules/snapshots/myweb-page-in-place.yaml"),
        dir.join("myweb-page-in-place.yaml"),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn a_broken_expectation_fails_with_its_line_and_a_diff() {
    let dir = tempfile::tempdir().unwrap();
    let file = variant(
        dir.path(),
        "type: NodePort, ports",
        "type: ClusterIP, ports",
    );
    let line = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .position(|l| l.contains("type: ClusterIP"))
        .unwrap()
        + 1;
    let (code, out) = rulebook_test(&[&file]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("  FAIL  first render"), "{out}");
    assert!(
        out.contains(&format!(
            "{file}:{line}: Service/hello: spec.type: expected \"ClusterIP\", got \"NodePort\""
        )),
        "{out}"
    );
    assert!(
        out.contains("-  type: ClusterIP") && out.contains("+  type: NodePort"),
        "{out}"
    );
    assert!(out.trim_end().ends_with("5 passed, 1 failed"), "{out}");
}

#[test]
fn an_unlabeled_fixture_must_match_for_the_ready_step() {
    // Without the fixture's Deployment the step's Ready=True expectation fails.
    let dir = tempfile::tempdir().unwrap();
    let file = variant(
        dir.path(),
        "observed: [ { file: fixtures/myweb-available.yaml } ]",
        "observed: []",
    );
    let (code, out) = rulebook_test(&[&file]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("  FAIL  ready once the deployment is available"),
        "{out}"
    );
    assert!(
        out.contains("phase: expected \"Serving\", got \"Pending\""),
        "{out}"
    );
}

#[test]
fn a_changed_snapshot_fails_until_updated() {
    let dir = tempfile::tempdir().unwrap();
    let file = variant(
        dir.path(),
        "name: the Deployment once the page exists",
        "name: the Deployment once the page exists (copy)",
    );
    let snap = dir.path().join("myweb-page-in-place.yaml");
    let edited = std::fs::read_to_string(&snap)
        .unwrap()
        .replace("replicas: 2", "replicas: 9");
    std::fs::write(&snap, edited).unwrap();
    let (code, out) = rulebook_test(&[&file]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("differs from the snapshot"), "{out}");
    assert!(
        out.contains("-  replicas: 9") && out.contains("+  replicas: 2"),
        "{out}"
    );
    let (code, out) = rulebook_test(&["--update", &file]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = rulebook_test(&[&file]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn a_broken_test_file_or_no_tests_fail() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, out) = rulebook_test(&[empty.to_str().unwrap()]);
    assert_eq!(code, 1, "no tests at all must fail: {out}");
    assert!(out.contains("0 passed, 0 failed"), "{out}");
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(
        broken.join("t.yaml"),
        "apiVersion: rulebook.dev/v1alpha1\nkind: RuleTest\nmetadata: { name: x\nspec: {}\n",
    )
    .unwrap();
    let (code, out) = rulebook_test(&[broken.to_str().unwrap()]);
    assert_eq!(code, 1, "a test file that does not parse must fail: {out}");
    assert!(out.contains("t.yaml:"), "{out}");
}
