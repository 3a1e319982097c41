//! SVG plots for the report (plotters, SVG backend only; text is laid out
//! with plotters' built-in size estimate, so no font is needed).

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One row of a dot plot: a median (dot) with a whisker from `min` to `max`
/// (min..max over rounds, or p50..p99 for latency), its marks, or a failed run.
#[derive(Clone, Debug, Default)]
pub struct Bar {
    pub label: String,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// The report's marks on this figure ("" when none): drawn in red beside it.
    pub mark: String,
    /// A note on the figure ("no data moved"), drawn beside it in black.
    pub note: String,
    /// The run failed: the row says "failed" and has no dot.
    pub failed: bool,
}

/// One line: named points (x, y), each with an optional whisker top (p99)
/// and mark; a failed series has no points and says so in the legend.
#[derive(Clone, Debug, Default)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Whisker tops, one per point (empty: no whiskers).
    pub hi: Vec<f64>,
    /// The points the report marked (drawn ringed in red).
    pub marked: Vec<(f64, f64)>,
    pub failed: bool,
    /// A same-run floor: drawn dashed, in grey.
    pub floor: bool,
}

const W: u32 = 900;

/// A width that holds a title of 18 px (plotters writes it at 18/1.24 px) with margins.
fn title_width(t: &str) -> u32 {
    text_width(t.chars().count(), 18.0 / 1.24) as u32 + 40
}

/// The width plotters' layout and a viewer give a text of `chars` characters
/// at `size` px, at most (sans-serif averages about 0.55 em).
pub fn text_width(chars: usize, size: f64) -> f64 {
    chars as f64 * size * 0.62
}

/// Why a plot was not drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw: every figure failed or is not a positive number.
    #[error("no {0}")]
    Empty(&'static str),
    /// plotters refused to draw (its message).
    #[error("{0}")]
    Draw(String),
}

fn err<E: std::fmt::Display>(e: E) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// The palette's colour `i` (cycled).
fn colour(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
        RGBColor(31, 60, 120),
    ];
    C[i % C.len()]
}

const MARK: RGBColor = RGBColor(214, 39, 40);
const FLOOR: RGBColor = RGBColor(90, 90, 90);

/// A power of ten at or below `v` (and at or above for `up`), for log axes.
fn decade(v: f64, up: bool) -> f64 {
    let e = v.max(1e-9).log10();
    10f64.powf(if up { e.ceil() } else { e.floor() })
}

/// What an axis holds: nanoseconds (shown in one unit picked from the
/// range), or a quantity with its unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quantity<'a> {
    Ns,
    Other(&'a str),
}

/// The unit an axis over `lo..hi` shows and the divisor from its values:
/// for ns, ns, µs or ms by the range's geometric middle.
pub fn axis_unit(q: Quantity, lo: f64, hi: f64) -> (String, f64) {
    match q {
        Quantity::Ns => {
            let mid = (lo.max(1e-9) * hi.max(1e-9)).sqrt();
            if mid >= 1e6 {
                ("ms".into(), 1e6)
            } else if mid >= 1e3 {
                ("µs".into(), 1e3)
            } else {
                ("ns".into(), 1.0)
            }
        }
        Quantity::Other(u) => (u.to_string(), 1.0),
    }
}

/// A tick value in its axis' unit: k and M for large counts, enough
/// decimals for small ones, no trailing zeros.
pub fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        return format!("{}M", trim(format!("{:.2}", v / 1e6)));
    }
    if a >= 1e4 {
        return format!("{}k", trim(format!("{:.1}", v / 1e3)));
    }
    if a == 0.0 {
        return "0".into();
    }
    let digits = (2 - a.log10().floor() as i32).clamp(0, 9) as usize;
    trim(format!("{v:.digits$}"))
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A value with its unit, for the text beside a dot.
pub fn value_text(v: f64, q: Quantity) -> String {
    match q {
        Quantity::Ns if v >= 1e6 => format!("{:.2} ms", v / 1e6),
        Quantity::Ns if v >= 1e3 => format!("{:.2} µs", v / 1e3),
        Quantity::Ns => format!("{v:.1} ns"),
        Quantity::Other(u) if v >= 100.0 => format!("{v:.0} {u}"),
        Quantity::Other(u) => format!("{v:.2} {u}"),
    }
}

