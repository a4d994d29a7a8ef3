//! `deletionPolicy: Orphan` across rule edits, against the real control plane with the
//! operator running as a process: a child let go of when the rule no longer has it, its
//! kind or not; when its parent is deleted across the edit; and when the edit that drops
//! its kind happens while no operator runs, so no process ever sees it (the parent's
//! record of its `Orphan` children's kinds leads the next one to them).

mod common;

use std::time::Duration;

use common::reload::*;
use common::*;
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;

const T: Duration = Duration::from_secs(120);

/// A child with `deletionPolicy: Orphan` outlives the rule edit that removes it, whether
/// its kind leaves the rule with it (the clean-up of dropped kinds) or stays for another
/// child (the parent's own pruning): let go of, not deleted. The policy travels with the
/// object (`rulebook.dev/deletion-policy`), since the rule that set it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_its_removal_from_the_rule() {
    let client = client().await;
    let ns = namespace(&client, "reload-orphan").await;
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    let orphan = "deletionPolicy: Orphan";
    let plain = with_children(
        &rules,
        &templates,
        "Keeper",
        &[
            Extra {
                name: "vault",
                kind: "Secret",
                line: orphan,
                body: "stringData:\n  t: x\n",
            },
            Extra {
                name: "ledger",
                kind: "ConfigMap",
                line: orphan,
                body: "data:\n  l: x\n",
            },
        ],
        false,
    );
    let rule_file = rules.join("keeper.yaml");
    let _op = Operator::start(&rules, &templates, Some(&ns), &["--install-crds"]).await;
    let keepers = parents_api(&client, &ns, "Keeper").await;
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    apply(&keepers, parent("Keeper", &ns, "k")).await;
    wait_ready(&keepers, "k", "True", None, T).await;
    let vault = secrets.get("k-vault").await.unwrap();
    let ledger = cms.get("k-ledger").await.unwrap();
    for o in [&vault, &ledger] {
        assert_eq!(
            o.annotations()
                .get("rulebook.dev/deletion-policy")
                .map(String::as_str),
            Some("Orphan"),
            "{}: the policy is on the object",
            o.name_any()
        );
    }

    // Both leave the rule: the Secret kind with it, the ConfigMap kind stays (`config`).
    std::fs::write(&rule_file, &plain).unwrap();
    for (what, api, before) in [("Secret", &secrets, &vault), ("ConfigMap", &cms, &ledger)] {
        let name = before.name_any();
        let after = wait_for(T, &format!("{what} {name} to be let go of"), || async {
            match api.get_opt(&name).await.ok()? {
                None => Some(None),
                Some(o) => o.owner_references().is_empty().then_some(Some(o)),
            }
        })
        .await;
        let after =
            after.unwrap_or_else(|| panic!("{what} {name} was deleted: its policy is Orphan"));
        assert_eq!(after.uid(), before.uid(), "{what} {name}: the same object");
        assert!(
            !after.labels().contains_key("rulebook.dev/owner"),
            "{what} {name}: Rulebook's labels are gone: {:?}",
            after.labels()
        );
    }
    // The other child is still the parent's.
    assert_eq!(cms.get("k").await.unwrap().owner_references().len(), 1);
}

/// A parent deleted while no operator runs, after an edit that removed its `Orphan` child
/// and left the rule with no reason for a finalizer: the new version still orphans the
/// child (its policy is recorded on it) before the finalizer comes off, rather than leave
/// it to the garbage collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_a_parent_deleted_across_the_edit() {
    let client = client().await;
    let ns = namespace(&client, "reload-orphan-gone").await;
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    let ledger = Extra {
        name: "ledger",
        kind: "ConfigMap",
        line: "deletionPolicy: Orphan",
        body: "data:\n  l: x\n",
    };
    let plain = with_children(&rules, &templates, "Hoarder", &[ledger], false);
    let rule_file = rules.join("hoarder.yaml");
    let mut op = Operator::start(&rules, &templates, Some(&ns), &["--install-crds"]).await;
    let hoarders = parents_api(&client, &ns, "Hoarder").await;
    let cms = api(&client, Some(&ns), "v1", "ConfigMap", "configmaps");
    apply(&hoarders, parent("Hoarder", &ns, "h")).await;
    wait_ready(&hoarders, "h", "True", None, T).await;
    let ledger = cms.get("h-ledger").await.unwrap();
    assert!(
        hoarders
            .get("h")
            .await
            .unwrap()
            .finalizers()
            .contains(&"rulebook.dev/finalizer".to_string()),
        "an Orphan child puts the finalizer on its parent"
    );

    // Operator down: the child leaves the rule (which then needs no finalizer), and the
    // parent is deleted.
    op.signal_and_wait("TERM");
    std::fs::write(&rule_file, &plain).unwrap();
    hoarders.delete("h", &Default::default()).await.unwrap();
    let _op = Operator::start(&rules, &templates, Some(&ns), &["--install-crds"]).await;
    wait_for(T, "the parent to be gone", || async {
        hoarders.get_opt("h").await.ok()?.is_none().then_some(())
    })
    .await;
    let after = wait_for(T, "the ledger to be orphaned or deleted", || async {
        match cms.get_opt("h-ledger").await.ok()? {
            None => Some(None),
            Some(o) if o.owner_references().is_empty() => Some(Some(o)),
            // Still owned: the garbage collector has not come to it yet.
            Some(_) => None,
        }
    })
    .await
    .unwrap_or_else(|| panic!("h-ledger was deleted with its parent: its policy is Orphan"));
    assert_eq!(after.uid(), ledger.uid());
}

