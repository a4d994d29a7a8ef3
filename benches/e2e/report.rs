//! `results.md`: the Markdown tables. A contender that ran more than once shows the
//! median of its runs with their range, `median (min–max)`, and its ratios are ratios of
//! medians (the medians and ranges come from `runs::combine`), so that one lucky or
//! unlucky run cannot make a ratio. Results written before the driver repeated runs (no
//! `runs`, one memory size) render as they did. The SVG plots are in `plot.rs`.

use serde_json::Value as Json;

use crate::runs;

fn f(v: &Json) -> Option<f64> {
    v.as_f64()
}

fn num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// `median (min–max)`, or one number when there is no range or it is a single value.
fn cell(v: Option<f64>, range: Option<(f64, f64)>) -> String {
    let Some(v) = v else {
        return "–".into();
    };
    match range.map(|(lo, hi)| (num(lo), num(hi))) {
        Some((lo, hi)) if lo != hi => format!("{} ({lo}–{hi})", num(v)),
        _ => num(v),
    }
}

fn ratio(x: Option<f64>, base: Option<f64>) -> String {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!("{:.2}×", x / b),
        (Some(x), Some(b)) if b == 0.0 && x == 0.0 => "=".into(),
        _ => "–".into(),
    }
}

/// `apply 3000, apply_status 2000`.
fn verbs(v: &Json) -> String {
    match v.as_object() {
        Some(m) if !m.is_empty() => m
            .iter()
            .map(|(k, n)| format!("{k} {}", num(n.as_f64().unwrap_or(0.0))))
            .collect::<Vec<_>>()
            .join(", "),
        Some(_) => "0".into(),
        None => "–".into(),
    }
}

/// The best API server rate of the sweep, objects per second.
pub fn best_rate(r: &Json) -> Option<f64> {
    r["api_limit"]
        .as_array()?
        .iter()
        .filter_map(|p| p["objects_per_second"].as_f64())
        .fold(None, |m, x| Some(m.map_or(x, |m: f64| m.max(x))))
}

/// The contenders in the configured order, each once (a contender may be named twice).
pub fn contender_names(r: &Json) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for v in r["config"]["contenders"].as_array().into_iter().flatten() {
        if let Some(n) = v.as_str()
            && !names.iter().any(|m| m == n)
        {
            names.push(n.to_string());
        }
    }
    names
}

/// How many runs a contender's figures are the median of (1 in older results).
pub fn runs_of(r: &Json, name: &str) -> u64 {
    r["contenders"][name]["runs"].as_u64().unwrap_or(1)
}

/// A contender's figure and its range over the runs.
type Cell = (Option<f64>, Option<(f64, f64)>);

struct Table {
    names: Vec<String>,
    titles: Vec<String>,
    reference: Option<usize>,
    rows: Vec<String>,
}

impl Table {
    fn new(r: &Json) -> Table {
        let names = contender_names(r);
        let titles = names
            .iter()
            .map(|n| {
                r["contenders"][n]["title"]
                    .as_str()
                    .unwrap_or(n.as_str())
                    .to_string()
            })
            .collect();
        let reference = names.iter().position(|n| n == "reference");
        Table {
            names,
            titles,
            reference,
            rows: Vec::new(),
        }
    }

    fn header(&self) -> String {
        let mut h = String::from("| workload | metric |");
        let mut sep = String::from("|---|---|");
        for t in &self.titles {
            h.push_str(&format!(" {t} |"));
            sep.push_str("---:|");
        }
        if let Some(ri) = self.reference {
            for (i, t) in self.titles.iter().enumerate() {
                if i != ri {
                    h.push_str(&format!(" {t} ÷ reference |"));
                    sep.push_str("---:|");
                }
            }
        }
        format!("{h}\n{sep}\n")
    }

    /// A row of numbers read by `get` from each contender's results (the medians), with
    /// their ranges (`get` on the minimum and maximum trees) and the ratios of medians.
    fn numbers(
        &mut self,
        r: &Json,
        workload: &str,
        metric: &str,
        get: impl Fn(&Json) -> Option<f64>,
    ) {
        let cells = self
            .names
            .iter()
            .map(|n| {
                let range = (runs_of(r, n) > 1)
                    .then(|| Some((get(&r["spread"][n]["min"])?, get(&r["spread"][n]["max"])?)))
                    .flatten();
                (get(&r["contenders"][n]), range)
            })
            .collect();
        self.push_numbers(workload, metric, cells);
    }

