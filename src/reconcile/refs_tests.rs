//! Unit tests of `refs.rs`.

use super::*;
use serde_json::json;

fn obj(ns: &str, name: &str, labels: Json) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels}
    }))
    .unwrap()
}

fn parent(ns: &str, name: &str) -> Key {
    (Some(ns.into()), name.into())
}

/// The event of `now` with `was` as the cached previous version: the parents woken.
fn event(
    idx: &RefIndex,
    was: Option<&DynamicObject>,
    now: DynamicObject,
    deleted: bool,
) -> Vec<Key> {
    let e = if deleted {
        Event::Delete(now.clone())
    } else {
        Event::Apply(now.clone())
    };
    idx.before_update(&e, was);
    let mut out = idx.parents_for(&now);
    out.sort();
    out
}

#[test]
fn events_wake_exactly_the_parents_that_read_the_object() {
    let idx = RefIndex::default();
    idx.track(
        parent("a", "p1"),
        RefTarget {
            reference: 0,
            namespace: Some("a".into()),
            select: RefSelect::Name("creds".into()),
        },
    );
    let team = |t: &str| RefTarget {
        reference: 0,
        namespace: Some("a".into()),
        select: RefSelect::Labels(BTreeMap::from([("team".into(), t.into())])),
    };
    idx.track(parent("a", "p2"), team("x"));
    idx.track(parent("a", "p3"), team("y"));
    // By name: only p1; the same name in another namespace: nobody.
    let creds = obj("a", "creds", json!({}));
    assert_eq!(
        event(&idx, None, creds.clone(), false),
        vec![parent("a", "p1")]
    );
    assert!(event(&idx, None, obj("b", "creds", json!({})), false).is_empty());
    // An object p2 read before it was tracked, relabelled to p3's team: both hear it.
    let x = obj("a", "s", json!({"team": "x"}));
    let y = obj("a", "s", json!({"team": "y"}));
    assert_eq!(event(&idx, None, x.clone(), false), vec![parent("a", "p2")]);
    assert_eq!(
        event(&idx, Some(&x), y.clone(), false),
        vec![parent("a", "p2"), parent("a", "p3")]
    );
    // Deleted: p3 once more, and nothing is left behind for it.
    assert_eq!(
        event(&idx, Some(&y), y.clone(), true),
        vec![parent("a", "p3")]
    );
    assert!(lock(&idx.maps).before.is_empty());
    // A stub whose labels were dropped: every parent with a selector in its
    // namespace hears it (not p1, which names another object).
    let mut dropped = obj("a", "big", json!({}));
    dropped.data = Json::Null;
    dropped.metadata.annotations =
        Some([(admission::DROPPED_LABELS.to_string(), String::new())].into());
    assert_eq!(
        event(&idx, None, dropped, false),
        vec![parent("a", "p2"), parent("a", "p3")]
    );
    // A parent whose reference moves is found under the new target only.
    idx.track(parent("a", "p1"), team("x"));
    assert!(event(&idx, None, creds, false).is_empty());
    // A parent relist without p1; then deletes of the others.
    idx.retain(|k| k != &parent("a", "p1"));
    assert_eq!(idx.parents(), 2);
    idx.forget(&parent("a", "p2"));
    idx.forget(&parent("a", "p3"));
    assert_eq!(idx.parents(), 0);
    assert!(lock(&idx.maps).by_selector.is_empty());
    assert!(lock(&idx.maps).by_name.is_empty());
}

/// Only valid label keys and values reach the API server's selector: a value from a
/// tenant cannot add a clause to it.
#[test]
fn a_selector_is_sent_only_when_every_label_is_valid() {
    let sel = |pairs: &[(&str, &str)]| {
        label_selector(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    assert_eq!(
        sel(&[("team", "a"), ("x.io/tier", "")]).as_deref(),
        Some("team=a,x.io/tier=")
    );
    for bad in [
        &[("team", "a,other!=b")][..],
        &[("team", "a b")],
        &[("te am", "a")],
        &[("x..io/tier", "a")],
        &[("team", &*"v".repeat(64))],
        &[("-team", "a")],
        &[],
    ] {
        assert_eq!(sel(bad), None, "{bad:?}");
    }
}

#[test]
fn members_follow_the_cache_and_its_relists() {
    let idx = RefIndex::default();
    idx.before_update(&Event::Apply(obj("a", "x", json!({}))), None);
    idx.before_update(&Event::Apply(obj("a", "y", json!({}))), None);
    idx.before_update(&Event::Delete(obj("a", "x", json!({}))), None);
    assert_eq!(idx.members(&Some("a".into())), vec!["y".to_string()]);
    idx.before_update(&Event::Init, None);
    idx.before_update(&Event::InitApply(obj("b", "z", json!({}))), None);
    assert_eq!(idx.members(&Some("a".into())).len(), 1);
    idx.before_update(&Event::InitDone, None);
    assert!(idx.members(&Some("a".into())).is_empty());
    assert_eq!(idx.members(&Some("b".into())), vec!["z".to_string()]);
}
