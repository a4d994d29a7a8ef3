//! Several rules on one parent kind (issue 45 part 3, docs/reference/decorators.md),
//! against the local control plane: the shipped rules together with the two decorator
//! examples of examples/decorators — `team-namespace` (every Namespace labelled `team`
//! gets a NetworkPolicy, a ResourceQuota and a RoleBinding) and `myapp-gold` (a MyApp
//! labelled `tier: gold` also gets a PodDisruptionBudget, beside the Deployment of the
//! shipped `myapp` rule). The right parents get the extra children and the others none
//! (the audit log: no write of Rulebook's into a namespace the decorator does not take);
//! a parent relabelled out of a selector loses exactly that rule's children and
//! condition; renaming the decorator rule hands its children to the new name (same
//! objects, no delete) and a dangling link in its place keeps them; removing it prunes
//! only its children; deleting a parent
//! takes both rules' children along.
// A scenario test reads top to bottom as one story (the function size limit is for the
// product code).
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::time::Duration;

use common::*;
use faults_kit::*;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);

/// The condition of type `kind` on `o`: `(status, reason)`.
fn condition(o: &Json, kind: &str) -> Option<(String, String)> {
    let c = o
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)?;
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    Some((s("status"), s("reason")))
}

async fn get(api: &Api<DynamicObject>, name: &str) -> Option<Json> {
    api.get_opt(name).await.ok().flatten().map(|o| to_json(&o))
}

/// Merges `labels` into the metadata of `name` (a JSON merge patch: `null` removes one).
async fn label(api: &Api<DynamicObject>, name: &str, labels: Json) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": labels}})),
    )
    .await
    .unwrap_or_else(|e| panic!("label {name}: {e}"));
}

/// The three children of `team-namespace` in namespace `ns`, as present or not.
/// `(uid, rulebook.dev/rule label)` of the three team children in `ns` (empty strings for
/// one missing).
async fn team_uids(client: &kube::Client, ns: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (api_version, kind, plural, name) in TEAM_CHILDREN {
        let o = get(&api(client, Some(ns), api_version, kind, plural), name).await;
        let field = |o: &Option<Json>, p: &str| {
            o.as_ref()
                .and_then(|o| o.pointer(p))
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_string()
        };
        out.push((
            field(&o, "/metadata/uid"),
            field(&o, "/metadata/labels/rulebook.dev~1rule"),
        ));
    }
    out
}

/// `before` as the renamed rule holds it: the same objects under the new rule's label.
fn before_renamed(before: &[(String, String)]) -> Vec<(String, String)> {
    before
        .iter()
        .map(|(uid, _)| (uid.clone(), "team-namespace-renamed".to_string()))
        .collect()
}

const TEAM_CHILDREN: [(&str, &str, &str, &str); 3] = [
    (
        "networking.k8s.io/v1",
        "NetworkPolicy",
        "networkpolicies",
        "default-deny",
    ),
    ("v1", "ResourceQuota", "resourcequotas", "team-quota"),
    (
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        "rolebindings",
        "team-members",
    ),
];

