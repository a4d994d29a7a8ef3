//! `rulebook diff` against the local control plane: a rule set on disk compared with the
//! objects a running operator made. Nothing changed: exit 0. A template change that
//! affects one parent: that parent's child diffed, nobody else's, exit 1. A Secret's
//! values are never printed. The audit log shows no persisted write, only dry runs. And
//! how long it takes for many parents (`RULEBOOK_DIFF_PARENTS`, default 300).
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(180);

const CONFIG: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-config\" }}\ndata:\n  team: {{ parent.spec.team }}\n";
const CONFIG_CHANGED: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-config\" }}\ndata:\n  team: {{ parent.spec.team }}\n{% if parent.spec.team == \"a\" %}  extra: only-team-a\n{% endif %}";
const SECRET: &str = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\nstringData:\n  password: {{ parent.spec.password ~ SUFFIX }}\n";

fn secret(suffix: &str) -> String {
    SECRET.replace("SUFFIX", &format!("{suffix:?}"))
}

/// `rulebook diff` on the rule dir: (exit code, stdout, stderr).
fn diff(d: &RuleDir, ns: &str, extra: &[&str]) -> (i32, String, String) {
    diff_as(&kubeconfig_path(), d, ns, extra)
}

/// [`diff`] with another identity.
fn diff_as(kubeconfig: &Path, d: &RuleDir, ns: &str, extra: &[&str]) -> (i32, String, String) {
    diff_of(kubeconfig, (&d.rules, &d.templates), ns, extra)
}

