//! Helpers of the sharding tests (`tests/sharding.rs`, `tests/sharding_fence.rs`):
//! a fleet of `rulebook run --sharding namespace` processes over one rule (a ConfigMap
//! per parent), and what the tests read of them (their `/status` share, cached parents,
//! RSS) and of the API server (Ready parents at a wave, the audit log by replica).

#![allow(dead_code)] // each test binary uses a different part of the kit

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use crate::common::*;
use crate::faults_kit::*;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value as Json, json};

pub const T: Duration = Duration::from_secs(300);
/// The member Lease's duration in these tests.
pub const LEASE: u64 = 6;

pub fn size(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub struct Fleet {
    d: RuleDir,
    group: String,
    /// The API server the replicas talk to (the local one, or the one without the gate).
    kubeconfig: PathBuf,
}

impl Fleet {
    pub fn new(kind: &str, rule: &str, kubeconfig: PathBuf) -> Fleet {
        Fleet::with_data(kind, rule, kubeconfig, "", unique("shards"))
    }

    /// The same group and rule, with `extra` lines in the child's `data`: another rule
    /// set version, as a rolling update brings it.
    pub fn next_version(&self, kind: &str, rule: &str, extra: &str) -> Fleet {
        Fleet::with_data(
            kind,
            rule,
            self.kubeconfig.clone(),
            extra,
            self.group.clone(),
        )
    }

    fn with_data(kind: &str, rule: &str, kubeconfig: PathBuf, extra: &str, group: String) -> Fleet {
        let d = RuleDir::new();
        d.template(
            "cm.yaml",
            &configmap_template(
                "cm",
                &format!("  gen: \"{{{{ parent.spec.gen | default(0) }}}}\"\n{extra}"),
            ),
        );
        d.rule(
            "shard.yaml",
            &rule_text(
                rule,
                kind,
                &[child("cm", "v1", "ConfigMap", "cm.yaml", &[])],
            ),
        );
        Fleet {
            d,
            group,
            kubeconfig,
        }
    }

    /// The fleet's rule directory (for a test that adds a rule of its own).
    pub fn dir(&self) -> &RuleDir {
        &self.d
    }

    pub async fn replica(&self) -> Operator {
        self.replica_as(None).await
    }

    /// A replica with `--identity` (its user agent in the audit log names it).
    pub async fn replica_as(&self, identity: Option<&str>) -> Operator {
        let lease = LEASE.to_string();
        let mut args = vec![
            "--install-crds",
            "--sharding",
            "namespace",
            "--lease-name",
            &self.group,
            "--lease-namespace",
            "default",
            "--lease-duration",
            &lease,
            // Soon enough to balance the parents created after the replicas started,
            // rarely enough not to move ranges while a failover is being timed.
            "--shard-rebalance-seconds",
            "20",
        ];
        if let Some(id) = identity {
            args.extend(["--identity", id]);
        }
        self.d
            .operator()
            .flags(&args)
            .kubeconfig(&self.kubeconfig)
            .start()
            .await
    }
}

/// Whether namespace `ns` hashes into `ranges` (`/status`'s `start-end,…` in hex).
pub fn in_ranges(ranges: &str, ns: &str) -> bool {
    rulebook::shard::Ranges::decode(ranges).is_ok_and(|r| r.holds_namespace(ns))
}

/// Sets `spec.gen` to `wave` on each (namespace, name).
pub async fn touch(client: &kube::Client, kind: &str, targets: &[(String, String)], wave: u64) {
    for (ns, name) in targets {
        let a = api(client, Some(ns), API_VERSION, kind, &plural(kind));
        a.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"gen": wave}})),
        )
        .await
        .expect("patch");
    }
}

/// Waits until each (namespace, name) is Ready for its generation and its child says `wave`.
pub async fn ready_at(
    client: &kube::Client,
    kind: &str,
    targets: &[(String, String)],
    wave: u64,
    within: Duration,
) {
    let parents: Api<DynamicObject> = api(client, None, API_VERSION, kind, &plural(kind));
    let cms: Api<DynamicObject> = api(client, None, "v1", "ConfigMap", "configmaps");
    let sel = format!("rulebook.dev/rule={}", kind.to_lowercase());
    let key = |o: &DynamicObject| {
        (
            o.metadata.namespace.clone().unwrap_or_default(),
            o.metadata.name.clone().unwrap_or_default(),
        )
    };
    let wanted: BTreeSet<(String, String)> = targets.iter().cloned().collect();
    let what = format!("{} parents at wave {wave}", targets.len());
    wait_for(within, &what, || async {
        let ready: BTreeSet<(String, String)> = parents
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .iter()
            .filter(|p| is_ready(&to_json(p)))
            .map(key)
            .collect();
        let at: BTreeSet<(String, String)> = cms
            .list(&ListParams::default().labels(&sel))
            .await
            .ok()?
            .items
            .iter()
            .filter(|c| c.data["data"]["gen"].as_str() == Some(wave.to_string().as_str()))
            .map(|c| {
                let (ns, name) = key(c);
                (ns, name.trim_end_matches("-cm").to_string())
            })
            .collect();
        wanted
            .iter()
            .all(|t| ready.contains(t) && at.contains(t))
            .then_some(())
    })
    .await;
}

pub async fn share(op: &Operator) -> Json {
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap_or_default();
    s["sharding"].clone()
}

