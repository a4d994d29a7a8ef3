//! Unit tests of `admission.rs`.

use super::*;
use crate::counts::testing::Counted;
use serde_json::json;

fn cm(ns: &str, name: &str, bytes: usize) -> DynamicObject {
    let mut o: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns}
    }))
    .unwrap();
    o.data = serde_json::Value::String("x".repeat(bytes));
    o
}

fn budget(per_namespace: usize, total: usize) -> CacheBudget {
    counted_budget(per_namespace, total).0
}

/// A budget, and what it counts.
fn counted_budget(per_namespace: usize, total: usize) -> (CacheBudget, Arc<Counted>) {
    let counted = Arc::new(Counted::default());
    let b = CacheBudget::new(
        CacheLimits {
            per_namespace,
            total,
        },
        counted.clone(),
    );
    (b, counted)
}

#[test]
fn a_namespace_over_its_budget_gets_stubs_and_others_do_not() {
    let b = budget(1000, 10_000);
    let c = b.cache_id(CacheKind::Children);
    for i in 0..3 {
        let mut e = Event::Apply(cm("tenant", &format!("c{i}"), 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    }
    let mut e = Event::Apply(cm("tenant", "c3", 300));
    assert_eq!(
        b.admit(c, "r", &mut e),
        Admitted::Stubbed { announce: true }
    );
    let Event::Apply(o) = &e else { unreachable!() };
    assert!(o.data.is_null());
    // Announced once per namespace in a while.
    let mut e = Event::Apply(cm("tenant", "c4", 300));
    assert_eq!(
        b.admit(c, "r", &mut e),
        Admitted::Stubbed { announce: false }
    );
    // Another namespace is unaffected.
    let mut e = Event::Apply(cm("other", "c0", 300));
    assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    // A deletion frees room; a replaced object is counted once.
    b.admit(c, "r", &mut Event::Delete(cm("tenant", "c0", 300)));
    let mut e = Event::Apply(cm("tenant", "c1", 300));
    assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    let mut e = Event::Apply(cm("tenant", "c5", 300));
    assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    let mut e = Event::Apply(cm("tenant", "c6", 300));
    assert!(matches!(b.admit(c, "r", &mut e), Admitted::Stubbed { .. }));
}

#[test]
fn the_total_bounds_all_namespaces_and_a_relist_counts_afresh() {
    let b = budget(1000, 1000);
    let c = b.cache_id(CacheKind::Children);
    for i in 0..3 {
        let mut e = Event::Apply(cm(&format!("ns{i}"), "c", 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    }
    let mut e = Event::Apply(cm("ns3", "c", 300));
    assert!(matches!(b.admit(c, "r", &mut e), Admitted::Stubbed { .. }));
    b.admit(c, "r", &mut Event::Init);
    let mut e = Event::InitApply(cm("ns3", "c", 300));
    assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
    b.drop_cache(c);
    assert_eq!(lock(&b.state).total, 0);
}

fn heavy(ns: &str, name: &str, content: Option<usize>) -> DynamicObject {
    let mut labels: serde_json::Map<String, serde_json::Value> = (0..1000)
        .map(|i| (format!("tenant/l{i}"), json!("v")))
        .collect();
    labels.insert(labels::OWNER.into(), json!("uid-p"));
    labels.insert(labels::MANAGED_BY.into(), json!("rulebook"));
    let mut o: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels,
            "annotations": {"tenant/blob": "x".repeat(200_000),
                            labels::DESIRED_HASH: "abc",
                            "rulebook.dev/forged": "y".repeat(10_000)},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "P", "name": "p", "uid": "uid-p", "controller": true},
                {"apiVersion": "v1", "kind": "P", "name": "q", "uid": "uid-q"}],
            "finalizers": (0..3000).map(|i| format!("tenant.example.com/f{i}-{}", "x".repeat(200))).collect::<Vec<_>>(),
            "generateName": "g".repeat(100_000),
            "managedFields": [{"manager": "tenant", "operation": "Update"}]}
    }))
    .unwrap();
    o.data = content.map_or(serde_json::Value::Null, |n| {
        serde_json::Value::String("x".repeat(n))
    });
    o
}

