//! `rulebook render` as `rulebook run` sees the parent (issue 47, part 5), offline: kro's
//! webapp sample instance (`service: {}`, no port, image or replicas) renders as it is,
//! the CRD schema's defaults filled in; a child of a kind the rule set itself defines
//! as cluster-scoped renders without `namespace: default`; a parent the API server would
//! refuse, and a child its kind's schema refuses, fail the render as they fail
//! `rulebook test`.

use std::path::Path;
use std::process::Command;

use serde_json::Value as Json;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `rulebook render` on a rule directory (`rules`, `templates` under `dir`) and a parent
/// file: (exit code, stdout, stderr).
fn render(dir: &Path, parent: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .arg("render")
        .arg("--rules")
        .arg(dir.join("rules"))
        .arg("--templates")
        .arg(dir.join("templates"))
        .arg("-f")
        .arg(parent)
        .output()
        .expect("run rulebook");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn objects(text: &str) -> Vec<Json> {
    serde_saphyr::from_multiple::<Json>(text)
        .expect("yaml")
        .into_iter()
        .filter(|o| !o.is_null())
        .collect()
}

fn of_kind<'a>(objects: &'a [Json], kind: &str) -> Option<&'a Json> {
    objects.iter().find(|o| o["kind"] == kind)
}

#[test]
fn kros_webapp_instance_renders_with_the_schema_defaults() {
    let dir = root().join("examples/kro/webapp");
    let (code, stdout, stderr) = render(&dir, &dir.join("examples/instance.yaml"));
    assert_eq!(code, 0, "{stderr}");
    let children = objects(&stdout);
    let d = of_kind(&children, "Deployment").expect("a Deployment");
    // spec.replicas, image, serviceAccount and namespace come from the schema's defaults.
    assert_eq!(d["spec"]["replicas"], 1, "{stdout}");
    assert_eq!(d["metadata"]["namespace"], "default");
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["containers"][0]["image"], "nginx");
    assert_eq!(pod["containers"][0]["ports"][0]["containerPort"], 80);
    assert_eq!(pod["serviceAccountName"], "default");
    // The Service (`service.enabled` defaults to true) and the Ingress (enabled) wait
    // for the Deployment: not rendered until it is live.
    assert!(of_kind(&children, "Service").is_none(), "{stdout}");
}

#[test]
fn a_cluster_scoped_kind_of_the_rule_set_renders_without_a_namespace() {
    let dir = root().join("examples/kro/saas-multi-tenant");
    let (code, stdout, stderr) = render(&dir, &dir.join("examples/tenant-instance.yaml"));
    assert_eq!(code, 0, "{stderr}");
    let children = objects(&stdout);
    // (the TenantApplication waits for the TenantEnvironment: not rendered yet)
    let c = of_kind(&children, "TenantEnvironment").unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        c["metadata"].get("namespace").is_none(),
        "TenantEnvironment is cluster-scoped in the rule set: {c}"
    );
}

/// A copy of the webapp example with `edit` applied to a file's text.
fn webapp_with(file: &str, edit: impl Fn(&str) -> String) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    let from = root().join("examples/kro/webapp");
    for sub in ["rules", "templates/webapp", "examples"] {
        std::fs::create_dir_all(tmp.path().join(sub)).expect("mkdir");
        for e in std::fs::read_dir(from.join(sub)).expect("read_dir") {
            let e = e.expect("entry");
            let text = std::fs::read_to_string(e.path()).expect("read");
            let rel = format!("{sub}/{}", e.file_name().to_string_lossy());
            let text = if rel == file { edit(&text) } else { text };
            std::fs::write(tmp.path().join(&rel), text).expect("write");
        }
    }
    tmp
}

#[test]
fn a_parent_the_api_server_would_refuse_fails_the_render() {
    let tmp = webapp_with("examples/instance.yaml", |t| {
        t.replace("port: 80", "port: eighty")
    });
    let (code, stdout, stderr) = render(tmp.path(), &tmp.path().join("examples/instance.yaml"));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stderr.contains("the API server would refuse the parent") && stderr.contains("spec.port"),
        "{stderr}"
    );
}

#[test]
fn a_child_its_schema_refuses_fails_the_render() {
    let tmp = webapp_with("templates/webapp/deployment.yaml", |t| {
        t.replace("imagePullPolicy: Always", "imagePullPolicy: [Always]")
    });
    let (code, stdout, stderr) = render(tmp.path(), &tmp.path().join("examples/instance.yaml"));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stderr.contains("deployment.yaml:") && stderr.contains("imagePullPolicy"),
        "{stderr}"
    );
}