    /// A row of (median, range) per contender, with the ratios of medians.
    fn push_numbers(&mut self, workload: &str, metric: &str, cells: Vec<Cell>) {
        let vals: Vec<Option<f64>> = cells.iter().map(|c| c.0).collect();
        if vals.iter().all(Option::is_none) {
            return;
        }
        let mut row = format!("| {workload} | {metric} |");
        for (v, range) in &cells {
            row.push_str(&format!(" {} |", cell(*v, *range)));
        }
        if let Some(ri) = self.reference {
            for (i, v) in vals.iter().enumerate() {
                if i != ri {
                    row.push_str(&format!(" {} |", ratio(*v, vals[ri])));
                }
            }
        }
        self.rows.push(row);
    }

    /// A row of text read by `get` (no ratios).
    fn text(
        &mut self,
        r: &Json,
        workload: &str,
        metric: &str,
        get: impl Fn(&Json) -> Option<String>,
    ) {
        let vals: Vec<Option<String>> = self
            .names
            .iter()
            .map(|n| get(&r["contenders"][n]))
            .collect();
        if vals.iter().all(Option::is_none) {
            return;
        }
        let mut row = format!("| {workload} | {metric} |");
        for v in &vals {
            row.push_str(&format!(" {} |", v.clone().unwrap_or_else(|| "–".into())));
        }
        if let Some(ri) = self.reference {
            for i in 0..vals.len() {
                if i != ri {
                    row.push_str(" |");
                }
            }
        }
        self.rows.push(row);
    }

    fn render(&self) -> String {
        let mut s = self.header();
        for r in &self.rows {
            s.push_str(r);
            s.push('\n');
        }
        s
    }
}

/// The first time at which the phase reached 99 % of its target (N parents; for the
/// template change, N parents at the new rule version with their ConfigMap changed): per
/// run in the driver's medians (`seconds_to_99`), else from the phase's timeline.
fn quantile_time(phase: &Json, r: &Json) -> Option<f64> {
    if let Some(t) = phase["seconds_to_99"].as_f64() {
        return Some(t);
    }
    let n = phase["children"]
        .as_f64()
        .or_else(|| r["config"]["n"].as_f64())?;
    runs::time_to_99(&phase["timeline"], n)
}

/// `3` when the phase's median is of every run, `2 of 3` when some were left out.
fn runs_text(c: &Json, phase: &Json) -> Option<String> {
    let used = phase["runs_in_median"].as_u64()?;
    let all = c["runs"].as_u64().unwrap_or(used);
    Some(if used == all {
        used.to_string()
    } else {
        format!("**{used} of {all}**⁵")
    })
}

fn finished(phase: &Json) -> Option<String> {
    phase["converged"].as_bool().map(|b| {
        if b {
            "yes".into()
        } else {
            "**timed out**".into()
        }
    })
}

fn restarted(phase: &Json) -> Option<String> {
    phase["control_plane_restarted"]
        .as_bool()
        .filter(|b| *b)
        .map(|_| "**yes: figures disturbed**".into())
}

/// Whether any contender ran more than once (then the tables say of how many runs).
fn repeated(r: &Json) -> bool {
    contender_names(r).iter().any(|n| runs_of(r, n) > 1)
}

/// `floor`: seconds the API server needs for the children the workload must write.
fn phase_rows(t: &mut Table, r: &Json, key: &str, label: &str, floor: Option<f64>, timed: bool) {
    if timed {
        t.numbers(r, label, "time (s)", |c| f(&c[key]["seconds"]));
        if let Some(fl) = floor {
            t.numbers(r, label, "× API server floor³", |c| {
                f(&c[key]["seconds"]).map(|s| s / fl)
            });
        }
        t.numbers(r, label, "time to 99 % of parents (s)", |c| {
            c.get(key).and_then(|p| quantile_time(p, r))
        });
        t.text(r, label, "finished", |c| finished(&c[key]));
    }
    if repeated(r) {
        t.text(r, label, "runs in the median", |c| runs_text(c, &c[key]));
    }
    t.text(r, label, "control plane restarted by another run", |c| {
        restarted(&c[key])
    });
    t.numbers(r, label, "writes, audit log⁴", |c| {
        f(&c[key]["audit_writes_total"])
    });
    t.text(r, label, "… by verb (audit)", |c| {
        c.get(key)
            .filter(|p| p.get("audit_writes").is_some())
            .map(|p| verbs(&p["audit_writes"]))
    });
    t.text(
        r,
        label,
        "… others writing in the namespace (audit)",
        |c| {
            c.get(key)
                .filter(|p| p.get("audit_others_in_namespace").is_some())
                .map(|p| verbs(&p["audit_others_in_namespace"]))
        },
    );
    t.numbers(r, label, "writes, controller's count", |c| {
        f(&c[key]["writes_total"])
    });
    t.text(r, label, "… by verb", |c| {
        c.get(key).map(|p| verbs(&p["writes"]))
    });
    t.numbers(r, label, "writes, API server's count¹", |c| {
        f(&c[key]["apiserver_writes_total"])
    });
    t.numbers(r, label, "reconciles", |c| f(&c[key]["reconciles"]));
    t.numbers(r, label, "controller CPU (s)", |c| {
        f(&c[key]["cpu_seconds"])
    });
    t.numbers(r, label, "controller RSS at end (MiB)", |c| {
        f(&c[key]["rss_mib"])
    });
    t.numbers(r, label, "controller peak RSS (MiB)", |c| {
        f(&c[key]["hwm_mib"])
    });
    t.numbers(r, label, "API server CPU (s)", |c| {
        f(&c[key]["apiserver_cpu_seconds"])
    });
    t.numbers(r, label, "etcd CPU (s)", |c| f(&c[key]["etcd_cpu_seconds"]));
    t.numbers(r, label, "other processes' CPU (s)²", |c| {
        f(&c[key]["other_cpu_seconds"])
    });
}

