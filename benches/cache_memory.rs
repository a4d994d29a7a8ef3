//! Memory per cached object, without a cluster: `cargo bench --bench cache_memory`.
//!
//! Builds N copies of a child as the benchmark rule's ConfigMap looks in the watch cache
//! (Rulebook's labels and annotations, an owner reference, Rulebook's managedFields
//! entry) and reports the live heap per object (a counting allocator) and the RSS
//! growth: as kube-runtime would cache it, packed as the watch stream carries it
//! (`rulebook::cache::strip_child`), and as Rulebook's child store holds it
//! (`rulebook::cache::store::ChildStore`: packed as text, with its key and owner
//! index). Writes `target/bench/cache_memory.json`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kube::api::DynamicObject;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        // SAFETY: `p` was allocated by `System` with `l`.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn rss() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn child(i: usize) -> String {
    let name = format!("b-{i:05}");
    serde_json::json!({
      "apiVersion": "v1", "kind": "ConfigMap",
      "metadata": {
        "name": format!("{name}-config"), "namespace": "bench-rulebook-123456",
        "uid": format!("0b0e7d1e-8f5a-4c3e-9a55-2d1f0c8{i:05}"), "resourceVersion": format!("{}", 100000 + i),
        "creationTimestamp": "2026-11-22T06:34:38Z",
        "labels": {"app": name, "app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": "bench",
                   "rulebook.dev/owner": format!("5b0e7d1e-8f5a-4c3e-9a55-2d1f0c8{i:05}"), "rulebook.dev/child": "config"},
        "annotations": {"rulebook.dev/rule-version": "fb9494ac5cdf", "rulebook.dev/desired-hash": "a1b2c3d4e5f60718"},
        "ownerReferences": [{"apiVersion": "bench.rulebook.dev/v1", "kind": "Bench", "name": name,
            "uid": format!("5b0e7d1e-8f5a-4c3e-9a55-2d1f0c8{i:05}"), "controller": true, "blockOwnerDeletion": true}],
        "managedFields": [{"manager": "rulebook", "operation": "Apply", "apiVersion": "v1",
            "time": "2026-11-22T06:34:38Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:data": {"f:data": {}, "f:size": {}}, "f:metadata": {
              "f:annotations": {"f:rulebook.dev/desired-hash": {}, "f:rulebook.dev/rule-version": {}},
              "f:labels": {"f:app": {}, "f:app.kubernetes.io/managed-by": {}, "f:rulebook.dev/child": {},
                           "f:rulebook.dev/owner": {}, "f:rulebook.dev/rule": {}},
              "f:ownerReferences": {format!("k:{{\"uid\":\"5b0e7d1e-8f5a-4c3e-9a55-2d1f0c8{i:05}\"}}"): {}}}}}]
      },
      "data": {"size": "3", "data": "some data of the bench parent"}
    })
    .to_string()
}

#[derive(Clone, Copy, PartialEq)]
enum Form {
    Raw,
    Packed,
    Stored,
}

fn measure(n: usize, form: Form) -> (usize, usize, usize) {
    let texts: Vec<String> = (0..n).map(child).collect();
    let json_bytes = texts.iter().map(String::len).sum::<usize>() / n.max(1);
    let (rss0, live0) = (rss(), LIVE.load(Relaxed));
    let mut cache: Vec<Arc<DynamicObject>> = Vec::with_capacity(n);
    let store = rulebook::cache::store::ChildStore::new(&kube::api::ApiResource::erase::<
        k8s_openapi::api::core::v1::ConfigMap,
    >(&()));
    for t in &texts {
        let Ok(mut o) = serde_json::from_str::<DynamicObject>(t) else {
            continue;
        };
        if form != Form::Raw {
            rulebook::cache::strip_child(&mut o);
        }
        if form == Form::Stored {
            store.observe(&kube::runtime::watcher::Event::Apply(o));
        } else {
            cache.push(Arc::new(o));
        }
    }
    let live = (LIVE.load(Relaxed) - live0) / n.max(1);
    let grown = rss().saturating_sub(rss0) / n.max(1);
    drop(cache);
    drop(store);
    (json_bytes, live, grown)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("cache_memory: run with `cargo bench --bench cache_memory`");
        return;
    }
    let n: usize = std::env::var("BENCH_CACHE_OBJECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9000);
    // Smallest first: RSS growth is measured on a fresh heap, which the later runs reuse.
    let (json, stored_live, stored_rss) = measure(n, Form::Stored);
    let (_, packed_live, packed_rss) = measure(n, Form::Packed);
    let (_, raw_live, raw_rss) = measure(n, Form::Raw);
    println!("cache_memory: {n} ConfigMap children of {json} JSON bytes each");
    println!(
        "  as kube-runtime caches them: {raw_live} B live heap per object ({raw_rss} B RSS growth)"
    );
    println!(
        "  packed (the watch stream):   {packed_live} B live heap per object ({packed_rss} B RSS growth)"
    );
    println!(
        "  stored (Rulebook's store):   {stored_live} B live heap per object ({stored_rss} B RSS growth)"
    );
    let out = serde_json::json!({
        "objects": n, "json_bytes_per_object": json,
        "raw": {"live_heap_per_object": raw_live, "rss_growth_per_object": raw_rss},
        "packed": {"live_heap_per_object": packed_live, "rss_growth_per_object": packed_rss},
        "stored": {"live_heap_per_object": stored_live, "rss_growth_per_object": stored_rss},
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("cache_memory.json"), out.to_string());
    }
}
