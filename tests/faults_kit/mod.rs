//! Shared scenarios of the fault and abuse tests (`tests/faults.rs`, light, run with the
//! other tests of `make test`; `tests/faults_heavy.rs`, heavy, `#[ignore]`d and run one at
//! a time at the end of `make test` or alone by `make test-faults`).
//! See docs/faults.md.
//!
//! Every scenario runs its own `rulebook run` process on rules it writes into a temp dir,
//! for a parent kind of its own in group `faults.rulebook.dev`, in a namespace of its own.

#![allow(dead_code)] // each test binary uses a different part of the kit

pub mod memory;
pub mod teardown;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchParams,
};
use kube::core::WatchEvent;
use serde_json::{Value as Json, json};

use crate::common::*;

pub const GROUP: &str = "faults.rulebook.dev";
pub const API_VERSION: &str = "faults.rulebook.dev/v1";

// ---------------------------------------------------------------------------------------
// Rules on disk.

/// A temp dir with `rules/` and `templates/`.
pub struct RuleDir {
    _dir: tempfile::TempDir,
    pub rules: PathBuf,
    pub templates: PathBuf,
}

impl RuleDir {
    pub fn new() -> RuleDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let rules = dir.path().join("rules");
        let templates = dir.path().join("templates");
        std::fs::create_dir_all(&rules).unwrap();
        std::fs::create_dir_all(&templates).unwrap();
        RuleDir {
            _dir: dir,
            rules,
            templates,
        }
    }

    pub fn rule(&self, file: &str, text: &str) {
        std::fs::write(self.rules.join(file), text).unwrap();
    }

    pub fn template(&self, rel: &str, text: &str) {
        let path = self.templates.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

pub fn plural(kind: &str) -> String {
    format!("{}s", kind.to_lowercase())
}

/// One child entry of a rule; `extra` are further keys, as YAML lines (`forEach: "..."`).
pub fn child(name: &str, api_version: &str, kind: &str, template: &str, extra: &[&str]) -> String {
    let mut s = format!(
        "    - name: {name}\n      apiVersion: {api_version}\n      kind: {kind}\n      template: {template}\n"
    );
    for e in extra {
        s.push_str(&format!("      {e}\n"));
    }
    s
}

/// A rule for `kind` with one ConfigMap child (`cm.yaml`) whose `deletionPolicy` is
/// `Orphan`.
pub fn orphan_rule(rule: &str, kind: &str) -> String {
    rule_text(
        rule,
        kind,
        &[child(
            "config",
            "v1",
            "ConfigMap",
            "cm.yaml",
            &["deletionPolicy: Orphan"],
        )],
    )
}

/// A rule named `name` for parent `kind` (group faults.rulebook.dev), with its CRD.
pub fn rule_text(name: &str, kind: &str, children: &[String]) -> String {
    format!(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {name}
spec:
  parent:
    apiVersion: {API_VERSION}
    kind: {kind}
  children:
{children}  crd:
    plural: {plural}
    specSchema:
      type: object
      x-kubernetes-preserve-unknown-fields: true
"#,
        children = children.concat(),
        plural = plural(kind),
    )
}

/// A ConfigMap template named `<parent>-<suffix>` whose data are `data` (YAML lines,
/// indented two spaces).
pub fn configmap_template(suffix: &str, data: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-{suffix}\" }}}}\ndata:\n{data}"
    )
}

/// The CRD `rulebook crds` would install for `kind` (used where the operator must not
/// install it itself).
pub fn crd(kind: &str) -> Json {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{}.{GROUP}", plural(kind))},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural(kind), "singular": kind.to_lowercase(),
                      "kind": kind, "listKind": format!("{kind}List")},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                }}},
            }],
        },
    })
}

pub fn crds_api(client: &kube::Client) -> Api<DynamicObject> {
    api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    )
}

// ---------------------------------------------------------------------------------------
// API helpers that ride out an API server or etcd restart.

pub const RETRY_FOR: Duration = Duration::from_secs(120);

/// Retries `f` on any error for up to [`RETRY_FOR`] (an API server restart takes ~5 s).
pub async fn retry<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if start.elapsed() < RETRY_FOR => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Server-side apply (field manager `test`), retried.
pub async fn put(a: &Api<DynamicObject>, obj: &Json) -> DynamicObject {
    let name = obj["metadata"]["name"].as_str().expect("name").to_string();
    let o: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    retry(&format!("apply {name}"), || async {
        a.patch(
            &name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&o),
        )
        .await
    })
    .await
}

/// Creates with a JSON POST, retried.
pub async fn create(a: &Api<DynamicObject>, obj: &Json) -> DynamicObject {
    let name = obj["metadata"]["name"].as_str().expect("name").to_string();
    let o: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    retry(&format!("create {name}"), || async {
        a.create(&PostParams::default(), &o).await
    })
    .await
}

/// A JSON merge patch, retried.
pub async fn merge(a: &Api<DynamicObject>, name: &str, body: Json) -> DynamicObject {
    retry(&format!("patch {name}"), || async {
        a.patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
    })
    .await
}