/// The kind of an `Orphan` child leaves the rule while no operator runs: no process sees
/// the edit, so the clean-up of dropped kinds never starts, and no cache of the new rule
/// holds a Secret. The parents' record (`rulebook.dev/orphan-kinds`) leads the next
/// operator to them: the child of a parent still there is let go of, and so is the child
/// of a parent deleted meanwhile, before its finalizer comes off (before, the garbage
/// collector deleted that one with its parent). Entries a tenant made up do not hold
/// anything: a kind nobody serves has no objects, a malformed entry is not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_of_a_kind_dropped_while_no_operator_ran_is_let_go_of() {
    let client = client().await;
    let ns = namespace(&client, "orphan-offline").await;
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    let vault = Extra {
        name: "vault",
        kind: "Secret",
        line: "deletionPolicy: Orphan",
        body: "stringData:\n  t: x\n",
    };
    let plain = with_children(&rules, &templates, "Stasher", &[vault], false);
    let rule_file = rules.join("stasher.yaml");
    let mut op = Operator::start(&rules, &templates, Some(&ns), &["--install-crds"]).await;
    let stashers = parents_api(&client, &ns, "Stasher").await;
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    for name in ["kept", "gone"] {
        apply(&stashers, parent("Stasher", &ns, name)).await;
    }
    for name in ["kept", "gone"] {
        wait_ready(&stashers, name, "True", None, T).await;
        let p = stashers.get(name).await.unwrap();
        assert_eq!(
            p.annotations()
                .get("rulebook.dev/orphan-kinds")
                .map(String::as_str),
            Some("v1/Secret"),
            "{name}: the record of its Orphan children's kinds"
        );
        assert!(
            p.finalizers()
                .contains(&"rulebook.dev/finalizer".to_string())
        );
    }
    let before: Vec<_> =
        futures::future::join_all(["kept-vault", "gone-vault"].map(|n| secrets.get(n)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();

    // Operator down: the Secret leaves the rule (which then needs no finalizer), a tenant
    // adds to one record, and the other parent is deleted.
    op.signal_and_wait("TERM");
    std::fs::write(&rule_file, &plain).unwrap();
    stashers
        .patch(
            "kept",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "rulebook.dev/orphan-kinds": "v1/Secret,nothing.example.com/v1/Nothing,not a kind"
            }}})),
        )
        .await
        .unwrap();
    stashers.delete("gone", &Default::default()).await.unwrap();
    let _op = Operator::start(&rules, &templates, Some(&ns), &["--install-crds"]).await;

    wait_for(T, "the deleted parent to be gone", || async {
        stashers.get_opt("gone").await.ok()?.is_none().then_some(())
    })
    .await;
    for old in &before {
        let name = old.name_any();
        let after = wait_for(T, &format!("{name} to be let go of"), || async {
            match secrets.get_opt(&name).await.ok()? {
                None => Some(None),
                Some(o) => o.owner_references().is_empty().then_some(Some(o)),
            }
        })
        .await
        .unwrap_or_else(|| panic!("{name} was deleted: its policy is Orphan"));
        assert_eq!(after.uid(), old.uid(), "{name}: the same object");
        assert!(!after.labels().contains_key("rulebook.dev/owner"));
    }
    // Done: the parent still there keeps neither the record nor the finalizer.
    wait_for(T, "the record and the finalizer to come off", || async {
        let p = stashers.get("kept").await.ok()?;
        (p.annotations().get("rulebook.dev/orphan-kinds").is_none() && p.finalizers().is_empty())
            .then_some(())
    })
    .await;
    wait_ready(&stashers, "kept", "True", None, T).await;
}
