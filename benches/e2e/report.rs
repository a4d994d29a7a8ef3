//! `results.md` (Markdown tables) and `converge.svg` (plotters, SVG backend only: text
//! is written as SVG `<text>`, so no font file or system library is needed).

use anyhow::Result;
use serde_json::Value as Json;

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

struct Table {
    names: Vec<String>,
    titles: Vec<String>,
    reference: Option<usize>,
    rows: Vec<String>,
}

impl Table {
    fn new(r: &Json) -> Table {
        let names: Vec<String> = r["config"]["contenders"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
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

    /// A row of numbers read by `get` from each contender's results, with ratios.
    fn numbers(
        &mut self,
        r: &Json,
        workload: &str,
        metric: &str,
        get: impl Fn(&Json) -> Option<f64>,
    ) {
        let vals: Vec<Option<f64>> = self
            .names
            .iter()
            .map(|n| get(&r["contenders"][n]))
            .collect();
        if vals.iter().all(Option::is_none) {
            return;
        }
        let mut row = format!("| {workload} | {metric} |");
        for v in &vals {
            row.push_str(&format!(" {} |", v.map(num).unwrap_or_else(|| "–".into())));
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

/// The first time at which the timeline reached 99 % of its target (N parents; for the
/// template change, N parents at the new rule version with their ConfigMap changed).
fn quantile_time(timeline: &Json, target: Option<f64>, r: &Json) -> Option<f64> {
    let n = target.or_else(|| r["config"]["n"].as_f64())?;
    let want = (n * 0.99).ceil();
    timeline
        .as_array()?
        .iter()
        .find(|p| p[1].as_f64().is_some_and(|c| c >= want))
        .and_then(|p| p[0].as_f64())
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
            quantile_time(&c[key]["timeline"], c[key]["children"].as_f64(), r)
        });
        t.text(r, label, "finished", |c| {
            c[key]["converged"].as_bool().map(|b| {
                if b {
                    "yes".into()
                } else {
                    "**timed out**".into()
                }
            })
        });
    }
    t.text(r, label, "control plane restarted by another run", |c| {
        c[key]["control_plane_restarted"]
            .as_bool()
            .filter(|b| *b)
            .map(|_| "**yes: figures disturbed**".into())
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
    s.push_str(&format!(
        "- sizes: N = {n} parents (3N = {} children), memory at scale {} parents, steady window {} s; \
         every controller runs {} concurrent reconciles; the driver creates/updates parents {} at a time\n\n",
        3 * n,
        cfg["scale_n"],
        cfg["steady_seconds"],
        cfg["concurrency"],
        cfg["driver_concurrency"]
    ));

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
    let sn = cfg["scale_n"].as_u64().unwrap_or(0);
    let label = format!("memory at scale ({sn} + {})", 3 * sn);
    t.numbers(r, &label, "RSS after converging (MiB)", |c| {
        f(&c["scale"]["rss_mib"])
    });
    t.numbers(r, &label, "peak RSS (MiB)", |c| f(&c["scale"]["hwm_mib"]));
    t.numbers(r, &label, "RSS idle, before parents (MiB)", |c| {
        f(&c["scale"]["idle_rss_mib"])
    });
    t.numbers(r, &label, "time to converge (s)", |c| {
        f(&c["scale"]["seconds"])
    });
    t.numbers(r, &label, "controller CPU (s)", |c| {
        f(&c["scale"]["cpu_seconds"])
    });
    t.text(r, &label, "control plane restarted by another run", |c| {
        c["scale"]["control_plane_restarted"]
            .as_bool()
            .filter(|b| *b)
            .map(|_| "**yes: figures disturbed**".into())
    });
    t.text(r, &label, "finished", |c| {
        c["scale"]["converged"].as_bool().map(|b| {
            if b {
                "yes".into()
            } else {
                "**timed out**".into()
            }
        })
    });
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
         namespace (a server-side apply is logged as `patch`, events as `create events`).\n\n",
    );
    for (name, c) in r["contenders"].as_object().into_iter().flatten() {
        for key in ["skipped", "error", "scale_error"] {
            if let Some(e) = c[key].as_str() {
                s.push_str(&format!("- **{name}** {key}: {e}\n"));
            }
        }
        if let Some(ch) = c["update"]["children_checked"].as_str() {
            s.push_str(&format!("- {name}, update: {ch}\n"));
        }
    }

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

/// Parents converged over time, converge and update side by side, one line per contender,
/// and the API server floor for the children.
pub fn plot(r: &Json, path: &std::path::Path) -> Result<()> {
    use plotters::prelude::*;
    let n = r["config"]["n"].as_f64().unwrap_or(0.0);
    let floor = best_rate(r).map(|rate| 3.0 * n / rate);
    let colors = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
    ];
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    for (area, key, title) in [
        (&left, "converge", "Converge: create N parents"),
        (&right, "update", "Update: change every parent"),
    ] {
        let order: Vec<String> = r["config"]["contenders"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let series: Vec<(String, Vec<(f64, f64)>)> = order
            .iter()
            .filter_map(|name| {
                let c = &r["contenders"][name];
                let tl = c[key]["timeline"].as_array()?;
                let pts: Vec<(f64, f64)> = tl
                    .iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect();
                Some((c["title"].as_str().unwrap_or(name).to_string(), pts))
            })
            .collect();
        let xmax = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|x| x.0))
            .chain(floor)
            .fold(1.0f64, f64::max)
            * 1.05;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{title} (N = {n})"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..xmax, 0f64..(n.max(1.0) * 1.05))?;
        chart
            .configure_mesh()
            .x_desc("seconds since the first parent was written")
            .y_desc("parents converged")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let color = colors[i % colors.len()];
            // Counts change in steps: draw them as steps.
            let mut steps = Vec::with_capacity(pts.len() * 2);
            for (j, p) in pts.iter().enumerate() {
                if j > 0 {
                    steps.push((p.0, pts[j - 1].1));
                }
                steps.push(*p);
            }
            chart
                .draw_series(LineSeries::new(steps, color.stroke_width(2)))?
                .label(name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        if key == "converge"
            && let Some(fl) = floor
        {
            let gray = RGBColor(120, 120, 120);
            chart
                .draw_series(LineSeries::new(
                    vec![(0.0, 0.0), (fl, n)],
                    gray.stroke_width(1),
                ))?
                .label("API server floor (3N applies)")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], gray));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
