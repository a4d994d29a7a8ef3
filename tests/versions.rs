//! Several versions of a rule's CRD on the local control plane (issue 43): the API server
//! calls the conversion webhook Rulebook serves on 127.0.0.1, so an object created as
//! `v1alpha1` reads back as `v1` and the reverse, and children are rendered from the
//! storage version; switching the storage version migrates every stored object (counted
//! in etcd, before and after), through a SIGKILL of the operator mid-way, and ends with
//! `status.storedVersions` holding the new version alone.
// A scenario test reads top to bottom as one story (see tests/reconcile_examples.rs).
#![allow(clippy::too_many_lines)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::{Value as Json, json};

const GROUP: &str = "versions.rulebook.dev";
const T: Duration = Duration::from_secs(120);
/// A migration of [`migrated`] objects under a loaded `make test` (one took 40 s alone).
const MIGRATION_T: Duration = Duration::from_secs(300);

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A rule of a kind of its own in `v1alpha1` (flat `image`, `port`) and `v1`
/// (`container: {image, port}`), with the two conversion templates of
/// examples/versioned.
struct Versioned {
    _dir: tempfile::TempDir,
    rules: PathBuf,
    templates: PathBuf,
    rule: String,
    kind: String,
    plural: String,
    /// The webhook configurations' and certificates' Secret's name.
    name: String,
}

impl Versioned {
    fn new(prefix: &str) -> Versioned {
        let dir = tempfile::tempdir().expect("tempdir");
        let rules = dir.path().join("rules");
        let templates = dir.path().join("templates");
        let example = repo().join("examples/versioned/templates/webapp");
        std::fs::create_dir_all(&rules).unwrap();
        std::fs::create_dir_all(templates.join("v")).unwrap();
        for t in ["v1alpha1-to-v1.yaml", "v1-to-v1alpha1.yaml"] {
            std::fs::copy(example.join(t), templates.join("v").join(t)).unwrap();
        }
        // The child reads the storage version, whichever it is.
        for (version, image) in [
            ("v1", "parent.spec.container.image"),
            ("v1alpha1", "parent.spec.image"),
        ] {
            std::fs::write(
                templates.join(format!("v/config-{version}.yaml")),
                format!(
                    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\ndata:\n  image: {{{{ {image} }}}}\n  readAs: {{{{ parent.apiVersion }}}}\n"
                ),
            )
            .unwrap();
        }
        let id: String = unique(prefix)
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        let kind = format!("Vr{id}");
        Versioned {
            _dir: dir,
            rules,
            templates,
            rule: format!("vr-{id}"),
            plural: format!("{}s", kind.to_lowercase()),
            name: format!("rulebook-test-{id}"),
            kind,
        }
    }