/// Applies many objects, `concurrency` at a time.
pub async fn put_all(a: &Api<DynamicObject>, objs: Vec<Json>, concurrency: usize) {
    futures::stream::iter(objs)
        .map(|o| async move {
            put(a, &o).await;
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
}

/// Deletes, retried; a missing object is fine.
pub async fn remove(a: &Api<DynamicObject>, name: &str) {
    retry(&format!("delete {name}"), || async {
        match a.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    })
    .await
}

pub async fn list(a: &Api<DynamicObject>, selector: Option<&str>) -> Vec<Json> {
    let lp = match selector {
        Some(s) => ListParams::default().labels(s),
        None => ListParams::default(),
    };
    retry("list", || a.list(&lp))
        .await
        .items
        .iter()
        .map(to_json)
        .collect()
}

pub async fn get_json(a: &Api<DynamicObject>, name: &str) -> Option<Json> {
    retry(&format!("get {name}"), || a.get_opt(name))
        .await
        .map(|o| to_json(&o))
}

pub fn parent(kind: &str, ns: &str, name: &str, spec: Json) -> Json {
    json!({"apiVersion": API_VERSION, "kind": kind,
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

/// The parent API of `kind`, once its CRD is served.
pub async fn kind_api(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    timeout: Duration,
) -> Api<DynamicObject> {
    let a = api(client, Some(ns), API_VERSION, kind, &plural(kind));
    wait_for(timeout, &format!("the {kind} CRD to be served"), || async {
        a.list(&ListParams::default().limit(1))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    a
}

/// Ready=True for the current generation.
pub fn is_ready(o: &Json) -> bool {
    ready_condition(o).is_some_and(|(s, _, _)| s == "True")
        && o.pointer("/metadata/generation") == o.pointer("/status/observedGeneration")
}

pub fn name_of(o: &Json) -> String {
    o["metadata"]["name"].as_str().unwrap_or("").to_string()
}

pub fn uid_of(o: &Json) -> String {
    o["metadata"]["uid"].as_str().unwrap_or("").to_string()
}

pub fn rv_of(o: &Json) -> String {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Waits until every parent named in `names` is Ready for its current generation.
pub async fn wait_all_ready(a: &Api<DynamicObject>, names: &BTreeSet<String>, timeout: Duration) {
    let what = format!("{} parents to be Ready", names.len());
    wait_for(timeout, &what, || async {
        let items = a.list(&ListParams::default()).await.ok()?;
        let ready = items
            .items
            .iter()
            .map(to_json)
            .filter(|o| names.contains(&name_of(o)) && is_ready(o))
            .count();
        (ready == names.len()).then_some(())
    })
    .await
}

pub async fn status(op: &Operator) -> Json {
    serde_json::from_str(&op.get("/status").await).expect("/status is JSON")
}

/// The API server's count of ConfigMap watchers it closed because they did not keep up
/// (`apiserver_terminated_watchers_total{resource="configmaps"}`); `None` while it has
/// closed none (the series appears with the first one) or `/metrics` cannot be read.
pub async fn terminated_watchers(client: &kube::Client) -> Option<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(vec![]).ok()?)
        .await
        .ok()?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_terminated_watchers_total{")
                && l.contains("resource=\"configmaps\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The API servers' audit logs of write requests (`.cluster/logs/audit.log`, and
/// `audit-nogate.log` of the second API server the sharding fallback test starts), read
/// from where each ended when [`Audit::mark`] was called, less the requests received
/// before it: a write is visible to readers before the API server has logged it, so a
/// write a test saw before the mark may be logged after it.
pub struct Audit {
    logs: Vec<(PathBuf, u64)>,
    since: jiff::Timestamp,
}

impl Audit {
    pub fn mark() -> Audit {
        let dir = kubeconfig_path()
            .parent()
            .expect("cluster dir")
            .join("logs");
        let path = dir.join("audit.log");
        let from = std::fs::metadata(&path)
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e}: the local control plane writes an audit log of write requests; \
                     restart it with `make cluster-restart`",
                    path.display()
                )
            })
            .len();
        // The second API server's log may not exist yet: all of it is new then.
        let nogate = dir.join("audit-nogate.log");
        let nogate_from = std::fs::metadata(&nogate).map(|m| m.len()).unwrap_or(0);
        Audit {
            logs: vec![(path, from), (nogate, nogate_from)],
            since: jiff::Timestamp::now(),
        }
    }

    /// The write requests (create, update, patch, delete, deletecollection) to objects in
    /// `ns` logged since the mark, as audit events (`verb`, `userAgent`, `objectRef`,
    /// `responseStatus`, `stageTimestamp`, ...), in the order of their `stageTimestamp`.
    pub fn writes(&self, ns: &str) -> Vec<Json> {
        self.requests(ns)
            .into_iter()
            .filter(|e| {
                matches!(
                    e["verb"].as_str(),
                    Some("create" | "update" | "patch" | "delete" | "deletecollection")
                )
            })
            .collect()
    }

    /// Every request to objects in `ns` logged since the mark: the writes, and in the one
    /// namespace whose reads the audit policy logs (`rulebook-audit-reads`), the GETs.
    pub fn requests(&self, ns: &str) -> Vec<Json> {
        use std::io::{Read, Seek, SeekFrom};
        let quoted = format!("\"{ns}\"");
        let mut events = Vec::new();
        for (i, (path, from)) in self.logs.iter().enumerate() {
            let mut f = match std::fs::File::open(path) {
                Ok(f) => f,
                // Only the main API server's log must be there.
                Err(_) if i > 0 => continue,
                Err(e) => panic!("audit log {}: {e}", path.display()),
            };
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            // Rotated meanwhile (500 MB): read the new file from its start.
            let from = if len < *from { 0 } else { *from };
            f.seek(SeekFrom::Start(from)).expect("seek");
            let mut text = String::new();
            f.read_to_string(&mut text).expect("read audit log");
            events.extend(
                text.lines()
                    .filter(|l| l.contains(&quoted))
                    .filter_map(|l| serde_json::from_str::<Json>(l).ok())
                    .filter(|e| e["objectRef"]["namespace"] == ns)
                    .filter(|e| {
                        e["requestReceivedTimestamp"]
                            .as_str()
                            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                            .is_none_or(|t| t >= self.since)
                    }),
            );
        }
        events.sort_by_key(audit_time);
        events
    }
}

/// An audit event's `stageTimestamp`.
pub fn audit_time(e: &Json) -> Option<jiff::Timestamp> {
    e["stageTimestamp"].as_str()?.parse().ok()
}

/// Rulebook's writes (user agent `rulebook/…`) in `ns` since `audit`, without events.
pub fn rulebook_writes(audit: &Audit, ns: &str) -> Vec<Json> {
    audit
        .writes(ns)
        .into_iter()
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|a| a.starts_with("rulebook/"))
                && e["objectRef"]["resource"] != "events"
        })
        .collect()
}

/// `verb resource/name (code, user agent)` of an audit event.
pub fn describe_audit(e: &Json) -> String {
    format!(
        "{} {} {}/{} ({}, {})",
        e["stageTimestamp"].as_str().unwrap_or(""),
        e["verb"].as_str().unwrap_or(""),
        e["objectRef"]["resource"].as_str().unwrap_or(""),
        e["objectRef"]["name"].as_str().unwrap_or(""),
        e["responseStatus"]["code"],
        e["userAgent"].as_str().unwrap_or("")
    )
}

/// Sends a signal to a process (e.g. `STOP`, `CONT`).
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// `tests/cluster/cluster.sh <cmd>` (restart-apiserver, restart-etcd); returns how long it took.
pub async fn cluster_sh(cmd: &str) -> Duration {
    let start = Instant::now();
    let script = repo().join("tests/cluster/cluster.sh");
    let cmd = cmd.to_string();
    let out = tokio::task::spawn_blocking(move || Command::new(script).arg(&cmd).output())
        .await
        .unwrap()
        .expect("cluster.sh");
    assert!(
        out.status.success(),
        "cluster.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    start.elapsed()
}

/// A small xorshift generator; the seed is printed so a run can be repeated
/// (`FAULTS_SEED=<n>`).
pub struct Rng(u64);

impl Rng {
    pub fn new(test: &str) -> Rng {
        let seed = std::env::var("FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        println!("{test}: FAULTS_SEED={seed}");
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

// ---------------------------------------------------------------------------------------
// Foreign objects: created by "someone else" in the test namespace, compared at the end.

pub struct Foreign {
    objects: Vec<(Api<DynamicObject>, String, String, String)>, // api, name, uid, rv
}

impl Foreign {
    /// A plain ConfigMap, a Secret, a ConfigMap that carries the rule's labels (but no
    /// owner reference), and one named like a child of a parent that does not exist.
    pub async fn create(client: &kube::Client, ns: &str, rule: &str) -> Foreign {
        let cms = api(client, Some(ns), "v1", "ConfigMap", "configmaps");
        let secrets = api(client, Some(ns), "v1", "Secret", "secrets");
        let mut objects = Vec::new();
        let specs = [
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "foreign-plain", "namespace": ns}, "data": {"a": "b"}}),
            ),
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "foreign-lookalike", "namespace": ns, "labels": {
                    "app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule,
                    "rulebook.dev/owner": "00000000-0000-0000-0000-00000000f00d",
                    "rulebook.dev/child": "config"}},
                "data": {"rev": "foreign"}}),
            ),
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "ghost-config", "namespace": ns}, "data": {"rev": "x"}}),
            ),
            (
                &secrets,
                json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "foreign-secret", "namespace": ns}, "stringData": {"k": "v"}}),
            ),
        ];
        for (a, o) in specs {
            let created = to_json(&put(a, &o).await);
            objects.push((
                (*a).clone(),
                name_of(&created),
                uid_of(&created),
                rv_of(&created),
            ));
        }
        Foreign { objects }
    }

    pub fn names(&self) -> BTreeSet<String> {
        self.objects.iter().map(|(_, n, _, _)| n.clone()).collect()
    }

    /// The foreign objects whose uid or resourceVersion changed, or that are gone.
    pub async fn touched(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (a, name, uid, rv) in &self.objects {
            match get_json(a, name).await {
                Some(o) if &uid_of(&o) == uid && &rv_of(&o) == rv => {}
                Some(o) => out.push(format!(
                    "{name} (uid {uid} → {}, resourceVersion {rv} → {})",
                    uid_of(&o),
                    rv_of(&o)
                )),
                None => out.push(format!("{name} (deleted)")),
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// The kill/restart scenario.

/// The rule of the kill/restart scenario: per parent a ConfigMap `<p>-config`, a
/// ConfigMap per shard `<p>-shard-<i>` (forEach over `spec.shards`) and a Secret
/// `<p>-secret`, each carrying `spec.rev`.
fn kill_rules(rule: &str, kind: &str) -> RuleDir {
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "kill/config.yaml", &[]),
                child(
                    "shard",
                    "v1",
                    "ConfigMap",
                    "kill/shard.yaml",
                    &["forEach: \"range(parent.spec.shards)\""],
                ),
                child("secret", "v1", "Secret", "kill/secret.yaml", &[]),
            ],
        ),
    );
    d.template(
        "kill/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d.template(
        "kill/shard.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name ~ \"-shard-\" ~ index }}\ndata:\n  rev: {{ parent.spec.rev | string }}\n  index: {{ index | string }}\n",
    );
    d.template(
        "kill/secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\ndata:\n  rev: {{ parent.spec.rev | string | b64encode }}\n",
    );
    d
}

