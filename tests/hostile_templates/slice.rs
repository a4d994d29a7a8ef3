//! The first attempt at a render on the async runtime (`render::slice`,
//! `reconcile::offload`): only rules of straight-line code get one; it stops within the
//! slice's fuel and bytes, in the slice environment, with a budget error (so the work
//! goes to the pool); and the same render with the parent's whole budget succeeds.

use std::time::Duration;

use rulebook::render::{
    Observed, ParentBudget, SLICE_FUEL, SLICE_INPUT, SLICE_OUTPUT, Scope, weighs_at_most,
};
use serde_json::{Value as Json, json};

use super::*;

fn parent(spec: Json) -> Json {
    json!({
        "apiVersion": "test.rulebook.dev/v1",
        "kind": "Hostile",
        "metadata": {"name": "h", "namespace": "default", "uid": "u-1"},
        "spec": spec,
    })
}

/// A slice of `rule`'s budget with all the time in the world: only fuel and bytes bound
/// it, so the test does not depend on the machine's speed.
fn slice_of(rule: &CompiledRule) -> (ParentBudget, ParentBudget) {
    let whole = rule.budget();
    let slice = whole.slice(Duration::from_secs(3600), SLICE_OUTPUT, SLICE_FUEL);
    (whole, slice)
}

/// A straight-line template of `n` interpolations: a few instructions each, nothing
/// printed in between but the values (the budget's clock is read every 16th piece; the
/// fuel only after the template).
fn long_template(n: usize) -> String {
    format!("{HEAD}data:\n{}", lines(n))
}

/// `n` lines `  k<i>: {{ parent.spec.v }}`.
fn lines(n: usize) -> String {
    (0..n)
        .map(|i| format!("  k{i}: {{{{ parent.spec.v }}}}\n"))
        .collect()
}

/// Renders `p` within a slice (which must trip, stopped by the slice environment's own
/// fuel) and within the whole budget (which must succeed).
fn trips_on_fuel_then_renders_whole(what: &str, rule: &CompiledRule, p: &Json) {
    assert!(
        rule.can_slice(),
        "{what}: straight-line, so it has its slice environment"
    );
    let (mut whole, mut slice) = slice_of(rule);
    let e = rule
        .render_within(p, &Observed::default(), &|_| Scope::Namespaced, &mut slice)
        .expect_err("the slice must trip");
    // A budget error, so the first attempt is dropped and the work goes to the pool.
    assert!(e.is_budget_exceeded(), "{what}: {e}");
    // Stopped inside the template by the slice environment's fuel. Had the attempt run in
    // the rule's environment (a million per template), the template would have finished
    // and only the budget's check after it would have refused the fuel spent.
    assert!(e.message.contains("ran out of fuel"), "{what}: {e}");
    rule.render_within(p, &Observed::default(), &|_| Scope::Namespaced, &mut whole)
        .unwrap_or_else(|e| panic!("{what}: the whole budget renders it: {e}"));
    assert!(
        whole.fuel_used() > SLICE_FUEL,
        "{what}: {}",
        whole.fuel_used()
    );
}

#[test]
fn a_long_template_stops_at_the_slice_fuel_and_renders_whole_on_the_pool() {
    let rule = load("", &long_template(8_000)).unwrap_or_else(|d| panic!("load failed:\n{d}"));
    trips_on_fuel_then_renders_whole("long template", &rule, &parent(json!({"v": "a"})));
}

#[test]
fn running_out_of_fuel_inside_an_include_is_a_budget_error() {
    // minijinja wraps an error inside an included template (`BadInclude`): the out of
    // fuel underneath must still read as the budget's, or the slice's error would be
    // reported as a template bug instead of the work going to the pool.
    let mut src = sources("", &format!("{HEAD}data:\n{{% include \"long.yaml\" %}}\n"));
    src.templates.insert(
        "long.yaml".to_string(),
        ("templates/long.yaml".to_string(), lines(8_000)),
    );
    let rule = rulebook::render::compile(&src, &rulebook::render::Limits::default())
        .unwrap_or_else(|d| panic!("load failed:\n{d}"))
        .rules["hostile"]
        .clone();
    trips_on_fuel_then_renders_whole("include", &rule, &parent(json!({"v": "a"})));
}

