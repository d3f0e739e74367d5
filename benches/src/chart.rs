//! `chart.svg`: grouped bars of TPS, one panel per workload (their scales differ tenfold),
//! one group per query mode and client count, one bar per configuration, labelled with its
//! TPS and its ratio to direct; whiskers span the rounds' min and max. Hand-written SVG.

use std::fmt::Write;

use crate::measure::CellResult;
use crate::plan::{Setup, Workload};
use crate::report::thousands;

const WIDTH: f64 = 1100.0;
const MARGIN_LEFT: f64 = 80.0;
const MARGIN_RIGHT: f64 = 20.0;
const PANEL_HEIGHT: f64 = 330.0;
const PLOT_TOP: f64 = 60.0;
const PLOT_BOTTOM: f64 = 50.0;
const HEADER: f64 = 84.0;
const FOOTER: f64 = 28.0;

/// The SVG document.
pub fn svg(cells: &[CellResult], title: &str, footer: &str) -> String {
    let setups: Vec<Setup> = Setup::ALL
        .into_iter()
        .filter(|s| cells.iter().any(|c| c.setups.iter().any(|r| r.setup == *s)))
        .collect();
    let workloads: Vec<Workload> = [Workload::SelectOnly, Workload::TpcbLike]
        .into_iter()
        .filter(|w| cells.iter().any(|c| c.cell.workload == *w))
        .collect();
    let height = HEADER + PANEL_HEIGHT * workloads.len() as f64 + FOOTER;
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"Helvetica, Arial, sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{MARGIN_LEFT}\" y=\"28\" font-size=\"18\" font-weight=\"bold\">{}</text>\n",
        esc(title)
    );
    legend(&mut s, &setups);
    let _ = writeln!(
        s,
        "<text x=\"{MARGIN_LEFT}\" y=\"74\" font-size=\"11\" fill=\"#666\">Bars: median TPS \
         over rounds (black label); whiskers: min–max over rounds; grey label: ratio to direct (median of the rounds' ratios).</text>"
    );
    for (i, &w) in workloads.iter().enumerate() {
        let top = HEADER + PANEL_HEIGHT * i as f64;
        let group: Vec<&CellResult> = cells.iter().filter(|c| c.cell.workload == w).collect();
        panel(&mut s, top, w, &group, &setups);
    }
    let _ = write!(
        s,
        "<text x=\"{MARGIN_LEFT}\" y=\"{}\" font-size=\"11\" fill=\"#666\">{}</text>\n</svg>\n",
        height - 10.0,
        esc(footer)
    );
    s
}

fn legend(s: &mut String, setups: &[Setup]) {
    let mut x = MARGIN_LEFT;
    let y = 52.0;
    for setup in setups {
        let label = setup.label();
        let _ = writeln!(
            s,
            "<rect x=\"{x}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"{}\"/>\
             <text x=\"{}\" y=\"{}\" font-size=\"13\">{}</text>",
            y - 11.0,
            setup.colour(),
            x + 19.0,
            y,
            esc(label)
        );
        x += 19.0 + 7.2 * label.len() as f64 + 22.0;
    }
}

/// A round number of TPS for the axis top, and the tick step.
fn axis(max: f64) -> (f64, f64) {
    if max <= 0.0 {
        return (1.0, 0.2);
    }
    let rough = max / 5.0;
    let mag = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|st| st >= &rough)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

