//! Replicas that share the parents (issue 19), against the local control plane (which
//! runs with the `ShardedListAndWatch` feature gate): `rulebook run --sharding namespace`
//! as child processes over parents spread across namespaces named alike.
//!
//! Sizes: `SHARD_TEST_NAMESPACES` (default 300) namespaces of `SHARD_TEST_PER_NAMESPACE`
//! (default 10) parents, one ConfigMap child each.

mod common;
mod faults_kit;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use faults_kit::*;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(300);
/// The member Lease's duration in these tests.
const LEASE: u64 = 6;

fn size(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Fleet {
    d: RuleDir,
    group: String,
    filter: &'static str,
}

impl Fleet {
    fn new(kind: &str, rule: &str, filter: &'static str) -> Fleet {
        let d = RuleDir::new();
        d.template(
            "cm.yaml",
            &configmap_template("cm", "  gen: \"{{ parent.spec.gen | default(0) }}\"\n"),
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
            group: unique("shards"),
            filter,
        }
    }

    async fn replica(&self) -> Operator {
        let lease = LEASE.to_string();
        Operator::start(
            &self.d.rules,
            &self.d.templates,
            None,
            &[
                "--install-crds",
                "--sharding",
                "namespace",
                "--lease-name",
                &self.group,
                "--lease-namespace",
                "default",
                "--lease-duration",
                &lease,
                "--shard-filter",
                self.filter,
                "--shard-rebalance-seconds",
                "5",
            ],
        )
        .await
    }
}

async fn share(op: &Operator) -> Json {
    let s: Json = serde_json::from_str(&op.get("/status").await).unwrap_or_default();
    s["sharding"].clone()
}

/// Sets `spec.gen` on every parent and waits until all are Ready for it.
async fn edit_wave(
    client: &kube::Client,
    kind: &str,
    spaces: &[String],
    per: usize,
    wave: u64,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for ns in spaces {
        let a = kind_api(client, ns, kind, T).await;
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                let p = json!({"spec": {"gen": wave}});
                let _ = a
                    .patch(&format!("p{i}"), &PatchParams::default(), &Patch::Merge(&p))
                    .await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    all_ready(client, kind, spaces, spaces.len() * per, Some(wave), within).await;
    start.elapsed()
}

/// Waits until `n` parents of `kind` (all namespaces) are Ready for their generation
/// (and, with `gen`, their child carries it).
async fn all_ready(
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
                .filter(|c| ours(c) && c.data["data"]["gen"] == g.to_string())
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
fn no_two_writers(audit: &Audit, spaces: &[String]) {
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

async fn cached_parents(op: &Operator, rule: &str) -> f64 {
    // A replica without a share runs no cache, and has no series.
    op.metric_opt(&format!(
        "rulebook_cached_objects{{rule=\"{rule}\",cache=\"parents\"}}"
    ))
    .await
    .unwrap_or(0.0)
}

async fn run_fleet(kind: &str, rule: &str, filter: &'static str) {
    let client = client().await;
    let spaces_n = size("SHARD_TEST_NAMESPACES", 300);
    let per = size("SHARD_TEST_PER_NAMESPACE", 10);
    let total = spaces_n * per;
    let fleet = Fleet::new(kind, rule, filter);
    let prefix = unique("team");
    let mut spaces = Vec::new();
    for i in 0..spaces_n {
        let ns = format!("{prefix}-{i}");
        let a: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        let obj = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        a.create(&Default::default(), &obj)
            .await
            .expect("namespace");
        spaces.push(ns);
    }
    let audit = Audit::mark();
    let mut ops = vec![
        fleet.replica().await,
        fleet.replica().await,
        fleet.replica().await,
    ];
    for ns in &spaces {
        let a = kind_api(&client, ns, kind, T).await;
        put_all(
            &a,
            (0..per)
                .map(|i| parent(kind, ns, &format!("p{i}"), json!({})))
                .collect(),
            8,
        )
        .await;
    }
    all_ready(&client, kind, &spaces, total, None, T).await;

    // Each replica holds a part: the API server filtered its caches. (Parents of the
    // kind left by earlier runs on a reused cluster count too: the caches hold them.)
    let mode = if filter == "auto" { "server" } else { "client" };
    let everywhere = api(&client, None, API_VERSION, kind, &plural(kind));
    // The replicas started before the parents existed: ranges move to the load.
    // Balanced once two readings of the caches' gauges (refreshed every 2 s) agree.
    let mut previous: Option<Vec<f64>> = None;
    let started = Instant::now();
    let all = loop {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let all = everywhere
            .list(&ListParams::default())
            .await
            .map(|l| l.items.len())
            .unwrap_or(0);
        let mut cached = Vec::new();
        for op in &ops {
            cached.push(cached_parents(op, rule).await);
        }
        let balanced = cached.iter().all(|c| *c <= 0.4 * all as f64)
            && cached.iter().sum::<f64>() as usize == all;
        if balanced && previous.as_ref() == Some(&cached) {
            break all;
        }
        assert!(
            started.elapsed() < T,
            "timed out waiting for balanced caches: {cached:?} of {all}"
        );
        previous = balanced.then_some(cached);
    };
    let mut cached = Vec::new();
    for op in &ops {
        assert_eq!(
            op.metric(&format!("rulebook_shard_mode{{mode=\"{mode}\"}}"))
                .await,
            1.0
        );
        cached.push(cached_parents(op, rule).await);
        eprintln!("{rule}: {}", share(op).await);
    }
    eprintln!("{rule}: parents cached per replica: {cached:?} of {all}");
    assert!(
        cached.iter().all(|c| *c <= 0.4 * all as f64),
        "each replica caches at most 40 %: {cached:?} of {all}"
    );
    let g = share(&ops[0]).await;
    assert_eq!(g["members"].as_array().map(Vec::len), Some(3), "{g}");

    // SIGKILL one replica: the survivors take its parents over.
    let killed = ops.remove(1);
    let mut killed = killed;
    killed.signal_and_wait("KILL");
    let took = edit_wave(
        &client,
        kind,
        &spaces,
        per,
        1,
        Duration::from_secs(LEASE + 10 + 60),
    )
    .await;
    eprintln!("{rule}: after SIGKILL, every parent reconciled in {took:?} (lease {LEASE} s)");
    assert!(
        took <= Duration::from_secs(LEASE + 10),
        "reconciled by the survivors within the Lease + 10 s: {took:?}"
    );

    // Scale 2 → 5 → 2 under load.
    for _ in 0..3 {
        ops.push(fleet.replica().await);
    }
    wait_for(T, "five members", || async {
        let s = share(&ops[0]).await;
        (s["members"].as_array().map(Vec::len) == Some(5)
            && s["waitingFor"].as_array().is_some_and(Vec::is_empty))
        .then_some(())
    })
    .await;
    edit_wave(&client, kind, &spaces, per, 2, T).await;
    for mut op in ops.drain(..3) {
        op.signal_and_wait("TERM");
    }
    edit_wave(&client, kind, &spaces, per, 3, T).await;
    wait_for(T, "the two survivors to hold everything", || async {
        let all = everywhere
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .len();
        let mut sum = 0.0;
        for op in &ops {
            sum += cached_parents(op, rule).await;
        }
        (sum as usize == all).then_some(())
    })
    .await;
    no_two_writers(&audit, &spaces);
    drop(ops);
    for ns in &spaces {
        cleanup_namespace(&client, ns).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_parents_with_the_api_servers_filter() {
    run_fleet("ShardApp", "shardapp", "auto").await;
}