    /// (Re)writes the rule with `storage` as the storage version; with a ConfigMap
    /// child when `child`.
    fn write_rule(&self, storage: &str, child: bool) {
        let children = if child {
            format!(
                "\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: v/config-{storage}.yaml"
            )
        } else {
            " []".to_string()
        };
        let (alpha_storage, one_storage) = (storage == "v1alpha1", storage == "v1");
        let text = format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {rule}
spec:
  parent:
    apiVersion: {GROUP}/{storage}
    kind: {kind}
  children:{children}
  crd:
    plural: {plural}
    versions:
      - name: v1
        storage: {one_storage}
        specSchema:
          type: object
          properties:
            replicas: {{ type: integer }}
            container:
              type: object
              properties:
                image: {{ type: string }}
                port: {{ type: integer }}
      - name: v1alpha1
        storage: {alpha_storage}
        deprecated: true
        specSchema:
          type: object
          properties:
            replicas: {{ type: integer }}
            image: {{ type: string }}
            port: {{ type: integer }}
    conversion:
      - {{ from: v1alpha1, to: v1, template: v/v1alpha1-to-v1.yaml }}
      - {{ from: v1, to: v1alpha1, template: v/v1-to-v1alpha1.yaml }}
"#,
            rule = self.rule,
            kind = self.kind,
            plural = self.plural,
        );
        std::fs::write(self.rules.join(format!("{}.yaml", self.rule)), text).unwrap();
    }

    fn crd_name(&self) -> String {
        format!("{}.{GROUP}", self.plural)
    }

    /// An operator on this rule, watching `ns`, serving webhooks on `port`.
    fn operator(&self, ns: &str, port: u16) -> OperatorBuilder {
        let flags = [
            "--install-crds".to_string(),
            "--webhook-bind".into(),
            "127.0.0.1".into(),
            "--webhook-port".into(),
            port.to_string(),
            "--webhook-url".into(),
            format!("https://127.0.0.1:{port}"),
            "--webhook-secret".into(),
            format!("{ns}/{}", self.name),
            "--webhook-configuration".into(),
            self.name.clone(),
            // Paced, so that the SIGKILL below lands mid-way whatever the machine's speed:
            // unpaced, 300 rewrites fit between a /status poll and the kill.
            "--migration-rate".into(),
            "50".into(),
        ];
        Operator::on(&self.rules, &self.templates)
            .namespace(ns)
            .flags(&flags)
    }

    fn api(&self, client: &kube::Client, ns: &str, version: &str) -> Api<DynamicObject> {
        api(
            client,
            Some(ns),
            &format!("{GROUP}/{version}"),
            &self.kind,
            &self.plural,
        )
    }

    fn crds(&self, client: &kube::Client) -> Api<DynamicObject> {
        api(
            client,
            None,
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
        )
    }

    /// Waits until the CRD stores in `storage` and converts through the webhook on
    /// `port` with a CA bundle; returns it.
    async fn wait_crd(&self, client: &kube::Client, port: u16, storage: &str) -> Json {
        let crds = self.crds(client);
        let url = format!("https://127.0.0.1:{port}/convert/{}", self.rule);
        let crd = wait_for(T, "the CRD with its conversion webhook", || async {
            let c = to_json(&crds.get_opt(&self.crd_name()).await.ok()??);
            let cc = c.pointer("/spec/conversion/webhook/clientConfig")?;
            let stores = c["spec"]["versions"]
                .as_array()?
                .iter()
                .any(|v| v["name"] == storage && v["storage"] == true);
            (cc["url"] == url.as_str()
                && cc["caBundle"].as_str().is_some_and(|s| !s.is_empty())
                && stores)
                .then_some(c)
        })
        .await;
        wait_established(client, &self.crd_name()).await;
        crd
    }

    /// Deletes the CRD (and so every object of the kind) while the operator still
    /// serves the conversion the API server needs to delete them.
    async fn remove_crd(&self, client: &kube::Client) {
        let crds = self.crds(client);
        let _ = crds
            .delete(&self.crd_name(), &DeleteParams::default())
            .await;
        let _ = poll_for(T, || async {
            crds.get_opt(&self.crd_name())
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
        for kind in [
            "ValidatingWebhookConfiguration",
            "MutatingWebhookConfiguration",
        ] {
            let plural = format!("{}s", kind.to_lowercase());
            let a = api(
                client,
                None,
                "admissionregistration.k8s.io/v1",
                kind,
                &plural,
            );
            let _ = a.delete(&self.name, &DeleteParams::default()).await;
        }
    }

    fn parent_v1alpha1(&self, name: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": format!("{GROUP}/v1alpha1"), "kind": self.kind,
            "metadata": {"name": name},
            "spec": {"replicas": 1, "image": format!("{name}:1"), "port": 8080},
        }))
        .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_read_back_in_either_version_and_children_render_from_storage() {
    let client = client().await;
    let ns = namespace(&client, "vers-read").await;
    let v = Versioned::new("rd");
    v.write_rule("v1", true);
    let port = free_port();
    let op = v.operator(&ns, port).start().await;
    let crd = v.wait_crd(&client, port, "v1").await;
    assert_eq!(
        crd["spec"]["conversion"]["webhook"]["conversionReviewVersions"],
        json!(["v1"])
    );
    let alpha = v.api(&client, &ns, "v1alpha1");
    let one = v.api(&client, &ns, "v1");

    // Created as v1alpha1 (the API server converts it to v1 to store it), read as v1.
    wait_for(T, "a create as v1alpha1", || async {
        alpha
            .create(&PostParams::default(), &v.parent_v1alpha1("old"))
            .await
            .ok()
    })
    .await;
    let read = to_json(&one.get("old").await.unwrap());
    assert_eq!(read["apiVersion"], format!("{GROUP}/v1"));
    assert_eq!(
        read["spec"],
        json!({"replicas": 1, "container": {"image": "old:1", "port": 8080}})
    );
    // And back as v1alpha1, as written.
    let back = to_json(&alpha.get("old").await.unwrap());
    assert_eq!(
        back["spec"],
        json!({"replicas": 1, "image": "old:1", "port": 8080})
    );

    // Created as v1, read as v1alpha1.
    let new: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"), "kind": v.kind,
        "metadata": {"name": "new"},
        "spec": {"container": {"image": "new:2"}},
    }))
    .unwrap();
    one.create(&PostParams::default(), &new).await.unwrap();
    let read = to_json(&alpha.get("new").await.unwrap());
    assert_eq!(read["apiVersion"], format!("{GROUP}/v1alpha1"));
    assert_eq!(read["spec"], json!({"image": "new:2"}));
    // A list in v1alpha1 converts every object.
    let listed = alpha.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 2);

    // The children are rendered from the storage version (v1: spec.container.image).
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    for (name, image) in [("old", "old:1"), ("new", "new:2")] {
        let cm = wait_for(T, &format!("the ConfigMap of {name}"), || async {
            Some(to_json(&cms.get_opt(name).await.ok()??))
        })
        .await;
        assert_eq!(cm["data"]["image"], image);
        assert_eq!(cm["data"]["readAs"], format!("{GROUP}/v1"));
    }

    // Conversion has no failure policy: with no replica answering, the kind cannot be
    // read in another version than it is stored in (a clear error); nothing is lost,
    // and reads come back with the operator.
    drop(op);
    let err = wait_for(T, "reads in v1alpha1 to fail", || async {
        match alpha.get("old").await {
            Err(kube::Error::Api(s)) => Some(s.message),
            _ => None,
        }
    })
    .await;
    println!("with no webhook: {err}");
    assert!(err.contains("conversion webhook"), "{err}");
    assert_eq!(
        to_json(&one.get("old").await.unwrap())["spec"]["container"]["image"],
        "old:1",
        "the storage version reads without conversion"
    );
    let _op = v.operator(&ns, port).start().await;
    let back = wait_for(T, "reads in v1alpha1 to come back", || async {
        alpha.get("old").await.ok()
    })
    .await;
    assert_eq!(to_json(&back)["spec"]["image"], "old:1");
    v.remove_crd(&client).await;
}