pub fn markdown(r: &Json) -> String {
    let mut s = String::new();
    let cfg = &r["config"];
    let n = cfg["n"].as_u64().unwrap_or(0);
    s.push_str("# Rulebook benchmark results\n\n");
    let m = &r["machine"];
    s.push_str(&format!(
        "- machine: {} CPUs ({}), {} GiB memory, Linux {}\n",
        m["nproc"],
        m["cpu_model"].as_str().unwrap_or(""),
        m["memory_gib"],
        m["kernel"].as_str().unwrap_or("")
    ));
    s.push_str(&format!(
        "- Kubernetes {} (local control plane), Rulebook {}\n",
        r["kubernetes"].as_str().unwrap_or("?"),
        r["rulebook"].as_str().unwrap_or("?")
    ));
    s.push_str(&format!(
        "- run: {} → {}; load average at start {}, at end {}\n",
        r["started"].as_str().unwrap_or(""),
        r["finished"].as_str().unwrap_or(""),
        r["loadavg"]["start"].as_str().unwrap_or(""),
        r["loadavg"]["end"].as_str().unwrap_or("")
    ));
    // `scale_n`: a list since the memory curve, one number before.
    let sizes: Vec<String> = match &cfg["scale_n"] {
        Json::Array(a) => a.iter().map(|v| v.to_string()).collect(),
        v if v.as_u64().is_some_and(|m| m > 0) => vec![v.to_string()],
        _ => Vec::new(),
    };
    let memory = if sizes.is_empty() {
        "no memory run".to_string()
    } else {
        format!("memory at {} parents", sizes.join(", "))
    };
    s.push_str(&format!(
        "- sizes: N = {n} parents (3N = {} children), {memory}, steady window {} s; \
         every controller runs {} concurrent reconciles; the driver creates/updates parents {} at a time\n",
        3 * n,
        cfg["steady_seconds"],
        cfg["concurrency"],
        cfg["driver_concurrency"]
    ));
    s.push_str(&runs_line(r));
    s.push('\n');

    let floor = best_rate(r).map(|rate| 3.0 * n as f64 / rate);
    if let Some(points) = r["api_limit"].as_array() {
        s.push_str("## API server limit\n\nA plain client server-side applying the same 3N objects (ConfigMap, Service, Secret) as fast as it can.\n\n");
        s.push_str("| concurrency | objects | time (s) | objects/s | API server CPU (s) |\n|---:|---:|---:|---:|---:|\n");
        for p in points {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                p["concurrency"],
                p["objects"],
                num(p["seconds"].as_f64().unwrap_or(0.0)),
                num(p["objects_per_second"].as_f64().unwrap_or(0.0)),
                num(p["apiserver_cpu_seconds"].as_f64().unwrap_or(0.0)),
            ));
        }
        if let Some(fl) = floor {
            s.push_str(&format!(
                "\nFloor: 3N objects at the best rate = **{} s** (children only; status writes come on top).\n\n",
                num(fl)
            ));
        }
    }

    let mut t = Table::new(r);
    phase_rows(
        &mut t,
        r,
        "converge",
        &format!("converge ({n})"),
        floor,
        true,
    );
    // An update changes 2N children (the Service does not depend on the spec); converge
    // writes all 3N; a template change of the ConfigMap writes N.
    let update_floor = floor.map(|f| f * 2.0 / 3.0);
    let template_floor = floor.map(|f| f / 3.0);
    phase_rows(
        &mut t,
        r,
        "update",
        &format!("update ({n})"),
        update_floor,
        true,
    );
    phase_rows(
        &mut t,
        r,
        "steady",
        &format!("steady state ({} s)", cfg["steady_seconds"]),
        None,
        false,
    );
    phase_rows(
        &mut t,
        r,
        "template",
        "template change (ConfigMap)",
        template_floor,
        true,
    );
    s.push_str("## Results\n\n");
    s.push_str(&t.render());
    s.push_str(
        "\n¹ `apiserver_request_total` deltas for configmaps, services, secrets, benches (and /status) and events, \
         minus the driver's own creates and patches; the metric has no user-agent label, so on a shared \
         cluster it includes other clients' writes.  \n\
         ² busy CPU of the whole machine minus the controller, API server, etcd and driver: \
         kube-controller-manager (garbage collector), other test runs.  \n\
         ³ time ÷ the time the plain client needs for the children the workload must write at \
         its best concurrency (3N for converge, 2N for update, N for the template change).  \n\
         ⁴ the API server's audit log: write requests with the contender's user agent in its own \
         namespace (a server-side apply is logged as `patch`, events as `create events`).  \n\
         ⁵ runs whose phase timed out or failed are left out of the median (see the notes); a \
         phase that timed out in every run is shown as it was.\n\n",
    );
    for (name, c) in r["contenders"].as_object().into_iter().flatten() {
        for key in ["skipped", "error", "scale_error"] {
            if let Some(e) = c[key].as_str() {
                s.push_str(&format!("- **{name}** {key}: {e}\n"));
            }
        }
        for (size, e) in c["scale_errors"].as_object().into_iter().flatten() {
            let e = e.as_str().unwrap_or_default();
            s.push_str(&format!("- **{name}** memory at {size} parents: {e}\n"));
        }
        if let Some(ch) = c["update"]["children_checked"].as_str() {
            s.push_str(&format!("- {name}, update: {ch}\n"));
        }
    }
    s.push('\n');
    s.push_str(&memory_curve(r));

    if let Some(rc) = r["render"].as_object().filter(|o| !o.is_empty()) {
        s.push_str("\n## Render cost (criterion, per parent)\n\n| rule | render | status | render + status |\n|---|---:|---:|---:|\n");
        for (group, v) in rc {
            let us = |k: &str| {
                v[k]["mean_ns"]
                    .as_f64()
                    .map(|ns| format!("{:.1} µs", ns / 1000.0))
                    .unwrap_or_else(|| "–".into())
            };
            s.push_str(&format!(
                "| {group} | {} | {} | {} |\n",
                us("render"),
                us("status"),
                us("render_status")
            ));
        }
    }
    s.push_str(&runs_table(r));
    if let Some(notes) = r["notes"].as_array().filter(|a| !a.is_empty()) {
        s.push_str("\n## Notes\n\n");
        for n in notes {
            s.push_str(&format!("- {}\n", n.as_str().unwrap_or("")));
        }
    }
    s.push_str(&format!(
        "\nWrite counts: {}\n",
        r["write_counts_source"].as_str().unwrap_or("")
    ));
    s
}

