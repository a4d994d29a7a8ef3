//! Unit tests of the per-parent memory: each memo on its own, and [`ParentMemory`]'s
//! forgetting.

use std::time::Duration;

use super::applied::Applied;
use super::digest::{identity, keys, observed};
use super::steady::AWAITED_MAX;
use super::*;
use kube::ResourceExt;
use serde_json::json;

/// A resourceVersion as a number.
fn rv(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse().ok())
}

fn obj(uid: &str, rv: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "n", "uid": uid, "resourceVersion": rv}
    }))
    .unwrap()
}

#[test]
fn a_child_behind_in_the_cache_is_keyed_by_the_version_applied() {
    let applied = Applied::default();
    let cached = |uid: &str, rv: &str| (0usize, Arc::new(obj(uid, rv)));
    // Nothing applied: the keys as cached.
    let kids = vec![cached("a", "5"), cached("b", "7")];
    assert_eq!(applied.keys_as_applied(&kids), keys(&kids));
    // `a` applied at 9, the cache still at 5: keyed as 9, as the reconcile that
    // applied it keyed it for the one its writes bring.
    applied.record(&obj("a", "9"), "h");
    let as_applied = applied.keys_as_applied(&kids);
    assert_eq!(as_applied[0], (0, Some("a".into()), Some("9".into())));
    assert_eq!(as_applied[1], (0, Some("b".into()), Some("7".into())));
    assert_eq!(as_applied, keys(&[cached("a", "9"), cached("b", "7")]));
    // The cache caught up, or someone else wrote after: as cached.
    assert_eq!(
        applied.keys_as_applied(&[cached("a", "9")]),
        keys(&[cached("a", "9")])
    );
    assert_eq!(
        applied.keys_as_applied(&[cached("a", "12")]),
        keys(&[cached("a", "12")])
    );
}

#[test]
fn identity_is_what_makes_a_parent_worth_reconciling() {
    let p = |generation: i64, labels: Json, annotations: Json| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "x/v1", "kind": "P",
            "metadata": {"name": "p", "uid": "u", "resourceVersion": "1",
                         "generation": generation, "labels": labels, "annotations": annotations}
        }))
        .unwrap()
    };
    let base = identity(&p(1, json!({"a": "1"}), json!({})));
    assert!(base.is_some());
    assert_ne!(base, identity(&p(2, json!({"a": "1"}), json!({}))));
    assert_ne!(base, identity(&p(1, json!({"a": "2"}), json!({}))));
    // The cache drops kubectl's last-applied annotation; it is no difference.
    assert_eq!(
        base,
        identity(&p(
            1,
            json!({"a": "1"}),
            json!({"kubectl.kubernetes.io/last-applied-configuration": "{}"})
        ))
    );
    assert_eq!(identity(&obj("u", "3")), None, "no generation");
}

#[test]
fn only_the_awaited_versions_of_this_process_s_writes_are_expected() {
    let s = Steady::default();
    s.await_write("p", Some("n"), "a", 10);
    assert!(!s.holds("p", 7), "awaiting writes is no fingerprint");
    s.await_write("p", Some("n"), "b", 11);
    s.mark_written("p", Some("n"), 7);
    assert!(s.holds("p", 7));
    // Another version of a child (someone else's edit), another child, another
    // parent: not expected.
    assert!(!s.expects("p", "a", 12));
    assert!(!s.expects("p", "c", 10));
    assert!(!s.expects("q", "a", 10));
    // Each awaited version once; the fingerprint stays.
    assert!(s.expects("p", "a", 10));
    assert!(!s.expects("p", "a", 10));
    assert!(s.holds("p", 7));
    // A reconcile that wrote nothing since forgets what is awaited...
    s.mark("p", Some("n"), 8);
    assert!(!s.expects("p", "b", 11));
    // ...as does forgetting the parent.
    s.await_write("p", Some("n"), "a", 20);
    s.forget("p");
    assert!(!s.expects("p", "a", 20));
    // A reconcile that begins takes what was awaited: nothing is awaited while it
    // runs, and its own writes are...
    s.await_write("p", Some("n"), "a", 21);
    s.mark_written("p", Some("n"), 9);
    let before = s.begin("p");
    assert!(!s.expects("p", "a", 21), "awaited by an earlier reconcile");
    s.await_write("p", Some("n"), "b", 22);
    // ...and if it stopped at the fingerprint, the earlier ones are awaited again.
    s.resume("p", before);
    assert!(s.expects("p", "a", 21));
    assert!(s.expects("p", "b", 22));
    assert!(s.holds("p", 9));
    // One version awaited a child: the latest written.
    s.await_write("p", Some("n"), "a", 30);
    s.await_write("p", Some("n"), "a", 31);
    assert!(!s.expects("p", "a", 30));
    assert!(s.expects("p", "a", 31));
    // A parent's awaited writes are bounded.
    for i in 0..=AWAITED_MAX {
        s.await_write("p", Some("n"), &format!("c{i}"), 40);
    }
    assert!(!s.expects("p", "c0", 40), "the oldest were forgotten");
    assert!(s.expects("p", &format!("c{AWAITED_MAX}"), 40));
}