/// A dot plot, one row per path: the median as a dot with its whisker, its
/// value (and marks, in red) in a right-hand column, failed rows saying so.
/// The axis is logarithmic when the values span 10x or more (dots, never
/// bars, so no baseline is implied), else linear from zero. `floor`, when
/// given, is drawn as a dashed vertical line with its name.
pub struct DotPlot<'a> {
    pub title: &'a str,
    /// What the axis measures, without its unit ("time per guest access").
    pub what: &'a str,
    pub q: Quantity<'a>,
    /// What the whisker spans, for the axis label ("min..max over rounds").
    pub whisker: &'a str,
    pub floor: Option<(f64, String)>,
}

pub fn dots(p: &DotPlot, bars: &[Bar]) -> Result<String, PlotError> {
    let ok: Vec<&Bar> = bars.iter().filter(|b| !b.failed && b.median.is_finite() && b.median > 0.0).collect();
    if ok.is_empty() {
        return Err(PlotError::Empty("figures"));
    }
    let vals =
        || ok.iter().flat_map(|b| [b.min, b.median, b.max]).chain(p.floor.iter().map(|f| f.0)).filter(|v| *v > 0.0);
    let lo = vals().fold(f64::INFINITY, f64::min);
    let hi = vals().fold(0.0, f64::max);
    let log = hi / lo >= 10.0;
    let (x0, x1) = if log { (decade(lo, false), decade(hi * 1.01, true)) } else { (0.0, hi * 1.1) };
    let (unit, div) = if log { axis_unit(p.q, x0, x1) } else { axis_unit(p.q, hi / 10.0, hi) };
    let text_of = |b: &Bar| -> String {
        if b.failed || !(b.median.is_finite() && b.median > 0.0) {
            return "failed".into();
        }
        [value_text(b.median, p.q), b.note.clone(), b.mark.clone()]
            .into_iter()
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let left = bars.iter().map(|b| text_width(b.label.chars().count(), 14.0)).fold(120.0, f64::max) as u32 + 16;
    let right = bars.iter().map(|b| text_width(text_of(b).chars().count(), 13.0)).fold(80.0, f64::max) as u32 + 16;
    let width = (left + right + 520).max(W).max(title_width(p.title));
    let n = bars.len();
    let height = 150 + 34 * n as u32;
    let desc =
        format!("{}, {unit}{} — dot: median, whisker: {}", p.what, if log { " (log scale)" } else { "" }, p.whisker);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        // The title over the whole picture, not just the plot left of the values.
        root.draw(&Text::new(
            p.title,
            (width as i32 / 2, 10),
            ("sans-serif", 18).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top)),
        ))
        .map_err(err)?;
        let (plot_area, _) = root.split_horizontally(width - right);
        let mut chart = ChartBuilder::on(&plot_area)
            .margin(12)
            .margin_top(40)
            .x_label_area_size(48)
            .y_label_area_size(left)
            .build_cartesian_2d(x0..x1, 0f64..n as f64)
            .map_err(err)?;
        // Ticks: the linear range's own; on a log axis, the decades and their 2x and 5x.
        let ticks: Vec<f64> = if log {
            let mut t = Vec::new();
            let mut d = x0;
            while d <= x1 * 1.0001 {
                t.extend([d, 2.0 * d, 5.0 * d].into_iter().filter(|v| *v <= x1 * 1.0001));
                d *= 10.0;
            }
            t
        } else {
            let step = nice_step(x1 / 6.0);
            (0..).map(|k| k as f64 * step).take_while(|v| *v <= x1).collect()
        };
        let pos = |v: f64| if log { (v.log10() - x0.log10()) / (x1.log10() - x0.log10()) } else { v / x1 };
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_y_axis()
            .x_labels(0)
            .x_desc(desc.clone())
            .axis_desc_style(("sans-serif", 14))
            .draw()
            .map_err(err)?;
        let ((px0, px1), (py0, py1)) = {
            let (xr, yr) = chart.plotting_area().get_pixel_range();
            ((xr.start, xr.end), (yr.start, yr.end))
        };
        let xpix = |v: f64| px0 + ((px1 - px0) as f64 * pos(v)).round() as i32;
        for t in &ticks {
            let x = xpix(*t);
            root.draw(&PathElement::new(vec![(x, py0), (x, py1)], RGBColor(225, 225, 225))).map_err(err)?;
            root.draw(&Text::new(
                tick(t / div),
                (x, py1 + 6),
                ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top)),
            ))
            .map_err(err)?;
        }
        let ypix = |row: usize| py0 + ((py1 - py0) as f64 * (row as f64 + 0.5) / n as f64).round() as i32;
        for (i, b) in bars.iter().enumerate() {
            let y = ypix(i);
            let failed = text_of(b) == "failed";
            root.draw(&Text::new(
                b.label.clone(),
                (px0 - 8, y),
                ("sans-serif", 14).into_font().color(&BLACK).pos(Pos::new(HPos::Right, VPos::Center)),
            ))
            .map_err(err)?;
            let c = if b.mark.is_empty() { colour(i) } else { MARK };
            if !failed {
                if b.max > b.min && b.min > 0.0 {
                    let (a, z) = (xpix(b.min.max(x0)), xpix(b.max.min(x1)));
                    root.draw(&PathElement::new(vec![(a, y), (z, y)], BLACK.stroke_width(1))).map_err(err)?;
                    for e in [a, z] {
                        root.draw(&PathElement::new(vec![(e, y - 5), (e, y + 5)], BLACK)).map_err(err)?;
                    }
                }
                root.draw(&Circle::new((xpix(b.median), y), 6, c.filled())).map_err(err)?;
                if !b.mark.is_empty() {
                    root.draw(&Circle::new((xpix(b.median), y), 10, MARK.stroke_width(2))).map_err(err)?;
                }
            }
            let tc = if failed || !b.mark.is_empty() { MARK } else { BLACK };
            root.draw(&Text::new(
                text_of(b),
                ((width - right) as i32 + 4, y),
                ("sans-serif", 13).into_font().color(&tc).pos(Pos::new(HPos::Left, VPos::Center)),
            ))
            .map_err(err)?;
        }
        if let Some((v, name)) = &p.floor {
            let x = xpix(*v);
            root.draw(&PathElement::new(vec![(x, py0), (x, py1)], FLOOR.stroke_width(2))).map_err(err)?;
            // The name on the side of the line with room for it.
            let (tx, h) = if x > (px0 + px1) / 2 { (x - 4, HPos::Right) } else { (x + 4, HPos::Left) };
            root.draw(&Text::new(
                format!("{name}: {}", value_text(*v, p.q)),
                (tx, py0 + 2),
                ("sans-serif", 12).into_font().color(&FLOOR).pos(Pos::new(h, VPos::Top)),
            ))
            .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// 1, 2 or 5 times a power of ten, at or above `v`.
fn nice_step(v: f64) -> f64 {
    let d = decade(v, false);
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|k| k * d).find(|s| *s >= v).unwrap_or(10.0 * d)
}

