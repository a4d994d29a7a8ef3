//! Checks of the benchmark's arithmetic: the run order, the medians and ranges of the
//! runs, the memory slope, and the tables made of them, old results included.
//!
//! The e2e bench has no libtest harness (`harness = false`: its `main` is the driver), so
//! `#[test]` functions in it would never be compiled as tests nor run. `main` runs
//! [`all`] first instead, under `cargo bench` (a broken report fails before an hour of
//! benchmark) and under `cargo test --bench e2e`, where it is all the target does.

use serde_json::json;

use crate::report;
use crate::runs::{aggregate, combine, fit, median, memory_points, order, recombine};

/// Every check; the failures, joined.
pub fn all() -> Result<(), String> {
    let failed: Vec<String> = [runs(), report()]
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// The medians and ranges, the order, the slope and both layouts of the memory workload.
fn runs() -> Result<(), String> {
    let mut failed = Vec::new();
    let mut check = |ok: bool, what: &str| {
        if !ok {
            failed.push(what.to_string());
        }
    };

    // Alternating order, a contender named twice running twice per round.
    let o = order(&["a", "b", "c"], 3);
    let want = [
        (1, "a"),
        (1, "b"),
        (1, "c"),
        (2, "c"),
        (2, "b"),
        (2, "a"),
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ];
    check(o == want, "order: as given, reversed, as given");
    check(
        order(&["r", "x", "r"], 2)
            .iter()
            .filter(|(_, k)| *k == "r")
            .count()
            == 4,
        "order: a contender named twice runs twice per round",
    );
    check(order(&["a"], 0).is_empty(), "order: no rounds");

    check(median(&[3.0, 1.0, 2.0]) == Some(2.0), "median of three");
    check(median(&[4.0, 1.0, 2.0, 3.0]) == Some(2.5), "median of four");
    check(median(&[]).is_none(), "median of none");

    // Median and range of trees.
    let a = json!({"t": "A", "x": 1, "y": 1.5, "o": {"z": 10, "b": false}, "l": [1], "only": 7});
    let b = json!({"t": "B", "x": 5, "y": null, "o": {"z": 30, "b": true}, "l": [2]});
    let c = json!({"t": "C", "x": 2, "y": 2.5, "o": {"z": 20, "b": false}, "l": [3]});
    let g = aggregate(&[&a, &b, &c]);
    check(
        g.median["x"] == json!(2),
        "aggregate: integer median stays an integer",
    );
    check(
        g.median["y"] == json!(2.0),
        "aggregate: null left out, median of two",
    );
    check(g.median["o"]["z"] == json!(20), "aggregate: nested median");
    check(
        g.median["o"]["b"] == json!(true),
        "aggregate: a boolean true in any run",
    );
    check(
        g.median["t"] == json!("A") && g.median["l"] == json!([1]),
        "aggregate: first's text",
    );
    check(
        g.median["only"] == json!(7),
        "aggregate: a key only one run has",
    );
    check(
        g.min["x"] == json!(1) && g.max["x"] == json!(5),
        "aggregate: range",
    );
    check(
        g.min["o"]["z"] == json!(10) && g.max["o"]["z"] == json!(30),
        "aggregate: nested range",
    );
    check(
        g.min.get("t").is_none(),
        "aggregate: no text in the range trees",
    );
    let h = aggregate(&[&json!({"x": 1}), &json!({"x": 2})]);
    check(
        h.median["x"] == json!(1.5),
        "aggregate: a half stays a float",
    );

    // One contender's runs: round 2's converge timed out, round 3 failed outright.
    let phase = |secs: f64, ok: bool, rss: f64| {
        json!({"seconds": secs, "converged": ok, "rss_mib": rss,
               "timeline": [[0.0, 0], [secs, if ok { 10 } else { 5 }]]})
    };
    let runs = vec![
        json!({"title": "R", "round": 1, "converge": phase(3.0, true, 20.0),
               "steady": {"converged": null, "cpu_seconds": 1.0},
               "scale": {"1000": {"seconds": 9.0, "converged": true, "rss_mib": 30.0,
                                  "idle_rss_mib": 10.0, "parents": 1000}}}),
        json!({"title": "R", "round": 2, "converge": phase(99.0, false, 50.0),
               "scale": {"1000": {"seconds": 11.0, "converged": true, "rss_mib": 34.0,
                                  "idle_rss_mib": 10.0, "parents": 1000}}}),
        json!({"title": "R", "round": 3, "error": "boom", "scale_errors": {"3000": "gone"}}),
        json!({"title": "R", "round": 4, "converge": phase(4.0, true, 22.0)}),
        json!({"title": "R", "round": 5, "converge": phase(5.0, true, 24.0),
               "steady": {"converged": null, "cpu_seconds": 3.0}}),
    ];
    let cm = combine("R", &runs, 10.0);
    let m = &cm.median;
    check(
        m["converge"]["seconds"] == json!(4.0),
        "combine: timed-out phase left out",
    );
    check(
        m["converge"]["converged"] == json!(true),
        "combine: finished",
    );
    check(
        m["converge"]["runs_in_median"] == json!(3),
        "combine: runs in the median",
    );
    check(
        m["converge"]["timeline_round"] == json!(4),
        "combine: timeline of the median run",
    );
    check(
        m["converge"]["seconds_to_99"] == json!(4.0),
        "combine: time to 99 % per run",
    );
    check(
        cm.max["converge"]["rss_mib"] == json!(24.0),
        "combine: range without the left out",
    );
    check(
        m["steady"]["cpu_seconds"] == json!(2.0),
        "combine: steady kept",
    );
    check(
        m["scale"]["1000"]["rss_mib"] == json!(32.0),
        "combine: scale median",
    );
    check(
        m["scale_errors"]["3000"] == json!("gone"),
        "combine: size no run finished",
    );
    check(
        m.get("error").is_none(),
        "combine: an error of one run is not the contender's",
    );
    check(
        m["runs"] == json!(5) && m.get("round").is_none(),
        "combine: run count, no round",
    );
    check(
        cm.notes
            .iter()
            .any(|n| n.contains("round 2: converge timed out"))
            && cm
                .notes
                .iter()
                .any(|n| n.contains("round 3: failed (boom)"))
            && cm
                .notes
                .iter()
                .any(|n| n.contains("round 3: memory at 3000")),
        "combine: notes",
    );
    let all_out = combine("R", &runs[1..2], 10.0);
    check(
        all_out.median["converge"]["converged"] == json!(false)
            && all_out.median["converge"]["seconds"] == json!(99.0)
            && all_out.notes.is_empty(),
        "combine: a phase that timed out in every run is kept",
    );
    let errs = combine(
        "R",
        &[
            json!({"round": 1, "error": "x"}),
            json!({"round": 2, "error": "y"}),
        ],
        1.0,
    );
    check(
        errs.median["error"] == json!("x"),
        "combine: every run failed",
    );

    // The slope.
    let (s, i) = fit(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]).unwrap_or_default();
    check(
        (s - 2.0).abs() < 1e-9 && (i - 1.0).abs() < 1e-9,
        "fit: exact line",
    );
    let (s, _) = fit(&[(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]).unwrap_or_default();
    check((s - 0.5).abs() < 1e-9, "fit: least squares");
    check(fit(&[(1.0, 1.0)]).is_none(), "fit: one point");
    check(fit(&[(1.0, 1.0), (1.0, 2.0)]).is_none(), "fit: one x");
    check(fit(&[]).is_none(), "fit: no point");

    // Both layouts of the memory workload.
    let old = json!({"scale": {"parents": 3000, "rss_mib": 50.0, "idle_rss_mib": 20.0}});
    check(
        memory_points(&old, None) == vec![(12000.0, 30.0)],
        "memory: old layout",
    );
    let old = json!({"scale": {"rss_mib": 50.0, "idle_rss_mib": 20.0}});
    check(
        memory_points(&old, Some(10)) == vec![(40.0, 30.0)],
        "memory: old layout, config n",
    );
    let new = json!({"scale": {"10000": {"rss_mib": 60.0, "idle_rss_mib": 20.0},
                               "1000": {"rss_mib": 24.0, "idle_rss_mib": 20.0},
                               "3000": {"rss_mib": 99.0, "idle_rss_mib": 20.0, "converged": false}}});
    check(
        memory_points(&new, None) == vec![(4000.0, 4.0), (40000.0, 40.0)],
        "memory: new layout, sorted, timed out left out",
    );
    check(
        memory_points(&json!({}), Some(5)).is_empty(),
        "memory: none",
    );

    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// The tables: the ranges, the ratios of medians, a run left out, one column per
/// contender named twice, and results written before the repeats.
fn report() -> Result<(), String> {
    let run = |title: &str, round: u64, secs: f64, ok: bool| {
        let mem = |parents: u64, rss: f64| json!({"parents": parents, "rss_mib": rss, "idle_rss_mib": 10.0, "converged": true});
        json!({"title": title, "round": round, "seq": round,
               "converge": {"seconds": secs, "converged": ok, "timeline": [[0.0, 0], [secs, 10]]},
               "scale": {"1000": mem(1000, 20.0 + secs), "3000": mem(3000, 40.0 + secs)}})
    };
    let mut r = json!({"config": {"n": 10, "contenders": ["rulebook", "reference", "rulebook"],
                                  "repeats": 3, "scale_n": [1000, 3000]}});
    let all = [
        (
            "rulebook",
            [
                run("RB", 1, 2.0, true),
                run("RB", 2, 4.0, true),
                run("RB", 3, 50.0, false),
            ],
        ),
        (
            "reference",
            [
                run("REF", 1, 1.0, true),
                run("REF", 2, 1.0, true),
                run("REF", 3, 3.0, true),
            ],
        ),
    ];
    for (name, runs) in &all {
        r["runs"][*name] = json!(runs);
    }
    let notes = recombine(&mut r);
    let md = report::markdown(&r);
    let mut failed = Vec::new();
    if notes != ["RB, round 3 (run 3): converge timed out; left out of the median"] {
        failed.push(format!("recombine: notes {notes:?}"));
    }
    for want in [
        "| workload | metric | RB | REF | RB ÷ reference |",
        "| converge (10) | time (s) | 3.00 (2.00–4.00) | 1.00 (1.00–3.00) | 3.00× |",
        "| converge (10) | runs in the median | **2 of 3**⁵ | 3 | |",
        "| 1000 parents (4000 objects) | RSS after converging (MiB) | 24.0 (22.0–70.0) | 21.0 (21.0–23.0) | 1.14× |",
        "| fit over the sizes⁶ | MiB per 1,000 managed objects | 2.50 | 2.50 | 1.00× |",
        "| 3 | 3 | rulebook |  | converge timed out |",
        "(RB 3, REF 3)",
    ] {
        if !md.contains(want) {
            failed.push(format!("markdown lacks `{want}`"));
        }
    }
    let old = json!({"config": {"n": 10, "contenders": ["rulebook"], "scale_n": 3000},
                     "contenders": {"rulebook": {"title": "RB",
                        "converge": {"seconds": 2.0, "converged": true},
                        "scale": {"parents": 3000, "rss_mib": 50.0, "idle_rss_mib": 20.0,
                                  "converged": true}}}});
    let md = report::markdown(&old);
    for want in [
        "| converge (10) | time (s) | 2.00 |",
        "| 3000 parents (12000 objects) | RSS after converging (MiB) | 50.0 |",
        "memory at 3000 parents",
    ] {
        if !md.contains(want) {
            failed.push(format!("markdown of old results lacks `{want}`"));
        }
    }
    if md.contains("runs in the median") || md.contains("## Runs") {
        failed.push("markdown of old results speaks of runs".into());
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}
