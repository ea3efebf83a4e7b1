//! Dependency-free SVG line and scatter charts for the evaluation report.
//!
//! [`svg`] renders a [`Chart`] as one standalone 640x420 SVG document: title, axes with five
//! round-number ticks each, axis labels, a legend, one palette colour per series, points as
//! circles and, when asked, polylines through them. The output is a pure function of the chart
//! (fixed palette, fixed number formatting), so reports diff cleanly. Degenerate input never
//! panics: no series, empty series, a single point or a zero range get a padded axis, and
//! points with a non-finite coordinate are left out.

use std::fmt::Write as _;

/// One named set of points, drawn in one colour.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// `(x, y)` in data units, connected in this order when the chart draws lines.
    pub points: Vec<(f64, f64)>,
}

/// A chart: labels plus the series to draw on shared axes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chart {
    /// Text above the plot.
    pub title: String,
    /// Text under the x axis.
    pub x_label: String,
    /// Text beside the y axis.
    pub y_label: String,
    /// Series in legend order; colours cycle through the palette.
    pub series: Vec<Series>,
    /// Connect each series' points with a polyline (otherwise a scatter plot).
    pub lines: bool,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 420.0;
const PLOT_LEFT: f64 = 72.0;
const PLOT_TOP: f64 = 40.0;
const PLOT_BOTTOM: f64 = 356.0;
/// Rough width of a 12px sans-serif character, to size the legend column.
const CHAR_W: f64 = 7.0;
const TICKS: usize = 5;
/// Okabe-Ito colours (distinguishable with common colour-vision deficiencies), black last.
const PALETTE: [&str; 8] = [
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
];

