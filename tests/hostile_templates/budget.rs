//! The per-parent render budget (`Limits::parent_*`): a big or hostile parent must end
//! with the budget error (`RenderError::is_budget_exceeded`), fast and with bounded
//! memory, while the shipped rules stay far inside the budget. A counting allocator
//! measures the memory one render allocates on its thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::time::Duration;

use rulebook::render::{Limits, Observed, ParentBudget, Scope};
use serde_json::{Value as Json, json};

use super::*;

/// Counts the bytes live on each thread, and the peak.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the most memory it held at once on this thread.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get) - start;
    (out, peak.max(0) as usize)
}

const MIB: usize = 1 << 20;

/// Loads with `limits`, renders (which must fail) and checks it is a budget error.
fn over_budget(what: &str, limits: &Limits, extra: &str, template: &str, spec: Json) -> String {
    let e = timed(what, || {
        let rule = rulebook::render::compile(&sources(extra, template), limits)
            .unwrap_or_else(|d| panic!("{what}: load failed:\n{d}"))
            .rules["hostile"]
            .clone();
        match render_with(&rule, spec) {
            Ok(c) => panic!("{what}: rendered {} children", c.len()),
            Err(e) => e,
        }
    });
    assert!(e.is_budget_exceeded(), "{what}: not a budget error: {e}");
    assert_eq!(e.condition_reason(), "RenderBudgetExceeded", "{what}");
    assert!(e.to_string().len() < 400, "{what}: too long: {e}");
    e.message
}

/// The default budget with the parent's time lifted: every case here but the deadline's
/// (which sets its own) is about another bound, and a loaded CI machine must not end it
/// with the deadline instead.
fn defaults() -> Limits {
    Limits {
        parent_time: Duration::from_secs(600),
        ..Limits::default()
    }
}

/// A ~900 KB parent: 8000 strings of 100 characters.
fn big_items() -> Json {
    let items: Vec<String> = (0..8000).map(|i| format!("{i:0>100}")).collect();
    json!({ "items": items, "shards": (0..1000).collect::<Vec<u32>>() })
}

const LOOP_HEAVY: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ \"probe-\" ~ index }}\ndata:\n{% for x in parent.spec.items %}\n  k{{ loop.index }}: {{ x }}\n{% endfor %}\n";

#[test]
fn a_900_kb_parent_through_a_loop_heavy_template_hits_the_output_budget() {
    // Each of the 1000 children prints all 900 KB: 900 MB without a parent budget. The
    // budget is a quarter of the default: parsing and hashing each 900 KB child is slow
    // in a debug build, and the point is that the budget, not the cap of 1000 items or
    // memory, ends the render.
    let limits = Limits {
        parent_output_bytes: 4 * MIB,
        ..defaults()
    };
    let (message, peak) = peak_during(|| {
        over_budget(
            "900 KB parent",
            &limits,
            "      forEach: \"parent.spec.shards\"\n",
            LOOP_HEAVY,
            big_items(),
        )
    });
    assert!(
        message.starts_with("parent exceeds the render budget: ")
            && message.ends_with("of output (limit 4 MiB per parent)"),
        "{message}"
    );
    assert!(!message.contains("0000000"), "tenant values in: {message}");
    println!("900 KB parent: peak {} MiB", peak / MIB);
    assert!(peak < 256 * MIB, "the render held {} MiB", peak / MIB);
}

#[test]
fn fuel_adds_up_across_for_each_items() {
    // Each item loops over 8000 values printing nothing: far under one template's fuel,
    // but 1000 of them are not.
    let t = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ \"probe-\" ~ index }}\n{% for x in parent.spec.items %}{% if x == \"no\" %}{{ x }}{% endif %}{% endfor %}\n";
    let limits = Limits {
        parent_fuel: 2_000_000,
        ..defaults()
    };
    let m = over_budget(
        "fuel",
        &limits,
        "      forEach: \"parent.spec.shards\"\n",
        t,
        big_items(),
    );
    assert!(
        m.starts_with("parent exceeds the render budget: ")
            && m.contains("fuel (limit 2000000 per parent)"),
        "{m}"
    );
}

