//! Renders checked against the children's schemas (issue 44, part 1): `rulebook check`
//! refuses a template that renders `replicas: "three"` into a Deployment, naming the
//! template's `file:line` and the JSON path, with the built-in schemas (offline), a
//! directory of saved ones (`--openapi`) and the cluster's (`--kubeconfig`, the local
//! control plane); `rulebook test` fails the step that renders it (the RuleTest is
//! `web-test.yaml.txt`, copied out of the repository's tests/ to run). The fixture is
//! tests/schema_check/: rule `web` (the bad Deployment, from its example's `size:
//! three`) and rule `stack`, whose child is `web`'s own kind, checked against `web`'s
//! generated CRD.

use std::path::Path;
use std::process::Command;

const FIXTURE: &str = "tests/schema_check";
const REPLICAS: &str = "tests/schema_check/templates/web/deployment.yaml:7: spec.replicas: \
                        expected integer, got string \"three\"";

fn rulebook(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RULEBOOK_RULES")
        .env_remove("RULEBOOK_TEMPLATES")
        .env_remove("KUBECONFIG")
        .output()
        .expect("run rulebook");
    (
        out.status.code().expect("exited"),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

fn check(extra: &[&str]) -> (i32, String, String) {
    let rules = format!("{FIXTURE}/rules");
    let templates = format!("{FIXTURE}/templates");
    let mut args = vec!["check", "--rules", &rules, "--templates", &templates];
    args.extend_from_slice(extra);
    rulebook(&args)
}

/// The error lines of a failed check (standard error without notes and the count).
fn errors(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| !l.starts_with("note: ") && !l.ends_with(" errors"))
        .collect()
}

#[test]
fn check_refuses_a_string_replicas_with_the_template_line_and_path() {
    let (code, stdout, stderr) = check(&[]);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("schemas: the built-in schemas of Kubernetes v1.36"),
        "{stdout}"
    );
    let errors = errors(&stderr);
    assert!(
        errors[0].starts_with(REPLICAS),
        "first error is not {REPLICAS:?}:\n{stderr}"
    );
    assert!(
        errors[0].ends_with("(rule 'web', child 'deployment' Deployment/shop, rendered for tests/schema_check/examples/web.yaml:1)"),
        "{stderr}"
    );
    // The rule's own CRD is a kind: `stack` renders a SchemaWeb that `web`'s CRD refuses.
    let stack = [
        "tests/schema_check/templates/stack/web.yaml:8: spec.colour: unknown field",
        "tests/schema_check/templates/stack/web.yaml:7: spec.image: expected string, got integer 7",
    ];
    for want in stack {
        assert!(
            errors.iter().any(|l| l.starts_with(want)),
            "no {want:?} in:\n{stderr}"
        );
    }
    assert_eq!(errors.len(), 3, "{stderr}");
    assert!(stderr.ends_with("3 errors\n"), "{stderr}");
}

#[test]
fn check_uses_the_schemas_of_an_openapi_directory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let saved = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/v1.36");
    // Only the core group: Deployments have no schema there, so they are not checked.
    std::fs::copy(saved.join("api__v1.json"), dir.path().join("core.json")).expect("copy");
    let shown = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["--openapi", &shown]);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains(&format!("schemas: the OpenAPI documents in {shown}")),
        "{stdout}"
    );
    assert!(!stderr.contains("spec.replicas"), "{stderr}");
    assert!(
        stderr.contains("note: no schema of apps/v1 Deployment (rule 'web', child 'deployment')"),
        "{stderr}"
    );
    // The apps group's document as saved: the Deployment is checked again.
    std::fs::copy(
        saved.join("apis__apps__v1.json"),
        dir.path().join("apps.json"),
    )
    .expect("copy");
    let (code, _, stderr) = check(&["--openapi", &shown]);
    assert_eq!(code, 1, "{stderr}");
    assert!(errors(&stderr)[0].starts_with(REPLICAS), "{stderr}");
}

#[test]
fn check_with_kubeconfig_uses_the_clusters_schemas() {
    let kubeconfig = std::env::var("RULEBOOK_TEST_KUBECONFIG")
        .expect("RULEBOOK_TEST_KUBECONFIG names the local control plane's kubeconfig");
    let (code, stdout, stderr) = check(&["--kubeconfig", &kubeconfig]);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains(&format!("schemas: the cluster's schemas ({kubeconfig})")),
        "{stdout}"
    );
    let errors = errors(&stderr);
    assert!(errors[0].starts_with(REPLICAS), "{stderr}");
    assert_eq!(errors.len(), 3, "{stderr}");
}

#[test]
fn test_fails_the_step_whose_child_the_schema_refuses() {
    // The RuleTest is copied out of the repository's tests/, whose RuleTests are the
    // shipped rules' (tests/ruletest.rs runs them all).
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("web.yaml");
    std::fs::copy(format!("{FIXTURE}/web-test.yaml.txt"), &file).expect("copy the RuleTest");
    let shown = file.display().to_string();
    let (code, stdout, stderr) = rulebook(&[
        "test",
        "--rules",
        &format!("{FIXTURE}/rules"),
        "--templates",
        &format!("{FIXTURE}/templates"),
        &shown,
    ]);
    assert_eq!(code, 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("  ok    renders\n"), "{stdout}");
    assert!(stdout.contains("  FAIL  a word for the size\n"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "{shown}:18: tests/schema_check/templates/web/deployment.yaml:7: \
             spec.replicas: expected integer, got string \"two\""
        )),
        "{stdout}"
    );
    assert!(stdout.ends_with("1 passed, 1 failed\n"), "{stdout}");
    assert!(
        stderr
            .contains("rendered children checked against the built-in schemas of Kubernetes v1.36"),
        "{stderr}"
    );
}

#[test]
fn the_repository_rules_and_examples_pass_the_schema_check() {
    for (rules, templates) in [
        ("rules", "templates"),
        ("examples/admission/rules", "examples/admission/templates"),
        ("examples/versioned/rules", "examples/versioned/templates"),
    ] {
        let (code, stdout, stderr) =
            rulebook(&["check", "--rules", rules, "--templates", templates]);
        assert_eq!(code, 0, "{rules}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(
            !stderr.contains("not checked") && !stderr.contains("did not render"),
            "{rules}: {stderr}"
        );
        let checked: usize = stdout
            .lines()
            .filter(|l| l.contains(" checked against their schemas"))
            .filter_map(|l| {
                l.split("  ")
                    .nth(2)?
                    .split(' ')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .sum();
        assert!(checked > 0, "{rules}: no child checked:\n{stdout}");
        println!("{rules}: {checked} children checked");
    }
}
