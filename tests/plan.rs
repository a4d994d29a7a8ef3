//! The reconcile plan as a specification: objects built in code, a plan computed from
//! them, and what it must say — with no cluster and no client. (The stages that carry a
//! plan out are tested against the local control plane in the other test files.)

use std::sync::Arc;

use kube::api::DynamicObject;
use rulebook::reconcile::drift::Drift;
use rulebook::reconcile::plan::{
    ApplyGate, ChildStep, Dependencies, FinalizeOutcome, FinalizeState, Hold, Live, Owned,
    TeardownStep, plan_applies, plan_child, plan_prunes, plan_status, plan_teardown,
};
use rulebook::render::DesiredChild;
use rulebook::render::status::ConditionState;
use rulebook::rules::DeletionOrder;
use serde_json::{Map, Value as Json, json};
use std::time::Duration;

const PARENT: &str = "uid-parent";
const HASH: &str = "h1";

/// The ConfigMap a rule wants: `data.k = v`.
fn desired(value: &str) -> DesiredChild {
    DesiredChild {
        child: 0,
        name: "config".into(),
        index: None,
        object: json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns"},
            "data": {"k": value}
        }),
        hash: HASH.into(),
    }
}

/// A live ConfigMap `c`: controlled by `controller` (if any), labelled with `owner` (if
/// any), last applied by Rulebook with `hash`, with `fields` as Rulebook's field set.
fn live(controller: Option<&str>, owner: Option<&str>, hash: &str, fields: Json) -> DynamicObject {
    let mut labels = Map::new();
    if let Some(o) = owner {
        labels.insert("rulebook.dev/owner".into(), json!(o));
    }
    let refs: Vec<Json> = controller
        .map(|uid| {
            json!({"apiVersion": "x.dev/v1", "kind": "App", "name": "p", "uid": uid,
                   "controller": true})
        })
        .into_iter()
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {
            "name": "c", "namespace": "ns", "uid": "uid-child",
            "labels": labels,
            "annotations": {"rulebook.dev/desired-hash": hash},
            "ownerReferences": refs,
            "managedFields": [{"manager": "rulebook", "operation": "Apply",
                               "fieldsType": "FieldsV1", "fieldsV1": fields}]
        },
        "data": {"k": "v"}
    }))
    .unwrap()
}

fn ours_intact() -> DynamicObject {
    live(
        Some(PARENT),
        Some(PARENT),
        HASH,
        json!({"f:metadata": {}, "f:data": {"f:k": {}}}),
    )
}

#[test]
fn a_missing_child_is_created() {
    let step = plan_child(PARENT, false, Live::Absent, false, &desired("v"), false);
    assert_eq!(
        step,
        ChildStep::Apply {
            why: Drift::Missing,
            adopt: false
        }
    );
}

#[test]
fn an_intact_child_needs_nothing() {
    let o = ours_intact();
    let step = plan_child(PARENT, false, Live::Cached(&o), true, &desired("v"), false);
    assert_eq!(step, ChildStep::UpToDate { report: false });
    // Read from the API server (not yet cached): nothing to write, but the status must see it.
    let step = plan_child(
        PARENT,
        false,
        Live::Fetched(&o),
        false,
        &desired("v"),
        false,
    );
    assert_eq!(step, ChildStep::UpToDate { report: true });
}

#[test]
fn a_changed_template_or_parent_updates_the_child() {
    let o = live(
        Some(PARENT),
        Some(PARENT),
        "h0",
        json!({"f:metadata": {}, "f:data": {"f:k": {}}}),
    );
    let step = plan_child(PARENT, false, Live::Cached(&o), true, &desired("w"), false);
    assert_eq!(
        step,
        ChildStep::Apply {
            why: Drift::DesiredChanged,
            adopt: false
        }
    );
}

#[test]
fn drift_is_repaired_when_someone_else_took_a_field() {
    // Another manager changed data.k: the API server moved the field out of Rulebook's set.
    let o = live(Some(PARENT), Some(PARENT), HASH, json!({"f:metadata": {}}));
    let step = plan_child(PARENT, false, Live::Cached(&o), true, &desired("v"), false);
    assert_eq!(
        step,
        ChildStep::Apply {
            why: Drift::FieldsChanged,
            adopt: false
        }
    );
    // Checked by hash only (the API server records fields differently): no repair loop.
    let step = plan_child(PARENT, false, Live::Cached(&o), true, &desired("v"), true);
    assert_eq!(step, ChildStep::UpToDate { report: false });
}