#[test]
fn memory_heavy_filters_are_refused_before_they_build() {
    let long = "y".repeat(1000);
    for (what, expr, needle) in [
        (
            "indent",
            "parent.spec.text | indent(10**9)",
            "`indent` would build",
        ),
        (
            "indent kwarg",
            "parent.spec.text | indent(width=10**9)",
            "`indent` would build",
        ),
        (
            "replace",
            "parent.spec.a40k | replace(\"a\", parent.spec.long)",
            "`replace` would build",
        ),
        (
            "replace empty",
            "parent.spec.a40k | replace(\"\", parent.spec.long)",
            "`replace` would build",
        ),
        (
            "join",
            "range(100000) | join(parent.spec.long)",
            "`join` would build",
        ),
        (
            "tojson",
            "parent.spec | tojson(indent=10**9)",
            "`tojson` would build",
        ),
        (
            "format precision",
            "\"%.999999999f\" | format(1.5)",
            "`format` would build",
        ),
        (
            "format star",
            "\"%*s\" | format(10**9, \"x\")",
            "`format` would build",
        ),
        (
            "batch",
            "[1] | batch(10**9, 0) | length",
            "`batch` would build",
        ),
        (
            "slice",
            "[1] | slice(10**9) | length",
            "`slice` would build",
        ),
        (
            "list of a string",
            "(\"x\" * 10**7) | list | length",
            "`list` would build",
        ),
        (
            "repetition through a filter",
            "(\"ab\" * parent.spec.n) | indent(2)",
            "`indent` would build",
        ),
    ] {
        let t = format!("{HEAD}data:\n  x: {{{{ {expr} }}}}\n");
        let spec =
            json!({"text": "a\nb\nc", "a40k": "a".repeat(40_000), "long": long, "n": 10_000_000});
        let (m, peak) = peak_during(|| over_budget(what, &defaults(), "", &t, spec));
        assert!(
            m.starts_with("parent exceeds the render budget: ") && m.contains(needle),
            "{what}: {m}"
        );
        assert!(!m.contains("yyyy"), "{what}: tenant values in: {m}");
        // The VM's `"x" * n` itself is minijinja's (up to 100 MB); nothing more is built.
        println!("{what}: peak {} MiB", peak / MIB);
        assert!(
            peak < 64 * MIB,
            "{what}: the render held {} MiB",
            peak / MIB
        );
    }
}

#[test]
fn repeated_copies_add_up() {
    // Each call is under the budget; together they are not.
    for (what, body) in [
        (
            "upper",
            "{% for i in range(100) %}{{ (parent.spec.big | upper) | length }}{% endfor %}",
        ),
        (
            "to_yaml",
            "{% for i in range(100) %}{{ (parent.spec | to_yaml) | length }}{% endfor %}",
        ),
        (
            "pprint",
            "{% for i in range(100) %}{{ (parent.spec | pprint) | length }}{% endfor %}",
        ),
        (
            "b64encode",
            "{% for i in range(100) %}{{ (parent.spec.big | b64encode) | length }}{% endfor %}",
        ),
        (
            "debug",
            "{% for i in range(100) %}{{ debug() | length }}{% endfor %}",
        ),
    ] {
        let t = format!("{HEAD}data:\n  x: \"{body}\"\n");
        let spec = json!({ "big": "z".repeat(500_000) });
        let m = over_budget(what, &defaults(), "", &t, spec);
        assert!(
            m.starts_with("parent exceeds the render budget: ") && m.contains("would build"),
            "{what}: {m}"
        );
    }
}

#[test]
fn string_repetition_and_range_abuse_are_budget_errors() {
    for (what, body, needle) in [
        (
            "repetition printed",
            "data:\n  x: {{ \"x\" * parent.spec.n }}\n",
            "output is larger than the limit of 1048576 bytes",
        ),
        (
            "range",
            "{% for i in range(10**9) %}x{% endfor %}\n",
            "range has too many elements",
        ),
        (
            "range from the parent",
            "{% for i in range(parent.spec.n) %}x{% endfor %}\n",
            "range has too many elements",
        ),
        (
            "nested ranges",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}\n",
            "ran out of fuel",
        ),
    ] {
        let t = format!("{HEAD}{body}");
        let m = over_budget(what, &defaults(), "", &t, json!({"n": 10_000_000}));
        assert!(m.contains(needle), "{what}: {m}");
    }
}

#[test]
fn the_deadline_stops_a_parent() {
    let limits = Limits {
        parent_time: Duration::ZERO,
        ..defaults()
    };
    let m = over_budget(
        "deadline",
        &limits,
        "",
        &format!("{HEAD}data: {{}}\n"),
        json!({}),
    );
    assert!(
        m.contains("rendering took") && m.contains("limit 0 ms per parent"),
        "{m}"
    );
}

