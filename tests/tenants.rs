//! Tenant and operator-safety reproductions against the local control plane, with
//! `rulebook run` as a child process: what a rule author's routine change, a tenant's
//! objects or a stalled process must not be able to do to the operator or to other
//! tenants. Each was written to fail on the code that had the bug and stays as its
//! regression test:
//!
//! 1. moving a child kind to another API version of the same kind (autoscaling/v2 → v1)
//!    by a hot reload must not delete and recreate the children;
//! 2. one parent nested deeper than the JSON parser allows must not stop the whole rule
//!    (its LIST fails), and the operator must not log parents' content;
//! 3. a tenant's ConfigMaps that merely carry a rule's child labels must not be cached
//!    by the operator (200 × 512 KiB must not grow its memory);
//! 4. an object in another namespace labelled and owner-referenced as a parent's child
//!    must not feed that parent's templates or status, nor be deleted by Rulebook;
//! 5. an expensive render must not block `/healthz` and must fail its parent with
//!    `RenderBudgetExceeded`;
//! 6. a leader stopped (SIGSTOP) past its lease must never write after another instance
//!    took over, even with reconciles in flight when it resumes;
//! 7. one namespace's thousand parents must not hold back another namespace's parent.
//!
//! Every test prints its figures (`--nocapture`) for docs/faults.md.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(180);
const MIB: u64 = 1 << 20;

/// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
fn proc_bytes(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A short id for rule names and selectors that no earlier run used.
fn run_id(prefix: &str) -> String {
    unique(prefix)
}

/// The rule's four child labels, as a tenant would copy them.
fn child_labels(rule: &str, owner: &str, child: &str) -> Json {
    json!({
        "app.kubernetes.io/managed-by": "rulebook",
        "rulebook.dev/rule": rule,
        "rulebook.dev/owner": owner,
        "rulebook.dev/child": child,
    })
}

// ---------------------------------------------------------------------------------------
// 1. A child kind moved to another API version by a hot reload.

const HPA_V2: &str = r#"apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ parent.metadata.name }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ parent.metadata.name }}
  minReplicas: 1
  maxReplicas: 3
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: 80
"#;

const HPA_V1: &str = r#"apiVersion: autoscaling/v1
kind: HorizontalPodAutoscaler
metadata:
  name: {{ parent.metadata.name }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ parent.metadata.name }}
  minReplicas: 1
  maxReplicas: 3
  targetCPUUtilizationPercentage: 80
"#;