/// `- runs: …`: of how many runs the medians are, and in which order they ran.
fn runs_line(r: &Json) -> String {
    if r["runs"].as_object().is_none_or(|o| o.is_empty()) {
        return String::new();
    }
    let of: Vec<String> = contender_names(r)
        .iter()
        .filter(|n| r["contenders"][n.as_str()].get("runs").is_some())
        .map(|n| {
            let c = &r["contenders"][n.as_str()];
            format!("{} {}", c["title"].as_str().unwrap_or(n), runs_of(r, n))
        })
        .collect();
    format!(
        "- runs: {} round(s), the contender list as given in odd rounds and reversed in even ones; \
         each figure is the median of a contender's runs ({}), with the range (min–max) in brackets \
         where the runs differ; the ratios are ratios of medians\n",
        r["config"]["repeats"].as_u64().unwrap_or(1),
        of.join(", ")
    )
}

/// The runs in the order they ran: round, contender, load at start, what went wrong.
fn runs_table(r: &Json) -> String {
    let mut all: Vec<(&str, &Json)> = r["runs"]
        .as_object()
        .into_iter()
        .flatten()
        .flat_map(|(name, runs)| {
            runs.as_array()
                .into_iter()
                .flatten()
                .map(move |run| (name.as_str(), run))
        })
        .collect();
    if all.is_empty() {
        return String::new();
    }
    all.sort_by_key(|(_, run)| (run["seq"].as_u64(), run["round"].as_u64()));
    let mut s = String::from(
        "\n## Runs\n\n| # | round | contender | load average at start | outcome |\n|---:|---:|---|---|---|\n",
    );
    for (name, run) in all {
        let mut bad: Vec<String> = Vec::new();
        if let Some(e) = run["error"].as_str() {
            bad.push(format!("failed: {e}"));
        }
        for p in runs::PHASES {
            if run[p]["converged"] == serde_json::json!(false) {
                bad.push(format!("{p} timed out"));
            }
        }
        for (parents, p) in runs::scale_phases(run, None) {
            if p["converged"] == serde_json::json!(false) {
                bad.push(format!("memory at {parents} timed out"));
            }
        }
        for (size, e) in run["scale_errors"].as_object().into_iter().flatten() {
            let e = e.as_str().unwrap_or_default();
            bad.push(format!("memory at {size} failed: {e}"));
        }
        s.push_str(&format!(
            "| {} | {} | {name} | {} | {} |\n",
            run["seq"],
            run["round"],
            run["loadavg_start"].as_str().unwrap_or(""),
            if bad.is_empty() {
                "ok".into()
            } else {
                bad.join("; ").replace('|', "\\|")
            }
        ));
    }
    s
}