/// `live(None, owner, …)` as an `Orphan` child: it recorded the policy, and carries no
/// ownerReference.
fn orphan_child(owner: &str, hash: &str) -> DynamicObject {
    let mut o = live(
        None,
        Some(owner),
        hash,
        json!({"f:metadata": {}, "f:data": {"f:k": {}}}),
    );
    o.metadata
        .annotations
        .get_or_insert_default()
        .insert("rulebook.dev/deletion-policy".into(), "Orphan".into());
    o
}

#[test]
fn an_orphan_child_without_an_owner_reference_is_its_parents_alone() {
    // Its own parent's: kept up to date like any child (no adoption needed).
    let ours = orphan_child(PARENT, HASH);
    let step = plan_child(
        PARENT,
        false,
        Live::Cached(&ours),
        true,
        &desired("v"),
        false,
    );
    assert_eq!(step, ChildStep::UpToDate { report: false });
    let older = orphan_child(PARENT, "h0");
    let step = plan_child(
        PARENT,
        false,
        Live::Cached(&older),
        true,
        &desired("w"),
        false,
    );
    assert_eq!(
        step,
        ChildStep::Apply {
            why: Drift::DesiredChanged,
            adopt: false
        }
    );
    // Another parent's `Orphan` child has no controller, but is never adopted.
    let theirs = orphan_child("uid-other", HASH);
    for adopt in [false, true] {
        let step = plan_child(
            PARENT,
            adopt,
            Live::Fetched(&theirs),
            false,
            &desired("v"),
            false,
        );
        assert!(
            matches!(&step, ChildStep::Conflict { owner } if owner.contains("another parent")),
            "{step:?}"
        );
    }
}

#[test]
fn adoption_is_refused_for_objects_with_a_controller_or_another_parents_label() {
    let fields = json!({});
    // Another parent's child, even with `adopt: true`.
    let other = live(Some("uid-other"), Some("uid-other"), HASH, fields.clone());
    for adopt in [false, true] {
        let step = plan_child(
            PARENT,
            adopt,
            Live::Fetched(&other),
            false,
            &desired("v"),
            false,
        );
        assert!(
            matches!(&step, ChildStep::Conflict { owner } if owner.contains("controlled by App p")),
            "{step:?}"
        );
    }
    // No controller, but labelled as another parent's child.
    let labelled = live(None, Some("uid-other"), HASH, fields.clone());
    let step = plan_child(
        PARENT,
        true,
        Live::Cached(&labelled),
        true,
        &desired("v"),
        false,
    );
    assert!(
        matches!(&step, ChildStep::Conflict { owner } if owner.contains("another parent")),
        "{step:?}"
    );
    // A plain foreign object: left alone without `adopt`, taken over with it.
    let foreign = live(None, None, "", fields);
    let step = plan_child(
        PARENT,
        false,
        Live::Fetched(&foreign),
        false,
        &desired("v"),
        false,
    );
    assert!(matches!(step, ChildStep::Conflict { .. }), "{step:?}");
    let step = plan_child(
        PARENT,
        true,
        Live::Fetched(&foreign),
        false,
        &desired("v"),
        false,
    );
    assert_eq!(
        step,
        ChildStep::Apply {
            why: Drift::Missing,
            adopt: true
        }
    );
}

#[test]
fn what_is_no_longer_rendered_is_pruned() {
    let kept = Arc::new(ours_intact());
    let mut gone = ours_intact();
    gone.metadata.name = Some("old".into());
    let mut elsewhere = ours_intact();
    elsewhere.metadata.namespace = Some("other".into());
    let owned = vec![(0, kept), (0, Arc::new(gone)), (0, Arc::new(elsewhere))];
    // `c` in `ns` is still rendered; `old` is not, nor is `c` in namespace `other`.
    assert_eq!(plan_prunes(&[(0, Some("ns"), "c")], &owned), vec![1, 2]);
    // Same name, another kind: pruned too.
    assert_eq!(plan_prunes(&[(1, Some("ns"), "c")], &owned), vec![0, 1, 2]);
}