/// Axes of a line plot.
pub struct Axes<'a> {
    pub title: &'a str,
    /// What each axis measures, without its unit; the unit comes from `x_q`/`y_q`.
    pub x_what: &'a str,
    pub x_q: Quantity<'a>,
    pub y_what: &'a str,
    pub y_q: Quantity<'a>,
    pub log_x: bool,
    /// Logarithmic y: always, never, or (None) when the values span 10x or more.
    pub log_y: Option<bool>,
    /// Y from 0 (linear) instead of from the data's minimum.
    pub y_zero: bool,
    /// Where the legend goes: where the lines leave room.
    pub legend: Legend,
}

/// A legend's corner.
#[derive(Clone, Copy, Debug)]
pub enum Legend {
    UpperLeft,
    LowerRight,
}

/// Lines with points (and whiskers, marks, floors) and a legend naming
/// each series, failed ones too.
pub fn lines(a: &Axes, series: &[Series]) -> Result<String, PlotError> {
    let fin = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite() && (!a.log_x || x > 0.0);
    let pts = || {
        series
            .iter()
            .flat_map(|s| s.points.iter().copied().chain(s.points.iter().zip(&s.hi).map(|(p, h)| (p.0, *h))))
            .filter(fin)
    };
    if pts().next().is_none() {
        return Err(PlotError::Empty("points"));
    }
    let (mut x0, mut x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| (a.min(x), b.max(x)));
    let (mut y0, mut y1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (_, y)| (a.min(y), b.max(y)));
    let log_y = a.log_y.unwrap_or(y0 > 0.0 && y1 / y0 >= 10.0) && y0 > 0.0;
    if a.log_x {
        (x0, x1) = (x0 / 1.25, x1 * 1.25);
    } else if x1 <= x0 {
        (x0, x1) = (x0 - 1.0, x1 + 1.0);
    }
    if log_y {
        (y0, y1) = (decade(y0, false), decade(y1 * 1.01, true));
    } else {
        if a.y_zero {
            y0 = 0.0;
        }
        y1 = if y1 > y0 { y1 + (y1 - y0) * 0.08 } else { y0 + 1.0 };
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W.max(title_width(a.title)), 580)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let scale = |log: bool| if log { " (log scale)" } else { "" };
        let (xu, xd) = axis_unit(a.x_q, x0, x1);
        let (yu, yd) = axis_unit(a.y_q, y0.max(y1 / 1e3), y1);
        let l = Labels {
            x_desc: format!("{}, {xu}{}", a.x_what, scale(a.log_x)),
            y_desc: format!("{}, {yu}{}", a.y_what, scale(log_y)),
            xd,
            yd,
        };
        // A log x has its ticks at the data's own x values (iodepths) when
        // there are few, not at plotters' dense 1..9 per decade.
        let mut xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).filter(|x| *x > 0.0).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let keyed = a.log_x && (2..=8).contains(&xs.len());
        // The combinations of linear, log and keyed axes, one generic body.
        match (a.log_x, keyed, log_y) {
            (false, _, false) => draw(&root, a, &l, series, x0..x1, y0..y1)?,
            (false, _, true) => draw(&root, a, &l, series, x0..x1, (y0..y1).log_scale())?,
            (true, true, false) => draw(&root, a, &l, series, (x0..x1).log_scale().with_key_points(xs), y0..y1)?,
            (true, true, true) => {
                draw(&root, a, &l, series, (x0..x1).log_scale().with_key_points(xs), (y0..y1).log_scale())?
            }
            (true, false, false) => draw(&root, a, &l, series, (x0..x1).log_scale(), y0..y1)?,
            (true, false, true) => draw(&root, a, &l, series, (x0..x1).log_scale(), (y0..y1).log_scale())?,
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Axis descriptions and the divisors of their ticks.
struct Labels {
    x_desc: String,
    y_desc: String,
    xd: f64,
    yd: f64,
}

fn draw<X, Y>(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    a: &Axes,
    l: &Labels,
    series: &[Series],
    x: X,
    y: Y,
) -> Result<(), PlotError>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(a.title, ("sans-serif", 18))
        .margin(16)
        .margin_right(28)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .x_labels(8)
        .x_desc(l.x_desc.as_str())
        .y_desc(l.y_desc.as_str())
        .axis_desc_style(("sans-serif", 14))
        .x_label_formatter(&|v| tick(*v / l.xd))
        .y_label_formatter(&|v| tick(*v / l.yd))
        .draw()
        .map_err(err)?;
    let mut k = 0;
    for s in series {
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        if s.failed || pts.is_empty() {
            chart
                .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
                .map_err(err)?
                .label(format!("{}: failed (no figures)", s.name))
                .legend(|(x, y)| Cross::new((x + 9, y), 5, MARK.stroke_width(2)));
            continue;
        }
        if s.floor {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, FLOOR.stroke_width(2)))
                .map_err(err)?
                .label(s.name.clone())
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], FLOOR.stroke_width(2)));
            continue;
        }
        let c = colour(k);
        k += 1;
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled()))).map_err(err)?;
        for (p, h) in s.points.iter().zip(&s.hi).filter(|(p, h)| h.is_finite() && **h > p.1) {
            chart
                .draw_series(std::iter::once(PathElement::new(vec![*p, (p.0, *h)], c.stroke_width(1))))
                .map_err(err)?;
            // A cap at p99.
            let cap = chart.backend_coord(&(p.0, *h));
            root.draw(&PathElement::new(vec![(cap.0 - 5, cap.1), (cap.0 + 5, cap.1)], c.stroke_width(1)))
                .map_err(err)?;
        }
        chart.draw_series(s.marked.iter().map(|&p| Circle::new(p, 9, MARK.stroke_width(2)))).map_err(err)?;
    }
    if series.iter().any(|s| !s.marked.is_empty()) {
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
            .map_err(err)?
            .label("ringed: marked, see report.md")
            .legend(|(x, y)| Circle::new((x + 9, y), 6, MARK.stroke_width(2)));
    }
    if series.iter().any(|s| !s.hi.is_empty()) {
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
            .map_err(err)?
            .label("dot: p50, whisker: up to p99")
            .legend(|(x, y)| PathElement::new(vec![(x + 9, y - 6), (x + 9, y + 6)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(match a.legend {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        })
        .draw()
        .map_err(err)?;
    Ok(())
}