/// `rulebook diff` of the rules and templates `dirs`, as the identity of `kubeconfig`.
fn diff_of(
    kubeconfig: &Path,
    dirs: (&Path, &Path),
    ns: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .arg("diff")
        .arg("--rules")
        .arg(dirs.0)
        .arg("--templates")
        .arg(dirs.1)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--namespace")
        .arg(ns)
        .args(extra)
        .output()
        .expect("run rulebook diff");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn diff_rule(d: &RuleDir, rule: &str, kind: &str) {
    d.rule(
        "r.yaml",
        &rule_text(
            rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "config.yaml", &[]),
                child("secret", "v1", "Secret", "secret.yaml", &[]),
            ],
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_shows_exactly_what_a_change_would_do() {
    let test = "diff_shows_exactly_what_a_change_would_do";
    let client = client().await;
    let ns = namespace(&client, "diff").await;
    let (kind, rule) = ("DiffApp", "diffapp");
    let d = RuleDir::new();
    d.template("config.yaml", CONFIG);
    d.template("secret.yaml", &secret(""));
    diff_rule(&d, rule, kind);
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let names: BTreeSet<String> = ["p0", "p1", "p2"].iter().map(|s| s.to_string()).collect();
    for (n, team) in [("p0", "a"), ("p1", "b"), ("p2", "b")] {
        let spec = json!({"team": team, "password": format!("hunter-{n}-old")});
        put(&parents, &parent(kind, &ns, n, spec)).await;
    }
    wait_all_ready(&parents, &names, T).await;
    drop(op);

    // The rules as deployed: nothing would change.
    let (code, out, err) = diff(&d, &ns, &[]);
    assert_eq!(code, 0, "{test}: {out}\n{err}");
    assert!(
        out.contains(&format!(
            "rule {rule}: 3 parents; children: 6 unchanged, 0 changed, 0 created, 0 pruned"
        )),
        "{test}: {out}"
    );

    // A template change for team a only, and a new password for everyone.
    d.template("config.yaml", CONFIG_CHANGED);
    d.template("secret.yaml", &secret("-new"));
    let audit = Audit::mark();
    let started = Instant::now();
    let (code, out, err) = diff(&d, &ns, &[]);
    let took = started.elapsed();
    let out_text = out.clone();
    assert_eq!(code, 1, "{test}: {out}\n{err}");
    assert!(out.contains("+  extra: only-team-a"), "{test}: {out}");
    assert!(
        out.contains("# changed of DiffApp") && out.contains("ConfigMap"),
        "{test}: {out}"
    );
    let config_changes: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("# changed of") && l.ends_with(": ConfigMap"))
        .collect();
    assert_eq!(
        config_changes,
        vec![format!("# changed of {kind} {ns}/p0: ConfigMap").as_str()],
        "{test}: only p0's ConfigMap changes: {out}"
    );
    assert!(
        out.contains(&format!(
            "rule {rule}: 3 parents; children: 2 unchanged, 4 changed, 0 created, 0 pruned"
        )),
        "{test}: {out}"
    );
    assert!(
        out.contains("password: \"<redacted: changed>\""),
        "{test}: {out}"
    );
    for n in ["p0", "p1", "p2"] {
        for secret in [format!("hunter-{n}-old"), format!("hunter-{n}-old-new")] {
            let b64 = base64_of(&secret);
            assert!(
                !out.contains(&secret) && !out.contains(&b64) && !err.contains(&secret),
                "{test}: a Secret value was printed: {out}"
            );
        }
    }
    // Read-only: every write request of the diff was a dry run.
    let writes = audit.writes(&ns);
    let persisted: Vec<String> = writes
        .iter()
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|a| a.contains("(diff)"))
        })
        .filter(|e| {
            !e["requestURI"]
                .as_str()
                .unwrap_or("")
                .contains("dryRun=All")
        })
        .map(describe_audit)
        .collect();
    let dry_runs = writes
        .iter()
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|a| a.contains("(diff)"))
        })
        .count();
    assert!(
        persisted.is_empty(),
        "{test}: persisted writes: {persisted:?}"
    );
    assert_eq!(dry_runs, 6, "{test}: one dry-run apply per child");
    // The same as JSON, for CI bots.
    let (code, out, _) = diff(&d, &ns, &["-o", "json"]);
    assert_eq!(code, 1);
    let reports: Json = serde_json::from_str(&out).expect("JSON");
    assert_eq!(reports[0]["rule"], rule);
    assert_eq!(reports[0]["changed"], 4);
    assert_eq!(reports[0]["unchanged"], 2);
    // The same with only the role `rulebook rbac --diff-role` prints.
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        d.rules.to_str().unwrap(),
        "--templates",
        d.templates.to_str().unwrap(),
        "--diff-role",
        "--name",
        &unique("rulebook-diff"),
        "--service-account",
        &format!("{ns}/differ"),
    ]));
    let kubeconfig = service_account_kubeconfig(&client, &ns, "differ", rbac).await;
    let (code, out_sa, err_sa) = diff_as(kubeconfig.path(), &d, &ns, &[]);
    assert_eq!(code, 1, "{test}: as the diff role: {out_sa}\n{err_sa}");
    // The role reads no Secret: the Secret children are not compared, and the status
    // counts them as applied (as the operator's status after its apply would).
    let summary_sa = out_sa.lines().last().unwrap_or("");
    assert!(
        summary_sa.starts_with(&format!(
            "rule {rule}: 3 parents; children: 2 unchanged, 1 changed, 0 created, 0 pruned, 0 orphaned, 3 not compared"
        )),
        "{test}: as the diff role: {out_sa}\n{err_sa}"
    );
    let tail = |s: &str| s.rsplit_once("; status:").map(|(_, t)| t.to_string());
    assert_eq!(
        tail(summary_sa),
        tail(out_text.lines().last().unwrap_or("")),
        "{test}: the diff role sees the status an administrator sees"
    );
    assert!(!out_sa.contains("forbidden"), "{test}: {out_sa}");
    // A tenant's object in another namespace claiming to be p0's child is not p0's.
    let other = namespace(&client, "diff-other").await;
    let p0 = get_json(&parents, "p0").await.expect("p0");
    let cms_other = api(&client, Some(&other), "v1", "ConfigMap", "configmaps");
    put(
        &cms_other,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "spoof", "namespace": other,
                "labels": {"app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule,
                           "rulebook.dev/owner": uid_of(&p0), "rulebook.dev/child": "config"},
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": kind, "name": "p0",
                                     "uid": uid_of(&p0), "controller": true}]},
            "data": {"team": "spoofed"}}),
    )
    .await;
    let (_, out_spoof, _) = diff(&d, &ns, &[]);
    assert_eq!(
        out_spoof, out_text,
        "{test}: another namespace's object changed p0's diff"
    );
    // An object of a child's name that is someone else's: a conflict, exit 2.
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    put(
        &cms,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "p3-config", "namespace": ns}, "data": {"mine": "yes"}}),
    )
    .await;
    put(
        &parents,
        &parent(
            kind,
            &ns,
            "p3",
            json!({"team": "b", "password": "pw-p3-old"}),
        ),
    )
    .await;
    // And a Secret of someone else's under p4's Secret child's name.
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    put(
        &secrets,
        &json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "p4-secret", "namespace": ns},
                "stringData": {"password": "foreign-admin-password"}}),
    )
    .await;
    put(
        &parents,
        &parent(
            kind,
            &ns,
            "p4",
            json!({"team": "b", "password": "pw-p4-old"}),
        ),
    )
    .await;
    let (code, out, err) = diff(&d, &ns, &[]);
    assert_eq!(code, 2, "{test}: {out}\n{err}");
    // The operator's reason and message, in the error line and in the status.
    for (p, what, child) in [
        ("p3", format!("ConfigMap {ns}/p3-config"), "config"),
        ("p4", format!("Secret {ns}/p4-secret"), "secret"),
    ] {
        let message = format!(
            "{what} already exists and was not created by Rulebook for this parent; Rulebook leaves it alone (set `adopt: true` on child '{child}' to take it over)"
        );
        assert!(
            out.contains(&format!("# error: {kind} {ns}/{p}: Conflict: {message}")),
            "{test}: {out}"
        );
        let status = section(&out, &format!("# status of {kind} {ns}/{p}"));
        assert!(
            status
                .lines()
                .any(|l| l.starts_with('+') && l.trim_end().ends_with("reason: Conflict"))
                && status.contains(&message),
            "{test}: {p}'s status: {status}"
        );
        assert!(!status.contains("ChildrenNotReady"), "{test}: {status}");
    }
    for foreign in [
        "mine: yes",
        "foreign-admin-password",
        &base64_of("foreign-admin-password"),
    ] {
        assert!(
            !out.contains(foreign),
            "{test}: the foreign object was diffed: {out}"
        );
    }
    eprintln!(
        "{test}: 3 parents × 2 children: nothing to change → exit 0; a template change for one \
         parent and a new password for all → exit 1, 4 changed (1 ConfigMap, 3 Secrets, values \
         redacted), 2 unchanged; {dry_runs} dry-run applies and 0 persisted writes; {:.2} s",
        took.as_secs_f64()
    );
}