fn parent_with(status: Json) -> Json {
    json!({"apiVersion": "x.dev/v1", "kind": "App",
           "metadata": {"name": "p", "generation": 2}, "status": status})
}

#[test]
fn a_status_change_alone_is_written_and_an_unchanged_one_is_not() {
    let ready = ConditionState::new(true, "Ready", "all children are ready");
    let mut fields = Map::new();
    fields.insert("phase".into(), json!("Serving"));
    let now = "2026-11-23T12:00:00Z";
    // First time: everything to write.
    let first = plan_status(&parent_with(json!({})), &["phase"], &fields, &ready, now)
        .expect("a first status");
    assert_eq!(first["phase"], "Serving");
    assert_eq!(first["conditions"][0]["reason"], "Ready");
    // The parent has exactly that: nothing to do, even later (the time alone is no change).
    let later = "2026-11-23T12:05:00Z";
    assert_eq!(
        plan_status(
            &parent_with(first.clone()),
            &["phase"],
            &fields,
            &ready,
            later
        ),
        None
    );
    // Only a status field changed (children untouched): one write with the new value.
    fields.insert("phase".into(), json!("Degraded"));
    let changed = plan_status(
        &parent_with(first.clone()),
        &["phase"],
        &fields,
        &ready,
        later,
    )
    .expect("a status write");
    assert_eq!(changed["phase"], "Degraded");
    // A field the rule no longer computes is removed.
    let gone = plan_status(&parent_with(first), &["phase"], &Map::new(), &ready, later)
        .expect("a status write");
    assert!(gone.get("phase").is_none_or(Json::is_null), "{gone}");
}

