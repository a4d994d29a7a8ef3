//! The first attempt at a render on the async runtime (`render::slice`,
//! `reconcile::offload`): whatever a template does, the attempt stops within the slice's
//! fuel, in the slice environment, and the same render with the parent's whole budget
//! still succeeds.

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

#[test]
fn a_loop_that_prints_nothing_stops_at_the_slice_fuel_and_runs_whole_on_the_pool() {
    // 5,000 iterations of a few instructions each: more than the slice's fuel, far less
    // than a template's. Nothing is printed and no filter called, so nothing but the
    // environment's own fuel can stop it inside the template.
    let template = format!(
        "{HEAD}data:\n  n: {{% for i in range(parent.spec.n) %}}{{% if i < 0 %}}x{{% endif %}}{{% endfor %}}done\n"
    );
    let rule = load("", &template).unwrap_or_else(|d| panic!("load failed:\n{d}"));
    assert!(rule.can_slice(), "the rule has its slice environment");
    let p = parent(json!({"n": 5000}));
    let (mut whole, mut slice) = slice_of(&rule);
    let e = rule
        .render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut slice)
        .expect_err("the slice must trip");
    assert!(e.is_budget_exceeded(), "{e}");
    // The slice environment ran out of its own fuel inside the loop. Had the attempt run
    // in the rule's environment (a million per template), the loop would have finished
    // and only the budget's check after the template would have refused the fuel spent.
    assert!(
        e.message.contains("ran out of fuel"),
        "stopped by the slice environment's fuel, inside the loop: {e}"
    );
    let children = rule
        .render_within(&p, &Observed::default(), &|_| Scope::Namespaced, &mut whole)
        .unwrap_or_else(|e| panic!("the whole budget renders it: {e}"));
    assert_eq!(children[0].object["data"]["n"], "done");
    assert!(whole.fuel_used() > SLICE_FUEL, "{}", whole.fuel_used());
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
    let template = format!("{HEAD}data:\n  v: {{{{ parent.spec.v * 2000 }}}}\n");
    let rule = load("", &template).unwrap_or_else(|d| panic!("load failed:\n{d}"));
    // 2,000 × 40 bytes: 80 KB of output, more than the slice's 64 KiB.
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