#[test]
fn a_template_error_is_not_a_budget_error() {
    let e = render_fails(
        "undefined",
        "",
        &format!("{HEAD}data:\n  x: {{{{ parent.spec.nope }}}}\n"),
        json!({}),
    );
    assert!(!e.is_budget_exceeded(), "{e}");
    assert_eq!(e.condition_reason(), "RenderFailed");
}

#[test]
fn render_and_status_share_one_budget() {
    let extra = "      readyWhen: \"child.data.x == parent.spec.x\"\n";
    let t = format!("{HEAD}data:\n  x: {{{{ parent.spec.x }}}}\n");
    let rule = load(extra, &t).unwrap_or_else(|d| panic!("{d}"));
    let parent = json!({
        "apiVersion": "test.rulebook.dev/v1", "kind": "Hostile",
        "metadata": {"name": "h", "namespace": "default", "uid": "u-1"},
        "spec": {"x": "1"},
    });
    let scope = |_: usize| Scope::Namespaced;
    let mut budget = rule.budget();
    let desired = rule
        .render_within(&parent, &Observed::default(), &scope, &mut budget)
        .expect("render");
    let (fuel, output) = (budget.fuel_used(), budget.output_used());
    assert!(fuel > 0 && output > 0, "{budget:?}");
    let observed = Observed::from_objects(desired.iter().map(|d| d.object.clone()));
    let report = rule
        .status_within(&parent, &observed, &desired, &mut budget)
        .expect("status");
    assert!(report.readiness.is_ready());
    assert!(budget.fuel_used() > fuel, "readyWhen fuel was not counted");

    // With exactly the render's fuel, the status has none left.
    let limits = Limits {
        parent_fuel: fuel,
        ..defaults()
    };
    let mut tight = ParentBudget::new(&limits);
    let desired = rule
        .render_within(&parent, &Observed::default(), &scope, &mut tight)
        .expect("render within the exact fuel");
    let e = rule
        .status_within(&parent, &observed, &desired, &mut tight)
        .expect_err("no fuel left for the status");
    assert!(e.is_budget_exceeded(), "{e}");
    assert!(e.message.contains("fuel are spent"), "{e}");
    let first = tight.exceeded().unwrap_or("none");
    assert!(e.message.ends_with(first), "{e} / {first}");
}

/// A parent read from a file, as `rulebook render` completes it.
fn example(path: &Path) -> Json {
    let text = std::fs::read_to_string(path).expect("example");
    let mut parent: Json = serde_saphyr::from_str(&text).expect("example yaml");
    let meta = parent["metadata"].as_object_mut().expect("metadata");
    meta.entry("namespace").or_insert(json!("default"));
    meta.insert("uid".into(), json!("00000000-0000-0000-0000-000000000001"));
    parent
}

fn within_budget(rule: &rulebook::render::CompiledRule, parent: &Json, what: &str) {
    let scope = |_: usize| Scope::Namespaced;
    let mut budget = rule.budget();
    let desired = rule
        .render_within(parent, &Observed::default(), &scope, &mut budget)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let observed = Observed::from_objects(desired.iter().map(|d| d.object.clone()));
    rule.status_within(parent, &observed, &desired, &mut budget)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let limits = Limits::default();
    println!(
        "{what}: {} fuel, {} bytes, {:?}",
        budget.fuel_used(),
        budget.output_used(),
        budget.elapsed()
    );
    // A hundredth of the budget: room for parents far bigger than the examples.
    assert!(
        budget.fuel_used() * 100 < limits.parent_fuel,
        "{what}: {budget:?}"
    );
    assert!(
        budget.output_used() * 100 < limits.parent_output_bytes,
        "{what}: {budget:?}"
    );
}

#[test]
fn the_shipped_rules_fit_well_within_the_budget() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let set = rulebook::render::load(&root.join("rules"), &root.join("templates"), &defaults())
        .unwrap_or_else(|d| panic!("{d}"));
    for name in ["myapp", "myweb", "project"] {
        let parent = example(&root.join(format!("examples/{name}.yaml")));
        within_budget(&set.rules[name], &parent, name);
    }
    let bench = rulebook::render::load(
        &root.join("benches/rules"),
        &root.join("benches/templates"),
        &defaults(),
    )
    .unwrap_or_else(|d| panic!("{d}"));
    let parent = json!({
        "apiVersion": "bench.rulebook.dev/v1", "kind": "Bench",
        "metadata": {"name": "b-00042", "namespace": "bench", "uid": "u-42"},
        "spec": {"size": 42, "data": "payload-00042-".repeat(8)},
    });
    within_budget(&bench.rules["bench"], &parent, "bench");
}