async fn team_children(client: &kube::Client, ns: &str) -> [bool; 3] {
    let np = api(
        client,
        Some(ns),
        "networking.k8s.io/v1",
        "NetworkPolicy",
        "networkpolicies",
    );
    let quota = api(client, Some(ns), "v1", "ResourceQuota", "resourcequotas");
    let rb = api(
        client,
        Some(ns),
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        "rolebindings",
    );
    [
        get(&np, "default-deny").await.is_some(),
        get(&quota, "team-quota").await.is_some(),
        get(&rb, "team-members").await.is_some(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decorators_beside_the_shipped_rules() {
    let client = client().await;
    let run = unique("deco");
    // This run's parents only (Namespaces are cluster-wide, and other tests run MyApps).
    let selector = format!("rulebook.test/run={run}");
    let apps_ns = namespace(&client, "deco-apps").await;
    let namespaces: Api<DynamicObject> = api(&client, None, "v1", "Namespace", "namespaces");
    // Two team namespaces and one without the label.
    let mut guards = Vec::new();
    for n in ["team-a", "team-b", "plain"] {
        guards.push(TestNamespace::create_without_pods(&client, &format!("{n}-{run}")).await);
    }
    let _guards = TestNamespaces::new(guards);
    let (team_a, team_b, plain) = (
        format!("team-a-{run}"),
        format!("team-b-{run}"),
        format!("plain-{run}"),
    );
    label(&namespaces, &apps_ns, json!({"rulebook.test/run": run})).await;
    label(
        &namespaces,
        &team_a,
        json!({"rulebook.test/run": run, "team": "a"}),
    )
    .await;
    label(
        &namespaces,
        &team_b,
        json!({"rulebook.test/run": run, "team": "b"}),
    )
    .await;
    label(&namespaces, &plain, json!({"rulebook.test/run": run})).await;

    // The shipped rules and the decorator examples, in one directory.
    let dir = tempfile::tempdir().expect("tempdir");
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    copy_tree(&repo().join("rules"), &rules);
    copy_tree(&repo().join("templates"), &templates);
    copy_tree(&repo().join("examples/decorators/rules"), &rules);
    copy_tree(&repo().join("examples/decorators/templates"), &templates);
    let audit = Audit::mark();
    let op = Operator::on(&rules, &templates)
        .flags(&["--install-crds", "--selector", &selector])
        .start()
        .await;

    // MyApps: one gold, one not.
    let apps = api(
        &client,
        Some(&apps_ns),
        "app.example.com/v1",
        "MyApp",
        "myapps",
    );
    wait_for(T, "the MyApp CRD to be served", || async {
        apps.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    let mut gold = example("decorators/examples/myapp-gold.yaml", &apps_ns);
    gold["metadata"]["labels"]["rulebook.test/run"] = json!(run);
    apply(&apps, gold).await;
    let mut silver = example("myapp.yaml", &apps_ns);
    silver["metadata"]["name"] = json!("ledger");
    silver["metadata"]["labels"] = json!({"rulebook.test/run": run, "tier": "silver"});
    apply(&apps, silver).await;

    // The team namespaces get the three children; the gold MyApp its budget, reported by
    // the decorator's own condition beside the main rule's Ready.
    for ns in [&team_a, &team_b] {
        wait_for(T, &format!("the team children in {ns}"), || async {
            (team_children(&client, ns).await == [true; 3]).then_some(())
        })
        .await;
    }
    let deploys = api(
        &client,
        Some(&apps_ns),
        "apps/v1",
        "Deployment",
        "deployments",
    );
    let pdbs = api(
        &client,
        Some(&apps_ns),
        "policy/v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
    );
    wait_for(T, "checkout's Deployment and budget", || async {
        (get(&deploys, "checkout").await.is_some() && get(&pdbs, "checkout").await.is_some())
            .then_some(())
    })
    .await;
    let checkout = wait_for(T, "checkout's MyappGoldReady condition", || async {
        let o = get(&apps, "checkout").await?;
        (condition(&o, "MyappGoldReady")?.0 == "True").then_some(o)
    })
    .await;
    let budget = get(&pdbs, "checkout").await.expect("budget");
    assert_eq!(
        budget["metadata"]["labels"]["rulebook.dev/rule"],
        "myapp-gold"
    );
    assert_eq!(
        budget["metadata"]["ownerReferences"][0]["uid"],
        checkout["metadata"]["uid"]
    );
    let ledger = wait_for(T, "ledger's Deployment and Ready", || async {
        get(&deploys, "ledger").await?;
        let o = get(&apps, "ledger").await?;
        ready_condition(&o).map(|_| o)
    })
    .await;
    assert!(
        get(&pdbs, "ledger").await.is_none(),
        "a silver MyApp got a budget"
    );
    assert_eq!(condition(&ledger, "MyappGoldReady"), None);
    // Every write into the team namespaces succeeded: the Namespaces were listed at start,
    // where the API server leaves out their apiVersion and kind, and the children's
    // ownerReferences still name them.
    for ns in [&team_a, &team_b] {
        let failed: Vec<String> = rulebook_writes(&audit, ns)
            .iter()
            .filter(|e| {
                e["responseStatus"]["code"]
                    .as_u64()
                    .is_none_or(|c| c >= 400)
            })
            .map(describe_audit)
            .collect();
        assert!(failed.is_empty(), "failed writes into {ns}: {failed:?}");
    }
    // The namespace without the label: nothing of the decorator, not even an attempt.
    assert_eq!(team_children(&client, &plain).await, [false; 3]);
    let into_plain = rulebook_writes(&audit, &plain);
    assert!(
        into_plain.is_empty(),
        "writes into {plain}: {:?}",
        into_plain.iter().map(describe_audit).collect::<Vec<_>>()
    );

    // Out of gold: the budget and the decorator's condition go, the Deployment stays.
    label(&apps, "checkout", json!({"tier": "silver"})).await;
    wait_for(T, "checkout's budget and MyappGoldReady gone", || async {
        let o = get(&apps, "checkout").await?;
        (get(&pdbs, "checkout").await.is_none() && condition(&o, "MyappGoldReady").is_none())
            .then_some(())
    })
    .await;
    let o = get(&apps, "checkout").await.expect("checkout");
    assert!(
        get(&deploys, "checkout").await.is_some(),
        "the Deployment went too"
    );
    assert!(
        ready_condition(&o).is_some(),
        "the main rule's Ready went: {o}"
    );

    // A namespace whose team label is removed loses the three; the other keeps them.
    label(&namespaces, &team_a, json!({"team": null})).await;
    wait_for(
        T,
        &format!("the team children gone from {team_a}"),
        || async { (team_children(&client, &team_a).await == [false; 3]).then_some(()) },
    )
    .await;
    assert_eq!(team_children(&client, &team_b).await, [true; 3]);

    // The decorator rule renamed (a hot reload): the new rule takes the same objects over
    // — same UIDs, its label — and nothing of them is deleted on the way.
    let before = team_uids(&client, &team_b).await;
    assert!(
        before
            .iter()
            .all(|(uid, rule)| !uid.is_empty() && rule == "team-namespace"),
        "{before:?}"
    );
    let renamed = std::fs::read_to_string(rules.join("team-namespace.yaml"))
        .expect("read the rule")
        .replacen(
            "name: team-namespace\n",
            "name: team-namespace-renamed\n",
            1,
        );
    assert!(renamed.contains("team-namespace-renamed"));
    let staged = dir.path().join("team-namespace-renamed.yaml");
    std::fs::write(&staged, renamed).expect("write the renamed rule");
    std::fs::rename(&staged, rules.join("team-namespace-renamed.yaml")).expect("move it in");
    std::fs::remove_file(rules.join("team-namespace.yaml")).expect("remove the old name");
    wait_for(
        T,
        "the team children taken over by the renamed rule",
        || async {
            let now = team_uids(&client, &team_b).await;
            now.iter()
                .all(|(_, rule)| rule == "team-namespace-renamed")
                .then_some(now)
        },
    )
    .await
    .iter()
    .zip(&before)
    .for_each(|(now, was)| assert_eq!(now.0, was.0, "a child was replaced on the rename"));
    let deletes: Vec<String> = rulebook_writes(&audit, &team_b)
        .iter()
        .filter(|e| e["verb"] == "delete")
        .map(describe_audit)
        .collect();
    assert!(deletes.is_empty(), "the rename deleted: {deletes:?}");

    // Its file a dangling link for a while (a GitOps checkout half-swapped): the rule is
    // missing, not removed, and its children stay.
    let file = rules.join("team-namespace-renamed.yaml");
    std::fs::remove_file(&file).expect("remove the rule file");
    std::os::unix::fs::symlink(dir.path().join("nowhere.yaml"), &file).expect("dangling link");
    wait_for(T, "the operator to notice the dangling link", || async {
        op.log_tail()
            .contains("the file of a rule with spec.parent.selector was skipped")
            .then_some(())
    })
    .await;
    assert_eq!(team_uids(&client, &team_b).await, before_renamed(&before));

    // The decorator rule removed: its children are pruned; the MyApps' are not.
    std::fs::remove_file(&file).expect("remove the rule");
    wait_for(
        T,
        &format!("the team children gone from {team_b}"),
        || async { (team_children(&client, &team_b).await == [false; 3]).then_some(()) },
    )
    .await;
    assert!(get(&deploys, "checkout").await.is_some());
    assert!(get(&deploys, "ledger").await.is_some());

    // A gold MyApp deleted: neither rule holds a finalizer on MyApps, so both rules'
    // children go with it (the garbage collector), the other MyApp's stay.
    label(&apps, "ledger", json!({"tier": "gold"})).await;
    wait_for(T, "ledger's budget", || async {
        get(&pdbs, "ledger").await
    })
    .await;
    apps.delete("ledger", &Default::default())
        .await
        .expect("delete ledger");
    wait_for(T, "ledger's Deployment and budget gone", || async {
        (get(&deploys, "ledger").await.is_none() && get(&pdbs, "ledger").await.is_none())
            .then_some(())
    })
    .await;
    assert!(get(&deploys, "checkout").await.is_some());
}