/// Waits until `n` parents of `kind` (all namespaces) are Ready for their generation
/// (and, with `gen`, their child carries it).
pub async fn all_ready(
    client: &kube::Client,
    kind: &str,
    spaces: &[String],
    n: usize,
    generation: Option<u64>,
    within: Duration,
) {
    let parents: Api<DynamicObject> = api(client, None, API_VERSION, kind, &plural(kind));
    let cms: Api<DynamicObject> = api(client, None, "v1", "ConfigMap", "configmaps");
    let sel = format!("rulebook.dev/rule={}", kind.to_lowercase());
    wait_for(within, &format!("{n} parents Ready"), || async {
        let items = parents.list(&ListParams::default()).await.ok()?;
        let ours = |o: &DynamicObject| {
            o.metadata
                .namespace
                .as_ref()
                .is_some_and(|ns| spaces.contains(ns))
        };
        let ready = items
            .items
            .iter()
            .filter(|o| ours(o))
            .map(to_json)
            .filter(is_ready)
            .count();
        if ready < n {
            return None;
        }
        if let Some(g) = generation {
            let children = cms.list(&ListParams::default().labels(&sel)).await.ok()?;
            let at = children
                .items
                .iter()
                .filter(|c| {
                    ours(c) && c.data["data"]["gen"].as_str() == Some(g.to_string().as_str())
                })
                .count();
            if at < n {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// No object written by two replicas within the same second (audit log, by user agent).
pub fn no_two_writers(audit: &Audit, spaces: &[String]) {
    let mut by_object_second: BTreeMap<(String, String, String), BTreeSet<String>> =
        BTreeMap::new();
    for ns in spaces {
        for e in rulebook_writes(audit, ns) {
            let second = e["stageTimestamp"]
                .as_str()
                .unwrap_or("")
                .chars()
                .take(19)
                .collect();
            let object = format!(
                "{}/{}/{}",
                e["objectRef"]["resource"].as_str().unwrap_or(""),
                e["objectRef"]["subresource"].as_str().unwrap_or(""),
                e["objectRef"]["name"].as_str().unwrap_or("")
            );
            by_object_second
                .entry((ns.clone(), object, second))
                .or_default()
                .insert(e["userAgent"].as_str().unwrap_or("").to_string());
        }
    }
    let fights: Vec<_> = by_object_second
        .iter()
        .filter(|(_, agents)| agents.len() > 1)
        .collect();
    assert!(
        fights.is_empty(),
        "objects written by two replicas in one second: {fights:#?}"
    );
}

pub async fn cached_parents(op: &Operator, rule: &str) -> f64 {
    // A replica without a share runs no cache, and has no series.
    op.metric_opt(&format!(
        "rulebook_cached_objects{{rule=\"{rule}\",cache=\"parents\"}}"
    ))
    .await
    .unwrap_or(0.0)
}

/// Creates `n` namespaces `<prefix>-0` … (named alike, as the set-up has them),
/// deleted when the returned guard drops.
pub async fn namespaces(client: &kube::Client, prefix: &str, n: usize) -> TestNamespaces {
    let mut spaces = Vec::new();
    for i in 0..n {
        spaces.push(TestNamespace::create_without_pods(client, &format!("{prefix}-{i}")).await);
    }
    TestNamespaces::new(spaces)
}

/// Creates `per` parents `p0` … in each namespace of `spaces`.
pub async fn create_parents(client: &kube::Client, kind: &str, spaces: &[String], per: usize) {
    use futures::StreamExt;
    futures::stream::iter(spaces.to_vec())
        .map(|ns| {
            let client = client.clone();
            async move {
                let a = kind_api(&client, &ns, kind, T).await;
                put_all(
                    &a,
                    (0..per)
                        .map(|i| parent(kind, &ns, &format!("p{i}"), json!({})))
                        .collect(),
                    2,
                )
                .await;
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await;
}

/// A second API server on the local control plane's etcd, without the
/// `ShardedListAndWatch` gate (started by `cluster.sh apiserver-without-gate` if it is not
/// running); its kubeconfig.
pub async fn apiserver_without_gate() -> PathBuf {
    cluster_sh("apiserver-without-gate").await;
    let path = kubeconfig_path()
        .parent()
        .expect("cluster dir")
        .join("kubeconfig-nogate");
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// Rulebook's writes in `spaces` since `audit` by the replica whose user agent names
/// `identity`, events aside.
pub fn writes_by(audit: &Audit, spaces: &[String], identity: &str) -> Vec<Json> {
    let tag = format!("({identity})");
    spaces
        .iter()
        .flat_map(|ns| rulebook_writes(audit, ns))
        .filter(|e| e["userAgent"].as_str().is_some_and(|a| a.contains(&tag)))
        .collect()
}

/// Waits until every replica holds ranges, none waits for an acknowledgement, two
/// readings 2.5 s apart agree, and `want` accepts the ranges; returns them (in the
/// order of `ops`).
pub async fn settled_ranges(ops: &[&Operator], want: impl Fn(&[String]) -> bool) -> Vec<String> {
    let mut previous: Option<Vec<String>> = None;
    let started = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let mut holding = Vec::new();
        for op in ops {
            let s = share(op).await;
            let r = s["ranges"].as_str().unwrap_or("").to_string();
            if !r.is_empty() && s["waitingFor"].as_array().is_some_and(Vec::is_empty) {
                holding.push(r);
            }
        }
        if holding.len() == ops.len() && previous.as_ref() == Some(&holding) && want(&holding) {
            return holding;
        }
        assert!(
            started.elapsed() < T,
            "timed out waiting for settled ranges: {holding:?}"
        );
        previous = Some(holding);
    }
}