/// How many objects the migration test stores: `RULEBOOK_TEST_MIGRATED`, default 500
/// (five pages of the migration's 100; docs/reference/crd.md says so). 1,000 doubled this
/// binary's share of a warm `make test` on 2 cores and proved nothing 500 does not: the
/// kill still lands after two pages and before the last.
fn migrated() -> usize {
    std::env::var("RULEBOOK_TEST_MIGRATED")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 300)
        .unwrap_or(500)
}

/// The stored `apiVersion` of every object of the kind in `ns`, read from etcd itself
/// (its JSON gateway, at the port the local control plane records): what the API server
/// cannot show, since it converts what it reads.
async fn stored_versions(v: &Versioned, ns: &str) -> std::collections::BTreeMap<String, usize> {
    let env = std::fs::read_to_string(
        kubeconfig_path()
            .parent()
            .expect("the control plane's directory")
            .join("run/ports.env"),
    )
    .expect("the local control plane's run/ports.env (etcd's port)");
    let port = env
        .lines()
        .find_map(|l| l.strip_prefix("ETCD_CLIENT_PORT="))
        .expect("ETCD_CLIENT_PORT in ports.env");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let prefix = format!("/registry/{GROUP}/{}/{ns}/", v.plural);
    let mut end = prefix.clone().into_bytes();
    *end.last_mut().unwrap() += 1;
    let body = json!({"key": b64(&prefix), "range_end": base64::engine::general_purpose::STANDARD.encode(&end)});
    let answer = etcd_post(port, "/v3/kv/range", &body.to_string()).await;
    let answer: Json = serde_json::from_str(&answer).expect("etcd's JSON");
    let mut counts = std::collections::BTreeMap::new();
    for kv in answer["kvs"].as_array().cloned().unwrap_or_default() {
        let value = base64::engine::general_purpose::STANDARD
            .decode(kv["value"].as_str().unwrap())
            .unwrap();
        let stored: Json =
            serde_json::from_slice(&value).expect("a custom resource is stored as JSON");
        *counts
            .entry(stored["apiVersion"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    counts
}

/// POSTs `body` to etcd's gateway on loopback `port`; the answer's body.
async fn etcd_post(port: &str, path: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("etcd listens");
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_string()
    }
}

/// `rules.<rule>.migration` of the operator's `/status`.
async fn migration(op: &Operator, rule: &str) -> Option<Json> {
    let s: Json = serde_json::from_str(&op.get_opt("/status").await?).ok()?;
    let m = s["rules"][rule]["migration"].clone();
    (!m.is_null()).then_some(m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_the_storage_version_migrates_every_object_through_a_sigkill() {
    let client = client().await;
    let ns = namespace(&client, "vers-mig").await;
    // The objects live in a namespace the operator does not reconcile: a reconcile's
    // status write stores its parent in the storage version too, and would migrate
    // them before the migration does (every one of 500 within seconds of the switch).
    // The migration covers every namespace of the kind, watched or not.
    let stored = namespace(&client, "vers-mig-store").await;
    let v = Versioned::new("mig");
    v.write_rule("v1alpha1", false);
    let port = free_port();
    let mut op = v.operator(&ns, port).start().await;
    v.wait_crd(&client, port, "v1alpha1").await;
    let alpha = v.api(&client, &stored, "v1alpha1");

    // `n` objects, stored as v1alpha1.
    let n = migrated();
    let started = Instant::now();
    let mut creates = tokio::task::JoinSet::new();
    for w in 0..8 {
        let (alpha, objects): (Api<DynamicObject>, Vec<DynamicObject>) = (
            alpha.clone(),
            (0..n)
                .filter(|i| i % 8 == w)
                .map(|i| v.parent_v1alpha1(&format!("p-{i:04}")))
                .collect(),
        );
        creates.spawn(async move {
            for o in objects {
                alpha
                    .create(&PostParams::default(), &o)
                    .await
                    .expect("create");
            }
        });
    }
    while let Some(r) = creates.join_next().await {
        r.unwrap();
    }
    println!("{n} objects created in {:?}", started.elapsed());
    let before = stored_versions(&v, &stored).await;
    assert_eq!(
        before,
        [(format!("{GROUP}/v1alpha1"), n)].into(),
        "stored before"
    );

    // v1 becomes the storage version: the migration starts; the operator is killed
    // mid-way (after at least two pages).
    let started = Instant::now();
    v.write_rule("v1", false);
    let seen = wait_for(MIGRATION_T, "the migration to be under way", || async {
        let m = migration(&op, &v.rule).await?;
        (m["state"] == "running" && m["rewritten"].as_u64()? >= 200).then_some(m)
    })
    .await;
    op.signal_and_wait("KILL");
    println!("killed at {seen} after {:?}", started.elapsed());
    assert_eq!(seen["from"], json!(["v1alpha1"]));
    assert_eq!(seen["to"], "v1");
    let crd = to_json(&v.crds(&client).get(&v.crd_name()).await.unwrap());
    assert_eq!(
        crd["status"]["storedVersions"],
        json!(["v1alpha1", "v1"]),
        "not trimmed before every object is rewritten"
    );
    let marker: Json = serde_json::from_str(
        crd["metadata"]["annotations"]["rulebook.dev/storage-migration"]
            .as_str()
            .expect("the resume marker"),
    )
    .unwrap();
    assert_eq!(marker["to"], "v1");
    let partly = stored_versions(&v, &stored).await;
    println!("stored after the kill: {partly:?}");
    assert!(
        partly.get(&format!("{GROUP}/v1")).copied().unwrap_or(0)
            >= marker["rewritten"].as_u64().unwrap() as usize,
        "every object up to the marker is stored as v1: {partly:?}, {marker}"
    );
    assert!(
        partly.contains_key(&format!("{GROUP}/v1alpha1")),
        "killed mid-way: {partly:?}"
    );

    // A new operator resumes and finishes; every object is stored as v1, and v1alpha1
    // leaves storedVersions.
    let op2 = v.operator(&ns, port).start().await;
    let done = wait_for(MIGRATION_T, "the migration to finish", || async {
        let m = migration(&op2, &v.rule).await?;
        (m["state"] == "done").then_some(m)
    })
    .await;
    println!("done: {done} after {:?}", started.elapsed());
    assert_eq!(done["rewritten"], n, "each object counted once");
    let crd = to_json(&v.crds(&client).get(&v.crd_name()).await.unwrap());
    assert_eq!(crd["status"]["storedVersions"], json!(["v1"]));
    assert!(
        crd["metadata"]["annotations"]
            .get("rulebook.dev/storage-migration")
            .is_none()
    );
    let after = stored_versions(&v, &stored).await;
    assert_eq!(after, [(format!("{GROUP}/v1"), n)].into(), "stored after");
    // Nothing lost, nothing changed: every object reads as it was written.
    let listed = alpha.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), n);
    for o in &listed.items {
        let o = to_json(o);
        let name = o["metadata"]["name"].as_str().unwrap();
        assert_eq!(
            o["spec"],
            json!({"replicas": 1, "image": format!("{name}:1"), "port": 8080})
        );
    }
    assert!(op2.log_tail().contains("storage migration: done"));
    v.remove_crd(&client).await;
}