/// The lines of `out` after the line `header`, up to the next `# ` line.
fn section(out: &str, header: &str) -> String {
    out.lines()
        .skip_while(|l| *l != header)
        .skip(1)
        .take_while(|l| !l.starts_with("# "))
        .collect::<Vec<_>>()
        .join("\n")
}

fn base64_of(s: &str) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for chunk in b.chunks(3) {
        let n = (chunk[0] as u32) << 16
            | (*chunk.get(1).unwrap_or(&0) as u32) << 8
            | *chunk.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Many parents whose children do not exist yet: every child is a dry-run create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_of_many_parents() {
    let n: usize = std::env::var("RULEBOOK_DIFF_PARENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let client = client().await;
    let ns = namespace(&client, "diff-many").await;
    let (kind, rule) = ("DiffMany", "diffmany");
    let d = RuleDir::new();
    d.template("config.yaml", CONFIG);
    d.template("secret.yaml", &secret(""));
    d.template("extra.yaml", &configmap_template("extra", "  k: v\n"));
    d.rule(
        "r.yaml",
        &rule_text(
            rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "config.yaml", &[]),
                child("secret", "v1", "Secret", "secret.yaml", &[]),
                child("extra", "v1", "ConfigMap", "extra.yaml", &[]),
            ],
        ),
    );
    let crds = crds_api(&client);
    put(&crds, &crd(kind)).await;
    wait_established(&client, &format!("{}.{GROUP}", plural(kind))).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    put_all(
        &parents,
        (0..n)
            .map(|i| {
                parent(
                    kind,
                    &ns,
                    &format!("m{i}"),
                    json!({"team": "b", "password": "x"}),
                )
            })
            .collect(),
        16,
    )
    .await;
    let started = Instant::now();
    let (code, out, err) = diff(&d, &ns, &[]);
    let took = started.elapsed();
    assert_eq!(code, 1, "{out}\n{err}");
    let summary = out.lines().last().unwrap_or("");
    assert!(
        summary.contains(&format!(
            "{n} parents; children: 0 unchanged, 0 changed, {} created",
            3 * n
        )),
        "{summary}"
    );
    eprintln!(
        "diff_of_many_parents: {n} parents × 3 children (all to be created): {:.1} s, {:.0} dry-run applies/s",
        took.as_secs_f64(),
        (3 * n) as f64 / took.as_secs_f64()
    );
}