#[test]
fn a_child_whose_version_came_is_caught_up() {
    let a = Applied::default();
    a.record(&obj("u", "10"), "h");
    a.caught_up("u", 9);
    assert!(
        a.ahead_of_cache(&obj("u", "9"), "h"),
        "an older version: kept"
    );
    a.caught_up("u", 10);
    assert!(
        !a.ahead_of_cache(&obj("u", "9"), "h"),
        "the version applied: gone"
    );
}

#[test]
fn an_apply_is_not_repeated_until_the_cache_has_it() {
    let a = Applied::default();
    a.record(&obj("u", "10"), "h2");
    // The cache still has version 9: applying h2 again would be a duplicate.
    assert!(a.ahead_of_cache(&obj("u", "9"), "h2"));
    // Something else is wanted now: apply.
    assert!(!a.ahead_of_cache(&obj("u", "9"), "h3"));
    // The cache has caught up: the plan decides again, and the entry is gone.
    assert!(!a.ahead_of_cache(&obj("u", "10"), "h2"));
    assert!(!a.ahead_of_cache(&obj("u", "9"), "h2"));
    // A reconcile that stops early forgets only what the cache has caught up with.
    a.record(&obj("u", "10"), "h2");
    a.forget_caught_up(&[(0, Arc::new(obj("u", "9")))]);
    assert!(a.ahead_of_cache(&obj("u", "9"), "h2"));
    a.forget_caught_up(&[(0, Arc::new(obj("u", "10")))]);
    assert!(!a.ahead_of_cache(&obj("u", "9"), "h2"));
}

#[test]
fn the_fingerprint_follows_every_input() {
    let parent = obj("p", "5");
    let kids = vec![(0, Arc::new(obj("c1", "7")))];
    let fingerprint = |p: &DynamicObject, kids: &[(usize, Arc<DynamicObject>)], refs| {
        digest::fingerprint(p, rv(p), observed(kids, refs))
    };
    let refs = std::collections::BTreeMap::from([(
        "creds".to_string(),
        json!({"metadata": {"uid": "s", "resourceVersion": "3"}}),
    )]);
    let f = fingerprint(&parent, &kids, &refs);
    assert_eq!(f, fingerprint(&parent, &kids, &refs));
    assert_ne!(f, fingerprint(&obj("p", "6"), &kids, &refs));
    assert_ne!(
        f,
        fingerprint(&parent, &[(0, Arc::new(obj("c1", "8")))], &refs)
    );
    assert_ne!(f, fingerprint(&parent, &[], &refs));
    let moved = std::collections::BTreeMap::from([(
        "creds".to_string(),
        json!({"metadata": {"uid": "s", "resourceVersion": "4"}}),
    )]);
    assert_ne!(f, fingerprint(&parent, &kids, &moved));
    let s = Steady::default();
    s.mark("p", Some("ns"), f);
    assert!(s.holds("p", f) && !s.holds("p", f + 1));
    s.forget("p");
    assert!(s.is_empty());
}

#[test]
fn a_share_change_forgets_the_parents_that_left_it() {
    use crate::shard::{Ranges, fnv1a};
    let s = Steady::default();
    s.mark("kept", Some("team-1"), 1);
    s.mark("moved", Some("team-2"), 2);
    s.mark("cluster", None, 3);
    let h = fnv1a("team-1");
    s.retain_namespaces(|x| Ranges::of([(u128::from(h), u128::from(h) + 1)]).contains(x));
    assert!(s.holds("kept", 1) && s.holds("cluster", 3));
    assert!(!s.holds("moved", 2));
    assert_eq!(s.len(), 2);
    s.retain_namespaces(|x| Ranges::none().contains(x));
    assert_eq!(s.len(), 1, "cluster-scoped parents move with their rule");
}