/// The rule's HorizontalPodAutoscaler children move from `autoscaling/v2` to
/// `autoscaling/v1` (the same objects, served in two versions) by a hot reload: every HPA
/// keeps its UID and nothing deletes one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiversion_move_keeps_children() {
    const N: usize = 3;
    let test = "apiversion_move_keeps_children";
    let client = client().await;
    let ns = namespace(&client, "tenants-hpa").await;
    let kind = "TenantHpa";
    let rule = "tenanthpa";
    let d = RuleDir::new();
    let rule_for = |version: &str, template: &str| {
        rule_text(
            rule,
            kind,
            &[child(
                "hpa",
                &format!("autoscaling/{version}"),
                "HorizontalPodAutoscaler",
                template,
                &[],
            )],
        )
    };
    d.template("hpa/v2.yaml", HPA_V2);
    d.rule("hpa.yaml", &rule_for("v2", "hpa/v2.yaml"));
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let hpas = api(
        &client,
        Some(&ns),
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        "horizontalpodautoscalers",
    );
    let names: BTreeSet<String> = (0..N).map(|i| format!("p{i}")).collect();
    put_all(
        &parents,
        names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"rev": 0})))
            .collect(),
        4,
    )
    .await;
    wait_all_ready(&parents, &names, T).await;
    let sel = format!("rulebook.dev/rule={rule}");
    let uids = |hpas: Vec<Json>| -> BTreeMap<String, String> {
        hpas.iter().map(|o| (name_of(o), uid_of(o))).collect()
    };
    let before = uids(list(&hpas, Some(&sel)).await);
    assert_eq!(
        before.len(),
        N,
        "one HPA per parent before the move: {before:?}"
    );
    let v_old = status(&op).await["rules"][rule]["version"]
        .as_str()
        .expect("the rule's version on /status")
        .to_string();

    // The move: the new template first (no rule uses it yet), then the rule file in one
    // rename (names starting with `.` are not read), so no half-written rule set loads.
    d.template("hpa/v1.yaml", HPA_V1);
    let audit = Audit::mark();
    let moved = Instant::now();
    let tmp = d.rules.join(".hpa.yaml.tmp");
    std::fs::write(&tmp, rule_for("v1", "hpa/v1.yaml")).unwrap();
    std::fs::rename(&tmp, d.rules.join("hpa.yaml")).unwrap();
    let v_new = wait_for(
        Duration::from_secs(60),
        "the operator to run the new rule version",
        || async {
            let s = status(&op).await;
            let r = &s["rules"][rule];
            let v = r["version"].as_str()?;
            (v != v_old && r["state"] == "running").then(|| v.to_string())
        },
    )
    .await;
    wait_for(
        T,
        "every parent reconciled by the new rule version (status.ruleVersion) and Ready",
        || async {
            for p in &names {
                let p = get_json(&parents, p).await?;
                if !is_ready(&p) || p["status"]["ruleVersion"] != v_new.as_str() {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    let took = moved.elapsed();
    let after = uids(list(&hpas, Some(&sel)).await);
    let replaced: Vec<String> = before
        .iter()
        .filter(|(n, uid)| after.get(*n) != Some(*uid))
        .map(|(n, uid)| format!("{n}: {uid} → {:?}", after.get(n)))
        .collect();
    let deletes: Vec<String> = audit
        .writes(&ns)
        .iter()
        .filter(|e| {
            e["verb"] == "delete" && e["objectRef"]["resource"] == "horizontalpodautoscalers"
        })
        .map(describe_audit)
        .collect();
    eprintln!(
        "{test}: {N} HPA children moved from autoscaling/v2 to autoscaling/v1 by a hot reload \
         (rule version {v_old} → {v_new}), all at the new version and every parent Ready \
         {:.1} s later: {} of {N} replaced (new UID), {} HPA deletes in the audit log since the reload",
        took.as_secs_f64(),
        replaced.len(),
        deletes.len()
    );
    assert!(
        replaced.is_empty() && deletes.is_empty(),
        "{test}: moving the child's apiVersion deleted and recreated the children: \
         replaced {replaced:?}; deletes in the audit log: {deletes:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 2. A parent nested too deep for the JSON parser.

/// A free-form spec (`spec.crd` without `specSchema`) lets a tenant create a parent
/// nested 200 levels deep. After a restart the operator must LIST every parent: the
/// other parents must still be reconciled, and no parent's content may reach the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_parent_does_not_stop_the_rule() {
    const N: usize = 3;
    const DEPTH: usize = 200;
    let test = "deep_parent_does_not_stop_the_rule";
    let mut rng = Rng::new(test);
    let client = client().await;
    let ns = namespace(&client, "tenants-deep").await;
    let kind = "TenantDeep";
    let rule = "tenantdeep";
    let d = RuleDir::new();
    let text = rule_text(
        rule,
        kind,
        &[child("config", "v1", "ConfigMap", "deep/config.yaml", &[])],
    );
    let schema =
        "    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n";
    assert!(text.contains(schema));
    d.rule("deep.yaml", &text.replace(schema, ""));
    d.template(
        "deep/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    let args = ["--install-crds"];
    let mut first = d.operator().namespace(&ns).flags(&args).start().await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let mut markers = BTreeMap::new();
    let mut marker = |name: &str| {
        let m = format!("tenant-secret-{:016x}", rng.next());
        markers.insert(name.to_string(), m.clone());
        m
    };
    let names: Vec<String> = (0..N).map(|i| format!("n{i}")).collect();
    for p in &names {
        let note = marker(p);
        put(
            &parents,
            &parent(kind, &ns, p, json!({"rev": 0, "note": note})),
        )
        .await;
    }
    for p in &names {
        wait_ready(&parents, p, "True", None, T).await;
    }

    // The deep parent, with a plain JSON POST (the test's own client would fail to read
    // the answer back, as the operator does).
    let mut deep = json!({"note": marker("deep")});
    for _ in 0..DEPTH {
        deep = json!({"a": deep});
    }
    let body = parent(kind, &ns, "deep", json!({"rev": 0, "deep": deep}));
    let url = format!("/apis/{API_VERSION}/namespaces/{ns}/{}", plural(kind));
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .unwrap();
    client
        .request_text(req)
        .await
        .unwrap_or_else(|e| panic!("{test}: the API server refused the deep parent: {e}"));

    // A restart: the new process must LIST the parents, the deep one among them.
    first.signal_and_wait("KILL");
    let restarted = Instant::now();
    let second = d.operator().namespace(&ns).flags(&args).start().await;
    // A change to an existing parent and a new parent, both after the restart.
    merge(&parents, "n0", json!({"spec": {"rev": 1}})).await;
    let note = marker("n-new");
    put(
        &parents,
        &parent(kind, &ns, "n-new", json!({"rev": 1, "note": note})),
    )
    .await;
    let served = poll_for(Duration::from_secs(60), || async {
        for (p, rev) in [("n0", "1"), ("n-new", "1"), ("n1", "0"), ("n2", "0")] {
            let o = get_json(&parents, p).await?;
            if !is_ready(&o) {
                return None;
            }
            let c = get_json(&cms, &format!("{p}-config")).await?;
            if c["data"]["rev"] != rev {
                return None;
            }
        }
        Some(restarted.elapsed())
    })
    .await;
    let mut leaked = Vec::new();
    let mut log_bytes = 0;
    for op in [&first, &second] {
        let log = std::fs::read_to_string(&op.log).unwrap_or_default();
        log_bytes += log.len();
        for (p, m) in &markers {
            if log.contains(m.as_str()) {
                leaked.push(format!("{p} ({})", op.log.display()));
            }
        }
    }
    let states = status(&second).await["rules"][rule].clone();
    eprintln!(
        "{test}: a parent nested {DEPTH} deep beside {N} others, operator restarted: {}; \
         {} of {} parents' marker strings in the operator logs ({log_bytes} bytes); rule on /status: {states}",
        match served {
            Some(t) => format!(
                "the other parents reconciled {:.1} s after the restart",
                t.as_secs_f64()
            ),
            None => "the other parents NOT reconciled within 60 s of the restart".into(),
        },
        leaked.len(),
        markers.len()
    );
    assert!(
        served.is_some() && leaked.is_empty(),
        "{test}: after the restart the other parents {} reconciled, and parents' content \
         reached the operator log: {leaked:?}\n--- operator log ---\n{}",
        if served.is_some() { "were" } else { "were NOT" },
        second.log_tail().chars().take(4000).collect::<String>()
    );
}

// ---------------------------------------------------------------------------------------
// 3. A tenant's lookalike ConfigMaps and the operator's memory.

/// 200 ConfigMaps of 512 KiB in a tenant's namespace carrying a rule's child labels (no
/// owner reference), half of it content and half annotations, must not grow a
/// cluster-wide operator's memory by more than 32 MiB once it has seen them, nor its
/// peak by more than 96 MiB, neither while it runs nor when it starts with them present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_configmaps_do_not_grow_memory() {
    const SPOOFS: usize = 200;
    const SIZE: usize = 256 << 10;
    // Annotations may hold 256 KiB in all, keys included.
    const ANNOTATIONS: usize = 240 << 10;
    // What the operator may keep once it has seen them (measured +3.8 MiB with content
    // only; the code that kept their metadata would keep 47 MiB of annotations).
    const KEPT: u64 = 32 * MIB;
    // Content is never kept, but a restart lists the 100 MiB in pages of 25 objects
    // (12.5 MiB): the response body, its text and the decoded objects are three copies of
    // a page, and freed pages can stay with different allocator arenas (2 worker threads
    // and the blocking pool). Measured peaks: +40.7 and +65.8 MiB over the baseline; the
    // code that kept the content peaked at +200 MiB.
    const BOUND: u64 = 96 * MIB;
    let test = "spoofed_configmaps_do_not_grow_memory";
    let client = client().await;
    let ns = namespace(&client, "tenants-mem").await;
    let tenant = namespace(&client, "tenants-mem-spoof").await;
    let kind = "TenantMem";
    // Cluster-wide: a rule name and a parent selector of this run only.
    let rule = run_id("mem");
    let selector = format!("tenants.rulebook.dev/run={rule}");
    let d = RuleDir::new();
    d.rule(
        "mem.yaml",
        &rule_text(
            &rule,
            kind,
            &[child("config", "v1", "ConfigMap", "mem/config.yaml", &[])],
        ),
    );
    d.template(
        "mem/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    let args = ["--install-crds", "--selector", selector.as_str()];
    let mut op = d.operator().flags(&args).start().await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let labelled = |p: &str| {
        let mut o = parent(kind, &ns, p, json!({"rev": 0}));
        o["metadata"]["labels"] = json!({"tenants.rulebook.dev/run": rule});
        o
    };
    let converge = |names: Vec<String>| {
        let parents = parents.clone();
        let objs: Vec<Json> = names.iter().map(|p| labelled(p)).collect();
        async move {
            put_all(&parents, objs, 4).await;
            wait_all_ready(&parents, &names.into_iter().collect(), T).await;
        }
    };
    converge((0..5).map(|i| format!("a{i}")).collect()).await;
    let pid = op.pid();
    let (rss0, hwm0) = (proc_bytes(pid, "VmRSS"), proc_bytes(pid, "VmHWM"));

    // The tenant's ConfigMaps: the rule's labels, an owner label, no owner reference.
    let spoofs = api(&client, Some(&tenant), "v1", "ConfigMap", "configmaps");
    let blob = "x".repeat(SIZE);
    let note = "y".repeat(ANNOTATIONS);
    let objs: Vec<Json> = (0..SPOOFS)
        .map(|i| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("spoof-{i}"), "namespace": tenant,
                    "labels": child_labels(&rule, &format!("00000000-0000-0000-0000-{i:012}"), "config"),
                    "annotations": {"tenant.example/note": note}},
                "data": {"blob": blob}})
        })
        .collect();
    let created = Instant::now();
    put_all(&spoofs, objs, 4).await;
    let create_time = created.elapsed();
    // Parents created after the spoofs converge only once the operator's ConfigMap watch
    // has delivered their children, that is every spoof before them.
    converge((0..3).map(|i| format!("b{i}")).collect()).await;
    let (rss1, hwm1) = (proc_bytes(pid, "VmRSS"), proc_bytes(pid, "VmHWM"));

    // A restart with the spoofs present: the new process lists them all.
    op.signal_and_wait("KILL");
    let op = d.operator().flags(&args).start().await;
    wait_for(T, "the restarted operator's caches to sync", || async {
        (status(&op).await["rules"][&rule]["synced"] == true).then_some(())
    })
    .await;
    converge((0..2).map(|i| format!("c{i}")).collect()).await;
    let pid2 = op.pid();
    let (rss2, hwm2) = (proc_bytes(pid2, "VmRSS"), proc_bytes(pid2, "VmHWM"));
    let mib = |b: u64| b as f64 / MIB as f64;
    eprintln!(
        "{test}: {SPOOFS} lookalike ConfigMaps of {} KiB content and {} KiB annotations ({:.0} MiB, created in {:.1} s) in another namespace: \
         operator RSS {:.1} → {:.1} MiB, peak {:.1} → {:.1} MiB; restarted with them present: RSS {:.1} MiB, peak {:.1} MiB \
         (bounds: baseline + {} MiB kept, + {} MiB at the peak)",
        SIZE >> 10,
        ANNOTATIONS >> 10,
        mib((SPOOFS * (SIZE + ANNOTATIONS)) as u64),
        create_time.as_secs_f64(),
        mib(rss0),
        mib(rss1),
        mib(hwm0),
        mib(hwm1),
        mib(rss2),
        mib(hwm2),
        KEPT / MIB,
        BOUND / MIB
    );
    // The 100 MiB of spoofs go with `tenant` (a TestNamespace) whatever the outcome.
    let over: Vec<String> = [
        ("RSS after the spoofs", rss1, rss0, KEPT),
        ("peak after the spoofs", hwm1, hwm0, BOUND),
        ("RSS after the restart", rss2, rss0, BOUND),
        ("peak after the restart", hwm2, hwm0, BOUND),
    ]
    .iter()
    .filter(|(_, v, base, bound)| *v > base + bound)
    .map(|(what, v, base, bound)| {
        format!(
            "{what}: +{:.1} MiB (bound + {} MiB)",
            mib(v - base),
            bound / MIB
        )
    })
    .collect();
    assert!(
        over.is_empty(),
        "{test}: a tenant's lookalike ConfigMaps grew the operator's memory: {over:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 4. A fake child in another namespace.

/// A tenant in namespace B creates a ConfigMap labelled as parent P's (namespace A) child
/// `extra` (which the rule leaves out: `includeWhen: false`), with a controller
/// ownerReference to P. P's status reads `children.extra.data.v`. The fake value must
/// show nowhere, and Rulebook must not write in namespace B. (No template reads `extra`:
/// a child that did would wait for it, and be left out with it, issue 47.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_child_in_another_namespace_is_ignored() {
    let test = "fake_child_in_another_namespace_is_ignored";
    let client = client().await;
    let ns = namespace(&client, "tenants-fake").await;
    let tenant = namespace(&client, "tenants-fake-other").await;
    let kind = "TenantFake";
    // Cluster-wide: a rule name and a parent selector of this run only.
    let rule = run_id("fake");
    let selector = format!("tenants.rulebook.dev/run={rule}");
    let d = RuleDir::new();
    let text = rule_text(
        &rule,
        kind,
        &[
            child("main", "v1", "ConfigMap", "fake/main.yaml", &[]),
            child(
                "extra",
                "v1",
                "ConfigMap",
                "fake/extra.yaml",
                &["includeWhen: \"false\""],
            ),
        ],
    );
    let text = text.replacen(
        "  crd:\n",
        "  status:\n    extra:\n      expr: \"children.extra.data.v | default('none')\"\n  crd:\n",
        1,
    );
    d.rule("fake.yaml", &text);
    d.template(
        "fake/main.yaml",
        &configmap_template("main", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d.template(
        "fake/extra.yaml",
        &configmap_template("extra", "  v: \"real\"\n"),
    );
    let args = ["--install-crds", "--selector", selector.as_str()];
    let _op = d.operator().flags(&args).start().await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let mine = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let labelled = |p: &str, rev: u64| {
        let mut o = parent(kind, &ns, p, json!({"rev": rev}));
        o["metadata"]["labels"] = json!({"tenants.rulebook.dev/run": rule});
        o
    };
    put(&parents, &labelled("p", 0)).await;
    let p = wait_ready(&parents, "p", "True", None, T).await;
    assert_eq!(
        &p["status"]["extra"],
        &json!("none"),
        "{test}: before the fake: {}",
        p["status"]
    );

    // The fake, kept by a finalizer (the garbage collector deletes a dependent whose
    // namespaced owner is not in its own namespace).
    let fake_value = format!("fake-{rule}");
    let other = api(&client, Some(&tenant), "v1", "ConfigMap", "configmaps");
    let audit = Audit::mark();
    let fake = to_json(
        &put(
            &other,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "p-extra", "namespace": tenant,
                    "labels": child_labels(&rule, &uid_of(&p), "extra"),
                    "finalizers": ["tenants.rulebook.dev/keep"],
                    "ownerReferences": [{"apiVersion": API_VERSION, "kind": kind, "name": "p",
                        "uid": uid_of(&p), "controller": true}]},
                "data": {"v": fake_value}}),
        )
        .await,
    );
    // A parent created after the fake converges only once the operator's ConfigMap watch
    // has delivered its child, and so the fake before it.
    put(&parents, &labelled("q", 0)).await;
    wait_ready(&parents, "q", "True", None, T).await;
    // A reconcile of P after that.
    merge(&parents, "p", json!({"spec": {"rev": 1}})).await;
    let p = wait_for(T, "P's status for its new generation", || async {
        let o = get_json(&parents, "p").await?;
        let observed = o.pointer("/status/observedGeneration")?;
        (Some(observed) == o.pointer("/metadata/generation")).then_some(o)
    })
    .await;
    let main = get_json(&mine, "p-main").await.expect("p-main");
    let fake_now = get_json(&other, "p-extra").await;
    let writes_b: Vec<String> = audit
        .writes(&tenant)
        .iter()
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .unwrap_or("")
                .starts_with("rulebook/")
        })
        .map(describe_audit)
        .collect();
    let shown = [
        ("status.extra", p["status"]["extra"].clone()),
        ("p-main data.rev", main["data"]["rev"].clone()),
    ];
    eprintln!(
        "{test}: a ConfigMap in another namespace labelled and owner-referenced as P's child \
         `extra` (value {fake_value:?}); after a reconcile of P: {}; Rulebook writes in the other \
         namespace: {} {writes_b:?}; the fake {}",
        shown
            .iter()
            .map(|(w, v)| format!("{w} = {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        writes_b.len(),
        match &fake_now {
            Some(o) if uid_of(o) == uid_of(&fake) && rv_of(o) == rv_of(&fake) =>
                "untouched".to_string(),
            Some(o) => format!(
                "changed (deletionTimestamp {}, resourceVersion {} → {})",
                o["metadata"]["deletionTimestamp"],
                rv_of(&fake),
                rv_of(o)
            ),
            None => "gone".to_string(),
        }
    );
    // Let the namespace go.
    merge(&other, "p-extra", json!({"metadata": {"finalizers": null}})).await;
    let leaked: Vec<String> = shown
        .iter()
        .filter(|(w, v)| {
            if w.starts_with("p-main") {
                v != "1"
            } else {
                v != "none"
            }
        })
        .map(|(w, v)| format!("{w} = {v}"))
        .collect();
    assert!(
        leaked.is_empty() && writes_b.is_empty(),
        "{test}: the fake child's value reached P: {leaked:?}; Rulebook's writes in the \
         tenant's namespace: {writes_b:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 5. An expensive render.

/// Two parents whose template repeats an expensive filter over their ~900 KB spec
/// (within the fuel: each call is one instruction): `/healthz` must keep answering
/// within 1 s, and the parents must end `Ready=False`, reason `RenderBudgetExceeded`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_render_keeps_health_and_fails_with_budget() {
    // ~80 ms per round in a debug build: ~8 s of CPU per render unbounded. Two parents,
    // as many as the operator's runtime has worker threads (2 cores).
    const ROUNDS: u64 = 100;
    const HEAVY: usize = 2;
    let test = "heavy_render_keeps_health_and_fails_with_budget";
    let client = client().await;
    let ns = namespace(&client, "tenants-heavy").await;
    let kind = "TenantHeavy";
    let rule = "tenantheavy";
    let d = RuleDir::new();
    d.rule(
        "heavy.yaml",
        &rule_text(
            rule,
            kind,
            &[child("out", "v1", "ConfigMap", "heavy/out.yaml", &[])],
        ),
    );
    d.template(
        "heavy/out.yaml",
        "{% for i in range(parent.spec.rounds) %}{% if (parent.spec.blob | replace(\"a\", \"bb\") | length) < 0 %}x{% endif %}{% endfor %}\n\
         apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-out\" }}\ndata:\n  rounds: {{ parent.spec.rounds | string }}\n",
    );
    let op = d.start_in(&ns).await;
    let parents = kind_api(&client, &ns, kind, T).await;
    // A light parent first: the rule serves.
    put(
        &parents,
        &parent(kind, &ns, "light", json!({"rounds": 1, "blob": "a"})),
    )
    .await;
    wait_ready(&parents, "light", "True", None, T).await;

    let stop = Arc::new(AtomicBool::new(false));
    let worst_ms = Arc::new(AtomicU64::new(0));
    let polls = Arc::new(AtomicU64::new(0));
    let poller = {
        let (stop, worst_ms, polls) = (stop.clone(), worst_ms.clone(), polls.clone());
        let url = format!("http://127.0.0.1:{}/healthz", op.metrics_port);
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                let ok = http_get(&url).await.is_ok_and(|b| b.trim() == "ok");
                // A failed probe counts as at least 1 s late.
                let ms = if ok {
                    t.elapsed().as_millis() as u64
                } else {
                    (t.elapsed().as_millis() as u64).max(1000)
                };
                worst_ms.fetch_max(ms, Ordering::SeqCst);
                polls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let blob = "a".repeat(900_000);
    let names: Vec<String> = (0..HEAVY).map(|i| format!("heavy{i}")).collect();
    let created = Instant::now();
    for p in &names {
        put(
            &parents,
            &parent(kind, &ns, p, json!({"rounds": ROUNDS, "blob": blob})),
        )
        .await;
    }
    // Each heavy parent's first verdict for its generation, whatever it is.
    let mut verdicts = Vec::new();
    for p in &names {
        let v = poll_for(Duration::from_secs(120), || async {
            let o = get_json(&parents, p).await?;
            let c = ready_condition(&o)?;
            (o.pointer("/status/observedGeneration") == o.pointer("/metadata/generation"))
                .then_some(c)
        })
        .await;
        verdicts.push((p.clone(), v, created.elapsed()));
    }
    stop.store(true, Ordering::SeqCst);
    poller.await.unwrap();
    let worst = Duration::from_millis(worst_ms.load(Ordering::SeqCst));
    // Other parents are still served.
    put(
        &parents,
        &parent(kind, &ns, "after", json!({"rounds": 1, "blob": "a"})),
    )
    .await;
    let after = poll_for(Duration::from_secs(30), || async {
        is_ready(&get_json(&parents, "after").await?).then_some(())
    })
    .await;
    for (p, v, t) in &verdicts {
        eprintln!(
            "{test}: {p} ({ROUNDS} × replace over 900 KB): {} {:.1} s after creation",
            match v {
                Some((s, r, m)) => format!(
                    "Ready={s} {r} ({})",
                    m.chars().take(200).collect::<String>()
                ),
                None => "no verdict".into(),
            },
            t.as_secs_f64()
        );
    }
    eprintln!(
        "{test}: worst /healthz latency {:.2} s over {} probes while {HEAVY} heavy parents rendered; \
         a light parent created afterwards {}",
        worst.as_secs_f64(),
        polls.load(Ordering::SeqCst),
        if after.is_some() {
            "was served"
        } else {
            "was NOT served within 30 s"
        }
    );
    let wrong: Vec<String> = verdicts
        .iter()
        .filter(|(_, v, _)| {
            !v.as_ref()
                .is_some_and(|(s, r, _)| s == "False" && r == "RenderBudgetExceeded")
        })
        .map(|(p, v, _)| format!("{p}: {v:?}"))
        .collect();
    assert!(
        worst < Duration::from_secs(1) && wrong.is_empty() && after.is_some(),
        "{test}: worst /healthz latency {:.2} s (must be < 1 s); parents not failed with \
         RenderBudgetExceeded: {wrong:?}; light parent served afterwards: {}",
        worst.as_secs_f64(),
        after.is_some()
    );
}

// ---------------------------------------------------------------------------------------
// 6. A leader stopped past its lease.

/// Two operators with leader election (6 s leases). The leader, op-a, is stopped with
/// SIGSTOP while it converges 150 parents; op-b takes over, converges them and applies
/// a change to all of them; then op-a is resumed. From the API server's audit log: op-a
/// must not write anything (leases aside) later than 1 s after it was stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_leader_never_writes() {
    const N: usize = 150;
    const LEASE: u64 = 6;
    let test = "stalled_leader_never_writes";
    let client = client().await;
    let ns = namespace(&client, "tenants-leader").await;
    let kind = "TenantLeader";
    let rule = "tenantleader";
    let d = RuleDir::new();
    d.rule(
        "leader.yaml",
        &rule_text(
            rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "leader/config.yaml", &[]),
                child("secret", "v1", "Secret", "leader/secret.yaml", &[]),
            ],
        ),
    );
    d.template(
        "leader/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d.template(
        "leader/secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\ndata:\n  rev: {{ parent.spec.rev | string | b64encode }}\n",
    );
    let lease = LEASE.to_string();
    let args = |id: &'static str| -> Vec<String> {
        [
            "--install-crds",
            "--concurrency",
            "16",
            "--leader-elect",
            "--lease-duration",
            lease.as_str(),
            "--lease-name",
            "tenants-leader",
            "--lease-namespace",
            ns.as_str(),
            "--identity",
            id,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let audit = Audit::mark();
    let a_args = args("op-a");
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let op_a = d.operator().namespace(&ns).flags(&a_args).start().await;
    wait_for(Duration::from_secs(60), "op-a to lead", || async {
        (op_a.metric("rulebook_leader").await == 1.0).then_some(())
    })
    .await;
    let b_args = args("op-b");
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let op_b = d.operator().namespace(&ns).flags(&b_args).start().await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let names: BTreeSet<String> = (0..N).map(|i| format!("p{i}")).collect();
    let spec = |rev: u64| {
        names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"rev": rev})))
            .collect::<Vec<_>>()
    };
    let writer = {
        let parents = parents.clone();
        let objs = spec(0);
        tokio::spawn(async move { put_all(&parents, objs, 16).await })
    };
    let ready_at_stop = wait_for(T, "op-a to be converging", || async {
        let ready = parents
            .list(&Default::default())
            .await
            .ok()?
            .items
            .iter()
            .map(to_json)
            .filter(is_ready)
            .count();
        (ready >= N / 10).then_some(ready)
    })
    .await;
    signal(op_a.pid(), "STOP");
    let stopped = jiff::Timestamp::now();
    let stopped_at = Instant::now();
    writer.await.unwrap();

    wait_for(Duration::from_secs(60), "op-b to lead", || async {
        (op_b.metric("rulebook_leader").await == 1.0).then_some(())
    })
    .await;
    let took_over = stopped_at.elapsed();
    wait_all_ready(&parents, &names, T).await;
    // A change only op-b applies.
    put_all(&parents, spec(1), 16).await;
    let rev_is = |want: &'static str| {
        let cms = cms.clone();
        async move {
            let all = list(&cms, Some(&format!("rulebook.dev/rule={rule}"))).await;
            all.iter().filter(|c| c["data"]["rev"] == want).count()
        }
    };
    wait_for(T, "op-b to apply rev 1 to every child", || async {
        (rev_is("1").await == N).then_some(())
    })
    .await;
    wait_all_ready(&parents, &names, T).await;

    signal(op_a.pid(), "CONT");
    let resumed = Instant::now();
    let stepped_down = wait_for(
        Duration::from_secs(60),
        "op-a to report it does not lead",
        || async { (op_a.metric("rulebook_leader").await == 0.0).then(|| resumed.elapsed()) },
    )
    .await;
    // Writes op-a's gate stopped (in the writer, in the client, or at the body as hyper
    // sent them): for the log, the audit log below is the check.
    let refused = op_a.metric("rulebook_writes_refused_total").await;
    // Two lease durations in which op-a must stay a standby and op-b the leader; any
    // child op-a put back to rev 0 is noted.
    let mut reverted_seen = 0;
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(2 * LEASE) {
        assert_eq!(
            op_a.metric("rulebook_leader").await,
            0.0,
            "op-a leads again"
        );
        assert_eq!(
            op_b.metric("rulebook_leader").await,
            1.0,
            "op-b stopped leading"
        );
        reverted_seen = reverted_seen.max(N - rev_is("1").await);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let cutoff = stopped
        .checked_add(jiff::SignedDuration::from_secs(1))
        .unwrap();
    let by_a: Vec<Json> = audit
        .writes(&ns)
        .into_iter()
        .filter(|e| e["userAgent"].as_str().unwrap_or("").contains("(op-a)"))
        .collect();
    let late: Vec<&Json> = by_a
        .iter()
        .filter(|e| audit_received(e).is_some_and(|t| t > cutoff))
        .collect();
    let (late_leases, late_writes): (Vec<&Json>, Vec<&Json>) = late
        .iter()
        .copied()
        .partition(|e| e["objectRef"]["resource"] == "leases");
    let by_b = audit
        .writes(&ns)
        .iter()
        .filter(|e| e["userAgent"].as_str().unwrap_or("").contains("(op-b)"))
        .count();
    eprintln!(
        "{test}: op-a stopped with {ready_at_stop}/{N} parents Ready; op-b led {:.1} s later; \
         op-a resumed after {:.1} s stopped and reported standby {:.2} s after SIGCONT \
         (its gate refused {refused} write(s)); writes in the audit log: op-a {} in all, {} more than 1 s after SIGSTOP ({} of them lease \
         requests), op-b {by_b}; children seen reverted to rev 0 after the resume: {reverted_seen}",
        took_over.as_secs_f64(),
        (resumed - stopped_at).as_secs_f64(),
        stepped_down.as_secs_f64(),
        by_a.len(),
        late.len(),
        late_leases.len(),
    );
    for e in late.iter().take(20) {
        eprintln!("{test}:   late op-a write: {}", describe_audit(e));
    }
    assert!(
        late_writes.is_empty(),
        "{test}: op-a wrote {} time(s) after it was stopped past its lease (op-b led): {:?}",
        late_writes.len(),
        late_writes
            .iter()
            .take(10)
            .map(|e| describe_audit(e))
            .collect::<Vec<_>>()
    );
    assert_eq!(rev_is("1").await, N, "every child at rev 1 at the end");
}