/// The value of the Secret a hostile pull request goes after.
const STOLEN: &str = "correct-horse-battery-staple-42";

/// A rule `rule` for `kind` whose templates and status print what reference `stolen`
/// (Secret `cloud-creds` of namespace `victim`) holds: a ConfigMap's annotations (base64,
/// decoded, a slice), a Deployment's env value, a status field, and for a parent whose
/// `spec.leak` is `label` a label value the API server refuses, quoting it.
fn hostile_rule(d: &RuleDir, rule: &str, kind: &str, victim: &str) {
    let text = rule_text(
        rule,
        kind,
        &[
            child("config", "v1", "ConfigMap", "config.yaml", &[]),
            child("app", "apps/v1", "Deployment", "app.yaml", &[]),
        ],
    );
    let refs = format!(
        "  references:\n    - name: stolen\n      apiVersion: v1\n      kind: Secret\n      namespace: {victim}\n      objectName: \"'cloud-creds'\"\n  status:\n    stolen:\n      expr: \"refs.stolen.data.token | b64decode\"\n  children:\n"
    );
    d.rule("r.yaml", &text.replacen("  children:\n", &refs, 1));
    d.template(
        "config.yaml",
        r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-config" }}
  annotations:
    leak-b64: {{ refs.stolen.data.token }}
    leak-plain: {{ refs.stolen.data.token | b64decode }}
    leak-slice: {{ (refs.stolen.data.token | b64decode)[3:17] }}
{% if parent.spec.leak == "label" %}  labels:
    leak: {{ "not a label " ~ (refs.stolen.data.token | b64decode) }}
{% endif %}data:
  team: {{ parent.spec.team }}
"#,
    );
    d.template(
        "app.yaml",
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ parent.metadata.name }}
spec:
  replicas: 0
  selector:
    matchLabels: {app: {{ parent.metadata.name }}}
  template:
    metadata:
      labels: {app: {{ parent.metadata.name }}}
    spec:
      containers:
        - name: app
          image: registry.example.com/app:1
          env:
            - name: TOKEN
              value: {{ refs.stolen.data.token | b64decode }}
"#,
    );
}

/// Every form of [`STOLEN`] a leak could take.
fn stolen_forms() -> Vec<String> {
    vec![
        STOLEN.to_string(),
        base64_of(STOLEN),
        STOLEN[3..17].to_string(),
        base64_of(STOLEN)[4..20].to_string(),
    ]
}

fn assert_nothing_stolen(test: &str, what: &str, out: &str, err: &str) {
    for form in stolen_forms() {
        assert!(
            !out.contains(&form) && !err.contains(&form),
            "{test}: {what}: '{form}' was printed:\n{out}\n{err}"
        );
    }
}