#[test]
fn a_created_child_is_on_its_way_until_cached_and_only_for_a_while() {
    let c = Created::default();
    let t0 = Instant::now();
    let k = Created::key(1, Some("n"), "p-a");
    assert!(!c.on_its_way(&k, t0), "never created");
    c.record(k.clone(), t0);
    assert!(
        !c.on_its_way(&Created::key(0, Some("n"), "p-a"), t0),
        "another kind"
    );
    assert!(c.on_its_way(&k, t0 + Duration::from_secs(1)));
    assert!(
        c.on_its_way(&k, t0 + Duration::from_secs(2)),
        "asked again before the cache has it"
    );
    c.arrived(|| k.clone());
    assert!(
        !c.on_its_way(&k, t0 + Duration::from_secs(3)),
        "cached, then missing: deleted"
    );
    c.record(k.clone(), t0);
    assert!(
        !c.on_its_way(&k, t0 + CREATED_LAG),
        "too long ago: deleted since"
    );
}

#[test]
fn a_parent_is_held_until_its_backoff_ends_or_it_succeeds() {
    let b = Backoffs::default();
    let now = tokio::time::Instant::now();
    let p = (Some("ns".to_string()), "p".to_string());
    assert!(!b.holds(&p, now));
    b.failed(p.clone(), now + Duration::from_secs(16));
    assert!(b.holds(&p, now));
    assert!(b.holds(&p, now + Duration::from_secs(15)));
    assert!(
        !b.holds(&p, now + Duration::from_secs(16)),
        "its retry runs then"
    );
    b.succeeded(&p);
    assert!(!b.holds(&p, now));
    assert!(b.is_empty());
}

/// Retries come as the backoffs end, earliest first; a success cancels one, a new
/// failure moves it.
#[tokio::test]
async fn retries_come_as_backoffs_end() {
    use futures::StreamExt;
    let b = Arc::new(Backoffs::default());
    let key = |n: &str| (Some("ns".to_string()), n.to_string());
    let now = tokio::time::Instant::now();
    b.failed(key("late"), now + Duration::from_millis(320));
    b.failed(key("early"), now + Duration::from_millis(160));
    b.failed(key("fixed"), now + Duration::from_millis(10));
    b.succeeded(&key("fixed"));
    b.failed(key("moved"), now + Duration::from_millis(20));
    b.failed(key("moved"), now + Duration::from_millis(200));
    let mut retries = Box::pin(b.clone().retries());
    assert_eq!(retries.next().await, Some(key("early")));
    assert!(tokio::time::Instant::now() >= now + Duration::from_millis(160));
    assert_eq!(retries.next().await, Some(key("moved")));
    assert_eq!(retries.next().await, Some(key("late")));
    assert!(b.is_empty(), "a retried parent is no longer held");
    // A failure while the stream waits wakes it.
    let waiting = tokio::spawn(async move { retries.next().await });
    tokio::task::yield_now().await;
    b.failed(
        key("again"),
        tokio::time::Instant::now() + Duration::from_millis(10),
    );
    assert_eq!(waiting.await.ok().flatten(), Some(key("again")));
}

fn memory() -> ParentMemory {
    ParentMemory::new(MemoryParts {
        steady: Arc::default(),
        orphans_pending: Arc::default(),
        records_version: true,
    })
}

fn parent(uid: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "x/v1", "kind": "P",
        "metadata": {"name": uid, "namespace": "n", "uid": uid, "resourceVersion": "5"}
    }))
    .unwrap()
}