#[test]
fn a_resumed_parent_drops_its_paused_condition_once() {
    let ready = ConditionState::new(true, "Ready", "all children are ready");
    let fields = Map::new();
    let now = "2026-11-23T12:00:00Z";
    let current = plan_status(&parent_with(json!({})), &[], &fields, &ready, now).unwrap();
    let paused = json!({"type": "Paused", "status": "True", "reason": "PausedByAnnotation", "message": "",
                        "lastTransitionTime": now});
    let mut with_paused = current.clone();
    with_paused["conditions"]
        .as_array_mut()
        .unwrap()
        .push(paused.clone());
    // Everything else matches: the write is for the Paused condition, which the apply
    // leaves out (so server-side apply removes it).
    let resumed = plan_status(&parent_with(with_paused), &[], &fields, &ready, now)
        .expect("a write that drops Paused");
    assert!(
        resumed["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["type"] != "Paused"),
        "{resumed}"
    );
    // Another writer's `Paused` condition (another reason: Cluster API writes `Paused`)
    // is not Rulebook's to remove.
    let mut foreign = current.clone();
    let mut theirs = paused;
    theirs["reason"] = json!("Paused");
    foreign["conditions"].as_array_mut().unwrap().push(theirs);
    assert_eq!(
        plan_status(&parent_with(foreign), &[], &fields, &ready, now),
        None
    );
}

// ---------------------------------------------------------------------------------------
// Teardown.

fn owned(list: &[(usize, bool)]) -> Vec<Owned> {
    list.iter()
        .map(|&(position, going)| Owned { position, going })
        .collect()
}

#[test]
fn teardown_runs_the_finalize_step_before_any_child_goes() {
    let children = owned(&[(0, false), (1, false)]);
    let order = DeletionOrder::Reverse;
    assert_eq!(
        plan_teardown(FinalizeState::NotStarted, &children, order),
        TeardownStep::StartFinalize
    );
    let remaining = Duration::from_secs(42);
    assert_eq!(
        plan_teardown(FinalizeState::Running { remaining }, &children, order),
        TeardownStep::AwaitFinalize { remaining }
    );
    for (state, outcome) in [
        (FinalizeState::Done, FinalizeOutcome::Done),
        (FinalizeState::TimedOut, FinalizeOutcome::TimedOut),
        (FinalizeState::Failed, FinalizeOutcome::Failed),
    ] {
        assert_eq!(
            plan_teardown(state, &children, order),
            TeardownStep::MarkFinalized(outcome)
        );
    }
}

#[test]
fn teardown_deletes_in_reverse_rule_order_one_wave_at_a_time() {
    // Children of rule positions 0, 2, 2 and 1: the wave is position 2 (both objects).
    let children = owned(&[(0, false), (2, false), (2, false), (1, false)]);
    assert_eq!(
        plan_teardown(FinalizeState::Over, &children, DeletionOrder::Reverse),
        TeardownStep::Wave {
            act: vec![1, 2],
            waiting: vec![]
        }
    );
    // One of them is already going: delete the other, wait for both; position 1 waits.
    let children = owned(&[(0, false), (2, true), (2, false), (1, false)]);
    assert_eq!(
        plan_teardown(FinalizeState::Over, &children, DeletionOrder::Reverse),
        TeardownStep::Wave {
            act: vec![2],
            waiting: vec![1]
        }
    );
    // All of the wave going: wait, and touch nothing else.
    let children = owned(&[(0, false), (2, true)]);
    assert_eq!(
        plan_teardown(FinalizeState::Over, &children, DeletionOrder::Reverse),
        TeardownStep::Wave {
            act: vec![],
            waiting: vec![1]
        }
    );
    // A child the rule no longer has goes first.
    let children = owned(&[(3, false), (usize::MAX, false)]);
    assert_eq!(
        plan_teardown(FinalizeState::Over, &children, DeletionOrder::Reverse),
        TeardownStep::Wave {
            act: vec![1],
            waiting: vec![]
        }
    );
}

#[test]
fn parallel_teardown_is_one_wave_and_the_finalizer_goes_last() {
    let children = owned(&[(0, false), (2, true), (1, false)]);
    assert_eq!(
        plan_teardown(FinalizeState::Over, &children, DeletionOrder::Parallel),
        TeardownStep::Wave {
            act: vec![0, 2],
            waiting: vec![1]
        }
    );
    assert_eq!(
        plan_teardown(FinalizeState::Over, &[], DeletionOrder::Reverse),
        TeardownStep::RemoveFinalizer
    );
}

#[test]
fn a_reconcile_brought_only_by_a_rule_change_is_a_rollout() {
    use rulebook::reconcile::plan::is_rule_rollout;
    let parent = |status: Json| json!({"metadata": {"generation": 3}, "status": status});
    let ready = |reason: &str, generation: i64| {
        json!([{"type": "Ready", "status": "True", "reason": reason, "message": "",
                "lastTransitionTime": "2026-11-25T00:00:00Z", "observedGeneration": generation}])
    };
    let v1 = json!({"ruleVersion": "v1", "observedGeneration": 3, "conditions": ready("Ready", 3)});
    // The parent is as it was when v1 went through; the rule moved from v1 to v2.
    assert!(is_rule_rollout(&parent(v1.clone()), Some(3), "v2"));
    let waiting = json!({"ruleVersion": "v1", "observedGeneration": 3, "conditions": ready("ChildrenNotReady", 3)});
    assert!(is_rule_rollout(&parent(waiting), Some(3), "v2"));
    // The same rule: its changes come from elsewhere (a child, a reference, a repair).
    assert!(!is_rule_rollout(&parent(v1.clone()), Some(3), "v1"));
    // The parent changed too (a generation its status has not observed): the tenant's.
    assert!(!is_rule_rollout(&parent(v1), Some(4), "v2"));
    // A failed reconcile observed generation 3 but applied nothing of it (its status
    // keeps v1): the tenant's change at 3 is still to be reported.
    let failed = json!({"ruleVersion": "v1", "observedGeneration": 3, "conditions": ready("RenderFailed", 3)});
    assert!(!is_rule_rollout(&parent(failed), Some(3), "v2"));
    let older =
        json!({"ruleVersion": "v1", "observedGeneration": 3, "conditions": ready("Ready", 2)});
    assert!(!is_rule_rollout(&parent(older), Some(3), "v2"));
    // Nothing recorded yet (a new parent) or no status at all.
    assert!(!is_rule_rollout(
        &parent(json!({"observedGeneration": 3, "conditions": ready("Ready", 3)})),
        Some(3),
        "v2"
    ));
    assert!(!is_rule_rollout(&json!({"metadata": {}}), Some(3), "v2"));
}

#[test]
fn a_rollout_reports_everything_on_the_parent_but_its_updates() {
    use rulebook::reconcile::plan::reported_on_parent;
    for reason in ["Created", "Updated", "Repaired", "Pruned", "Orphaned"] {
        assert!(reported_on_parent(reason, false), "{reason}, not a rollout");
    }
    assert!(!reported_on_parent("Updated", true));
    for reason in ["Created", "Repaired", "Pruned", "Orphaned"] {
        assert!(reported_on_parent(reason, true), "{reason} in a rollout");
    }
}

// ---------------------------------------------------------------------------------------
// What holds a write back: a conflict holds the parent, a failure its dependents.

/// A desired child `name` (rule child `child`) with `object`.
fn desired_object(child: usize, name: &str, object: Json) -> DesiredChild {
    DesiredChild {
        child,
        name: name.into(),
        index: None,
        object,
        hash: HASH.into(),
    }
}

fn secret(child: usize, name: &str) -> DesiredChild {
    desired_object(
        child,
        "secret",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
               "data": {"password": "c2VjcmV0"}}),
    )
}

