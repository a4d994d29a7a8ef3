//! `rulebook render --observed` with hand-written live children: objects without the
//! `rulebook.dev/child` label count when they have a rendered child's apiVersion, kind and
//! name, and every object that is no child is named in a warning (it used to be dropped
//! silently, leaving only a puzzling `missing: …`). Fixtures in `tests/observed/`.

use std::path::Path;
use std::process::Command;

use serde_json::Value as Json;

const NOW: &str = "2026-01-01T00:00:00Z";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the binary in the repository: (exit code, stdout, stderr).
fn rulebook(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(root())
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

/// `render` of `tests/observed/parent.yaml` (the `migration` rule) against `observed`.
fn render_migration(observed: &str, status: bool) -> (i32, String, String) {
    let mut args = vec![
        "render",
        "--rules",
        "tests/observed/rules",
        "--templates",
        "tests/observed/templates",
        "-f",
        "tests/observed/parent.yaml",
        "--observed",
        observed,
    ];
    if status {
        args.extend(["--status", "--now", NOW]);
    }
    rulebook(&args)
}

fn objects(yaml: &str) -> Vec<Json> {
    serde_saphyr::from_multiple::<Json>(yaml)
        .expect("YAML stream")
        .into_iter()
        .filter(|o| !o.is_null())
        .collect()
}

#[test]
fn unlabeled_children_count_by_apiversion_kind_and_name() {
    let (code, stdout, stderr) = render_migration("tests/observed/unlabeled.yaml", true);
    assert_eq!(code, 0, "stderr:\n{stderr}");
    assert!(stderr.is_empty(), "no object is ignored, yet:\n{stderr}");
    // Ready: the Job's readyWhen saw its status. The shards are in index order although
    // the file lists shard 1 first: each got its `forEach` index.
    let want = format!(
        "status:
  conditions:
  - lastTransitionTime: \"{NOW}\"
    message: all children are ready
    observedGeneration: 1
    reason: Ready
    status: \"True\"
    type: Ready
  observedGeneration: 1
  phase: Done
  shards:
  - users
  - orders
"
    );
    assert_eq!(stdout, want);
}

#[test]
fn matched_children_are_seen_by_the_templates() {
    // The report's name needs the live Job's uid: it matches only once the Job has
    // matched and the children were rendered again.
    let (code, stdout, stderr) = render_migration("tests/observed/unlabeled.yaml", false);
    assert_eq!(code, 0, "stderr:\n{stderr}");
    assert!(stderr.is_empty(), "stderr:\n{stderr}");
    let rendered = objects(&stdout);
    let names: Vec<&str> = rendered
        .iter()
        .filter_map(|o| o.pointer("/metadata/name").and_then(Json::as_str))
        .collect();
    assert_eq!(
        names,
        [
            "m1-migrate",
            "m1-shard-0",
            "m1-shard-1",
            "m1-report-44444444-4444-4444-4444-444444444441"
        ]
    );
    assert_eq!(
        rendered[3].pointer("/data/job").and_then(Json::as_str),
        Some("m1-migrate")
    );
}

#[test]
fn objects_that_are_no_child_are_named_in_warnings() {
    let (code, stdout, stderr) = render_migration("tests/observed/strays.yaml", true);
    // Warnings, not errors: the status is printed, and nothing counted as a child.
    assert_eq!(code, 0, "stderr:\n{stderr}");
    assert!(
        // The report reads `children.job`: it waits for the job (inferred, issue 47).
        stdout
            .contains("message: \"missing: job, shards[0], shards[1]; waiting: report (for job)\""),
        "{stdout}"
    );
    assert!(stdout.contains("phase: Pending"), "{stdout}");
    let file = "warning: tests/observed/strays.yaml: ";
    let unmatched = "ignored: no rulebook.dev/child label, and no rendered child of rule \
                     'migration' has its apiVersion, kind, name and namespace";
    let want = [
        format!("{file}ConfigMap/leftover: {unmatched}"),
        format!(
            "{file}Job/m1-migrate: {unmatched} (child 'job' is in namespace default, not other)"
        ),
        format!(
            "{file}Job/m1-migrate: {unmatched} (child 'job' has apiVersion batch/v1, not batch/v1beta1)"
        ),
        format!(
            "{file}ConfigMap/m1-shard-0: ignored: labelled rulebook.dev/child=shard, but rule \
             'migration' has no child 'shard'"
        ),
    ];
    let got: Vec<&str> = stderr.lines().collect();
    assert_eq!(got, want, "stderr:\n{stderr}");
}

#[test]
fn the_project_example_without_labels_gives_the_labelled_status() {
    // The `--observed` fixture of examples/project.yaml with every label removed.
    let labelled = std::fs::read_to_string(root().join("tests/snapshots/observed/project.yaml"))
        .expect("fixture");
    let mut unlabeled = objects(&labelled);
    assert_eq!(unlabeled.len(), 2);
    for o in &mut unlabeled {
        let meta = o
            .get_mut("metadata")
            .and_then(Json::as_object_mut)
            .expect("metadata");
        assert!(meta.remove("labels").is_some(), "the fixture is labelled");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("observed.json");
    let stream: String = unlabeled
        .iter()
        .map(|o| format!("---\n{}\n", serde_json::to_string(o).unwrap()))
        .collect();
    std::fs::write(&file, stream).expect("write fixture");
    let (code, stdout, stderr) = rulebook(&[
        "render",
        "-f",
        "examples/project.yaml",
        "--status",
        "--now",
        NOW,
        "--observed",
        file.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(code, 0, "stderr:\n{stderr}");
    assert!(stderr.is_empty(), "stderr:\n{stderr}");
    let want = std::fs::read_to_string(root().join("tests/snapshots/project.status-ready.yaml"))
        .expect("snapshot");
    assert!(want.contains("status: \"True\""), "{want}");
    assert_eq!(stdout, want);
}

/// Referenced objects in the `--observed` file: the Secret by kind and name, the team's
/// ConfigMaps by labels (in name order), another team's ConfigMap ignored with a warning.
/// The settings child is live, so the Deployment that waits for it is rendered.
#[test]
fn referenced_objects_are_taken_from_the_observed_file() {
    let (code, stdout, stderr) = rulebook(&[
        "render",
        "-f",
        "tests/observed/refs/teamapp.yaml",
        "--observed",
        "tests/observed/refs/observed.yaml",
    ]);
    assert_eq!(code, 0, "stderr:\n{stderr}");
    let out = objects(&stdout);
    let settings = out
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .expect("settings");
    assert_eq!(settings["data"]["sources"], "payments-a,payments-b");
    assert_eq!(settings["data"]["payments-a.a"], "1");
    assert!(settings["data"].get("search-a.s").is_none(), "{settings}");
    let deploy = out
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("the Deployment (settings is live)");
    assert_eq!(
        deploy["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["secretRef"]["name"],
        "orders-db"
    );
    assert!(
        stderr.contains("ConfigMap/search-a: ignored"),
        "stderr:\n{stderr}"
    );
    assert!(!stderr.contains("payments-a: ignored"), "stderr:\n{stderr}");

    // Without the Secret, a required reference: an error naming it, as the operator's
    // ReferenceMissing would.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("tests/observed/refs/observed.yaml")).unwrap();
    let without: Vec<&str> = text.split("\n---\n").skip(1).collect();
    let path = dir.path().join("observed.yaml");
    std::fs::write(&path, without.join("\n---\n")).unwrap();
    let (code, _, stderr) = rulebook(&[
        "render",
        "-f",
        "tests/observed/refs/teamapp.yaml",
        "--observed",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "stderr:\n{stderr}");
    assert!(
        stderr.contains("refs.credentials: Secret orders-db in namespace default not found"),
        "stderr:\n{stderr}"
    );
}