/// Metadata counts as well as content, and a stub keeps only what Rulebook reads
/// of it before reading the object itself: a tenant's object with 200 KB of
/// annotations and a thousand labels neither passes the budget nor stays in memory.
#[test]
fn metadata_counts_and_a_stub_keeps_only_rulebooks_metadata() {
    let b = budget(100_000, 1_000_000);
    let children = b.cache_id(CacheKind::Children);
    let mut e = Event::Apply(heavy("tenant", "a", Some(300)));
    assert_eq!(
        b.admit(children, "r", &mut e),
        Admitted::Stubbed { announce: true }
    );
    let Event::Apply(o) = &e else { unreachable!() };
    assert!(o.data.is_null());
    let m = &o.metadata;
    let labels_kept: Vec<&String> = m.labels.iter().flatten().map(|(k, _)| k).collect();
    assert_eq!(labels_kept, [labels::MANAGED_BY, labels::OWNER]);
    let annotations: Vec<&String> = m.annotations.iter().flatten().map(|(k, _)| k).collect();
    assert_eq!(annotations, [labels::DESIRED_HASH]);
    assert_eq!(m.owner_references.as_ref().map(Vec::len), Some(1));
    assert!(m.managed_fields.is_none());
    assert!(metadata_bytes(m) < 500, "{}", metadata_bytes(m));
    // What the stub holds is counted, not what it arrived with (an ordinary
    // object's metadata is within the allowance).
    assert_eq!(lock(&b.state).total, 0);
    // An object that cannot be a child (no content) is slimmed the same way.
    let mut e = Event::Apply(heavy("tenant", "b", None));
    assert_eq!(b.admit(children, "r", &mut e), Admitted::AsIs);
    let Event::Apply(o) = &e else { unreachable!() };
    assert!(metadata_bytes(&o.metadata) < 500);
    // A reference's stub keeps small labels (selectors match on them); a thousand
    // are dropped, marked so, as are labels forged with Rulebook's prefix.
    let references = b.cache_id(CacheKind::References);
    let mut small = heavy("tenant", "d", None);
    small.metadata.labels = Some([("team".to_string(), "a".to_string())].into());
    for (o, kept) in [(heavy("tenant", "c", None), 2), (small, 1)] {
        let mut e = Event::Apply(o);
        b.admit(references, "r", &mut e);
        let Event::Apply(o) = &e else { unreachable!() };
        assert_eq!(o.metadata.labels.as_ref().map(|l| l.len()), Some(kept));
        assert_eq!(super::labels_kept(&o.metadata), kept == 1);
        assert!(metadata_bytes(&o.metadata) < 500);
    }
    let mut forged = heavy("tenant", "e", None);
    for i in 0..1000 {
        let key = format!("{}l{i}", labels::PREFIX);
        forged.labels_mut().insert(key.clone(), "v".into());
        forged.annotations_mut().insert(key, "v".into());
    }
    let mut e = Event::Apply(forged);
    b.admit(children, "r", &mut e);
    let Event::Apply(o) = &e else { unreachable!() };
    assert!(metadata_bytes(&o.metadata) < 500);
    // A controller reference of 800 KB is no real one: not kept.
    let mut long = heavy("tenant", "f", None);
    if let Some(r) = long.metadata.owner_references.as_mut() {
        r[0].name = "n".repeat(800_000);
    }
    let mut e = Event::Apply(long);
    b.admit(children, "r", &mut e);
    let Event::Apply(o) = &e else { unreachable!() };
    assert!(
        o.metadata
            .owner_references
            .iter()
            .flatten()
            .next()
            .is_none()
    );
    assert!(metadata_bytes(&o.metadata) < 500);
}

/// A parent's stub keeps no labels or annotations of the tenant's, only a digest of
/// them, which changes when they do (the parent watch's filter of unchanged parents
/// hashes the annotations), and the bytes held are shown by cache.
#[test]
fn a_parents_stub_keeps_a_digest_of_what_it_dropped() {
    let (b, counted) = counted_budget(1000, 1_000_000);
    let parents = b.cache_id(CacheKind::Parents);
    let digest = |note: &str| {
        let mut o = heavy("tenant", "p", Some(2000));
        if let Some(a) = o.metadata.annotations.as_mut() {
            a.insert("tenant/note".into(), note.into());
        }
        let mut e = Event::Apply(o);
        assert!(matches!(
            b.admit(parents, "r", &mut e),
            Admitted::Stubbed { .. }
        ));
        let Event::Apply(o) = e else { unreachable!() };
        let m = o.metadata;
        let labels_kept: Vec<String> = m.labels.into_iter().flatten().map(|(k, _)| k).collect();
        assert_eq!(labels_kept, [labels::MANAGED_BY, labels::OWNER]);
        let annotations = m.annotations.unwrap_or_default();
        assert!(annotations.keys().all(|k| k.starts_with(labels::PREFIX)));
        annotations.get(DROPPED_METADATA).cloned()
    };
    let (one, two) = (digest("a"), digest("b"));
    assert!(one.is_some() && two.is_some() && one != two);
    assert_eq!(digest("a"), one);
    let held = |cache: &str| counted.content_bytes(cache);
    let mut e = Event::Apply(cm("tenant", "small", 10));
    assert_eq!(b.admit(parents, "r", &mut e), Admitted::AsIs);
    assert_eq!(held("children"), 0);
    assert!(held("parents") >= 10);
    let s = lock(&b.state);
    assert!(s.total > 0);
    assert_eq!(s.by_kind[CacheKind::Parents as usize], s.total);
}
