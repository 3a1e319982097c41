//! SVG plots for the report (plotters, SVG backend only; text is laid out
//! with plotters' built-in size estimate, so no font is needed).

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

/// One bar: a path's cost, median with its min..max.
#[derive(Clone, Debug)]
pub struct Bar {
    pub label: String,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// One line: named points (x, y).
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const W: u32 = 900;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The palette's colour `i` (cycled).
fn colour(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// A power of ten at or below `v` (and at or above for `up`), for log axes.
fn decade(v: f64, up: bool) -> f64 {
    let e = v.max(1e-9).log10();
    10f64.powf(if up { e.ceil() } else { e.floor() })
}

/// Horizontal bars on a log axis, one per path, with min..max whiskers and the median written at the bar's end.
pub fn cost_bars(title: &str, unit: &str, bars: &[Bar]) -> Result<String, String> {
    let bars: Vec<&Bar> = bars.iter().filter(|b| b.median.is_finite() && b.median > 0.0).collect();
    if bars.is_empty() {
        return Err("no bars".into());
    }
    let lo = decade(bars.iter().map(|b| b.min.min(b.median)).fold(f64::INFINITY, f64::min), false);
    let hi = decade(bars.iter().map(|b| b.max.max(b.median)).fold(0.0, f64::max) * 3.0, true);
    let n = bars.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, 120 + 36 * n as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(220)
            .build_cartesian_2d((lo..hi).log_scale(), 0f64..n as f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_desc(format!("{unit} per access (log scale)"))
            .x_label_formatter(&|v| axis_value(*v, unit))
            .draw()
            .map_err(err)?;
        for (i, b) in bars.iter().enumerate() {
            // Bar i sits in the band [n-1-i, n-i): the first bar on top.
            let y = (n - 1 - i) as f64;
            let c = colour(i);
            chart
                .draw_series(std::iter::once(Rectangle::new([(lo, y + 0.2), (b.median, y + 0.8)], c.filled())))
                .map_err(err)?;
            if b.max > b.min {
                chart
                    .draw_series(std::iter::once(PathElement::new(vec![(b.min, y + 0.5), (b.max, y + 0.5)], BLACK)))
                    .map_err(err)?;
            }
            chart
                .draw_series(std::iter::once(Text::new(
                    format!(" {}", fmt_value(b.median, unit)),
                    (b.max.max(b.median), y + 0.65),
                    ("sans-serif", 13),
                )))
                .map_err(err)?;
        }
        // Labels in the left margin, one per bar.
        let area = chart.plotting_area();
        let (px, _) = area.get_pixel_range();
        for (i, b) in bars.iter().enumerate() {
            let y = (n - 1 - i) as f64;
            let (_, py) = chart.backend_coord(&(lo, y + 0.5));
            root.draw(&Text::new(
                b.label.clone(),
                (px.start - 210, py - 7),
                ("sans-serif", 14).into_font().color(&BLACK),
            ))
            .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// An axis tick: ns as ns, us or ms; others short.
fn axis_value(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v >= 1e6 => format!("{} ms", short(v / 1e6)),
        "ns" if v >= 1e3 => format!("{} us", short(v / 1e3)),
        "ns" => format!("{} ns", short(v)),
        _ => short(v),
    }
}

fn fmt_value(v: f64, unit: &str) -> String {
    if unit == "ns" && v >= 1000.0 {
        format!("{:.2} us", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else {
        format!("{v:.1} {unit}")
    }
}

/// Axes of a line plot.
pub struct Axes<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub log_x: bool,
    pub log_y: bool,
    /// Y from 0 (linear) instead of from the data's minimum.
    pub y_zero: bool,
    /// The axes hold nanoseconds: ticks read ns, us or ms.
    pub x_ns: bool,
    pub y_ns: bool,
    /// Where the legend goes: where the lines leave room.
    pub legend: Legend,
}

/// A legend's corner.
#[derive(Clone, Copy, Debug)]
pub enum Legend {
    UpperLeft,
    LowerRight,
}

/// Lines with points and a legend naming each series.
pub fn lines(a: &Axes, series: &[Series]) -> Result<String, String> {
    let pts = || series.iter().flat_map(|s| s.points.iter()).filter(|(x, y)| x.is_finite() && y.is_finite());
    if pts().next().is_none() {
        return Err("no points".into());
    }
    let (mut x0, mut x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &(x, _)| (a.min(x), b.max(x)));
    let (mut y0, mut y1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &(_, y)| (a.min(y), b.max(y)));
    if a.log_x {
        (x0, x1) = (x0.max(1e-9) / 1.25, x1.max(1e-9) * 1.25);
    } else if x1 <= x0 {
        (x0, x1) = (x0 - 1.0, x1 + 1.0);
    }
    if a.log_y {
        (y0, y1) = (decade(y0, false), decade(y1 * 1.01, true));
    } else {
        if a.y_zero {
            y0 = 0.0;
        }
        y1 = if y1 > y0 { y1 + (y1 - y0) * 0.08 } else { y0 + 1.0 };
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        // Four combinations of linear and log axes, one generic body.
        match (a.log_x, a.log_y) {
            (false, false) => draw(&root, a, series, x0..x1, y0..y1)?,
            (true, false) => draw(&root, a, series, (x0..x1).log_scale(), y0..y1)?,
            (false, true) => draw(&root, a, series, x0..x1, (y0..y1).log_scale())?,
            (true, true) => draw(&root, a, series, (x0..x1).log_scale(), (y0..y1).log_scale())?,
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn draw<X, Y>(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    a: &Axes,
    series: &[Series],
    x: X,
    y: Y,
) -> Result<(), String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(a.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(a.x_desc)
        .y_desc(a.y_desc)
        .x_label_formatter(&|v| if a.x_ns { axis_value(*v, "ns") } else { short(*v) })
        .y_label_formatter(&|v| if a.y_ns { axis_value(*v, "ns") } else { short(*v) })
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let c = colour(i);
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(match a.legend {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        })
        .draw()
        .map_err(err)?;
    Ok(())
}

/// 1234567 -> "1.23M": short axis labels.
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 1.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}