/// A Deployment whose pods read Secret `secret` (in the parent's namespace).
fn deployment(child: usize, secret: &str) -> DesiredChild {
    desired_object(
        child,
        "app",
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "p"},
        "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "x",
          "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}]
        }]}}}}),
    )
}

fn configmap(child: usize) -> DesiredChild {
    desired_object(
        child,
        "settings",
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-settings"},
               "data": {"k": "v"}}),
    )
}

fn missing() -> ChildStep {
    ChildStep::Apply {
        why: Drift::Missing,
        adopt: false,
    }
}

/// The shipped Project rule's shape, without its `waitFor`: the Deployment names the
/// Secret child's object, and a ConfigMap beside them names nothing.
fn project_like(deployment_first: bool) -> (Vec<DesiredChild>, usize, usize, usize) {
    if deployment_first {
        let d = vec![
            deployment(0, "p-credentials"),
            secret(1, "p-credentials"),
            configmap(2),
        ];
        (d, 1, 0, 2)
    } else {
        let d = vec![
            secret(0, "p-credentials"),
            deployment(1, "p-credentials"),
            configmap(2),
        ];
        (d, 0, 1, 2)
    }
}

#[test]
fn a_child_goes_after_the_siblings_it_names_or_waits_for() {
    let no_waits = vec![Vec::new(); 3];
    // The Deployment first in rule order: the Secret it reads is written before it.
    let (d, s, app, cm) = project_like(true);
    let deps = Dependencies::of(&d, &no_waits, Some("ns"));
    assert_eq!(deps.on(app), [s]);
    assert!(deps.on(s).is_empty() && deps.on(cm).is_empty());
    assert_eq!(deps.order(), [s, app, cm]);
    // A Secret of another name, or in another namespace, is no sibling.
    let d = vec![deployment(0, "shared"), secret(1, "p-credentials")];
    let deps = Dependencies::of(&d, &[vec![], vec![]], Some("ns"));
    assert!(deps.on(0).is_empty());
    assert_eq!(deps.order(), [0, 1]);
    let mut elsewhere = secret(1, "p-credentials");
    elsewhere.object["metadata"]["namespace"] = json!("other");
    let d = vec![deployment(0, "p-credentials"), elsewhere];
    assert!(
        Dependencies::of(&d, &[vec![], vec![]], Some("ns"))
            .on(0)
            .is_empty()
    );
    // `waitFor`: the ConfigMap (rule child 0) waits for the Deployment (rule child 2).
    let d = vec![
        configmap(0),
        secret(1, "p-credentials"),
        deployment(2, "p-credentials"),
    ];
    let deps = Dependencies::of(&d, &[vec![2], vec![], vec![]], Some("ns"));
    assert_eq!(deps.on(0), [2]);
    assert_eq!(deps.order(), [1, 2, 0]);
    // A cycle is broken in rule order, and every child is written once.
    let d = vec![configmap(0), configmap(1)];
    let deps = Dependencies::of(&d, &[vec![1], vec![0]], Some("ns"));
    assert_eq!(deps.order(), [0, 1]);
}