/// What every parent should end up with: `(rev, shards)` by parent name.
pub type Expected = BTreeMap<String, (u64, u64)>;

/// The state of a namespace after a fault: every mismatch found.
#[derive(Debug, Default)]
pub struct Census {
    pub parents: usize,
    pub children: usize,
    pub not_ready: Vec<String>,
    /// Expected children that do not exist (or exist with stale content).
    pub lost: Vec<String>,
    pub stale: Vec<String>,
    /// Children of a parent beyond the expected ones, or two objects for one child slot.
    pub duplicates: Vec<String>,
    /// Children without a controller ownerReference to an existing parent.
    pub orphans: Vec<String>,
}

impl Census {
    pub fn clean(&self) -> bool {
        self.not_ready.is_empty()
            && self.lost.is_empty()
            && self.stale.is_empty()
            && self.duplicates.is_empty()
            && self.orphans.is_empty()
    }
}

fn b64(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

pub async fn kill_census(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    rule: &str,
    expected: &Expected,
    foreign: &BTreeSet<String>,
) -> Census {
    let parents_api = api(client, Some(ns), API_VERSION, kind, &plural(kind));
    let cms = api(client, Some(ns), "v1", "ConfigMap", "configmaps");
    let secrets = api(client, Some(ns), "v1", "Secret", "secrets");
    let parents = list(&parents_api, None).await;
    let sel = format!("rulebook.dev/rule={rule}");
    let mut children: Vec<(String, Json)> = list(&cms, Some(&sel))
        .await
        .into_iter()
        .map(|o| ("ConfigMap".to_string(), o))
        .collect();
    children.extend(
        list(&secrets, Some(&sel))
            .await
            .into_iter()
            .map(|o| ("Secret".to_string(), o)),
    );
    children.retain(|(_, o)| !foreign.contains(&name_of(o)));

    let mut c = Census {
        parents: parents.len(),
        children: children.len(),
        ..Census::default()
    };
    let by_uid: BTreeMap<String, &Json> = parents.iter().map(|p| (uid_of(p), p)).collect();
    for p in &parents {
        if !is_ready(p) {
            c.not_ready.push(format!(
                "{} ({:?}, generation {} observed {})",
                name_of(p),
                ready_condition(p),
                p["metadata"]["generation"],
                p["status"]["observedGeneration"]
            ));
        }
        if !expected.contains_key(&name_of(p)) {
            c.duplicates
                .push(format!("unexpected parent {}", name_of(p)));
        }
    }
    // Children by owner.
    let mut owned: BTreeMap<String, Vec<(String, &Json)>> = BTreeMap::new();
    for (k, o) in &children {
        let label = o["metadata"]["labels"]["rulebook.dev/owner"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let controller: Vec<&Json> = o["metadata"]["ownerReferences"]
            .as_array()
            .map(|refs| refs.iter().filter(|r| r["controller"] == true).collect())
            .unwrap_or_default();
        let ok = controller.len() == 1
            && controller[0]["uid"] == label.as_str()
            && controller[0]["kind"] == kind
            && by_uid.contains_key(&label);
        if !ok {
            c.orphans.push(format!(
                "{k} {} (owner label {label}, controllers {controller:?})",
                name_of(o)
            ));
            continue;
        }
        owned.entry(label).or_default().push((k.clone(), o));
    }
    for p in &parents {
        let name = name_of(p);
        let Some(&(rev, shards)) = expected.get(&name) else {
            continue;
        };
        let mut want: BTreeMap<(String, String), (String, String)> = BTreeMap::new(); // (kind, object name) → (slot, rev)
        want.insert(
            ("ConfigMap".into(), format!("{name}-config")),
            ("config".into(), rev.to_string()),
        );
        for i in 0..shards {
            want.insert(
                ("ConfigMap".into(), format!("{name}-shard-{i}")),
                (format!("shard[{i}]"), rev.to_string()),
            );
        }
        want.insert(
            ("Secret".into(), format!("{name}-secret")),
            ("secret".into(), b64(&rev.to_string())),
        );
        let mut slots = BTreeSet::new();
        let have = owned.get(&uid_of(p)).cloned().unwrap_or_default();
        let mut seen = BTreeSet::new();
        for (k, o) in &have {
            let labels = &o["metadata"]["labels"];
            let slot = format!(
                "{}[{}]",
                labels["rulebook.dev/child"].as_str().unwrap_or("?"),
                o["metadata"]["annotations"]["rulebook.dev/index"]
                    .as_str()
                    .unwrap_or("-")
            );
            if !slots.insert(slot.clone()) {
                c.duplicates.push(format!("{name}: two objects for {slot}"));
            }
            let key = (k.clone(), name_of(o));
            seen.insert(key.clone());
            match want.get(&key) {
                None => c
                    .duplicates
                    .push(format!("{name}: unexpected {} {}", key.0, key.1)),
                Some((_, rev)) => {
                    if o["data"]["rev"].as_str() != Some(rev.as_str()) {
                        c.stale.push(format!(
                            "{} {}: rev {} (want {rev})",
                            key.0, key.1, o["data"]["rev"]
                        ));
                    }
                }
            }
        }
        for key in want.keys() {
            if !seen.contains(key) {
                c.lost.push(format!("{} {}", key.0, key.1));
            }
        }
    }
    for name in expected.keys() {
        if !parents.iter().any(|p| &name_of(p) == name) {
            c.lost.push(format!("parent {name}"));
        }
    }
    c
}

/// Waits until the census is clean; on timeout, fails with what is still wrong.
pub async fn wait_census(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    rule: &str,
    expected: &Expected,
    foreign: &BTreeSet<String>,
    timeout: Duration,
) -> Result<Census, Census> {
    let start = Instant::now();
    loop {
        let c = kill_census(client, ns, kind, rule, expected, foreign).await;
        if c.clean() {
            return Ok(c);
        }
        if start.elapsed() > timeout {
            return Err(c);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl Census {
    pub fn describe(&self) -> String {
        let head = |v: &Vec<String>| v.iter().take(8).cloned().collect::<Vec<_>>();
        format!(
            "{} parents, {} children; not Ready {} {:?}; lost {} {:?}; stale {} {:?}; duplicates {} {:?}; orphans {} {:?}",
            self.parents,
            self.children,
            self.not_ready.len(),
            head(&self.not_ready),
            self.lost.len(),
            head(&self.lost),
            self.stale.len(),
            head(&self.stale),
            self.duplicates.len(),
            head(&self.duplicates),
            self.orphans.len(),
            head(&self.orphans)
        )
    }
}

pub struct KillReport {
    pub test: String,
    pub rounds: usize,
    /// Parents Ready (for their generation) when each SIGKILL hit, and the delay after start.
    pub at_kill: Vec<(usize, Duration)>,
    /// Until the census was clean, or until the timeout.
    pub converge_after_last_restart: Duration,
    /// The namespace at the end: clean, or what was still wrong at the timeout.
    pub census: Census,
    /// Foreign objects changed or deleted.
    pub foreign_touched: Vec<String>,
}

impl KillReport {
    /// Every expected parent Ready with exactly its children, nothing lost, duplicated,
    /// orphaned or stale, no foreign object touched.
    pub fn assert_intact(&self, parents: usize) {
        let c = &self.census;
        assert!(
            self.foreign_touched.is_empty(),
            "{}: foreign objects touched: {:?}",
            self.test,
            self.foreign_touched
        );
        assert_eq!(
            (
                c.lost.len(),
                c.orphans.len(),
                c.duplicates.len(),
                c.stale.len()
            ),
            (0, 0, 0, 0),
            "{}: lost, orphans, duplicates, stale after the last restart: {}",
            self.test,
            c.describe()
        );
        assert!(
            c.not_ready.is_empty(),
            "{}: parents still not Ready {:.1} s after the last restart: {}",
            self.test,
            self.converge_after_last_restart.as_secs_f64(),
            c.describe()
        );
        assert_eq!(c.parents, parents, "{}: {}", self.test, c.describe());
    }
}

async fn count_ready(a: &Api<DynamicObject>) -> usize {
    a.list(&ListParams::default())
        .await
        .map(|l| l.items.iter().map(to_json).filter(is_ready).count())
        .unwrap_or(0)
}

/// Starts the operator, changes parents while it converges, SIGKILLs it at a random
/// moment, `rounds` times; then lets the last one converge and checks everything.
pub async fn kill_restart(kind: &str, n: usize, rounds: usize, timeout: Duration) -> KillReport {
    let test = format!("kill_restart({kind}, {n} parents, {rounds} rounds)");
    let mut rng = Rng::new(&test);
    let client = client().await;
    let ns = namespace(&client, "faults-kill").await;
    let rule = kind.to_lowercase();
    let dir = kill_rules(&rule, kind);
    let args = ["--install-crds", "--concurrency", "8"];
    let foreign = Foreign::create(&client, &ns, &rule).await;
    let foreign_names = foreign.names();

    let mut op = Operator::start(&dir.rules, &dir.templates, Some(&ns), &args).await;
    let parents = kind_api(&client, &ns, kind, timeout).await;
    let mut expected: Expected = BTreeMap::new();
    let spec = |rev: u64, shards: u64| json!({"rev": rev, "shards": shards});
    let mut at_kill = Vec::new();
    let mut gc_seen = false;

    for round in 0..rounds {
        // The changes of this round: the first creates every parent; later ones change the
        // spec of about a third (a new rev, 1 to 3 shards, so shards are pruned and added),
        // and delete and recreate a few under the same name (new UID, old children still
        // there until the garbage collector removes them).
        let mut changes = Vec::new();
        let mut recreate = Vec::new();
        for i in 0..n {
            let name = format!("p{i}");
            let rev = expected.get(&name).map(|e| e.0).unwrap_or(0);
            if round == 0 {
                expected.insert(name.clone(), (0, 2));
                changes.push(parent(kind, &ns, &name, spec(0, 2)));
            } else if rng.below(3) == 0 {
                let next = (rev + 1, 1 + rng.below(3));
                expected.insert(name.clone(), next);
                changes.push(parent(kind, &ns, &name, spec(next.0, next.1)));
                if rng.below(12) == 0 {
                    recreate.push(name);
                }
            }
        }
        if round > 0 {
            // Half of the changes land while the operator is down, half while it runs.
            let half = changes.split_off(changes.len() / 2);
            if !recreate.is_empty() && !gc_seen {
                // The recreated parents wait for the collector to remove their
                // predecessors' children.
                gc_watches(&client, &parent(kind, &ns, "x", spec(0, 1)), &plural(kind)).await;
                gc_seen = true;
            }
            for name in &recreate {
                remove(&parents, name).await;
            }
            put_all(&parents, changes, 16).await;
            op = Operator::start(&dir.rules, &dir.templates, Some(&ns), &args).await;
            changes = half;
        }
        // A random moment within about the time the operator takes to converge them all.
        let kill_after = rng.millis(200, 1000 + 15 * n as u64);
        let started = Instant::now();
        let writer = {
            let parents = parents.clone();
            tokio::spawn(async move { put_all(&parents, changes, 16).await })
        };
        tokio::time::sleep(kill_after).await;
        let ready = count_ready(&parents).await;
        op.signal_and_wait("KILL");
        at_kill.push((ready, started.elapsed()));
        writer.await.unwrap();
        println!(
            "{test}: round {}: SIGKILL {:.1} s after start, {ready}/{n} parents Ready then",
            round + 1,
            started.elapsed().as_secs_f64()
        );
    }

    let restarted = Instant::now();
    let _op = Operator::start(&dir.rules, &dir.templates, Some(&ns), &args).await;
    let census = wait_census(
        &client,
        &ns,
        kind,
        &rule,
        &expected,
        &foreign_names,
        timeout,
    )
    .await;
    let converge = restarted.elapsed();
    let touched = foreign.touched().await;
    let clean = census.is_ok();
    let (Ok(census) | Err(census)) = census;
    println!(
        "{test}: {} {:.1} s after the last restart: {}; {} of {} foreign objects touched",
        if clean { "converged" } else { "NOT converged" },
        converge.as_secs_f64(),
        census.describe(),
        touched.len(),
        foreign_names.len()
    );
    KillReport {
        test,
        rounds,
        at_kill,
        converge_after_last_restart: converge,
        census,
        foreign_touched: touched,
    }
}

// ---------------------------------------------------------------------------------------
// Pause (SIGSTOP) and resume, optionally with a forced "410 Gone" on every watch.

/// How the operator's watches are interrupted while it is stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gap {
    /// SIGSTOP/SIGCONT only; enough writes to the watched objects meanwhile that the API
    /// server may drop the stalled watches, which then resume from their last
    /// resourceVersion (still in the watch cache).
    Pause,
    /// SIGSTOP, then restart the API server (its watch caches start over, so every older
    /// resourceVersion is "too old": 410 Gone), make the changes, then SIGCONT.
    Expired,
}

/// Pause/resume: changes made while the operator is stopped must all be reconciled.
pub async fn pause_resume(kind: &str, gap: Gap) {
    const N: usize = 25;
    let test = format!("pause_resume({kind}, {gap:?})");
    let client = client().await;
    let ns = namespace(&client, "faults-pause").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[child("config", "v1", "ConfigMap", "pause/config.yaml", &[])],
        ),
    );
    d.template(
        "pause/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    let op = Operator::start(&d.rules, &d.templates, Some(&ns), &["--install-crds"]).await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let mut names: BTreeSet<String> = (0..N).map(|i| format!("p{i}")).collect();
    put_all(
        &parents,
        names
            .iter()
            .map(|n| parent(kind, &ns, n, json!({"rev": 0})))
            .collect(),
        8,
    )
    .await;
    wait_all_ready(&parents, &names, Duration::from_secs(180)).await;
    // A lookalike ConfigMap (the rule's labels, no owner) that the writes below hammer:
    // its events go down the operator's child watch.
    let filler = to_json(
        &put(
            &cms,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "filler", "namespace": ns, "labels": {
                    "app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule}},
                "data": {"n": "0"}}),
        )
        .await,
    );
    let before: BTreeMap<String, String> = list(&cms, None)
        .await
        .iter()
        .map(|o| (name_of(o), uid_of(o)))
        .collect();
    let rv0 = retry("list", || async {
        cms.list(&ListParams::default().limit(1)).await
    })
    .await
    .metadata
    .resource_version
    .unwrap_or_default();

    // Three parents are deleted during the pause: the collector must have seen them to
    // remove their children.
    gc_watches(
        &client,
        &parent(kind, &ns, "x", json!({"rev": 0})),
        &plural(kind),
    )
    .await;
    signal(op.pid(), "STOP");
    let paused = Instant::now();
    let log_before = std::fs::read_to_string(&op.log).unwrap_or_default().len();
    if gap == Gap::Expired {
        let took = cluster_sh("restart-apiserver").await;
        println!(
            "{test}: API server restarted in {:.1} s",
            took.as_secs_f64()
        );
        // Proof that the resourceVersion the operator holds is gone: a watch from the
        // resourceVersion of just before the pause is refused with 410.
        let code = wait_for(
            Duration::from_secs(60),
            "a watch from the old resourceVersion to answer",
            || async {
                let mut s = cms
                    .watch(&WatchParams::default().timeout(5), &rv0)
                    .await
                    .ok()?
                    .boxed();
                match s.next().await {
                    Some(Ok(WatchEvent::Error(e))) if e.code == 429 || e.code >= 500 => None,
                    Some(Ok(WatchEvent::Error(e))) => Some(e.code),
                    Some(Ok(_)) => Some(200),
                    _ => None,
                }
            },
        )
        .await;
        assert_eq!(
            code, 410,
            "a watch from resourceVersion {rv0} is expired after the restart"
        );
        println!("{test}: a watch from resourceVersion {rv0} now answers 410 Gone");
    }

    // 300 writes of 64 KiB each down the stalled child watch (~19 MB: more than the
    // connection buffers hold), so that the API server gives up on the stalled watcher.
    let terminated0 = terminated_watchers(&client).await.unwrap_or(0.0);
    let blob = "x".repeat(64 << 10);
    for i in 1..=300 {
        merge(
            &cms,
            "filler",
            json!({"data": {"n": i.to_string(), "blob": blob}}),
        )
        .await;
    }
    if gap == Gap::Pause {
        // The point of the scenario: the operator's ConfigMap watch is dropped while it is
        // stopped. The changes below come after the drop, so they can reach the operator
        // only through the watch it re-establishes after SIGCONT.
        let dropped = poll_for(Duration::from_secs(30), || async {
            let now = terminated_watchers(&client).await?;
            (now > terminated0).then_some(now - terminated0)
        })
        .await;
        let Some(dropped) = dropped else {
            panic!(
                "{test}: the API server did not drop the stalled ConfigMap watcher \
                 (apiserver_terminated_watchers_total{{resource=\"configmaps\"}} is {:?}, was \
                 {terminated0} before 300 writes of 64 KiB): the scenario tests nothing",
                terminated_watchers(&client).await
            )
        };
        println!(
            "{test}: the API server dropped {dropped} stalled ConfigMap watcher(s) {:.1} s into the pause",
            paused.elapsed().as_secs_f64()
        );
    }

    // The changes, while the operator is stopped.
    let spec_changed: Vec<String> = (0..5).map(|i| format!("p{i}")).collect();
    let child_deleted: Vec<String> = (5..10).map(|i| format!("p{i}")).collect();
    let child_edited: Vec<String> = (10..15).map(|i| format!("p{i}")).collect();
    let parent_deleted: Vec<String> = (15..18).map(|i| format!("p{i}")).collect();
    let created: Vec<String> = (N..N + 5).map(|i| format!("p{i}")).collect();
    for p in &spec_changed {
        put(&parents, &parent(kind, &ns, p, json!({"rev": 1}))).await;
    }
    for p in &child_deleted {
        remove(&cms, &format!("{p}-config")).await;
    }
    for p in &child_edited {
        merge(
            &cms,
            &format!("{p}-config"),
            json!({"data": {"rev": "vandalised"}}),
        )
        .await;
    }
    for p in &parent_deleted {
        remove(&parents, p).await;
        names.remove(p);
    }
    for p in &created {
        put(&parents, &parent(kind, &ns, p, json!({"rev": 0}))).await;
        names.insert(p.clone());
    }
    println!(
        "{test}: operator stopped for {:.1} s: 300 writes of 64 KiB, then 5 specs changed, 5 children were deleted, 5 edited, 3 parents deleted, 5 created",
        paused.elapsed().as_secs_f64()
    );
    signal(op.pid(), "CONT");
    let resumed = Instant::now();

    let t = Duration::from_secs(120);
    let problems = |names: BTreeSet<String>| {
        let cms = cms.clone();
        let parents = parents.clone();
        let before = before.clone();
        let spec_changed = spec_changed.clone();
        let child_deleted = child_deleted.clone();
        async move {
            let mut bad = Vec::new();
            for p in &names {
                let Some(o) = parents.get_opt(p).await.ok().flatten() else {
                    bad.push(format!("{p}: parent missing"));
                    continue;
                };
                if !is_ready(&to_json(&o)) {
                    bad.push(format!("{p}: not Ready"));
                }
                match cms.get_opt(&format!("{p}-config")).await.ok().flatten() {
                    None => bad.push(format!(
                        "{p}-config: missing (parent {p}: {:?})",
                        ready_condition(&to_json(&o))
                    )),
                    Some(c) => {
                        let c = to_json(&c);
                        let want = if spec_changed.contains(p) { "1" } else { "0" };
                        if c["data"]["rev"] != want {
                            bad.push(format!("{p}-config: rev {}", c["data"]["rev"]));
                        }
                        if child_deleted.contains(p)
                            && before.get(&format!("{p}-config")) == Some(&uid_of(&c))
                        {
                            bad.push(format!("{p}-config: not recreated"));
                        }
                    }
                }
            }
            bad
        }
    };
    let start = Instant::now();
    loop {
        let bad = problems(names.clone()).await;
        if bad.is_empty() {
            break;
        }
        if start.elapsed() > t {
            let log = std::fs::read_to_string(&op.log).unwrap_or_default();
            panic!(
                "{test}: changes made while the operator was stopped are not all reconciled {t:?} after SIGCONT: {bad:?}\n--- operator log since the pause ---\n{}",
                log.get(log_before..).unwrap_or("")
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!(
        "{test}: every change made while stopped reconciled {:.1} s after SIGCONT",
        resumed.elapsed().as_secs_f64()
    );
    // The children of deleted parents go (garbage collector), the lookalike stays untouched
    // by the operator (only our 300 writes changed it).
    for p in &parent_deleted {
        let name = format!("{p}-config");
        wait_for(t, &format!("{name} to be garbage-collected"), || async {
            cms.get_opt(&name).await.ok()?.is_none().then_some(())
        })
        .await;
    }
    let f = get_json(&cms, "filler").await.expect("filler");
    assert_eq!(f["data"]["n"], "300");
    assert_eq!(uid_of(&f), uid_of(&filler));
    assert!(
        f["metadata"]["ownerReferences"].is_null(),
        "the lookalike was taken over: {}",
        f["metadata"]
    );
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    let since = log.get(log_before..).unwrap_or("");
    let expired = since
        .lines()
        .filter(|l| {
            l.contains("watch error")
                && (l.contains("410")
                    || l.contains("too old")
                    || l.contains("Expired")
                    || l.contains("expired"))
        })
        .count();
    println!("{test}: the operator logged {expired} expired-watch (410) error(s) after SIGCONT");
    if gap == Gap::Expired {
        assert!(
            expired > 0,
            "{test}: the operator never saw a 410 although its resourceVersions were expired:\n{since}"
        );
    }
    let h = op.get("/healthz").await;
    assert_eq!(h.trim(), "ok");
}

// ---------------------------------------------------------------------------------------
// A control-plane component restarted mid-convergence.

pub async fn restart_mid_convergence(kind: &str, component: &str, n: usize) {
    let test = format!("restart_mid_convergence({component})");
    let client = client().await;
    let ns = namespace(&client, "faults-restart").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[
                child("config", "v1", "ConfigMap", "r/config.yaml", &[]),
                child("secret", "v1", "Secret", "r/secret.yaml", &[]),
            ],
        ),
    );
    d.template(
        "r/config.yaml",
        &configmap_template("config", "  rev: {{ parent.spec.rev | string }}\n"),
    );
    d.template(
        "r/secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-secret\" }}\ndata:\n  rev: {{ parent.spec.rev | string | b64encode }}\n",
    );
    let op = Operator::start(
        &d.rules,
        &d.templates,
        Some(&ns),
        &["--install-crds", "--concurrency", "8"],
    )
    .await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let names: BTreeSet<String> = (0..n).map(|i| format!("p{i}")).collect();
    let writer = {
        let parents = parents.clone();
        let objs: Vec<Json> = names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"rev": 0})))
            .collect();
        tokio::spawn(async move { put_all(&parents, objs, 8).await })
    };
    // Restart once convergence is under way.
    let ready_then = wait_for(
        Duration::from_secs(180),
        "some parents to be Ready",
        || async {
            let r = count_ready(&parents).await;
            (r >= n / 5).then_some(r)
        },
    )
    .await;
    let took = cluster_sh(&format!("restart-{component}")).await;
    println!(
        "{test}: {component} restarted in {:.1} s with {ready_then}/{n} parents Ready",
        took.as_secs_f64()
    );
    writer.await.unwrap();
    // Changes after the restart reach the operator through its new watches.
    let bumped: Vec<Json> = names
        .iter()
        .take(n / 2)
        .map(|p| parent(kind, &ns, p, json!({"rev": 1})))
        .collect();
    put_all(&parents, bumped, 8).await;
    let after = Instant::now();
    wait_all_ready(&parents, &names, Duration::from_secs(300)).await;
    wait_for(
        Duration::from_secs(120),
        "every child at its parent's rev",
        || async {
            let all = cms
                .list(&ListParams::default().labels(&format!("rulebook.dev/rule={rule}")))
                .await
                .ok()?;
            let bumped: BTreeSet<String> = names.iter().take(n / 2).cloned().collect();
            let good = all
                .items
                .iter()
                .map(to_json)
                .filter(|c| {
                    let p = name_of(c).trim_end_matches("-config").to_string();
                    let want = if bumped.contains(&p) { "1" } else { "0" };
                    c["data"]["rev"] == want
                })
                .count();
            (good == n).then_some(())
        },
    )
    .await;
    // A hand edit after the restart is repaired: the child watch is live again.
    let victim = format!("{}-config", names.iter().next().unwrap());
    merge(&cms, &victim, json!({"data": {"rev": "x"}})).await;
    wait_for(
        Duration::from_secs(60),
        "the edit to be repaired",
        || async {
            let c = to_json(&cms.get_opt(&victim).await.ok()??);
            (c["data"]["rev"] != "x").then_some(())
        },
    )
    .await;
    let s = status(&op).await;
    println!(
        "{test}: all {n} parents Ready for their generation {:.1} s after the post-restart changes; rule state {}",
        after.elapsed().as_secs_f64(),
        s["rules"][&rule]
    );
    assert_eq!(s["rules"][&rule]["state"], "running");
}

