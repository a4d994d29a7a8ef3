//! An identity per rule (issue 45 part 2, docs/reference/identity.md), against the local
//! control plane. The operator runs as its own ServiceAccount under exactly what
//! `rulebook rbac --per-rule` generates for two rules — `idlow` and `idhigh`, each with
//! `spec.serviceAccount` and a ConfigMap and a Secret child — except that the low rule's
//! account is then denied every write of Secrets (it may still read them). The operator
//! itself holds no grant on the children or the parents: everything it does for a rule
//! it does as the rule's account. The low rule's Secret is refused by the API server
//! (the audit log: the request made as the low account, answered 403), its parent gets
//! `Ready=False`, its ConfigMap is still written (as the low account); the high rule's
//! parent is Ready with both children, written as the high account.
// A scenario test reads top to bottom as one story (the function size limit is for the
// product code).
#![allow(clippy::too_many_lines)]

mod common;
mod faults_kit;

use std::time::Duration;

use common::*;
use faults_kit::*;
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);
const GROUP: &str = "identity.rulebook.dev";

fn rule(name: &str, kind: &str, account: &str) -> String {
    let lower = kind.to_lowercase();
    format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  serviceAccount: {account}\n  parent:\n    apiVersion: {GROUP}/v1\n    kind: {kind}\n  crd:\n    plural: {lower}s\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n  children:\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: config.yaml\n    - name: secret\n      apiVersion: v1\n      kind: Secret\n      template: secret.yaml\n"
    )
}