/// The memory curve: each size's figures, and the slope fitted through them.
fn memory_curve(r: &Json) -> String {
    let old_n = r["config"]["scale_n"].as_u64();
    let names = contender_names(r);
    let mut sizes: Vec<u64> = names
        .iter()
        .flat_map(|n| runs::scale_phases(&r["contenders"][n.as_str()], old_n))
        .map(|(p, _)| p)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() {
        return String::new();
    }
    let mut t = Table::new(r);
    for &size in &sizes {
        let phase = move |c: &Json| -> Option<Json> {
            runs::scale_phases(c, old_n)
                .into_iter()
                .find(|(p, _)| *p == size)
                .map(|(_, v)| v.clone())
        };
        let objects = size as f64 * runs::OBJECTS_PER_PARENT;
        let label = format!("{size} parents ({} objects)", num(objects));
        let rows: [(&str, &str); 5] = [
            ("RSS after converging (MiB)", "rss_mib"),
            ("RSS idle, before parents (MiB)", "idle_rss_mib"),
            ("peak RSS (MiB)", "hwm_mib"),
            ("time to converge (s)", "seconds"),
            ("controller CPU (s)", "cpu_seconds"),
        ];
        for (metric, key) in rows {
            t.numbers(r, &label, metric, |c| phase(c)?[key].as_f64());
        }
        t.text(r, &label, "finished", |c| finished(&phase(c)?));
        if repeated(r) {
            t.text(r, &label, "runs in the median", |c| {
                runs_text(c, &phase(c)?)
            });
        }
        t.text(r, &label, "control plane restarted by another run", |c| {
            restarted(&phase(c)?)
        });
    }
    // The slope through the medians; its range is that of the slopes of each run alone.
    let fits = |c: &Json| runs::fit(&runs::memory_points(c, old_n));
    let slopes = names
        .iter()
        .map(|n| {
            let per_run: Vec<f64> = r["runs"][n.as_str()]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|run| fits(run).map(|f| f.0 * 1000.0))
                .collect();
            let range = (per_run.len() > 1).then(|| {
                let lo = per_run.iter().copied().fold(f64::INFINITY, f64::min);
                (lo, per_run.iter().copied().fold(lo, f64::max))
            });
            (
                fits(&r["contenders"][n.as_str()]).map(|f| f.0 * 1000.0),
                range,
            )
        })
        .collect();
    t.push_numbers(
        "fit over the sizes⁶",
        "MiB per 1,000 managed objects",
        slopes,
    );
    let fitted = names
        .iter()
        .any(|n| fits(&r["contenders"][n.as_str()]).is_some());
    // The part of the RSS above idle not proportional to the objects; no ratio.
    t.text(
        r,
        "fit over the sizes⁶",
        "intercept (MiB above idle)",
        |c| fits(c).map(|f| num(f.1)),
    );
    let footnote = if fitted {
        "\n⁶ least squares through (managed objects, RSS after converging − idle RSS) at the \
         medians of the sizes that finished; in brackets, the range of the slopes fitted to each \
         run alone. The ratio is that of the slopes.\n"
    } else {
        "\nNo slope: it needs two sizes or more (`BENCH_SCALE_N=1000,3000,10000`).\n"
    };
    format!(
        "## Memory curve\n\nEach size in a fresh process and namespace; managed objects = parents × 4 \
         (a parent and its three children). Plot: `memory.svg`.\n\n{}{footnote}\n",
        t.render()
    )
}