#[test]
fn failures_and_warnings_go_with_a_success_the_teardown_with_its_end() {
    let m = memory();
    let key = (Some("n".to_string()), "p".to_string());
    assert_eq!(m.failed("p"), 1);
    assert_eq!(m.failed("p"), 2);
    assert!(m.warn_once("p", 7, 1));
    assert!(
        !m.warn_once("p", 7, 2),
        "the same warning again says nothing new"
    );
    assert!(m.warn_once("p", 8, 3), "another warning does");
    // An unsent warning is forgotten only if it is still the last one.
    m.warning_unsent("p", 1);
    assert!(!m.warn_once("p", 8, 4));
    m.warning_unsent("p", 3);
    assert!(m.warn_once("p", 8, 5));
    m.let_go("p", "c1".into());
    m.succeeded("p", &key);
    assert_eq!(m.failed("p"), 1, "a success starts the count again");
    assert!(m.warn_once("p", 8, 6), "and forgets the last warning");
    m.succeeded("p", &key);
    // The teardown is kept through a success, and goes when it is done.
    let still = HashSet::from(["c1".to_string(), "c2".to_string()]);
    assert_eq!(
        m.let_go_among("p", &still),
        HashSet::from(["c1".to_string()])
    );
    assert_eq!(m.parents_noted(), 1);
    m.teardown_done("p");
    assert!(m.let_go_among("p", &still).is_empty());
    assert_eq!(m.parents_noted(), 0, "an empty note is not kept");
}

#[test]
fn a_teardown_forgets_children_no_longer_owned_and_waits_from_the_first_in_deletion() {
    let m = memory();
    assert_eq!(m.teardown_waiting_since("p", false), None);
    let first = m.teardown_waiting_since("p", true);
    assert!(first.is_some());
    assert_eq!(m.teardown_waiting_since("p", true), first, "not renewed");
    m.let_go("p", "gone".into());
    m.let_go("p", "kept".into());
    let still = HashSet::from(["kept".to_string()]);
    assert_eq!(m.let_go_among("p", &still), still);
    // `gone` was forgotten: it does not come back when owned again.
    let both = HashSet::from(["kept".to_string(), "gone".to_string()]);
    assert_eq!(m.let_go_among("p", &both), still);
}

#[test]
fn deleted_and_unlisted_parents_are_forgotten_by_every_memo() {
    use kube::runtime::watcher::Event;
    let m = memory();
    for uid in ["a", "b", "c"] {
        m.failed(uid);
        m.set_paused(uid, true);
        m.mark_steady(uid, Some("n"), 1);
    }
    let live = || HashSet::from(["a".to_string(), "b".to_string(), "c".to_string()]);
    // Nothing reported: nothing forgotten (and the parent cache is not read).
    m.forget_gone(|| unreachable!("read only after a listing"));
    assert_eq!((m.parents_noted(), m.paused().count()), (3, 3));
    // `a` deleted.
    m.parent_event(&Event::Delete(parent("a")));
    m.forget_gone(live);
    assert_eq!((m.parents_noted(), m.paused().count()), (2, 2));
    assert!(!m.steady.holds("a", 1) && m.steady.holds("b", 1));
    // A listing without `b` (deleted while the watch was down).
    m.parent_event(&Event::InitDone);
    m.forget_gone(|| HashSet::from(["c".to_string()]));
    assert_eq!((m.parents_noted(), m.paused().count()), (1, 1));
    assert!(!m.steady.holds("b", 1) && m.steady.holds("c", 1));
    assert_eq!(m.failed("c"), 2, "what remains is intact");
}

#[test]
fn the_parent_as_this_process_wrote_it_counts_in_the_fingerprint() {
    let m = memory();
    let p = parent("p");
    let before = m.fingerprint("p", &p, 9);
    let meta: kube::api::ObjectMeta =
        serde_json::from_value(json!({"resourceVersion": "6"})).unwrap();
    m.status_written("p".into(), 6, &meta, &json!({"phase": "x"}));
    assert_eq!(m.status_written_since("p", &p), Some(json!({"phase": "x"})));
    // Without a generation the write does not stand for the cached parent: same print.
    assert_eq!(m.fingerprint("p", &p, 9), before);
    assert!(m.records_version());
    assert!(m.stop_recording_version());
    assert!(!m.records_version() && !m.stop_recording_version());
}

#[test]
fn an_awaited_write_arriving_is_noted_once_as_caught_up() {
    let m = memory();
    let child = obj("c", "9");
    m.applied(&child, "h");
    m.created("0/n/c".into(), Instant::now());
    m.await_write("p", Some("n"), "c", 9);
    assert!(m.applied_ahead_of(&obj("c", "8"), "h"));
    assert!(m.own_write_seen("p", "c", 9, || "0/n/c".into()));
    assert!(!m.applied_ahead_of(&obj("c", "8"), "h"), "caught up");
    assert!(!m.created_on_its_way("0/n/c", Instant::now()), "arrived");
    assert!(!m.own_write_seen("p", "c", 9, || unreachable!()), "once");
}