/// Renders `chart` as a standalone SVG document.
#[allow(
    clippy::too_many_lines,
    reason = "the SVG document element by element in drawing order"
)]
pub fn svg(chart: &Chart) -> String {
    let finite = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    let all = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(finite);
    let (x_ticks, y_ticks) = {
        let (mut xs, mut ys) = (Range::empty(), Range::empty());
        for (x, y) in all {
            xs.add(x);
            ys.add(y);
        }
        (xs.ticks(), ys.ticks())
    };

    // The legend column is as wide as the longest name needs, but leaves the plot >= 300 px.
    let longest = chart
        .series
        .iter()
        .map(|s| s.name.chars().count())
        .max()
        .unwrap_or(0);
    let legend_w = (34.0 + CHAR_W * longest as f64).clamp(80.0, WIDTH - PLOT_LEFT - 300.0);
    let plot_right = WIDTH - legend_w - 12.0;

    let px = |x: f64| scale(x, x_ticks.first, x_ticks.last, PLOT_LEFT, plot_right);
    let py = |y: f64| scale(y, y_ticks.first, y_ticks.last, PLOT_BOTTOM, PLOT_TOP);

    let mut out = String::new();
    // `write!` into a String cannot fail; the results are ignored for that reason.
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#,
        w = WIDTH,
        h = HEIGHT
    );
    let _ = writeln!(
        out,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.2}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        (PLOT_LEFT + plot_right) / 2.0,
        escape(&chart.title)
    );

    // Grid, ticks and tick labels.
    let _ = writeln!(out, r##"<g stroke="#dddddd" stroke-width="1">"##);
    for t in &x_ticks.values {
        let x = px(*t);
        let _ = writeln!(
            out,
            r#"<line x1="{x:.2}" y1="{PLOT_TOP:.2}" x2="{x:.2}" y2="{PLOT_BOTTOM:.2}"/>"#
        );
    }
    for t in &y_ticks.values {
        let y = py(*t);
        let _ = writeln!(
            out,
            r#"<line x1="{PLOT_LEFT:.2}" y1="{y:.2}" x2="{plot_right:.2}" y2="{y:.2}"/>"#
        );
    }
    let _ = writeln!(out, "</g>");
    let _ = writeln!(
        out,
        r##"<g stroke="#333333" stroke-width="1"><line x1="{PLOT_LEFT:.2}" y1="{PLOT_BOTTOM:.2}" x2="{plot_right:.2}" y2="{PLOT_BOTTOM:.2}"/><line x1="{PLOT_LEFT:.2}" y1="{PLOT_TOP:.2}" x2="{PLOT_LEFT:.2}" y2="{PLOT_BOTTOM:.2}"/></g>"##
    );
    let _ = writeln!(out, r##"<g fill="#333333">"##);
    for (t, label) in x_ticks.values.iter().zip(&x_ticks.labels) {
        let _ = writeln!(
            out,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            px(*t),
            PLOT_BOTTOM + 18.0,
            escape(label)
        );
    }
    for (t, label) in y_ticks.values.iter().zip(&y_ticks.labels) {
        let _ = writeln!(
            out,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"#,
            PLOT_LEFT - 8.0,
            py(*t) + 4.0,
            escape(label)
        );
    }
    let _ = writeln!(out, "</g>");

    // Axis labels.
    let _ = writeln!(
        out,
        r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
        (PLOT_LEFT + plot_right) / 2.0,
        HEIGHT - 22.0,
        escape(&chart.x_label)
    );
    let mid_y = (PLOT_TOP + PLOT_BOTTOM) / 2.0;
    let _ = writeln!(
        out,
        r#"<text x="18" y="{mid_y:.2}" text-anchor="middle" transform="rotate(-90 18 {mid_y:.2})">{}</text>"#,
        escape(&chart.y_label)
    );

    // Series, then the legend.
    for (i, series) in chart.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = series
            .points
            .iter()
            .filter(|p| finite(p))
            .map(|&(x, y)| (px(x), py(y)))
            .collect();
        let _ = writeln!(out, r#"<g fill="{color}" stroke="{color}">"#);
        if chart.lines && pts.len() >= 2 {
            let coords: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.2},{y:.2}")).collect();
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke-width="1.5" points="{}"/>"#,
                coords.join(" ")
            );
        }
        for (x, y) in &pts {
            let _ = writeln!(out, r#"<circle cx="{x:.2}" cy="{y:.2}" r="3"/>"#);
        }
        let _ = writeln!(out, "</g>");
    }
    let legend_x = plot_right + 16.0;
    for (i, series) in chart.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let y = PLOT_TOP + 4.0 + 18.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<rect x="{legend_x:.2}" y="{y:.2}" width="12" height="12" fill="{color}"/>"#
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.2}" y="{:.2}">{}</text>"#,
            legend_x + 18.0,
            y + 10.0,
            escape(&series.name)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Min and max of the finite values seen so far.
struct Range {
    lo: f64,
    hi: f64,
}

impl Range {
    fn empty() -> Self {
        Range {
            lo: f64::INFINITY,
            hi: f64::NEG_INFINITY,
        }
    }

    fn add(&mut self, v: f64) {
        self.lo = self.lo.min(v);
        self.hi = self.hi.max(v);
    }

    /// Five ticks covering the range; an empty range becomes [0, 1], a single value is padded.
    fn ticks(&self) -> Ticks {
        let (lo, hi) = if self.lo > self.hi {
            (0.0, 1.0)
        } else if self.lo == self.hi {
            let v = self.lo;
            let pad = if v.abs() > 1e-300 { v.abs() * 0.1 } else { 1.0 };
            (v - pad, v + pad)
        } else {
            (self.lo, self.hi)
        };
        nice_ticks(lo, hi)
    }
}

/// Tick positions with their labels; `first`/`last` are the axis ends.
struct Ticks {
    values: Vec<f64>,
    labels: Vec<String>,
    first: f64,
    last: f64,
}

