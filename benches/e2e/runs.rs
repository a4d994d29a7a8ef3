//! Repeated runs and the memory curve, as plain functions on the results' JSON.
//!
//! One run of a workload on a shared machine moves by tens of percent from the next, and
//! whoever runs first meets a different machine (caches, load) than whoever runs last. So
//! the driver runs the contender list several times, reversing it every other round
//! ([`order`]), keeps every run, and the tables give the median of each figure with its
//! range ([`combine`]), a run that failed left out. Memory is measured at several sizes so
//! that the cost per managed object is a fitted slope ([`fit`], [`memory_points`]) rather
//! than one point.
//!
//! Checked by `checks.rs` (`cargo test --bench e2e`).

use serde_json::{Map, Value as Json, json};

/// The phases of the workloads run (one controller process); each one is left out of the
/// median on its own when it timed out.
pub const PHASES: [&str; 4] = ["converge", "update", "steady", "template"];

/// Managed objects per parent: the parent and its three children.
pub const OBJECTS_PER_PARENT: f64 = 4.0;

/// The runs in order, with their round (from 1): round 1 the list as given, round 2
/// reversed, round 3 as given, … A contender named twice runs twice per round.
pub fn order<T: Clone>(list: &[T], repeats: usize) -> Vec<(usize, T)> {
    (1..=repeats)
        .flat_map(|round| {
            let mut l = list.to_vec();
            if round % 2 == 0 {
                l.reverse();
            }
            l.into_iter().map(move |x| (round, x))
        })
        .collect()
}

pub fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// The median, minimum and maximum trees of several JSON trees.
pub struct Agg {
    pub median: Json,
    /// Only the numeric leaves (and the objects holding them).
    pub min: Json,
    pub max: Json,
}

