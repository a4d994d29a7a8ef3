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

/// A copy of tests/rules/myweb.yaml in `dir` with `from` replaced by `to`, with the
/// fixtures, parent and snapshot it names copied beside it (a test reads only files inside
/// its repository, here `dir`); returns the copy's path.
fn variant(dir: &Path, from: &str, to: &str) -> String {
    let root = repo();
    let text = std::fs::read_to_string(root.join("tests/rules/myweb.yaml"))
        .unwrap()
        .replace(from, to)
        .replace("../../examples/", "examples/")
        .replace("snapshot: snapshots/", "snapshot: ");
    assert!(text.contains(to), "the replacement must apply: {from}");
    let path = dir.join("myweb.yaml");
    std::fs::write(&path, text).unwrap();
    for (from, to) in [
        (
            "tests/rules/snapshots/myweb-page-in-place.yaml",
            "myweb-page-in-place.yaml",
        ),
        ("examples/myweb.yaml", "examples/myweb.yaml"),
        (
            "tests/rules/fixtures/myweb-available.yaml",
            "fixtures/myweb-available.yaml",
        ),
        (
            "tests/rules/fixtures/myweb-page.yaml",
            "fixtures/myweb-page.yaml",
        ),
    ] {
        let to = dir.join(to);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(root.join(from), to).unwrap();
    }
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

/// A test file in its own repository (`dir/repo`, with `.git`) that names `path` for the
/// parent, a live object or the snapshot (`field`); returns the file's path and the line.
fn hostile(dir: &Path, field: &str, path: &str) -> (String, usize) {
    let repo_dir = dir.join("repo");
    std::fs::create_dir_all(repo_dir.join(".git")).unwrap();
    std::fs::create_dir_all(repo_dir.join("tests")).unwrap();
    std::fs::copy(
        repo().join("examples/myweb.yaml"),
        repo_dir.join("myweb.yaml"),
    )
    .unwrap();
    let (parent, observed, snapshot) = match field {
        "parent" => (path, "../myweb.yaml", "snap.yaml"),
        "observed" => ("../myweb.yaml", path, "snap.yaml"),
        _ => ("../myweb.yaml", "../myweb.yaml", path),
    };
    let text = format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: RuleTest\nmetadata: {{ name: hostile }}\n\
         spec:\n  parent: {{ file: {parent} }}\n  steps:\n    - name: one\n      \
         observed: [ {{ file: {observed} }} ]\n      snapshot: {snapshot}\n"
    );
    let line = text
        .lines()
        .position(|l| l.contains(path))
        .map(|i| i + 1)
        .unwrap();
    let file = repo_dir.join("tests/t.yaml");
    std::fs::write(&file, text).unwrap();
    (file.display().to_string(), line)
}

#[test]
fn paths_out_of_the_repository_are_refused_with_file_and_line_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    // What must never be printed: a file beside the repository, reached by `..`, by an
    // absolute path, and by a link inside the repository.
    let outside = dir.path().join("ci-token.yaml");
    std::fs::write(&outside, "token: s3cr3t-ci-token\n").unwrap();
    std::fs::create_dir_all(dir.path().join("repo/tests")).unwrap();
    std::os::unix::fs::symlink(&outside, dir.path().join("repo/tests/link.yaml")).unwrap();
    let absolute = outside.display().to_string();
    for field in ["parent", "observed", "snapshot"] {
        for (path, why) in [
            ("/etc/passwd", "an absolute path"),
            (absolute.as_str(), "an absolute path"),
            ("../../ci-token.yaml", "leaves the repository"),
            ("link.yaml", "leaves the repository"),
        ] {
            let (file, line) = hostile(dir.path(), field, path);
            let (code, out) = rulebook_test(&[&file]);
            assert_eq!(code, 1, "{field} {path}: {out}");
            // `file:line` for the parent (a setup failure) and every step's failure.
            assert!(
                out.contains(&format!("t.yaml:{line}: {path}: {why}"))
                    || out.contains(&format!("t.yaml:{line}: line {line}: {path}: {why}")),
                "{field} {path}: {out}"
            );
            assert!(
                !out.contains("s3cr3t") && !out.contains("root:x:0"),
                "{out}"
            );
        }
    }
}

#[test]
fn update_never_writes_outside_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("written.yaml");
    for path in ["../../written.yaml", target.to_str().unwrap()] {
        let (file, line) = hostile(dir.path(), "snapshot", path);
        let (code, out) = rulebook_test(&["--update", &file]);
        assert_eq!(code, 1, "{path}: {out}");
        assert!(
            out.contains(&format!("t.yaml:{line}: line {line}: {path}")),
            "{out}"
        );
        assert!(
            !target.exists(),
            "{path}: --update wrote outside the repository"
        );
    }
    // Through a link to a directory outside, too.
    let out_dir = dir.path().join("elsewhere");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::os::unix::fs::symlink(&out_dir, dir.path().join("repo/tests/out")).unwrap();
    let (file, _) = hostile(dir.path(), "snapshot", "out/snap.yaml");
    let (code, out) = rulebook_test(&["--update", &file]);
    assert_eq!(code, 1, "{out}");
    assert!(
        !out_dir.join("snap.yaml").exists(),
        "--update followed a link out"
    );
    // Inside, it writes.
    let (file, _) = hostile(dir.path(), "snapshot", "snap.yaml");
    let (code, out) = rulebook_test(&["--update", &file]);
    assert_eq!(code, 0, "{out}");
    assert!(dir.path().join("repo/tests/snap.yaml").exists());
}