/// F6 of the third red-team report: a foreign Secret named like the Secret child is a
/// conflict, and then nothing new is written for the parent — not the Deployment that
/// would read the foreign Secret, not an unrelated child either — whatever the rule order.
#[test]
fn a_conflict_holds_every_write_of_the_parent() {
    let foreign = live(None, None, "", json!({}));
    for deployment_first in [false, true] {
        let (d, s, app, cm) = project_like(deployment_first);
        let deps = Dependencies::of(&d, &[vec![], vec![], vec![]], Some("ns"));
        let mut steps = vec![missing(), missing(), missing()];
        steps[s] = plan_child(PARENT, false, Live::Fetched(&foreign), false, &d[s], false);
        assert!(
            matches!(steps[s], ChildStep::Conflict { .. }),
            "{:?}",
            steps[s]
        );
        let holds = plan_applies(&steps, &deps);
        assert_eq!(
            holds[app],
            Some(Hold::Conflict(s)),
            "first: {deployment_first}"
        );
        assert_eq!(
            holds[cm],
            Some(Hold::Conflict(s)),
            "first: {deployment_first}"
        );
        assert_eq!(holds[s], None, "the conflict itself is no apply");
        // A child already up to date needs no write and is left as it is.
        steps[cm] = ChildStep::UpToDate { report: false };
        assert_eq!(plan_applies(&steps, &deps)[cm], None);
    }
    // Without a conflict, everything goes.
    let (d, ..) = project_like(false);
    let deps = Dependencies::of(&d, &[vec![], vec![], vec![]], Some("ns"));
    assert_eq!(
        plan_applies(&[missing(), missing(), missing()], &deps),
        [None, None, None]
    );
}

/// A conflict found only when the Secret's create is refused (the caches hold no foreign
/// object): the Deployment that names it comes after it, so it is held before it is
/// written; so is everything after.
#[test]
fn a_conflict_found_at_the_write_holds_what_comes_after() {
    let (d, s, app, cm) = project_like(true);
    let deps = Dependencies::of(&d, &[vec![], vec![], vec![]], Some("ns"));
    let mut gate = ApplyGate::new(&deps);
    let order = deps.order();
    assert_eq!(order[0], s);
    assert_eq!(gate.hold(s), None);
    gate.conflict(s); // the create was refused: the name is someone else's
    assert_eq!(gate.hold(app), Some(Hold::Conflict(s)));
    assert_eq!(gate.hold(cm), Some(Hold::Conflict(s)));
}

/// A child that failed holds the children that depend on it (by name or by `waitFor`,
/// and theirs in turn), and only those: an independent child is written.
#[test]
fn a_failed_child_holds_its_dependents_only() {
    // Rule children: 0 Deployment (names the Secret), 1 Secret, 2 ConfigMap (independent),
    // 3 ConfigMap that waits for the Deployment.
    let d = vec![
        deployment(0, "p-credentials"),
        secret(1, "p-credentials"),
        configmap(2),
        desired_object(
            3,
            "after-app",
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-after"}}),
        ),
    ];
    let deps = Dependencies::of(&d, &[vec![], vec![], vec![], vec![0]], Some("ns"));
    assert_eq!(deps.order(), [1, 0, 2, 3]);
    let mut gate = ApplyGate::new(&deps);
    assert_eq!(gate.hold(1), None);
    gate.failed(1); // the API server refused the Secret
    assert_eq!(gate.hold(0), Some(Hold::After(1)));
    assert_eq!(gate.hold(2), None, "an independent child is applied");
    assert_eq!(gate.hold(3), Some(Hold::After(0)), "held in turn");
    // Planned so before any write (a child whose content cannot be read) alike.
    let steps = vec![missing(), ChildStep::Unreadable, missing(), missing()];
    assert_eq!(
        plan_applies(&steps, &deps),
        [Some(Hold::After(1)), None, None, Some(Hold::After(0))]
    );
}

/// Several rules on one parent kind: an object labelled as another rule's child of the
/// same parent is that rule's, whatever its controller reference says.
#[test]
fn another_rules_child_of_the_same_parent_is_named() {
    use rulebook::reconcile::plan::other_rules_child;
    let o: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "x", "labels": {"rulebook.dev/rule": "myapp-gold"}}
    }))
    .unwrap();
    assert_eq!(other_rules_child(&o, "myapp"), Some("myapp-gold"));
    assert_eq!(other_rules_child(&o, "myapp-gold"), None);
    let unlabelled: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}
    }))
    .unwrap();
    assert_eq!(other_rules_child(&unlabelled, "myapp"), None);
}
