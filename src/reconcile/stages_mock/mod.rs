//! The apply, prune, status and teardown stages against a mocked API server (kube-rs
//! controller-rs's `tower_test` pattern): each test runs the real reconcile
//! ([`crate::reconcile::reconcile`], through the operator's gated client) over caches
//! filled by hand, and asserts the exact requests it sent — method, path, field manager,
//! the essentials of the body — and that a reconcile at steady state sends none. Events,
//! which the recorder sends in the background, are left out. These need no cluster; the
//! same behaviours are tested against the real control plane in `tests/` (steady_state,
//! deletion, orphans, …).

mod fixture;

use serde_json::{Value as Json, json};

use crate::meta::{FIELD_MANAGER, FINALIZER, labels};
use crate::write::writer::NO_OBJECT_RESOURCE_VERSION;
use fixture::{Fixture, NS, Seen, parent, rule};

const CHILD_PATH: &str = "/api/v1/namespaces/team/configmaps/p-config";
const STATUS_PATH: &str = "/apis/test.rulebook.dev/v1/namespaces/team/demos/p/status";
const PARENT_PATH: &str = "/apis/test.rulebook.dev/v1/namespaces/team/demos/p";

/// What a test expects of one request.
#[derive(Debug)]
enum Expect {
    /// A forced server-side apply by Rulebook's field manager.
    Apply(&'static str),
    /// A delete with UID and resourceVersion preconditions, in the background.
    Delete(&'static str, String, String),
    /// A JSON merge patch by Rulebook's field manager.
    MergePatch(&'static str),
    /// A list (of the parent's children elsewhere).
    List(&'static str),
}

/// Asserts that `seen` are exactly the requests `expected`, in order.
fn assert_requests(seen: &[Seen], expected: &[Expect]) {
    let shown: Vec<String> = seen
        .iter()
        .map(|s| format!("{} {} {:?}", s.method, s.path, s.query))
        .collect();
    assert_eq!(seen.len(), expected.len(), "requests sent: {shown:#?}");
    for (s, e) in seen.iter().zip(expected) {
        let manager = s.query.get("fieldManager").map(String::as_str);
        match e {
            Expect::Apply(path) => {
                assert_eq!((s.method.as_str(), s.path.as_str()), ("PATCH", *path));
                assert_eq!(manager, Some(FIELD_MANAGER), "{shown:?}");
                assert_eq!(s.query.get("force").map(String::as_str), Some("true"));
                assert_eq!(s.content_type, "application/apply-patch+yaml");
            }
            Expect::Delete(path, uid, rv) => {
                assert_eq!((s.method.as_str(), s.path.as_str()), ("DELETE", *path));
                let pre = &s.body["preconditions"];
                let found = (pre["uid"].as_str(), pre["resourceVersion"].as_str());
                assert_eq!(found, (Some(uid.as_str()), Some(rv.as_str())));
                assert_eq!(s.body["propagationPolicy"], "Background");
            }
            Expect::MergePatch(path) => {
                assert_eq!((s.method.as_str(), s.path.as_str()), ("PATCH", *path));
                assert_eq!(manager, Some(FIELD_MANAGER));
                assert_eq!(s.content_type, "application/merge-patch+json");
            }
            Expect::List(path) => {
                assert_eq!((s.method.as_str(), s.path.as_str()), ("GET", *path));
            }
        }
    }
}

/// The `Ready` condition of a status write's body.
fn ready(status_write: &Seen) -> Json {
    let conditions = status_write.body["status"]["conditions"]
        .as_array()
        .cloned();
    conditions
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .unwrap_or(Json::Null)
}

/// A parent reconciled for the first time: its child is created by a forced apply that
/// carries the create precondition and the parent's ownership, then its status is
/// written once. Returns the fixture with the caches as the watches leave them after.
async fn converged() -> (Fixture, Json, Json) {
    let mut f = Fixture::new(rule(None));
    let p = f.cache_parent(&parent("p", "uid-p", 5));
    f.reconcile(p).await.expect("the reconcile goes through");
    let sent = f.api.requests();
    assert_requests(
        &sent,
        &[Expect::Apply(CHILD_PATH), Expect::Apply(STATUS_PATH)],
    );
    let (child, status) = (sent[0].clone(), sent[1].clone());
    let meta = &child.body["metadata"];
    assert_eq!(
        meta["resourceVersion"], NO_OBJECT_RESOURCE_VERSION,
        "a create, never a takeover"
    );
    assert_eq!(meta["namespace"], NS);
    assert_eq!(meta["labels"][labels::OWNER], "uid-p");
    let owner = &meta["ownerReferences"][0];
    assert_eq!(
        (owner["uid"].as_str(), owner["controller"].as_bool()),
        (Some("uid-p"), Some(true))
    );
    assert_eq!(child.body["data"], json!({"greeting": "hello"}));
    assert_eq!(ready(&status)["status"], "True", "{:#}", status.body);
    assert_eq!(status.body["metadata"]["name"], "p");
    (f, child.answer, status.answer)
}

#[tokio::test]
async fn apply_creates_a_new_child_and_writes_the_status_once() {
    converged().await;
}

#[tokio::test]
async fn a_steady_state_sends_no_request_even_after_a_restart() {
    let (mut f, child, parent) = converged().await;
    // The watches bring the child as applied and the parent as its status write left it.
    f.cache_child(&child);
    let p = f.cache_parent(&parent);
    f.api.clear();
    f.reconcile(p).await.expect("steady");
    assert_requests(&f.api.requests(), &[]);
    // A restarted operator (no memory of its writes) finds nothing to do either.
    let mut again = Fixture::new(rule(None));
    again.cache_child(&child);
    let p = again.cache_parent(&parent);
    again.reconcile(p).await.expect("steady after a restart");
    assert_requests(&again.api.requests(), &[]);
}

#[tokio::test]
async fn a_child_no_longer_rendered_is_deleted_with_its_uid_and_version() {
    let (mut f, child, parent) = converged().await;
    f.cache_child(&child);
    // A child of this parent the rule renders no more (an earlier name).
    let mut old = child.clone();
    old["metadata"]["name"] = json!("p-old");
    old["metadata"]["uid"] = json!("uid-old");
    old["metadata"]["resourceVersion"] = json!("77");
    f.cache_child(&old);
    let p = f.cache_parent(&parent);
    f.api.clear();
    f.reconcile(p).await.expect("pruned");
    let old = "/api/v1/namespaces/team/configmaps/p-old";
    let delete = Expect::Delete(old, "uid-old".into(), "77".into());
    assert_requests(&f.api.requests(), &[delete]);
}

#[tokio::test]
async fn a_status_that_differs_is_written_once_and_nothing_else() {
    let (_, child, mut parent) = converged().await;
    // Someone wrote another status over Rulebook's; a fresh process reconciles.
    parent["status"] = json!({"conditions": [{"type": "Ready", "status": "False",
        "reason": "Other", "message": "someone else", "lastTransitionTime": "2020-01-01T00:00:00Z"}]});
    let mut f = Fixture::new(rule(None));
    f.cache_child(&child);
    let p = f.cache_parent(&parent);
    f.reconcile(p).await.expect("status written");
    let sent = f.api.requests();
    assert_requests(&sent, &[Expect::Apply(STATUS_PATH)]);
    let ready = ready(&sent[0]);
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("True"), Some("Ready")),
        "{ready:#}"
    );
}

#[tokio::test]
async fn a_deleted_parent_s_children_are_deleted_then_its_finalizer_removed() {
    let mut f = Fixture::new(rule(Some("{order: parallel}")));
    let mut deleted = parent("p", "uid-p", 9);
    deleted["metadata"]["finalizers"] = json!([FINALIZER, "someone.else/keep"]);
    deleted["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let child = fixture::applied(&json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "p-config", "namespace": NS,
            "labels": {labels::OWNER: "uid-p", labels::CHILD: "config", labels::RULE: "demo"},
            "ownerReferences": [{"apiVersion": "test.rulebook.dev/v1", "kind": "Demo",
                "name": "p", "uid": "uid-p", "controller": true}]},
        "data": {"greeting": "hello"},
    }));
    f.cache_child(&child);
    let p = f.cache_parent(&deleted);
    f.reconcile(p).await.expect("first wave");
    let uid = child["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let rv = child["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let sent = f.api.requests();
    // The wave: the child deleted as read, and the parent told what it waits for; the
    // finalizer stays while a child is left.
    assert_requests(
        &sent,
        &[
            Expect::Delete(CHILD_PATH, uid, rv),
            Expect::Apply(STATUS_PATH),
        ],
    );
    let ready = ready(&sent[1]);
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("Deleting"))
    );
    // The child's deletion reaches the cache: a look for children no cache shows (this
    // rule's, and another rule's `Orphan` ones), then the finalizer comes off — only
    // Rulebook's, conditional on the parent's version.
    f.ctx.kinds[0]
        .store
        .observe(&kube::runtime::watcher::Event::Delete(
            serde_json::from_value(child.clone()).expect("an object"),
        ));
    let p = f.cache_parent(&deleted);
    f.api.clear();
    f.reconcile(p).await.expect("finalizer removed");
    let sent = f.api.requests();
    let list = "/api/v1/namespaces/team/configmaps";
    assert_requests(
        &sent,
        &[
            Expect::List(list),
            Expect::List(list),
            Expect::MergePatch(PARENT_PATH),
        ],
    );
    for s in &sent[..2] {
        let selector = s.query.get("labelSelector").cloned().unwrap_or_default();
        assert!(
            selector.contains("rulebook.dev%2Fowner%3Duid-p"),
            "{selector}"
        );
    }
    let patch = &sent[2].body["metadata"];
    assert_eq!(patch["finalizers"], json!(["someone.else/keep"]));
    assert_eq!(patch["resourceVersion"], "9");
}

