//! The SVG plots of the results: `converge.svg` (parents converged over time) and
//! `memory.svg` (the memory curve: RSS against managed objects). Plotters with its SVG
//! backend only: text is written as SVG `<text>`, so no font file or system library is
//! needed.

use anyhow::Result;
use plotters::prelude::*;
use serde_json::Value as Json;

use crate::report::{best_rate, contender_names, runs_of};
use crate::runs;

/// One line of a plot: a contender's points, and the ranges of its runs as (x, low, high).
struct Series {
    /// The contender's place in the configured order, its color in both plots.
    color: usize,
    label: String,
    points: Vec<(f64, f64)>,
    bars: Vec<(f64, f64, f64)>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Parents converged over time, converge and update side by side, one line per contender,
/// and the API server floor for the children.
pub fn converge(r: &Json, path: &std::path::Path) -> Result<()> {
    let n = r["config"]["n"].as_f64().unwrap_or(0.0);
    let floor = best_rate(r).map(|rate| 3.0 * n / rate);
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    for (area, key, title) in [
        (&left, "converge", "Converge: create N parents"),
        (&right, "update", "Update: change every parent"),
    ] {
        // Of a contender that ran more than once: the run whose time was nearest the median.
        let series: Vec<Series> = contender_names(r)
            .iter()
            .enumerate()
            .filter_map(|(i, name)| {
                let c = &r["contenders"][name];
                let tl = c[key]["timeline"].as_array()?;
                let pts: Vec<(f64, f64)> = tl
                    .iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect();
                let mut label = c["title"].as_str().unwrap_or(name).to_string();
                if runs_of(r, name) > 1
                    && let Some(round) = c[key]["timeline_round"].as_u64()
                {
                    label.push_str(&format!(" (round {round}: time nearest the median)"));
                }
                Some(Series {
                    color: i,
                    label,
                    points: pts,
                    bars: Vec::new(),
                })
            })
            .collect();
        let xmax = series
            .iter()
            .flat_map(|s| s.points.iter().map(|x| x.0))
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
        for Series {
            color: i,
            label: name,
            points: pts,
            ..
        } in &series
        {
            let color = COLORS[i % COLORS.len()];
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

/// RSS after converging against managed objects (parents × 4), one line per contender
/// through its sizes' medians, starting at its idle RSS (no object), with the range of
/// the runs as a vertical bar; sizes that timed out are left out. False, and no file, when
/// no contender has a size.
pub fn memory(r: &Json, path: &std::path::Path) -> Result<bool> {
    let old_n = r["config"]["scale_n"].as_u64();
    let point = |c: &Json, parents: u64| -> Option<(f64, f64)> {
        let p = runs::scale_phases(c, old_n)
            .into_iter()
            .find(|(q, _)| *q == parents)?
            .1;
        if p["converged"] == Json::Bool(false) {
            return None; // the RSS of fewer objects than the size says
        }
        Some((
            parents as f64 * runs::OBJECTS_PER_PARENT,
            p["rss_mib"].as_f64()?,
        ))
    };
    let mut series: Vec<Series> = Vec::new();
    for (i, name) in contender_names(r).iter().enumerate() {
        let c = &r["contenders"][name];
        let phases = runs::scale_phases(c, old_n);
        let mut pts: Vec<(f64, f64)> = phases
            .iter()
            .filter_map(|(parents, _)| point(c, *parents))
            .collect();
        if pts.is_empty() {
            continue;
        }
        if let Some(idle) = phases.first().and_then(|p| p.1["idle_rss_mib"].as_f64()) {
            pts.insert(0, (0.0, idle));
        }
        let bars = phases
            .iter()
            .filter(|_| runs_of(r, name) > 1)
            .filter_map(|(parents, _)| {
                let lo = point(&r["spread"][name]["min"], *parents)?;
                let hi = point(&r["spread"][name]["max"], *parents)?;
                Some((lo.0, lo.1, hi.1))
            })
            .collect();
        let title = c["title"].as_str().unwrap_or(name).to_string();
        series.push(Series {
            color: i,
            label: title,
            points: pts,
            bars,
        });
    }
    if series.is_empty() {
        return Ok(false);
    }
    let xmax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(1.0f64, f64::max)
        * 1.05;
    let ymax = series
        .iter()
        .flat_map(|s| {
            s.points
                .iter()
                .map(|p| p.1)
                .chain(s.bars.iter().map(|b| b.2))
        })
        .fold(1.0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (800, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Memory: controller RSS after converging",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc("managed objects (parents × 4; 0 = idle, before any parent)")
        .y_desc("RSS (MiB)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    for Series {
        color: i,
        label: title,
        points: pts,
        bars,
    } in &series
    {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(title.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        chart.draw_series(bars.iter().map(|(x, lo, hi)| {
            PathElement::new(vec![(*x, *lo), (*x, *hi)], color.stroke_width(1))
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(true)
}