/// The `(verb, resource, name, code)` of the audit events made as `user`.
fn as_user(events: &[Json], user: &str) -> Vec<(String, String, String, u64)> {
    events
        .iter()
        .filter(|e| e["impersonatedUser"]["username"] == user)
        .map(|e| {
            let s = |p: &str| {
                e.pointer(p)
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            (
                s("/verb"),
                s("/objectRef/resource"),
                s("/objectRef/name"),
                e["responseStatus"]["code"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_runs_as_its_account_and_cannot_write_what_the_account_may_not() {
    let client = client().await;
    let ns = namespace(&client, "identity").await;
    let run = unique("idr");
    let (low, high) = (format!("low-{run}"), format!("high-{run}"));
    let d = RuleDir::new();
    d.rule("idlow.yaml", &rule("idlow", "Idlow", &low));
    d.rule("idhigh.yaml", &rule("idhigh", "Idhigh", &high));
    d.template(
        "config.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  who: {{ parent.kind }}\n",
    );
    d.template(
        "secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name }}\nstringData:\n  token: {{ \"t-\" ~ parent.metadata.name }}\n",
    );

    // Exactly what `rulebook rbac --per-rule` generates, but the low account may not
    // write Secrets: a template of that rule can render one, and no more.
    let role = unique("rb-identity");
    let text = rulebook(&[
        "rbac",
        "--rules",
        d.rules.to_str().unwrap(),
        "--templates",
        d.templates.to_str().unwrap(),
        "--per-rule",
        "--install-crds",
        "--name",
        &role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]);
    let mut rbac = yaml_objects(&text);
    let low_role = format!("{role}-rule-idlow");
    let mut edited = false;
    for o in &mut rbac {
        if o["kind"] == "ClusterRole" && o["metadata"]["name"] == low_role.as_str() {
            for r in o["rules"].as_array_mut().expect("rules") {
                if r["resources"]
                    .as_array()
                    .is_some_and(|rs| rs.contains(&json!("secrets")))
                {
                    r["verbs"] = json!(["get", "list", "watch"]);
                    edited = true;
                }
            }
        }
    }
    assert!(edited, "no secrets grant in {low_role}:\n{text}");
    // The operator's own role: nothing on the children, nothing on the parents but
    // what a CRD install needs (none of the rules' kinds).
    let own = rbac
        .iter()
        .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == role.as_str())
        .expect("the operator's ClusterRole");
    for r in own["rules"].as_array().expect("rules") {
        let resources = r["resources"].as_array().cloned().unwrap_or_default();
        for forbidden in [
            "secrets",
            "configmaps",
            "idlows",
            "idhighs",
            "idlows/status",
        ] {
            assert!(
                !resources.contains(&json!(forbidden)),
                "the operator itself is granted {forbidden}: {r}"
            );
        }
    }
    let accounts: Vec<Json> = rbac
        .iter()
        .filter(|o| o["kind"] == "ServiceAccount")
        .cloned()
        .collect();
    assert_eq!(accounts.len(), 2, "{text}");
    let sas = api(
        &client,
        Some(&ns),
        "v1",
        "ServiceAccount",
        "serviceaccounts",
    );
    for a in accounts {
        apply(&sas, a).await;
    }
    let rbac: Vec<Json> = rbac
        .into_iter()
        .filter(|o| o["kind"] != "ServiceAccount")
        .collect();
    let kubeconfig = service_account_kubeconfig(&client, &ns, "rulebook", rbac).await;

    let audit = Audit::mark();
    let _op = d
        .operator()
        .namespace(&ns)
        .kubeconfig(kubeconfig.path())
        .flags(&[
            "--install-crds",
            "--lease-namespace",
            &ns,
            // The start-up check would stop the low rule (its account lacks Secret
            // writes): off, to show that the API server refuses the write itself.
            "--check-permissions=false",
        ])
        .start()
        .await;
    let lows = api(
        &client,
        Some(&ns),
        &format!("{GROUP}/v1"),
        "Idlow",
        "idlows",
    );
    let highs = api(
        &client,
        Some(&ns),
        &format!("{GROUP}/v1"),
        "Idhigh",
        "idhighs",
    );
    for a in [&lows, &highs] {
        wait_for(T, "the CRD to be served", || async {
            a.list(&Default::default()).await.ok().map(|_| ())
        })
        .await;
    }
    let parent = |kind: &str, name: &str| {
        json!({"apiVersion": format!("{GROUP}/v1"), "kind": kind,
               "metadata": {"name": name, "namespace": ns.to_string()}, "spec": {}})
    };
    apply(&lows, parent("Idlow", "l1")).await;
    apply(&highs, parent("Idhigh", "h1")).await;

    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    wait_for(T, "h1 Ready with both children", || async {
        let h = to_json(&highs.get_opt("h1").await.ok()??);
        let ok = ready_condition(&h)?.0 == "True"
            && cms.get_opt("h1").await.ok()?.is_some()
            && secrets.get_opt("h1").await.ok()?.is_some();
        ok.then_some(())
    })
    .await;
    let (status, reason, message) = wait_for(T, "l1 Ready=False", || async {
        let l = to_json(&lows.get_opt("l1").await.ok()??);
        ready_condition(&l).filter(|c| c.0 == "False")
    })
    .await;
    println!("l1: Ready={status} {reason}: {message}");
    assert!(cms.get_opt("l1").await.unwrap().is_some(), "l1's ConfigMap");
    assert!(
        secrets.get_opt("l1").await.unwrap().is_none(),
        "the low account wrote a Secret"
    );

    // The audit log: each rule's requests were made as its account.
    let low_user = format!("system:serviceaccount:{ns}:{low}");
    let high_user = format!("system:serviceaccount:{ns}:{high}");
    let events = wait_for(
        T,
        "the low account's refused Secret write in the audit log",
        || async {
            let events = rulebook_writes(&audit, &ns);
            as_user(&events, &low_user)
                .iter()
                .any(|(_, res, name, code)| res == "secrets" && name == "l1" && *code == 403)
                .then_some(events)
        },
    )
    .await;
    let by_low = as_user(&events, &low_user);
    let by_high = as_user(&events, &high_user);
    println!("as {low_user}: {by_low:?}\nas {high_user}: {by_high:?}");
    assert!(
        by_low
            .iter()
            .any(|(_, res, name, code)| res == "configmaps" && name == "l1" && *code < 300),
        "l1's ConfigMap was not written as the low account: {by_low:?}"
    );
    assert!(
        by_high
            .iter()
            .any(|(_, res, name, code)| res == "secrets" && name == "h1" && *code < 300),
        "h1's Secret was not written as the high account: {by_high:?}"
    );
    // No write for either rule's objects went out as anyone else.
    for e in &events {
        let res = e["objectRef"]["resource"].as_str().unwrap_or("");
        if ["configmaps", "secrets", "idlows", "idhighs"].contains(&res) {
            let user = e["impersonatedUser"]["username"].as_str().unwrap_or("");
            assert!(
                user == low_user || user == high_user,
                "a write as {user:?}: {}",
                describe_audit(e)
            );
        }
        assert!(
            !(res == "secrets"
                && e["objectRef"]["name"] == "l1"
                && e["responseStatus"]["code"]
                    .as_u64()
                    .is_some_and(|c| c < 300)),
            "l1's Secret written: {}",
            describe_audit(e)
        );
    }
}