/// A number, an integer when every input was one and the value is whole.
fn number(x: f64, ints: bool) -> Json {
    if ints && x.fract() == 0.0 && x.abs() < 9.0e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// Merges trees leaf by leaf, over the union of their keys: numbers give their median
/// (and minimum and maximum), booleans are true when any is (a control plane restarted in
/// any run), objects merge recursively, anything else (text, arrays, mixed types) comes
/// from the first tree that has it. Nulls and missing keys are left out.
pub fn aggregate(trees: &[&Json]) -> Agg {
    let (median, min, max) = merge(trees);
    Agg {
        median,
        min: min.unwrap_or_else(|| json!({})),
        max: max.unwrap_or_else(|| json!({})),
    }
}

fn merge(values: &[&Json]) -> (Json, Option<Json>, Option<Json>) {
    let values: Vec<&Json> = values.iter().copied().filter(|v| !v.is_null()).collect();
    let Some(first) = values.first() else {
        return (Json::Null, None, None);
    };
    if values.iter().all(|v| v.is_number()) {
        let xs: Vec<f64> = values.iter().filter_map(|v| v.as_f64()).collect();
        let ints = values.iter().all(|v| v.is_i64() || v.is_u64());
        let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        return match median(&xs) {
            Some(m) => (
                number(m, ints),
                Some(number(lo, ints)),
                Some(number(hi, ints)),
            ),
            None => ((*first).clone(), None, None),
        };
    }
    if values.iter().all(|v| v.is_boolean()) {
        return (
            json!(values.iter().any(|v| v.as_bool() == Some(true))),
            None,
            None,
        );
    }
    if values.iter().all(|v| v.is_object()) {
        let mut keys: Vec<&String> = Vec::new();
        for v in &values {
            for k in v.as_object().into_iter().flatten().map(|(k, _)| k) {
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        let (mut med, mut lo, mut hi) = (Map::new(), Map::new(), Map::new());
        for k in keys {
            let children: Vec<&Json> = values.iter().filter_map(|v| v.get(k)).collect();
            let (m, l, h) = merge(&children);
            med.insert(k.clone(), m);
            if let Some(l) = l {
                lo.insert(k.clone(), l);
            }
            if let Some(h) = h {
                hi.insert(k.clone(), h);
            }
        }
        let some = |m: Map<String, Json>| (!m.is_empty()).then_some(Json::Object(m));
        return (Json::Object(med), some(lo), some(hi));
    }
    ((*first).clone(), None, None)
}

/// The phases of one run as JSON pointers: `/converge`, …, and `/scale/<parents>`.
fn sections(run: &Json) -> Vec<String> {
    let mut out: Vec<String> = PHASES
        .iter()
        .filter(|p| run[**p].is_object())
        .map(|p| format!("/{p}"))
        .collect();
    for (size, phase) in run["scale"].as_object().into_iter().flatten() {
        if size.parse::<u64>().is_ok() && phase.is_object() {
            out.push(format!("/scale/{size}"));
        }
    }
    out
}

fn section_name(s: &str) -> String {
    match s.strip_prefix("/scale/") {
        Some(size) => format!("memory at {size} parents"),
        None => s.trim_start_matches('/').to_string(),
    }
}

/// The first time at which a timeline (`[[seconds, count], …]`) reached 99 % of `target`.
pub fn time_to_99(timeline: &Json, target: f64) -> Option<f64> {
    let want = (target * 0.99).ceil();
    timeline
        .as_array()?
        .iter()
        .find(|p| p[1].as_f64().is_some_and(|c| c >= want))
        .and_then(|p| p[0].as_f64())
}

/// One contender's figures over its runs.
pub struct Combined {
    pub median: Json,
    pub min: Json,
    pub max: Json,
    /// What was left out of the medians, and why.
    pub notes: Vec<String>,
}

/// The median and range of one contender's runs (each with its `round`). A phase that
/// timed out in some runs is left out of the median of that phase (kept when it timed
/// out in every run, so that the table says so), as is a run that failed with an error.
/// Each phase of the median says of how many runs it is (`runs_in_median`,
/// `rounds_in_median`) and carries the timeline of the run whose time was nearest the
/// median (`timeline_round`). `n`: the parents of the workloads (the target of their
/// timelines).
pub fn combine(title: &str, runs: &[Json], n: f64) -> Combined {
    let round = |i: usize| runs[i]["round"].as_u64().unwrap_or(i as u64 + 1);
    // `round 2 (run 5)`: a contender named twice runs twice in a round.
    let which = |i: usize| match runs[i]["seq"].as_u64() {
        Some(seq) => format!("round {} (run {seq})", round(i)),
        None => format!("round {}", round(i)),
    };
    let mut notes = Vec::new();
    let mut pruned: Vec<Json> = runs.to_vec();
    for p in &mut pruned {
        if let Some(o) = p.as_object_mut() {
            for k in ["round", "seq", "loadavg_start", "error", "scale_errors"] {
                o.remove(k);
            }
        }
    }
    let mut all: Vec<String> = Vec::new();
    for s in runs.iter().flat_map(sections) {
        if !all.contains(&s) {
            all.push(s);
        }
    }
    let mut used_by_section = Vec::new();
    for s in &all {
        let present: Vec<usize> = (0..runs.len())
            .filter(|&i| runs[i].pointer(s).is_some_and(Json::is_object))
            .collect();
        let ok: Vec<usize> = present
            .iter()
            .copied()
            .filter(|&i| runs[i].pointer(&format!("{s}/converged")) != Some(&json!(false)))
            .collect();
        let used = if ok.is_empty() { present.clone() } else { ok };
        for &i in &present {
            if !used.contains(&i) {
                notes.push(format!(
                    "{title}, {}: {} timed out; left out of the median",
                    which(i),
                    section_name(s)
                ));
                let (parent, key) = s.rsplit_once('/').unwrap_or(("", s));
                if let Some(o) = pruned[i].pointer_mut(parent).and_then(Json::as_object_mut) {
                    o.remove(key);
                }
            }
        }
        // The time to 99 % of the target, per run, so that it has a median and a range.
        for &i in &used {
            let Some(phase) = runs[i].pointer(s) else {
                continue;
            };
            let target = phase["parents"]
                .as_f64()
                .or(phase["children"].as_f64())
                .unwrap_or(n);
            if let Some(t) = time_to_99(&phase["timeline"], target)
                && let Some(p) = pruned[i].pointer_mut(s)
                && p.get("seconds_to_99").is_none()
            {
                p["seconds_to_99"] = json!(t);
            }
        }
        used_by_section.push(used);
    }
    for (i, r) in runs.iter().enumerate() {
        if let Some(e) = r["error"].as_str() {
            notes.push(format!(
                "{title}, {}: failed ({e}); left out of the median",
                which(i)
            ));
        }
        for (size, e) in r["scale_errors"].as_object().into_iter().flatten() {
            notes.push(format!(
                "{title}, {}: memory at {size} parents failed ({}); left out of the median",
                which(i),
                e.as_str().unwrap_or_default()
            ));
        }
    }
    let agg = aggregate(&pruned.iter().collect::<Vec<_>>());
    let mut median = agg.median;
    for (s, used) in all.iter().zip(&used_by_section) {
        let Some(node) = median.pointer_mut(s) else {
            continue;
        };
        node["runs_in_median"] = json!(used.len());
        node["rounds_in_median"] = json!(used.iter().map(|&i| round(i)).collect::<Vec<_>>());
        // The timeline of the run whose time is nearest the median (the earlier on a tie).
        if let Some(m) = node["seconds"].as_f64() {
            let nearest = used
                .iter()
                .copied()
                .filter(|&i| runs[i].pointer(&format!("{s}/timeline")).is_some())
                .min_by(|&a, &b| {
                    let d = |i: usize| {
                        (runs[i]
                            .pointer(&format!("{s}/seconds"))
                            .and_then(Json::as_f64))
                        .map_or(f64::INFINITY, |x| (x - m).abs())
                    };
                    d(a).total_cmp(&d(b))
                });
            if let Some(i) = nearest {
                node["timeline"] = runs[i].pointer(&format!("{s}/timeline")).cloned().into();
                node["timeline_round"] = json!(round(i));
            }
        }
    }
    median["runs"] = json!(runs.len());
    median["rounds"] = json!((0..runs.len()).map(round).collect::<Vec<_>>());
    // Failures shown as the contender's own only when no run got past them.
    if let Some(e) = runs.iter().find_map(|r| r["error"].as_str())
        && runs.iter().all(|r| r["error"].is_string())
    {
        median["error"] = json!(e);
    }
    for r in runs {
        for (size, e) in r["scale_errors"].as_object().into_iter().flatten() {
            if median["scale"].get(size).is_none() && median["scale_errors"].get(size).is_none() {
                median["scale_errors"][size] = e.clone();
            }
        }
    }
    Combined {
        median,
        min: agg.min,
        max: agg.max,
        notes,
    }
}

/// Sets each contender's median (`contenders`) and range (`spread`) from its runs
/// (`runs`); the notes of what was left out. The driver calls it once the runs are done,
/// and a re-rendering (`BENCH_REPORT_ONLY`) again, so that runs merged or edited by hand
/// count.
pub fn recombine(results: &mut Json) -> Vec<String> {
    let n = results["config"]["n"].as_f64().unwrap_or(0.0);
    let mut notes = Vec::new();
    let all = results["runs"].as_object().cloned().unwrap_or_default();
    for (name, runs) in &all {
        let Some(runs) = runs.as_array().filter(|r| !r.is_empty()) else {
            continue;
        };
        let c = combine(runs[0]["title"].as_str().unwrap_or(name), runs, n);
        results["contenders"][name] = c.median;
        results["spread"][name] = json!({"min": c.min, "max": c.max});
        notes.extend(c.notes);
    }
    notes
}

/// Least-squares line through the points: (slope, intercept); none with fewer than two
/// distinct x.
pub fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let k = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / k;
    let my = points.iter().map(|p| p.1).sum::<f64>() / k;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if points.len() < 2 || sxx <= 0.0 || !sxx.is_finite() {
        return None;
    }
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// A contender's memory-at-scale phases by parents, smallest first: `{"scale": {"1000":
/// phase, …}}`, or the single phase of results written before the memory curve
/// (`{"scale": phase}`, its parents from the phase, else `old_n`).
pub fn scale_phases(c: &Json, old_n: Option<u64>) -> Vec<(u64, &Json)> {
    let s = &c["scale"];
    if s.get("rss_mib").is_some() || s.get("parents").is_some_and(Json::is_number) {
        return s["parents"]
            .as_u64()
            .or(s["parents"].as_f64().map(|x| x as u64))
            .or(old_n)
            .map(|p| vec![(p, s)])
            .unwrap_or_default();
    }
    let mut out: Vec<(u64, &Json)> = s
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
        .collect();
    out.sort_by_key(|p| p.0);
    out
}

/// (managed objects, RSS after converging − idle RSS in MiB) of the sizes that converged.
pub fn memory_points(c: &Json, old_n: Option<u64>) -> Vec<(f64, f64)> {
    scale_phases(c, old_n)
        .into_iter()
        .filter(|(_, p)| p["converged"] != json!(false))
        .filter_map(|(parents, p)| {
            Some((
                parents as f64 * OBJECTS_PER_PARENT,
                p["rss_mib"].as_f64()? - p["idle_rss_mib"].as_f64()?,
            ))
        })
        .collect()
}