fn panel(s: &mut String, top: f64, workload: Workload, cells: &[&CellResult], setups: &[Setup]) {
    let plot_top = top + PLOT_TOP;
    let plot_h = PANEL_HEIGHT - PLOT_TOP - PLOT_BOTTOM;
    let plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT;
    let base = plot_top + plot_h;
    let high = |c: &CellResult, setup: Setup| {
        c.setups
            .iter()
            .find(|r| r.setup == setup)
            .map(|r| r.runs.iter().map(|x| x.tps).fold(0.0, f64::max))
            .unwrap_or(0.0)
    };
    let max = cells
        .iter()
        .flat_map(|c| setups.iter().map(move |&st| high(c, st)))
        .fold(0.0, f64::max);
    // Room above the tallest bar for its two labels.
    let (ymax, step) = axis(max * 1.12);
    let y = |v: f64| base - plot_h * (v / ymax);

    let _ = writeln!(
        s,
        "<text x=\"{MARGIN_LEFT}\" y=\"{}\" font-size=\"15\" font-weight=\"bold\">{}: \
         transactions per second (higher is better)</text>",
        top + 30.0,
        workload.key()
    );
    let mut v = 0.0;
    while v <= ymax + step / 2.0 {
        let yy = y(v);
        let _ = writeln!(
            s,
            "<line x1=\"{MARGIN_LEFT}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#e3e3e3\"/>\
             <text x=\"{}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\" fill=\"#444\">{}</text>",
            WIDTH - MARGIN_RIGHT,
            MARGIN_LEFT - 6.0,
            yy + 4.0,
            short(v)
        );
        v += step;
    }
    let _ = writeln!(
        s,
        "<line x1=\"{MARGIN_LEFT}\" x2=\"{}\" y1=\"{base}\" y2=\"{base}\" stroke=\"#444\"/>",
        WIDTH - MARGIN_RIGHT
    );

    let group_w = plot_w / cells.len().max(1) as f64;
    let bar_w = ((group_w * 0.86) / setups.len().max(1) as f64).min(60.0);
    for (gi, c) in cells.iter().enumerate() {
        let gx = MARGIN_LEFT + group_w * gi as f64;
        let bars_w = bar_w * setups.len() as f64;
        let x0 = gx + (group_w - bars_w) / 2.0;
        for (bi, &setup) in setups.iter().enumerate() {
            let x = x0 + bar_w * bi as f64;
            let cx = x + bar_w / 2.0;
            let Some(r) = c.setups.iter().find(|r| r.setup == setup) else {
                continue;
            };
            let Some(m) = r.median else {
                let _ = writeln!(
                    s,
                    "<text x=\"{cx:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\" \
                     fill=\"#c00\">failed</text>",
                    base - 4.0
                );
                continue;
            };
            let top_y = y(m.tps);
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{top_y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">\
                 <title>{}: {} tps, mean {:.3} ms, p99 {:.3} ms</title></rect>",
                x + 1.0,
                bar_w - 2.0,
                base - top_y,
                setup.colour(),
                esc(r.label),
                thousands(m.tps),
                m.mean_ms,
                m.p99_ms
            );
            let (lo, hi) = r.runs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| {
                (lo.min(x.tps), hi.max(x.tps))
            });
            if r.runs.len() > 1 {
                let _ = writeln!(
                    s,
                    "<line x1=\"{cx:.1}\" x2=\"{cx:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#222\"/>\
                     <line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#222\"/>\
                     <line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#222\"/>",
                    y(lo),
                    y(hi),
                    cx - 3.0,
                    cx + 3.0,
                    y(lo),
                    y(lo),
                    cx - 3.0,
                    cx + 3.0,
                    y(hi),
                    y(hi)
                );
            }
            let label_y = y(hi.max(m.tps)) - 5.0;
            let _ = writeln!(
                s,
                "<text x=\"{cx:.1}\" y=\"{label_y:.1}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
                short(m.tps)
            );
            if setup != Setup::Direct {
                if let Some(ratio) = c.tps_ratio(setup, Setup::Direct) {
                    let _ = writeln!(
                        s,
                        "<text x=\"{cx:.1}\" y=\"{:.1}\" font-size=\"9.5\" text-anchor=\"middle\" \
                         fill=\"#555\">{ratio:.2}×</text>",
                        label_y - 12.0,
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\">{}, {} client{}</text>",
            gx + group_w / 2.0,
            base + 20.0,
            c.cell.mode.key(),
            c.cell.clients,
            if c.cell.clients == 1 { "" } else { "s" }
        );
    }
}

/// `41.2k`, `980`.
fn short(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1000.0 {
        format!("{:.1}k", v / 1000.0)
    } else {
        format!("{v:.0}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_is_round() {
        assert_eq!(axis(87_000.0), (100_000.0, 20_000.0));
        assert_eq!(axis(11_900.0), (12_500.0, 2_500.0));
        assert_eq!(axis(0.0), (1.0, 0.2));
        assert_eq!(short(41_234.0), "41.2k");
        assert_eq!(short(123_456.0), "123k");
        assert_eq!(short(980.0), "980");
    }
}