/// A pull request adds a reference to another namespace's Secret and prints it every way
/// it can. Against the base branch's rules (`--base-rules`) the reference is refused and
/// never read: exit 2, each parent's error names it. Let through
/// (`--allow-new-references`), or in a trusted run (no base), it is read, and no byte of
/// it is printed in any output form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_request_cannot_print_a_secret() {
    let test = "a_pull_request_cannot_print_a_secret";
    let client = client().await;
    let ns = namespace(&client, "diff-pr").await;
    let victim = namespace(&client, "diff-victim").await;
    let (kind, rule) = ("DiffPr", "diffpr");
    let secrets = api(&client, Some(&victim), "v1", "Secret", "secrets");
    put(
        &secrets,
        &json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "cloud-creds", "namespace": victim},
                "stringData": {"token": STOLEN}}),
    )
    .await;
    // The base branch: the same rule, without the reference.
    let base = RuleDir::new();
    base.template("config.yaml", CONFIG);
    base.rule(
        "r.yaml",
        &rule_text(
            rule,
            kind,
            &[child("config", "v1", "ConfigMap", "config.yaml", &[])],
        ),
    );
    let pr = RuleDir::new();
    hostile_rule(&pr, rule, kind, &victim);
    let crds = crds_api(&client);
    put(&crds, &crd(kind)).await;
    wait_established(&client, &format!("{}.{GROUP}", plural(kind))).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    for (n, leak) in [("p-ok", "annotations"), ("p-bad", "label")] {
        put(
            &parents,
            &parent(kind, &ns, n, json!({"team": "a", "leak": leak})),
        )
        .await;
    }
    let base_args = ["--base-rules", base.rules.to_str().unwrap()];
    let refusal = format!(
        "refs.stolen: reads Secret {victim}/cloud-creds, which the base rules do not read; refused (--allow-new-references)"
    );
    // Against the base: refused, in text and JSON.
    let (code, out, err) = diff(&pr, &ns, &base_args);
    assert_eq!(code, 2, "{test}: {out}\n{err}");
    for p in ["p-ok", "p-bad"] {
        assert!(
            out.contains(&format!("# error: {kind} {ns}/{p}: {refusal}")),
            "{test}: {out}\n{err}"
        );
    }
    assert_nothing_stolen(test, "refused, text", &out, &err);
    let (code, out, err) = diff(&pr, &ns, &[&base_args[..], &["-o", "json"]].concat());
    assert_eq!(code, 2, "{test}: {out}\n{err}");
    let reports: Json = serde_json::from_str(&out).expect("JSON");
    let errors = reports[0]["errors"].as_array().cloned().unwrap_or_default();
    assert_eq!(errors.len(), 2, "{test}: {out}");
    assert!(
        errors.iter().all(|e| e[1] == refusal.as_str()),
        "{test}: {out}"
    );
    assert_nothing_stolen(test, "refused, JSON", &out, &err);

    // Read after all: cleaned from the object diffs, the status diff, the error line.
    let allow = [&base_args[..], &["--allow-new-references"]].concat();
    for (what, args, json) in [
        ("allowed, text", allow.clone(), false),
        (
            "allowed, JSON",
            [&allow[..], &["-o", "json"]].concat(),
            true,
        ),
        ("trusted, text", vec![], false),
        ("trusted, JSON", vec!["-o", "json"], true),
    ] {
        let (code, out, err) = diff(&pr, &ns, &args);
        assert_eq!(
            code, 2,
            "{test}: {what}: p-bad's label is refused: {out}\n{err}"
        );
        assert_nothing_stolen(test, what, &out, &err);
        let text = if json {
            let reports: Json = serde_json::from_str(&out).expect("JSON");
            assert_eq!(reports[0]["created"], 2, "{test}: {what}: {out}");
            assert_eq!(reports[0]["status_changed"], 1, "{test}: {what}: {out}");
            reports.to_string()
        } else {
            out.clone()
        };
        for shown in ["leak-plain", "leak-b64", "leak-slice", "TOKEN", "stolen:"] {
            assert!(text.contains(shown), "{test}: {what}: no {shown}: {out}");
        }
        assert!(
            text.matches("[redacted]").count() >= 6,
            "{test}: {what}: the values are not marked: {out}"
        );
        assert!(
            text.contains(&format!("{ns}/p-bad")),
            "{test}: {what}: p-bad's refusal: {out}"
        );
        assert_eq!(
            err.contains("references are not checked against a base"),
            args.is_empty() || args == ["-o", "json"],
            "{test}: {what}: {err}"
        );
    }
}

/// Whether the identity of `client` may `verb` `resource` (`name` in `ns`; `None`: every
/// namespace).
async fn may(client: &kube::Client, verb: &str, resource: &str, ns: Option<&str>) -> bool {
    use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
    let review: SelfSubjectAccessReview = serde_json::from_value(json!({
        "spec": {"resourceAttributes": {
            "verb": verb, "group": "", "resource": resource, "namespace": ns,
            "name": if verb == "get" { "cloud-creds" } else { "" },
        }}
    }))
    .expect("review");
    kube::Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&Default::default(), &review)
        .await
        .expect("access review")
        .status
        .is_some_and(|s| s.allowed)
}

