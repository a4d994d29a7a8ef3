//! Several versions of a rule's CRD, offline (issue 43): `rulebook check` proves the
//! versioned example's conversions round-trip on its examples and RuleTest fixtures, and
//! fails naming the field a lossy conversion loses with `file:line`; `rulebook test` runs
//! its convert steps; `rulebook crds` prints the conversion stanza (a placeholder
//! `clientConfig`, said on standard error, when no endpoint is given).

use std::path::Path;
use std::process::Command;

const EX: &str = "examples/versioned";

fn rulebook(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(dir)
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

fn example() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(EX)
}

/// A copy of the versioned example to edit.
fn copy() -> tempfile::TempDir {
    fn walk(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let p = e.unwrap().path();
            let target = to.join(p.file_name().unwrap());
            if p.is_dir() {
                walk(&p, &target);
            } else {
                std::fs::copy(&p, &target).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    walk(&example(), dir.path());
    // The repository a RuleTest's fixtures stay in.
    std::fs::create_dir(dir.path().join(".git")).unwrap();
    dir
}

const CHECK: &[&str] = &["check", "--rules", "rules", "--templates", "templates"];

#[test]
fn the_versioned_example_checks_and_round_trips() {
    let (code, stdout, stderr) = rulebook(&example(), CHECK);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    // Two examples and one RuleTest parent.
    assert!(
        stdout.contains("ok  webapp  conversions round-trip on 3 objects\n"),
        "{stdout}"
    );
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn a_lossy_conversion_fails_the_check_naming_the_field_and_place() {
    let dir = copy();
    let t = dir.path().join("templates/webapp/v1-to-v1alpha1.yaml");
    let text = std::fs::read_to_string(&t).unwrap();
    std::fs::write(&t, text.replace("  port: {{ object.spec.container.port }}", "")).unwrap();
    let (code, stdout, stderr) = rulebook(dir.path(), CHECK);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    // The v1alpha1 example (line 1) and the RuleTest's parent (line 7) lose their port.
    assert!(
        stderr.contains(
            "examples/webapp-v1alpha1.yaml:1: rule 'webapp': WebApp blog does not survive v1alpha1 → v1 → v1alpha1: spec.port: lost"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("tests/webapp.yaml:7: rule 'webapp': WebApp blog does not survive"),
        "{stderr}"
    );
    assert!(stderr.ends_with("2 errors\n"), "{stderr}");
}

#[test]
fn a_failing_conversion_fails_the_check_with_its_template_line() {
    let dir = copy();
    let t = dir.path().join("templates/webapp/v1alpha1-to-v1.yaml");
    let text = std::fs::read_to_string(&t).unwrap();
    std::fs::write(&t, text.replace("{{ object.spec.image }}", "{{ object.spec.imag }}")).unwrap();
    let (code, _, stderr) = rulebook(dir.path(), CHECK);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("examples/webapp-v1alpha1.yaml:1: rule 'webapp': WebApp blog: round trip v1alpha1 → v1 → v1alpha1: templates/webapp/v1alpha1-to-v1.yaml:8: rule 'webapp': WebApp default/blog: spec.crd.conversion[0] (v1alpha1 → v1): undefined value"),
        "{stderr}"
    );
}

#[test]
fn rulebook_test_runs_convert_steps() {
    let (code, stdout, _) = rulebook(
        &example(),
        &["test", "--rules", "rules", "--templates", "templates"],
    );
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.ends_with("5 passed, 0 failed\n"), "{stdout}");
    // An expectation that does not hold fails at its line.
    let dir = copy();
    let t = dir.path().join("tests/webapp.yaml");
    let text = std::fs::read_to_string(&t).unwrap();
    std::fs::write(&t, text.replace("port: 8080 }", "port: 8081 }")).unwrap();
    let (code, stdout, _) = rulebook(
        dir.path(),
        &["test", "--rules", "rules", "--templates", "templates"],
    );
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("FAIL  v1alpha1 converts to v1")
            && stdout.contains("tests/webapp.yaml:28: converted object: spec.container.port"),
        "{stdout}"
    );
}

#[test]
fn crds_print_every_version_and_the_conversion_stanza() {
    let (code, stdout, stderr) = rulebook(
        &example(),
        &["crds", "--rules", "rules", "--templates", "templates"],
    );
    assert_eq!(code, 0, "{stderr}");
    let crd: serde_json::Value = serde_saphyr::from_str(&stdout).unwrap();
    assert_eq!(crd["spec"]["conversion"]["strategy"], "Webhook");
    assert_eq!(
        crd["spec"]["conversion"]["webhook"]["clientConfig"]["service"]["path"],
        "/convert/webapp"
    );
    assert_eq!(crd["spec"]["versions"].as_array().unwrap().len(), 2);
    assert!(
        stderr.starts_with("note: CRD webapps.web.example.com converts through Rulebook's webhook"),
        "{stderr}"
    );
}