/// Five equally spaced ticks `start + i·step` covering `[lo, hi]`, with `step` the smallest
/// of 1, 2, 2.5 or 5 times a power of ten that covers the range from a multiple of itself.
fn nice_ticks(lo: f64, hi: f64) -> Ticks {
    let intervals = (TICKS - 1) as f64;
    let raw = (hi - lo) / intervals;
    if raw.is_finite() && raw > 0.0 {
        let k = raw.log10().floor() as i32;
        // Stepping up two decades always reaches a step >= (hi - lo) / 3, which covers the range
        // from any start within one step below `lo`.
        for exp in k..=k + 2 {
            for mantissa in [1.0, 2.0, 2.5, 5.0] {
                let step = mantissa * 10f64.powi(exp);
                if step < raw {
                    continue;
                }
                // Tick j is j * step, computed as one rounding of an exact product or quotient so
                // that 660 * 0.005 gives the double nearest 3.3, not 3.3000000000000003.
                let tick = |j: f64| {
                    let v = if exp >= 0 {
                        j * mantissa * 10f64.powi(exp)
                    } else {
                        j * mantissa / 10f64.powi(-exp)
                    };
                    v + 0.0 // -0.0 -> 0.0, so no "-0" label
                };
                let mut first = (lo / step).floor();
                if tick(first) > lo {
                    first -= 1.0;
                }
                if tick(first + intervals) >= hi {
                    let values: Vec<f64> = (0..TICKS).map(|i| tick(first + i as f64)).collect();
                    let labels = tick_labels(&values, mantissa, exp);
                    return Ticks {
                        first: values[0],
                        last: values[TICKS - 1],
                        values,
                        labels,
                    };
                }
            }
        }
    }
    // Ranges too wide for a finite step (near f64::MAX): plain interpolation, no rounding.
    let values: Vec<f64> = (0..TICKS)
        .map(|i| {
            let t = i as f64 / intervals;
            lo * (1.0 - t) + hi * t
        })
        .collect();
    let labels = values.iter().map(|&v| sci(v)).collect();
    Ticks {
        first: lo,
        last: hi,
        values,
        labels,
    }
}

/// Labels with exactly the decimals the step needs (0.25 -> 2, 5 -> 0); scientific notation
/// for very large or very small magnitudes.
fn tick_labels(values: &[f64], mantissa: f64, exp: i32) -> Vec<String> {
    let magnitude = values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    if magnitude >= 1e6 || exp < -4 {
        return values.iter().map(|&v| sci(v)).collect();
    }
    let extra = if mantissa == 2.5 { 1 } else { 0 };
    let decimals = (extra - exp).max(0) as usize;
    values.iter().map(|v| format!("{v:.decimals$}")).collect()
}

/// `1.25e8`: up to four significant digits, trailing zeros dropped.
fn sci(v: f64) -> String {
    let s = format!("{v:.3e}");
    match s.split_once('e') {
        Some((mant, exp)) if mant.contains('.') => {
            format!("{}e{exp}", mant.trim_end_matches('0').trim_end_matches('.'))
        }
        _ => s,
    }
}

/// Linear map from `[d0, d1]` to `[p0, p1]`; the middle of the pixel range if the data range is
/// empty.
fn scale(v: f64, d0: f64, d1: f64, p0: f64, p1: f64) -> f64 {
    let span = d1 - d0;
    if span > 0.0 && span.is_finite() {
        p0 + (v - d0) / span * (p1 - p0)
    } else {
        (p0 + p1) / 2.0
    }
}