/// Parents and children over the cache budget (`--cache-namespace-mib 1`, six parents
/// and six children of ~300 KB) are cached as metadata only, announced by a
/// `CacheBudgetExceeded` event and a metric, and read from the API server when a
/// reconcile needs them: every parent still converges, its status reads its child's
/// content, and a change still reaches every child.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_over_the_cache_budget_are_read_on_demand() {
    let client = client().await;
    let ns = namespace(&client, "tenants-budget").await;
    let kind = "TenantBudget";
    let rule = "tenantbudget";
    let d = RuleDir::new();
    d.template(
        "b/cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-big\" }}\ndata:\n  blob: {{ parent.spec.blob }}\n  rev: {{ parent.spec.rev | string }}\n",
    );
    let text = rule_text(
        rule,
        kind,
        &[child("big", "v1", "ConfigMap", "b/cm.yaml", &[])],
    )
    .replace(
        "  crd:\n",
        "  status:\n    rev:\n      expr: \"children.big.data.rev | default('none')\"\n  crd:\n",
    );
    d.rule("budget.yaml", &text);
    let op = d
        .operator()
        .namespace(&ns)
        .flags(&["--install-crds", "--cache-namespace-mib", "1"])
        .start()
        .await;
    let parents = kind_api(&client, &ns, kind, T).await;
    let blob = "x".repeat(300 * 1024);
    let names: BTreeSet<String> = (0..6).map(|i| format!("p{i}")).collect();
    put_all(
        &parents,
        names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"blob": blob, "rev": 1})))
            .collect(),
        3,
    )
    .await;
    wait_all_ready(&parents, &names, T).await;
    let rev_of = |o: &Json| o["status"]["rev"].as_str().unwrap_or("").to_string();
    wait_for(T, "every parent's status to read its child", || async {
        let all = list(&parents, None).await;
        (all.len() == names.len() && all.iter().all(|o| rev_of(o) == "1")).then_some(())
    })
    .await;
    let stubbed_series = |cache: &str| {
        format!("rulebook_cache_stubbed_objects_total{{rule=\"{rule}\",cache=\"{cache}\"}}")
    };
    // Each fails when its series is not exported.
    let stubbed = op.metric(&stubbed_series("children")).await;
    let parents_stubbed = op.metric(&stubbed_series("parents")).await;
    assert!(
        stubbed >= 1.0 && parents_stubbed >= 1.0,
        "some children ({stubbed}) and parents ({parents_stubbed}) were cached without content"
    );
    let mut held = 0.0;
    for cache in ["parents", "children", "references"] {
        let series = format!("rulebook_cache_content_bytes{{cache=\"{cache}\"}}");
        held += op.metric(&series).await;
    }
    assert!(
        held <= (1 << 20) as f64,
        "content held {held} > 1 MiB budget"
    );
    let events = api(&client, Some(&ns), "events.k8s.io/v1", "Event", "events");
    wait_for(T, "a CacheBudgetExceeded event", || async {
        list(&events, None)
            .await
            .iter()
            .any(|e| e["reason"] == "CacheBudgetExceeded")
            .then_some(())
    })
    .await;

    // A change still reaches every child (each stubbed child is read to be compared).
    for p in &names {
        merge(&parents, p, json!({"spec": {"rev": 2}})).await;
    }
    wait_for(
        T,
        "every parent's status to read rev 2 from its child",
        || async {
            let all = list(&parents, None).await;
            (all.iter().filter(|o| rev_of(o) == "2").count() == names.len()).then_some(())
        },
    )
    .await;
    eprintln!(
        "children_over_the_cache_budget_are_read_on_demand: 6 parents and 6 children of 300 KB each with a 1 MiB budget: cached without content {parents_stubbed} times (parents) and {stubbed} times (children), {held} bytes held; every parent converged and followed a change"
    );
}

