//! Unit tests of `memo.rs`.

use super::*;
use serde_json::json;

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
        super::fingerprint(p, rv(p), observed(kids, refs))
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