/// XML text/attribute escaping; characters XML 1.0 forbids (most C0 controls) are dropped.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if c < ' ' || c == '\u{fffe}' || c == '\u{ffff}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.to_string(),
            points: points.to_vec(),
        }
    }

    fn chart(series: Vec<Series>, lines: bool) -> Chart {
        Chart {
            title: "TTFT vs quality".to_string(),
            x_label: "TTFT (ms)".to_string(),
            y_label: "F1".to_string(),
            series,
            lines,
        }
    }

    /// Checks that every element is closed in order and every `&` starts one of the five XML
    /// entities; returns the element names in document order.
    fn check_xml(doc: &str) -> Vec<String> {
        let mut stack: Vec<String> = Vec::new();
        let mut names = Vec::new();
        let mut rest = doc;
        while let Some(open) = rest.find('<') {
            let text = &rest[..open];
            check_entities(text);
            let Some(close) = rest[open..].find('>') else {
                panic!("unterminated tag in {rest}");
            };
            let tag = &rest[open + 1..open + close];
            check_entities(tag);
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop().as_deref(), Some(name), "mismatched </{name}>");
            } else {
                let name: String = tag
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric())
                    .collect();
                assert!(!name.is_empty(), "bad tag <{tag}>");
                assert!(!tag.contains('<'), "raw < inside <{tag}>");
                if !tag.ends_with('/') {
                    stack.push(name.clone());
                }
                names.push(name);
            }
            rest = &rest[open + close + 1..];
        }
        assert!(rest.trim().is_empty(), "text after the root: {rest}");
        assert!(stack.is_empty(), "unclosed: {stack:?}");
        names
    }

    fn check_entities(s: &str) {
        for (i, _) in s.match_indices('&') {
            let ok = ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                .iter()
                .any(|e| s[i..].starts_with(e));
            assert!(ok, "bare & in {s:?}");
        }
    }

    fn count(doc: &str, needle: &str) -> usize {
        doc.matches(needle).count()
    }

    #[test]
    fn renders_a_well_formed_standalone_svg() {
        let c = chart(
            vec![
                series("full_recompute", &[(120.0, 0.33), (240.0, 0.34)]),
                series("speccache", &[(50.0, 0.30), (60.0, 0.31), (70.0, 0.32)]),
                series("epic", &[(30.0, 0.2)]),
            ],
            true,
        );
        let doc = svg(&c);
        assert!(doc.starts_with(r#"<svg xmlns="http://www.w3.org/2000/svg""#));
        assert!(doc.ends_with("</svg>\n"));
        let names = check_xml(&doc);
        assert_eq!(names.first().map(String::as_str), Some("svg"));
        assert_eq!(names.iter().filter(|n| *n == "svg").count(), 1);
        assert_eq!(count(&doc, "<circle"), 6);
        // Lines only where a series has two or more points.
        assert_eq!(count(&doc, "<polyline"), 2);
        for s in &c.series {
            assert!(doc.contains(&format!(">{}</text>", s.name)), "{}", s.name);
        }
        for text in ["TTFT vs quality", "TTFT (ms)", ">F1<"] {
            assert!(doc.contains(text), "{text}");
        }
        // Three distinct colours, one per series.
        for color in &PALETTE[..3] {
            assert!(doc.contains(&format!(r#"fill="{color}" stroke="{color}""#)));
        }
    }

    #[test]
    fn scatter_has_no_polylines() {
        let doc = svg(&chart(vec![series("a", &[(0.0, 0.0), (1.0, 1.0)])], false));
        check_xml(&doc);
        assert_eq!(count(&doc, "<polyline"), 0);
        assert_eq!(count(&doc, "<circle"), 2);
    }

    #[test]
    fn escapes_xml_specials_in_all_text() {
        let mut c = chart(vec![series(r#"a<b & "c">'d'"#, &[(1.0, 2.0)])], true);
        c.title = "p<0.05 & q>1".to_string();
        c.x_label = "\"x\"".to_string();
        c.y_label = "y & z\u{7}".to_string();
        let doc = svg(&c);
        check_xml(&doc);
        assert!(doc.contains("a&lt;b &amp; &quot;c&quot;&gt;&apos;d&apos;"));
        assert!(doc.contains("p&lt;0.05 &amp; q&gt;1"));
        assert!(doc.contains("&quot;x&quot;"));
        // The BEL control character is not allowed in XML 1.0 and is dropped.
        assert!(doc.contains(">y &amp; z</text>"));
        assert!(!doc.contains("a<b"));
        assert!(!doc.contains('\u{7}'));
    }

    #[test]
    fn degenerate_inputs_do_not_panic_and_stay_finite() {
        let cases = vec![
            chart(vec![], true),
            chart(vec![series("empty", &[])], true),
            chart(vec![series("one", &[(3.0, 3.0)])], true),
            chart(vec![series("zero", &[(0.0, 0.0), (0.0, 0.0)])], true),
            chart(vec![series("flat", &[(1.0, 5.0), (2.0, 5.0)])], true),
            chart(vec![series("vertical", &[(7.0, 1.0), (7.0, 2.0)])], true),
            chart(
                vec![series(
                    "nonfinite",
                    &[(f64::NAN, 1.0), (1.0, f64::INFINITY), (2.0, 2.0)],
                )],
                true,
            ),
            chart(
                vec![series("huge", &[(-f64::MAX, 0.0), (f64::MAX, 1.0)])],
                true,
            ),
            chart(
                vec![series("tiny", &[(1e-12, 3e-12), (2e-12, 4e-12)])],
                true,
            ),
        ];
        for c in &cases {
            let doc = svg(c);
            check_xml(&doc);
            let finite_points: usize = c
                .series
                .iter()
                .flat_map(|s| &s.points)
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .count();
            assert_eq!(count(&doc, "<circle"), finite_points, "{}", c.series.len());
            assert!(!doc.contains("NaN") && !doc.contains("inf"), "{doc}");
        }
    }

    #[test]
    fn output_is_deterministic() {
        let c = chart(
            (0..10)
                .map(|i| series(&format!("s{i}"), &[(i as f64, (i * i) as f64)]))
                .collect(),
            true,
        );
        assert_eq!(svg(&c), svg(&c.clone()));
        // Ten series over eight colours: series 0 and 8 share the first colour.
        let first = format!(r#"<g fill="{0}" stroke="{0}">"#, PALETTE[0]);
        assert_eq!(count(&svg(&c), &first), 2);
    }

    fn ticks_of(lo: f64, hi: f64) -> (Vec<f64>, Vec<String>) {
        let t = nice_ticks(lo, hi);
        (t.values, t.labels)
    }

    #[test]
    fn ticks_are_five_round_numbers_covering_the_range() {
        let (v, l) = ticks_of(0.0, 1.0);
        assert_eq!(v, [0.0, 0.25, 0.5, 0.75, 1.0]);
        assert_eq!(l, ["0.00", "0.25", "0.50", "0.75", "1.00"]);

        let (v, l) = ticks_of(0.0, 97.0);
        assert_eq!(v, [0.0, 25.0, 50.0, 75.0, 100.0]);
        assert_eq!(l, ["0", "25", "50", "75", "100"]);

        // A step of 5 from 10 stops at 30 < 31, so the step grows to 10.
        let (v, l) = ticks_of(12.0, 31.0);
        assert_eq!(v, [10.0, 20.0, 30.0, 40.0, 50.0]);
        assert_eq!(l, ["10", "20", "30", "40", "50"]);

        let (_, l) = ticks_of(-0.3, 0.1);
        assert_eq!(l, ["-0.3", "-0.2", "-0.1", "0.0", "0.1"]);

        let (_, l) = ticks_of(1e8, 2e8);
        assert_eq!(l, ["1e8", "1.25e8", "1.5e8", "1.75e8", "2e8"]);

        for (lo, hi) in [
            (0.0, 1.0),
            (3.3, 3.31),
            (-7.0, 1234.5),
            (1e-9, 5e-9),
            (-2.0, -1.0),
        ] {
            let t = nice_ticks(lo, hi);
            assert_eq!(t.values.len(), TICKS);
            assert!(t.first <= lo && t.last >= hi, "{lo}..{hi}: {:?}", t.values);
            let step = t.values[1] - t.values[0];
            for w in t.values.windows(2) {
                assert!(((w[1] - w[0]) - step).abs() <= step * 1e-9);
            }
        }
    }

    #[test]
    fn single_value_range_is_padded() {
        let mut r = Range::empty();
        r.add(5.0);
        // 5 +- 10%.
        assert_eq!(r.ticks().labels, ["4.50", "4.75", "5.00", "5.25", "5.50"]);
        let mut r = Range::empty();
        r.add(0.0);
        // 0 +- 1, and the middle tick is "0.0", not "-0.0".
        assert_eq!(r.ticks().labels, ["-1.0", "-0.5", "0.0", "0.5", "1.0"]);
        // No points at all: the unit range.
        assert_eq!(
            Range::empty().ticks().labels,
            ["0.00", "0.25", "0.50", "0.75", "1.00"]
        );
    }
}