/// A fixture whose rule runs beside an old version during a rollout in `state`: the old
/// version renders `greeting: hello`, the new one `greeting: new`.
fn in_rollout(state: impl FnOnce(&str, &str) -> crate::rollout::RolloutState) -> Fixture {
    let old = rule(None);
    let mut f = Fixture::new(fixture::rule_greeting(None, "new"));
    let state = state(&old.version, &f.ctx.rule.version);
    let old_ctx = f.ctx.with_rule(old, vec![0]);
    let Some(ctx) = std::sync::Arc::get_mut(&mut f.ctx) else {
        panic!("the fixture's context is not shared yet")
    };
    crate::reconcile::versions::side_by_side(
        ctx,
        old_ctx,
        std::sync::Arc::new(parking_lot::RwLock::new(state)),
    );
    f
}

#[tokio::test]
async fn during_a_rollout_each_parent_renders_with_the_version_it_is_on() {
    use crate::rollout::{Phase, RolloutState};
    // Not placed yet: every parent stays on the old version.
    let mut f = in_rollout(|old, new| RolloutState::settled(old, 0).next(new, 0));
    let p = f.cache_parent(&parent("p", "uid-p", 5));
    f.reconcile(p).await.expect("the reconcile goes through");
    let sent = f.api.requests();
    assert_requests(
        &sent,
        &[Expect::Apply(CHILD_PATH), Expect::Apply(STATUS_PATH)],
    );
    assert_eq!(sent[0].body["data"], json!({"greeting": "hello"}));
    // Moved (the rollout completed): the new version.
    let mut f = in_rollout(|old, new| RolloutState {
        phase: Phase::Complete,
        ..RolloutState::settled(old, 0).next(new, 0)
    });
    let p = f.cache_parent(&parent("p", "uid-p", 5));
    f.reconcile(p).await.expect("the reconcile goes through");
    let sent = f.api.requests();
    assert_eq!(sent[0].body["data"], json!({"greeting": "new"}));
    // Within the step's boundary: the new version; rolled back: the old one again.
    let key = crate::rollout::RankKey::of(false, Some(NS), "p");
    let mut f = in_rollout(|old, new| RolloutState {
        boundary: Some(key),
        boundary_step: Some(0),
        ..RolloutState::settled(old, 0).next(new, 0)
    });
    let p = f.cache_parent(&parent("p", "uid-p", 5));
    f.reconcile(p).await.expect("the reconcile goes through");
    let sent = f.api.requests();
    assert_eq!(sent[0].body["data"], json!({"greeting": "new"}));
    // Its status write (made anyway: a new ruleVersion) says where it is.
    let rollout = rollout_condition(&sent[1].body);
    assert_eq!(
        (rollout["status"].as_str(), rollout["reason"].as_str()),
        (Some("True"), Some("Moved")),
        "{rollout}"
    );
    assert!(
        rollout["message"]
            .as_str()
            .is_some_and(|m| m.contains("batch 1 of")),
        "{rollout}"
    );
    let mut f = in_rollout(|old, new| RolloutState {
        boundary: Some(key),
        boundary_step: Some(0),
        phase: Phase::RolledBack,
        ..RolloutState::settled(old, 0).next(new, 0)
    });
    let p = f.cache_parent(&parent("p", "uid-p", 5));
    f.reconcile(p).await.expect("the reconcile goes through");
    let sent = f.api.requests();
    assert_eq!(sent[0].body["data"], json!({"greeting": "hello"}));
    // Never moved (no status yet): it hears nothing of the rollback.
    assert_eq!(rollout_condition(&sent[1].body), Json::Null);
}

/// The `Rollout` condition of a status apply's body (`null` when it has none).
fn rollout_condition(body: &Json) -> Json {
    body["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Rollout"))
        .cloned()
        .unwrap_or(Json::Null)
}