#[test]
fn only_straight_line_rules_get_a_first_attempt() {
    let straight = [
        format!("{HEAD}data:\n  v: {{{{ parent.spec.v ~ \"-x\" | upper }}}}\n"),
        format!(
            "{HEAD}data:\n  v: {{{{ (parent.spec.v | string) if parent.spec.v else \"\" }}}}\n"
        ),
    ];
    for t in &straight {
        let rule = load("", t).unwrap_or_else(|d| panic!("load failed:\n{d}"));
        assert!(rule.can_slice(), "straight-line: {t}");
    }
    // Loops, macros, accumulation, ranges and repetition go to the pool whatever the
    // inputs weigh.
    let not = [
        "{% for i in parent.spec.items %}{% endfor %}",
        "{% macro m(x) %}{{ x }}{% endmacro %}{{ m(1) }}",
        "{% set ns = namespace(a=1) %}{{ ns.a }}",
        "{{ range(parent.spec.n) | length }}",
        "{{ \"-\" * parent.spec.n }}",
        "{{ parent.spec.n ** 2 }}",
        "{% set a = parent.spec.v ~ parent.spec.v %}{{ a }}",
        "{% with a = parent.spec.v %}{{ a }}{% endwith %}",
        // A literal `}}` does not end the tag before its `*`.
        "{{ ('}}' ~ parent.spec.v) * 1000 }}",
    ];
    for body in not {
        let t = format!("{HEAD}data:\n  v: \"{body}\"\n");
        let rule = load("", &t).unwrap_or_else(|d| panic!("load failed ({body}):\n{d}"));
        assert!(!rule.can_slice(), "not straight-line: {body}");
    }
    // The same in an expression, and a status JSONPath that descends.
    let ok = format!("{HEAD}data: {{}}\n");
    for extra in [
        "      includeWhen: \"range(3) | length > 0\"\n",
        "  status:\n    all: \"$..name\"\n",
        "  status:\n    some: \"$.parent.spec.items[?@.a == 1]\"\n",
    ] {
        let rule = load(extra, &ok).unwrap_or_else(|d| panic!("load failed ({extra}):\n{d}"));
        assert!(!rule.can_slice(), "not straight-line: {extra}");
    }
    let rule = load("  status:\n    name: \"$.parent.metadata.name\"\n", &ok)
        .unwrap_or_else(|d| panic!("{d}"));
    assert!(rule.can_slice(), "a plain JSONPath status");
    // Words in comments and plain text do not count.
    let commented = format!("{HEAD}# for each range * 2\ndata: {{# for i in range(9) #}}{{}}\n");
    let rule = load("", &commented).unwrap_or_else(|d| panic!("{d}"));
    assert!(rule.can_slice(), "comments and text: {commented}");
}

#[test]
fn a_small_render_fits_its_slice_and_spends_what_the_whole_would() {
    let template = format!("{HEAD}data:\n  v: {{{{ parent.spec.v }}}}\n");
    let rule = load("", &template).unwrap_or_else(|d| panic!("load failed:\n{d}"));
    let p = parent(json!({"v": "a"}));
    let (mut whole, mut slice) = slice_of(&rule);
    let a = rule
        .render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut slice)
        .unwrap_or_else(|e| panic!("{e}"));
    let b = rule
        .render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut whole)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a, b);
    assert!(slice.exceeded().is_none());
    assert_eq!(slice.fuel_used(), whole.fuel_used());
    assert_eq!(slice.output_used(), whole.output_used());
    assert!(rule.fits_slice(&p, &Observed::default(), []));
}

#[test]
fn output_past_the_slice_trips_it() {
    // 2,000 × 40 bytes: 80 KB of output, more than the slice's 64 KiB (and far less
    // fuel than the slice's).
    let rule = load("", &long_template(2_000)).unwrap_or_else(|d| panic!("load failed:\n{d}"));
    let p = parent(json!({"v": "x".repeat(40)}));
    let (mut whole, mut slice) = slice_of(&rule);
    let e = rule
        .render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut slice)
        .expect_err("the slice must trip");
    assert!(e.is_budget_exceeded(), "{e}");
    assert!(slice.exceeded().is_some());
    rule.render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut whole)
        .unwrap_or_else(|e| panic!("the whole budget renders it: {e}"));
}

#[test]
fn heavy_inputs_never_get_a_first_attempt() {
    let rule = load("", &format!("{HEAD}data: {{}}\n")).unwrap_or_else(|d| panic!("{d}"));
    let light = parent(json!({"v": "a"}));
    assert!(rule.fits_slice(&light, &Observed::default(), []));
    // A big parent.
    let big = parent(json!({"v": "x".repeat(SLICE_INPUT)}));
    assert!(!rule.fits_slice(&big, &Observed::default(), []));
    // A light parent whose live children are big (a tenant can write into them).
    let child = json!({"metadata": {"name": "c", "labels": {"rulebook.dev/child": "probe"}},
                       "data": {"blob": "x".repeat(SLICE_INPUT)}});
    let observed = Observed::from_objects([child.clone()]);
    assert!(!rule.fits_slice(&light, &observed, []));
    // What a status reads besides: the rendered children.
    assert!(!rule.fits_slice(&light, &Observed::default(), [&child]));
    assert!(!weighs_at_most([&light, &child], SLICE_INPUT));
}
