//! `deletionPolicy: Orphan` across rule edits, against the real control plane with the
//! operator running as a process: a child let go of when the rule no longer has it, its
//! kind or not; when its parent is deleted across the edit; and when the edit that drops
//! its kind happens while no operator runs, so no process ever sees it (the parent's
//! record of its `Orphan` children's kinds leads the next one to them).
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::reload::*;
use common::*;
use kube::ResourceExt;
use kube::api::{DynamicObject, Patch, PatchParams};
use serde_json::{Value as Json, json};

const T: Duration = Duration::from_secs(120);

/// The `Orphan` children the rules here are given.
const VAULT: Extra<'static> = Extra {
    name: "vault",
    kind: "Secret",
    line: "deletionPolicy: Orphan",
    body: "stringData:\n  t: x\n",
};
const LEDGER: Extra<'static> = Extra {
    name: "ledger",
    kind: "ConfigMap",
    line: "deletionPolicy: Orphan",
    body: "data:\n  l: x\n",
};

/// A test's namespace and rule directory.
struct Setup {
    ns: TestNamespace,
    dir: tempfile::TempDir,
    rules: PathBuf,
    templates: PathBuf,
    /// The rule without its `extra` children.
    plain: String,
}

/// A namespace named after `prefix`, and `kind`'s rule with its plain children and `extra`.
async fn set_up(client: &kube::Client, prefix: &str, kind: &str, extra: &[Extra<'_>]) -> Setup {
    let ns = namespace(client, prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    let plain = with_children(&rules, &templates, kind, extra, false);
    Setup {
        ns,
        dir,
        rules,
        templates,
        plain,
    }
}

/// A child with `deletionPolicy: Orphan` outlives the rule edit that removes it, whether
/// its kind leaves the rule with it (the clean-up of dropped kinds) or stays for another
/// child (the parent's own pruning): let go of, not deleted. The policy travels with the
/// object (`rulebook.dev/deletion-policy`), since the rule that set it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_its_removal_from_the_rule() {
    let client = client().await;
    let Setup {
        ns,
        dir: _dir,
        rules,
        templates,
        plain,
    } = set_up(&client, "reload-orphan", "Keeper", &[VAULT, LEDGER]).await;
    let rule_file = rules.join("keeper.yaml");
    let _op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
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
        assert!(
            o.owner_references().is_empty(),
            "{}: an Orphan child carries no ownerReference",
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
                Some(o) => released(&o).then_some(Some(o)),
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
    // The clean-up of the dropped kind has let go of every Secret, and the rule's parents
    // are reconciled once more: the parent takes the kind off its record and, its rule
    // needing none, the finalizer comes off (nothing else wakes it).
    wait_for(T, "the record and the finalizer to come off", || async {
        let p = keepers.get("k").await.ok()?;
        (record(&p).is_none() && p.finalizers().is_empty()).then_some(())
    })
    .await;
}

/// A parent deleted while no operator runs, after an edit that removed its `Orphan` child
/// and left the rule with no reason for a finalizer: the new version still orphans the
/// child (its policy is recorded on it) before the finalizer comes off, rather than leave
/// it to the garbage collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_a_parent_deleted_across_the_edit() {
    let client = client().await;
    let Setup {
        ns,
        dir: _dir,
        rules,
        templates,
        plain,
    } = set_up(&client, "reload-orphan-gone", "Hoarder", &[LEDGER]).await;
    let rule_file = rules.join("hoarder.yaml");
    let mut op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
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
    let _op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    wait_for(T, "the parent to be gone", || async {
        hoarders.get_opt("h").await.ok()?.is_none().then_some(())
    })
    .await;
    let after = wait_for(T, "the ledger to be orphaned or deleted", || async {
        match cms.get_opt("h-ledger").await.ok()? {
            None => Some(None),
            Some(o) if released(&o) => Some(Some(o)),
            // Still the parent's.
            Some(_) => None,
        }
    })
    .await
    .unwrap_or_else(|| panic!("h-ledger was deleted with its parent: its policy is Orphan"));
    assert_eq!(after.uid(), ledger.uid());
}

/// The kind of an `Orphan` child leaves the rule while no operator runs: no process sees
/// the edit, so the clean-up of dropped kinds never starts, and no cache of the new rule
/// holds a Secret. The parents' record (`rulebook.dev/orphan-kinds`) leads the teardown
/// to them: the child of a parent deleted meanwhile is let go of before its finalizer
/// comes off (before, the garbage collector deleted it with its parent), and so is that of
/// a parent deleted later, which keeps the kind on its record and the finalizer until
/// then. Nothing else is touched: a lookalike with the parent's marks but neither a
/// controller reference nor the `Orphan` record keeps them, and a child of that kind
/// without the `Orphan` record goes with its parent. Entries a tenant made up do not hold anything: a kind nobody serves has
/// no objects, a malformed entry is not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_of_a_kind_dropped_while_no_operator_ran_is_let_go_of() {
    let client = client().await;
    let Setup {
        ns,
        dir: _dir,
        rules,
        templates,
        plain,
    } = set_up(&client, "orphan-offline", "Stasher", &[VAULT]).await;
    let rule_file = rules.join("stasher.yaml");
    let mut op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let stashers = parents_api(&client, &ns, "Stasher").await;
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    for name in ["kept", "gone"] {
        apply(&stashers, parent("Stasher", &ns, name)).await;
    }
    for name in ["kept", "gone"] {
        wait_ready(&stashers, name, "True", None, T).await;
        let p = stashers.get(name).await.unwrap();
        assert_eq!(record(&p), Some("v1/Secret"), "{name}: its record");
        assert!(p.finalizers().contains(&FINALIZER.to_string()));
    }
    let vaults: Vec<_> =
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
    // And someone puts marks of `kept` on a Secret it does not control, and makes one it
    // controls that did not record `Orphan`.
    let kept_uid = stashers.get("kept").await.unwrap().uid().unwrap();
    let marks = json!({
        "app.kubernetes.io/managed-by": "rulebook",
        "rulebook.dev/rule": "stasher",
        "rulebook.dev/owner": kept_uid,
    });
    let lookalike = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "lookalike", "namespace": ns, "labels": marks}});
    apply(&secrets, lookalike).await;
    let owned_plain = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "kept-plain", "namespace": ns, "labels": marks,
                     "ownerReferences": [{"apiVersion": "reload.rulebook.dev/v1",
                        "kind": "Stasher", "name": "kept", "uid": kept_uid,
                        "controller": true}]}});
    apply(&secrets, owned_plain).await;

    stashers.delete("gone", &Default::default()).await.unwrap();
    let _op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;

    wait_for(T, "the deleted parent to be gone", || async {
        stashers.get_opt("gone").await.ok()?.is_none().then_some(())
    })
    .await;
    let let_go = |old: &DynamicObject| {
        let (secrets, name, uid) = (&secrets, old.name_any(), old.uid());
        async move {
            let after = wait_for(T, &format!("{name} to be let go of"), || async {
                match secrets.get_opt(&name).await.ok()? {
                    None => Some(None),
                    Some(o) => released(&o).then_some(Some(o)),
                }
            })
            .await
            .unwrap_or_else(|| panic!("{name} was deleted: its policy is Orphan"));
            assert_eq!(after.uid(), uid, "{name}: the same object");
            for key in [
                "rulebook.dev/owner",
                "rulebook.dev/rule",
                "rulebook.dev/child",
            ] {
                assert!(!after.labels().contains_key(key), "{name}: {key}");
            }
            assert!(
                after
                    .annotations()
                    .get("rulebook.dev/deletion-policy")
                    .is_none()
            );
        }
    };
    let_go(&vaults[1]).await;

    // The parent still there: the malformed entry is gone from its record, the dropped
    // kind stays on it (and the kind nobody serves: nothing is looked up before the
    // teardown) with the finalizer, and its child stays its own until it goes.
    wait_for(T, "kept's record to be tidied", || async {
        let p = stashers.get("kept").await.ok()?;
        (record(&p) == Some("nothing.example.com/v1/Nothing,v1/Secret")).then_some(())
    })
    .await;
    wait_ready(&stashers, "kept", "True", None, T).await;
    let p = stashers.get("kept").await.unwrap();
    assert!(p.finalizers().contains(&FINALIZER.to_string()));
    let kept_vault = secrets.get("kept-vault").await.unwrap();
    assert_eq!(kept_vault.labels().get(OWNER), Some(&kept_uid));
    assert!(
        kept_vault.owner_references().is_empty(),
        "an Orphan child carries no ownerReference"
    );
    // The garbage collector must have seen `kept` to delete its plain child after it.
    gc_watches(&client, &parent("Stasher", &ns, "kept"), "stashers").await;
    stashers.delete("kept", &Default::default()).await.unwrap();
    let_go(&vaults[0]).await;
    wait_for(T, "kept to be gone", || async {
        stashers.get_opt("kept").await.ok()?.is_none().then_some(())
    })
    .await;
    let lookalike = secrets.get("lookalike").await.unwrap();
    assert_eq!(
        lookalike.labels().get("rulebook.dev/owner"),
        Some(&kept_uid),
        "the lookalike keeps its marks"
    );
    wait_for(
        T,
        "the child without the Orphan record to go with its parent",
        || async {
            secrets
                .get_opt("kept-plain")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
}

/// The rename tests' start: rule `renamed` with a ConfigMap child `config` and a
/// ConfigMap child `ledger` whose policy is `Orphan`, its operator, and parent `r` Ready.
struct Renaming {
    ns: TestNamespace,
    dir: tempfile::TempDir,
    rules: std::path::PathBuf,
    templates: std::path::PathBuf,
    /// The rule without the ledger.
    plain: String,
    op: Operator,
    parents: kube::Api<DynamicObject>,
    cms: kube::Api<DynamicObject>,
    /// The ledger's UID.
    ledger: Option<String>,
}

impl Renaming {
    async fn start(client: &kube::Client, prefix: &str) -> Renaming {
        let Setup {
            ns,
            dir,
            rules,
            templates,
            plain,
        } = set_up(client, prefix, "Renamed", &[LEDGER]).await;
        let op = Operator::on(&rules, &templates)
            .namespace(&ns)
            .flags(&["--install-crds"])
            .start()
            .await;
        let parents = parents_api(client, &ns, "Renamed").await;
        let cms = api(client, Some(&ns), "v1", "ConfigMap", "configmaps");
        apply(&parents, parent("Renamed", &ns, "r")).await;
        wait_ready(&parents, "r", "True", None, T).await;
        assert!(has_finalizer(&parents.get("r").await.unwrap()));
        let ledger = cms.get("r-ledger").await.unwrap().uid();
        Renaming {
            ns,
            dir,
            rules,
            templates,
            plain,
            op,
            parents,
            cms,
            ledger,
        }
    }

    /// Writes `rule` (a rule text) renamed to `renamed-v2`, at once (a reload must never
    /// read a half-written file: no rule for the kind would release the parent).
    fn rename(&self, rule: &str) {
        let renamed = rule.replace("  name: renamed\n", "  name: renamed-v2\n");
        let new = self.dir.path().join("renamed.yaml.new");
        std::fs::write(&new, renamed).unwrap();
        std::fs::rename(&new, self.rules.join("renamed.yaml")).unwrap();
    }

    async fn gone(&self) {
        wait_for(T, "r to be gone", || async {
            self.parents
                .get_opt("r")
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
    }

    /// The same ledger, let go of.
    async fn ledger_let_go(&self) {
        let after = self
            .cms
            .get_opt("r-ledger")
            .await
            .unwrap()
            .expect("the ledger was deleted: its policy is Orphan");
        assert_eq!(after.uid(), self.ledger, "the same ledger");
        assert!(
            released(&after),
            "the ledger is still the parent's: {:?}",
            after.metadata
        );
    }
}

/// A rule renamed in the same edit that drops its `Orphan` child (its kind stays for
/// another child, and the new rule needs no finalizer): the child, labelled with the old
/// name, is in none of the new rule's caches. It is let go of before the new rule takes
/// the finalizer off, so the garbage collector does not delete it with its parent; the
/// child the new rule still renders becomes its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_a_rename_that_drops_it() {
    let client = client().await;
    let case = Renaming::start(&client, "orphan-rename").await;
    case.rename(&case.plain);
    wait_for(
        T,
        "the new rule to take over r's config and drop the finalizer",
        || async {
            let config = case.cms.get("r").await.ok()?;
            let p = case.parents.get("r").await.ok()?;
            (config.labels().get("rulebook.dev/rule").map(String::as_str) == Some("renamed-v2")
                && !has_finalizer(&p))
            .then_some(())
        },
    )
    .await;
    case.ledger_let_go().await;
    case.parents.delete("r", &Default::default()).await.unwrap();
    case.gone().await;
    case.ledger_let_go().await;
}

/// A rename that also makes the `Orphan` child `Delete` (and the new rule then needs no
/// finalizer): the rule as it is now decides, as in pruning, so the child is not let go
/// of but taken over by the new rule (relabelled, still owned), and the parent stays
/// Ready — no conflict over a child its own rule let go of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_that_makes_the_orphan_child_delete_takes_it_over() {
    let client = client().await;
    let case = Renaming::start(&client, "orphan-rename-delete").await;
    let rule = std::fs::read_to_string(case.rules.join("renamed.yaml")).unwrap();
    assert!(rule.contains("      deletionPolicy: Orphan\n"));
    case.rename(&rule.replace("      deletionPolicy: Orphan\n", ""));
    let ledger = wait_for(
        T,
        "the new rule to take over the ledger and drop the finalizer",
        || async {
            let ledger = case.cms.get("r-ledger").await.ok()?;
            let p = case.parents.get("r").await.ok()?;
            (ledger.labels().get("rulebook.dev/rule").map(String::as_str) == Some("renamed-v2")
                && !has_finalizer(&p))
            .then_some(ledger)
        },
    )
    .await;
    assert_eq!(ledger.uid(), case.ledger, "the same ledger");
    assert_eq!(ledger.owner_references().len(), 1, "still owned");
    wait_ready(&case.parents, "r", "True", None, T).await;
}

/// A rule renamed while no operator runs, its parent deleted meanwhile (held by the
/// finalizer): the new rule's teardown finds no child in its caches, which select by
/// the new name, and lets go of the old rule's `Orphan` child before the finalizer
/// comes off; the other child is left to the garbage collector, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_child_outlives_a_rename_while_its_parent_is_deleted() {
    let client = client().await;
    let mut case = Renaming::start(&client, "orphan-rename-down").await;
    case.op.signal_and_wait("TERM");
    case.parents.delete("r", &Default::default()).await.unwrap();
    case.rename(&std::fs::read_to_string(case.rules.join("renamed.yaml")).unwrap());
    let _op = Operator::on(&case.rules, &case.templates)
        .namespace(&case.ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    case.gone().await;
    case.ledger_let_go().await;
    // The config child (policy Delete) is not let go of: still owned, or already taken
    // by the garbage collector.
    if let Some(config) = case.cms.get_opt("r").await.unwrap() {
        assert!(
            !config.owner_references().is_empty(),
            "the config child was let go of"
        );
    }
}

const OWNER: &str = "rulebook.dev/owner";

/// Whether a child has been let go of: no ownerReference (an `Orphan` child never has
/// one) and no owner label.
fn released(o: &DynamicObject) -> bool {
    o.owner_references().is_empty() && !o.labels().contains_key(OWNER)
}

fn has_finalizer(p: &DynamicObject) -> bool {
    p.finalizers().contains(&FINALIZER.to_string())
}

const FINALIZER: &str = "rulebook.dev/finalizer";

fn record(p: &DynamicObject) -> Option<&str> {
    p.annotations()
        .get("rulebook.dev/orphan-kinds")
        .map(String::as_str)
}

/// `rulebook rbac` for the rules in `rules`, for the service account `rulebook` of `ns`.
fn rbac(rules: &std::path::Path, templates: &std::path::Path, role: &str, ns: &str) -> Vec<Json> {
    yaml_objects(&rulebook(&[
        "rbac",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
        "--install-crds",
        "--name",
        role,
        "--service-account",
        &format!("{ns}/rulebook"),
    ]))
}

/// A recorded kind Rulebook may no longer list — its RBAC regenerated from rules that
/// dropped the kind, as a GitOps pipeline does — holds the teardown rather than leave the
/// child to the garbage collector: the parent stays, says why (`Deleting` condition,
/// reason `OrphansPending`), and the teardown goes on once the list is allowed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teardown_waits_for_orphans_it_may_not_list() {
    let client = client().await;
    let Setup {
        ns,
        dir: _dir,
        rules,
        templates,
        plain,
    } = set_up(&client, "orphan-forbidden", "Withholder", &[VAULT]).await;
    let role = unique("rulebook-orphans");
    let with_secrets = rbac(&rules, &templates, &role, &ns);
    let kubeconfig =
        service_account_kubeconfig(&client, &ns, "rulebook", with_secrets.clone()).await;
    let start = || {
        Operator::on(&rules, &templates)
            .namespace(&ns)
            .flags(&["--install-crds"])
            .kubeconfig(kubeconfig.path())
            .start()
    };
    let mut op = start().await;
    let parents = parents_api(&client, &ns, "Withholder").await;
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    apply(&parents, parent("Withholder", &ns, "w")).await;
    wait_ready(&parents, "w", "True", None, T).await;
    let before = secrets.get("w-vault").await.unwrap();

    // Operator down: the Secret leaves the rule, the RBAC is regenerated from the new
    // rules (no Secrets), and the parent is deleted.
    op.signal_and_wait("TERM");
    std::fs::write(rules.join("withholder.yaml"), &plain).unwrap();
    let without = rbac(&rules, &templates, &role, &ns);
    assert_ne!(without, with_secrets, "the new rules need no Secrets");
    apply_all(&client, &without).await;
    parents.delete("w", &Default::default()).await.unwrap();
    let _op = start().await;
    let why = wait_for(T, "the teardown to say why it waits", || async {
        let p = to_json(&parents.get("w").await.ok()?);
        p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Deleting" && c["reason"] == "OrphansPending")
            .map(|c| c["message"].as_str().unwrap_or_default().to_string())
    })
    .await;
    assert!(why.contains("forbidden"), "{why}");
    let held = secrets.get("w-vault").await.unwrap();
    assert!(!released(&held), "still the parent's");

    // Allowed again: the teardown lets go of it and finishes.
    apply_all(&client, &with_secrets).await;
    wait_for(T, "the parent to be gone", || async {
        parents.get_opt("w").await.ok()?.is_none().then_some(())
    })
    .await;
    let after = secrets.get("w-vault").await.unwrap();
    assert_eq!(after.uid(), before.uid());
    assert!(released(&after));
}

