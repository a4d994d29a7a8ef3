//! The kill/restart scenario: parents converging while the operator is SIGKILLed at random
//! moments, then a census of parents and children (nothing lost, stale, duplicated or
//! orphaned).

use super::*;

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

pub async fn count_ready(a: &Api<DynamicObject>) -> usize {
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

    let mut op = dir.operator().namespace(&ns).flags(&args).start().await;
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
            op = dir.operator().namespace(&ns).flags(&args).start().await;
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
    let _op = dir.operator().namespace(&ns).flags(&args).start().await;
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