// ---------------------------------------------------------------------------------------
// Poison parents.

pub struct PoisonReport {
    pub alone: Duration,
    pub with_poison: Duration,
    pub settled: Duration,
    pub reconciles_per_poison_in_30s: f64,
    pub writes_per_poison_in_30s: f64,
}

pub async fn poison(kind: &str, poisoned: usize, healthy: usize) -> PoisonReport {
    let test = format!("poison({poisoned} poison + {healthy} healthy)");
    let client = client().await;
    let ns = namespace(&client, "faults-poison").await;
    let rule = kind.to_lowercase();
    let d = RuleDir::new();
    d.rule(
        &format!("{rule}.yaml"),
        &rule_text(
            &rule,
            kind,
            &[child(
                "config",
                "v1",
                "ConfigMap",
                "poison/config.yaml",
                &[],
            )],
        ),
    );
    d.template(
        "poison/config.yaml",
        &configmap_template(
            "config",
            "  ok: \"yes\"\n{% if parent.spec.poison %}\n  broken: {{ parent.spec.missing.field }}\n{% endif %}\n",
        ),
    );
    let op = Operator::start(&d.rules, &d.templates, Some(&ns), &["--install-crds"]).await;
    let parents = kind_api(&client, &ns, kind, Duration::from_secs(120)).await;
    let t = Duration::from_secs(600);
    let batch = |prefix: &str, n: usize, poison: bool| -> (BTreeSet<String>, Vec<Json>) {
        let names: BTreeSet<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let objs = names
            .iter()
            .map(|p| parent(kind, &ns, p, json!({"poison": poison})))
            .collect();
        (names, objs)
    };

    // 1. Healthy parents alone.
    let (h1, objs) = batch("alone-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h1, t).await;
    let alone = start.elapsed();

    // 2. The poison, then the same number of healthy parents right behind it.
    let (pn, objs) = batch("poison-", poisoned, true);
    put_all(&parents, objs, 16).await;
    let (h2, objs) = batch("beside-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h2, t).await;
    let with_poison = start.elapsed();

    // 3. Every poison parent reports RenderFailed, naming the template line.
    wait_for(t, "every poison parent to report RenderFailed", || async {
        let items = parents.list(&ListParams::default()).await.ok()?;
        let failed = items
            .items
            .iter()
            .map(to_json)
            .filter(|o| {
                pn.contains(&name_of(o))
                    && ready_condition(o).is_some_and(|(s, r, m)| {
                        s == "False" && r == "RenderFailed" && m.contains("poison/config.yaml:")
                    })
            })
            .count();
        (failed == pn.len()).then_some(())
    })
    .await;

    // 4. They back off: reconciles and writes over 30 s, once the events of the first
    // round are sent (the outbox sends them in the background, later on a busy machine).
    wait_for(t, "the first round's events to be sent", || async {
        (op.metric("rulebook_events_unsent").await == 0.0).then_some(())
    })
    .await;
    let series = format!("rulebook_reconciles_total{{rule=\"{rule}\",result=\"render_failed\"}}");
    let writes =
        |verb: &str| format!("rulebook_api_writes_total{{rule=\"{rule}\",verb=\"{verb}\"}}");
    let r0 = op.metric(&series).await;
    // The series counts what the per-parent figure below divides: every poison parent has
    // reported RenderFailed, so each failed a reconcile at least once.
    assert!(
        r0 >= poisoned as f64,
        "{series} is {r0} although {poisoned} parents report RenderFailed"
    );
    let w0 = op.metric(&writes("apply_status")).await + op.metric(&writes("event")).await;
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await; // the measuring window
    let r1 = op.metric(&series).await;
    let w1 = op.metric(&writes("apply_status")).await + op.metric(&writes("event")).await;
    let secs = window.elapsed().as_secs_f64();
    let per = (r1 - r0) / poisoned as f64;
    let wper = (w1 - w0) / poisoned as f64;

    // 5. Healthy parents once the poison has settled into its backoff.
    let (h3, objs) = batch("settled-", healthy, false);
    let start = Instant::now();
    put_all(&parents, objs, 16).await;
    wait_all_ready(&parents, &h3, t).await;
    let settled = start.elapsed();

    println!(
        "{test}: {healthy} healthy parents converge in {:.2} s alone, {:.2} s right behind {poisoned} poison parents (×{:.2}), {:.2} s once the poison backs off (×{:.2})",
        alone.as_secs_f64(),
        with_poison.as_secs_f64(),
        with_poison.as_secs_f64() / alone.as_secs_f64(),
        settled.as_secs_f64(),
        settled.as_secs_f64() / alone.as_secs_f64()
    );
    println!(
        "{test}: over {secs:.1} s after the first round: {} render_failed reconciles ({per:.2} per poison parent), {} status/event writes ({wper:.3} per poison parent)",
        r1 - r0,
        w1 - w0
    );
    // A render error is retried after 16 s, 32 s, ...: at most 2 retries fit in any 30 s
    // window (3 counting one reconcile from a change); a hot loop would make hundreds.
    assert!(
        per <= 3.0,
        "poison parents do not back off: {per:.2} reconciles each in {secs:.0} s"
    );
    // Same error, same status: nothing new to write.
    assert!(
        wper <= 0.1,
        "failing parents keep writing status/events: {wper:.3} writes each in {secs:.0} s"
    );
    // No timing claims: the healthy parents converging at all (the waits above) is the check.
    let h = op.get("/healthz").await;
    assert_eq!(h.trim(), "ok");
    PoisonReport {
        alone,
        with_poison,
        settled,
        reconciles_per_poison_in_30s: per,
        writes_per_poison_in_30s: wper,
    }
}