/// One namespace's flood of parents does not hold back other namespaces': 1,000 parents
/// in one namespace and one in each of five others are created while no operator runs,
/// then the operator starts and lists them all at once. The five must be Ready while
/// most of the flood still waits. Started in the order kube-runtime's queue gives (its
/// order among objects triggered together is arbitrary), each of the five waited for a
/// random share of the flood; all five within the first quarter happens by chance once
/// in a thousand runs. The flood still converges whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_parents_does_not_hold_back_another_namespace() {
    let test = "a_flood_of_parents_does_not_hold_back_another_namespace";
    let client = client().await;
    let kind = "TenantFlood";
    let rule = "tenantflood";
    let d = RuleDir::new();
    d.template(
        "f/cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  n: {{ parent.spec.n | string }}\n",
    );
    d.rule(
        "flood.yaml",
        &rule_text(
            rule,
            kind,
            &[child("cm", "v1", "ConfigMap", "f/cm.yaml", &[])],
        ),
    );
    // The CRD first; the parents are created while no operator runs.
    let mut op = d.operator().flags(&["--install-crds"]).start().await;
    let flood_ns = namespace(&client, "flood-a").await;
    let flood = kind_api(&client, &flood_ns, kind, T).await;
    let mut quiet = Vec::new();
    for _ in 0..5 {
        let ns = namespace(&client, "flood-b").await;
        let a = kind_api(&client, &ns, kind, T).await;
        quiet.push((ns, a));
    }
    op.signal_and_wait("TERM");
    const N: usize = 1000;
    let names: BTreeSet<String> = (0..N).map(|i| format!("p{i:04}")).collect();
    put_all(
        &flood,
        names
            .iter()
            .map(|p| parent(kind, &flood_ns, p, json!({"n": 1})))
            .collect(),
        16,
    )
    .await;
    for (ns, a) in &quiet {
        put(a, &parent(kind, ns, "q", json!({"n": 1}))).await;
    }

    let op = d.operator().start().await;
    let started = Instant::now();
    wait_for(T, "the other namespaces' parents to be Ready", || async {
        for (_, a) in &quiet {
            let o = get_json(a, "q").await?;
            ready_condition(&o).filter(|(status, _, _)| status == "True")?;
        }
        Some(())
    })
    .await;
    let quiet_after = started.elapsed();
    let flood_ready = list(&flood, None)
        .await
        .iter()
        .filter(|o| ready_condition(o).is_some_and(|(status, _, _)| status == "True"))
        .count();
    wait_all_ready(&flood, &names, Duration::from_secs(600)).await;
    let flood_after = started.elapsed();
    eprintln!(
        "{test}: the five other namespaces' parents Ready {quiet_after:.2?} after the start, with {flood_ready} of the flood's {N} Ready; the flood all Ready after {flood_after:.2?}"
    );
    assert!(
        flood_ready < N / 4,
        "{test}: the other namespaces' parents waited for {flood_ready} of the flood's {N} parents"
    );
    let series = format!("rulebook_reconciles_waiting{{rule=\"{rule}\"}}");
    assert!(
        op.metric(&series).await >= 0.0,
        "{test}: the gauge is exported"
    );
    wait_for(T, "no reconcile left waiting for a turn", || async {
        (op.metric(&series).await == 0.0).then_some(())
    })
    .await;
}