/// The shipped rules, diffed as a ServiceAccount bound to exactly what `rulebook rbac
/// --diff-role --namespace <ns>` prints: it works (exit 0, no refusal, the Project's
/// Secret child not compared, the TeamApp's Secret reference read), and that identity
/// cannot read a Secret in kube-system, nor list Secrets anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_diff_role_diffs_the_shipped_rules_and_reads_no_other_secret() {
    let test = "the_diff_role_diffs_the_shipped_rules_and_reads_no_other_secret";
    let client = client().await;
    let ns = namespace(&client, "diff-role").await;
    let (rules, templates) = (repo().join("rules"), repo().join("templates"));
    let op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let label = unique("shipped");
    let projects = api(&client, Some(&ns), "xyz.com/v1", "Project", "projects");
    let apps = api(&client, Some(&ns), "xyz.com/v1", "TeamApp", "teamapps");
    for a in [&projects, &apps] {
        wait_for(T, "the shipped CRDs to be served", || async {
            a.list(&Default::default()).await.ok().map(|_| ())
        })
        .await;
    }
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    put(
        &secrets,
        &json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "db", "namespace": ns, "labels": {"team": "payments"}},
            "stringData": {"password": "teamapp-db-password"}}),
    )
    .await;
    let mut project = example("project.yaml", &ns);
    project["metadata"]["labels"] = json!({"rulebook-test": label});
    put(&projects, &project).await;
    put(
        &apps,
        &json!({"apiVersion": "xyz.com/v1", "kind": "TeamApp",
            "metadata": {"name": "shop", "namespace": ns, "labels": {"rulebook-test": label}},
            "spec": {"image": "shop:1", "team": "payments", "credentialsSecret": "db", "replicas": 0}}),
    )
    .await;
    wait_all_ready(&projects, &["apollo".to_string()].into(), T).await;
    wait_all_ready(&apps, &["shop".to_string()].into(), T).await;
    drop(op);

    let selector = format!("rulebook-test={label}");
    let dirs = (rules.as_path(), templates.as_path());
    let (code, admin, err) = diff_of(&kubeconfig_path(), dirs, &ns, &["--selector", &selector]);
    assert_eq!(code, 0, "{test}: as an administrator: {admin}\n{err}");
    let rbac = yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
        "--diff-role",
        "--name",
        &unique("rulebook-diff"),
        "--service-account",
        &format!("{ns}/differ"),
        "--namespace",
        &ns,
    ]));
    let kubeconfig = service_account_kubeconfig(&client, &ns, "differ", rbac).await;
    let base = ["--base-rules", rules.to_str().unwrap()];
    for extra in [
        vec!["--selector", &selector],
        [&base[..], &["--selector", &selector]].concat(),
    ] {
        let (code, out, err) = diff_of(kubeconfig.path(), dirs, &ns, &extra);
        assert_eq!(code, 0, "{test}: as the diff role {extra:?}: {out}\n{err}");
        assert!(
            !out.contains("forbidden") && !err.contains("forbidden"),
            "{test}: {out}\n{err}"
        );
        let summary = |rule: &str| {
            out.lines()
                .find(|l| l.starts_with(&format!("rule {rule}: ")))
                .unwrap_or("")
                .to_string()
        };
        assert!(
            summary("project").starts_with(
                "rule project: 1 parents; children: 1 unchanged, 0 changed, 0 created, 0 pruned, 0 orphaned, 1 not compared"
            ),
            "{test}: {out}"
        );
        assert!(
            summary("teamapp").starts_with(
                "rule teamapp: 1 parents; children: 2 unchanged, 0 changed, 0 created, 0 pruned, 0 orphaned, 0 not compared"
            ),
            "{test}: {out}"
        );
        assert!(!out.contains("teamapp-db-password"), "{test}: {out}");
    }
    // What that identity may do to Secrets: get by name in the namespace named, nothing
    // else.
    let sa = kube::Client::try_from(
        kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(kubeconfig.path()).expect("kubeconfig"),
            &Default::default(),
        )
        .await
        .expect("config"),
    )
    .expect("client");
    assert!(may(&sa, "get", "secrets", Some(&ns)).await, "{test}");
    for (verb, where_) in [
        ("get", Some("kube-system")),
        ("list", Some("kube-system")),
        ("list", None),
        ("list", Some(ns.as_str())),
        ("watch", None),
        ("create", Some(ns.as_str())),
        ("patch", Some(ns.as_str())),
    ] {
        assert!(
            !may(&sa, verb, "secrets", where_).await,
            "{test}: the diff role may {verb} Secrets in {where_:?}"
        );
    }
    let kube_system: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(sa, "kube-system");
    match kube_system.get("cloud-creds").await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{test}: {e:?}"),
        other => panic!("{test}: a Secret of kube-system: {other:?}"),
    }
}