/// After the clean-up of a dropped `Orphan` kind has let go of every child of it, each
/// parent takes the kind off its record and, its rule needing none, the finalizer off —
/// without waiting for a change of its own: the end of the clean-up reconciles every
/// parent once more (the new version's first reconciles run while it is still going).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_and_the_finalizer_come_off_once_the_clean_up_is_done() {
    let client = client().await;
    let Setup {
        ns,
        dir: _dir,
        rules,
        templates,
        plain,
    } = set_up(&client, "orphan-done", "Shedder", &[VAULT]).await;
    let _op = Operator::on(&rules, &templates)
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let shedders = parents_api(&client, &ns, "Shedder").await;
    let names: Vec<String> = (0..30).map(|i| format!("s{i}")).collect();
    for n in &names {
        apply(&shedders, parent("Shedder", &ns, n)).await;
    }
    for n in &names {
        wait_ready(&shedders, n, "True", None, T).await;
    }
    std::fs::write(rules.join("shedder.yaml"), &plain).unwrap();
    wait_for(
        T,
        "every parent's record and finalizer to come off",
        || async {
            let all = shedders.list(&Default::default()).await.ok()?;
            all.items
                .iter()
                .all(|p| record(p).is_none() && p.finalizers().is_empty())
                .then_some(())
        },
    )
    .await;
    let secrets = api(&client, Some(&ns), "v1", "Secret", "secrets");
    for n in &names {
        let s = secrets.get(&format!("{n}-vault")).await.unwrap();
        assert!(released(&s), "{n}-vault let go of");
    }
}
