//! `rulebook diff` against the local control plane: a rule set on disk compared with the
//! objects a running operator made. Nothing changed: exit 0. A template change that
//! affects one parent: that parent's child diffed, nobody else's, exit 1. A Secret's
//! values are never printed. The audit log shows no persisted write, only dry runs. And
//! how long it takes for many parents (`RULEBOOK_DIFF_PARENTS`, default 300).

mod common;
mod faults_kit;

use std::collections::BTreeSet;
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
fn diff_as(
    kubeconfig: &std::path::Path,
    d: &RuleDir,
    ns: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .arg("diff")
        .arg("--rules")
        .arg(&d.rules)
        .arg("--templates")
        .arg(&d.templates)
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
    let op = Operator::start(&d.rules, &d.templates, Some(&ns), &["--install-crds"]).await;
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
    assert_eq!(
        out_sa.lines().last(),
        out_text.lines().last(),
        "{test}: the diff role sees what an administrator sees"
    );
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
    let (code, out, err) = diff(&d, &ns, &[]);
    assert_eq!(code, 2, "{test}: {out}\n{err}");
    assert!(
        out.contains(&format!(
            "# error: {kind} {ns}/p3: conflict: ConfigMap p3-config"
        )),
        "{test}: {out}"
    );
    assert!(
        !out.contains("mine: yes"),
        "{test}: the foreign object was diffed: {out}"
    );
    cleanup_namespace(&client, &other).await;
    eprintln!(
        "{test}: 3 parents × 2 children: nothing to change → exit 0; a template change for one \
         parent and a new password for all → exit 1, 4 changed (1 ConfigMap, 3 Secrets, values \
         redacted), 2 unchanged; {dry_runs} dry-run applies and 0 persisted writes; {:.2} s",
        took.as_secs_f64()
    );
    cleanup_namespace(&client, &ns).await;
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
    cleanup_namespace(&client, &ns).await;
}
