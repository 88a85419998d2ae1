//! PNG plots with plotters' bitmap backend: TTFT CDF per leg, and TTFT P99 over time per leg.
//! Text is drawn with the bundled DejaVu Sans (assets/fonts, Bitstream Vera license),
//! registered with plotters' ab_glyph renderer at first use.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

/// The bundled font (assets/fonts/DejaVuSans.ttf).
static FONT_BYTES: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

const PLOT_SIZE: (u32, u32) = (1200, 720);
/// Most points drawn per CDF line.
const CDF_POINTS: usize = 2_000;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("the bundled font could not be registered")]
    Font,
    #[error("drawing {path}: {message}")]
    Draw { path: String, message: String },
}

/// One leg's TTFTs: (send time, TTFT), simulated seconds and milliseconds.
#[derive(Debug, Clone)]
pub struct LegSeries {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub(crate) fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT_BYTES).is_ok()
    });
    if registered {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

fn draw_error(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError::Draw {
        path: path.display().to_string(),
        message,
    }
}

/// The empirical CDF of a leg's TTFTs, thinned to at most `CDF_POINTS` points.
pub fn cdf_points(ttfts_ms: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = ttfts_ms
        .iter()
        .copied()
        .filter(|value| value.is_finite())
        .collect();
    sorted.sort_by(f64::total_cmp);
    let count = sorted.len();
    let step = count.div_ceil(CDF_POINTS).max(1);
    let mut points: Vec<(f64, f64)> = sorted
        .iter()
        .enumerate()
        .filter(|(index, _)| index % step == 0 || index + 1 == count)
        .map(|(index, value)| (*value, (index + 1) as f64 / count as f64))
        .collect();
    points.dedup_by(|later, earlier| later.0 == earlier.0 && later.1 == earlier.1);
    points
}

/// P99 of TTFT in consecutive windows of `window_s` simulated seconds: (window middle, P99).
pub fn windowed_p99(points: &[(f64, f64)], window_s: f64) -> Vec<(f64, f64)> {
    if points.is_empty() || window_s <= 0.0 {
        return Vec::new();
    }
    let last = points.iter().map(|point| point.0).fold(0.0, f64::max);
    let windows = (last / window_s).floor() as usize + 1;
    let mut buckets: Vec<Vec<f64>> = vec![Vec::new(); windows];
    for &(send_s, ttft_ms) in points {
        let bucket = ((send_s.max(0.0) / window_s).floor() as usize).min(windows - 1);
        buckets[bucket].push(ttft_ms);
    }
    buckets
        .into_iter()
        .enumerate()
        .filter(|(_, bucket)| !bucket.is_empty())
        .map(|(index, mut bucket)| {
            bucket.sort_by(f64::total_cmp);
            // Nearest-rank P99.
            let rank = ((bucket.len() as f64 * 0.99).ceil() as usize).clamp(1, bucket.len());
            ((index as f64 + 0.5) * window_s, bucket[rank - 1])
        })
        .collect()
}

/// Draws the TTFT CDF of every leg (log-scale x).
pub fn ttft_cdf(path: &Path, legs: &[LegSeries], title: &str) -> Result<(), PlotError> {
    register_font()?;
    let draw = draw_error(path);
    let curves: Vec<(String, Vec<(f64, f64)>)> = legs
        .iter()
        .map(|leg| {
            let ttfts: Vec<f64> = leg.points.iter().map(|point| point.1.max(0.01)).collect();
            (leg.name.clone(), cdf_points(&ttfts))
        })
        .collect();
    let all = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|point| point.0));
    let (low, high) = all.fold((f64::MAX, f64::MIN), |(low, high), value| {
        (low.min(value), high.max(value))
    });
    let (low, high) = if low <= high {
        (low * 0.9, high * 1.1)
    } else {
        (1.0, 10.0)
    };

    let root = BitMapBackend::new(path, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(70)
        .build_cartesian_2d((low..high).log_scale(), 0.0..1.0)
        .map_err(|error| draw(error.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, simulated time, log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|value| format!("{value:.0}"))
        .y_label_formatter(&|value| format!("{value:.1}"))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    for (index, (name, points)) in curves.into_iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(3)))
            .map_err(|error| draw(error.to_string()))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    root.present().map_err(|error| draw(error.to_string()))
}

/// Draws each leg's TTFT P99 per time window across the leg.
pub fn ttft_over_time(
    path: &Path,
    legs: &[LegSeries],
    window_s: f64,
    title: &str,
) -> Result<(), PlotError> {
    register_font()?;
    let draw = draw_error(path);
    let curves: Vec<(String, Vec<(f64, f64)>)> = legs
        .iter()
        .map(|leg| (leg.name.clone(), windowed_p99(&leg.points, window_s)))
        .collect();
    let max_x = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|point| point.0))
        .fold(window_s, f64::max)
        + window_s / 2.0;
    let max_y = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|point| point.1))
        .fold(1.0, f64::max)
        * 1.1;

    let root = BitMapBackend::new(path, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)
        .map_err(|error| draw(error.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(format!(
            "time into the leg (s, simulated; {window_s:.0} s windows)"
        ))
        .y_desc("TTFT P99 (ms, simulated)")
        .x_label_formatter(&|value| format!("{value:.0}"))
        .y_label_formatter(&|value| format!("{value:.0}"))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    for (index, (name, points)) in curves.into_iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|error| draw(error.to_string()))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    root.present().map_err(|error| draw(error.to_string()))
}

/// One line of an x/y chart: its name and points.
#[derive(Debug, Clone)]
pub struct XySeries {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed-looking (thinner) to set it apart, e.g. external routers.
    pub secondary: bool,
}

/// Draws lines with a marker at every point over integer-like x values (router cores); the
/// y range covers every point and zero.
pub fn xy_lines(
    path: &Path,
    series: &[XySeries],
    title: &str,
    x_desc: &str,
    y_desc: &str,
) -> Result<(), PlotError> {
    register_font()?;
    let draw = draw_error(path);
    let xs = series
        .iter()
        .flat_map(|line| line.points.iter().map(|point| point.0));
    let (x_low, x_high) = xs.fold((f64::MAX, f64::MIN), |(low, high), value| {
        (low.min(value), high.max(value))
    });
    let (x_low, x_high) = if x_low <= x_high {
        (x_low - 0.5, x_high + 0.5)
    } else {
        (0.5, 1.5)
    };
    let ys = series
        .iter()
        .flat_map(|line| line.points.iter().map(|point| point.1))
        .filter(|value| value.is_finite());
    let (y_low, y_high) = ys.fold((0.0f64, 0.0f64), |(low, high), value| {
        (low.min(value), high.max(value))
    });
    let span = (y_high - y_low).max(1e-3);
    let (y_low, y_high) = (
        if y_low < 0.0 { y_low - span * 0.1 } else { 0.0 },
        y_high + span * 0.1,
    );

    let root = BitMapBackend::new(path, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(90)
        .build_cartesian_2d(x_low..x_high, y_low..y_high)
        .map_err(|error| draw(error.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(((x_high - x_low).round() as usize + 1).min(20))
        .x_label_formatter(&|value| {
            if (value - value.round()).abs() < 1e-6 {
                format!("{value:.0}")
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|value| {
            if span >= 100.0 {
                format!("{value:.0}")
            } else {
                format!("{value:.3}")
            }
        })
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    for (index, line) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let width = if line.secondary { 1 } else { 3 };
        let points: Vec<(f64, f64)> = line
            .points
            .iter()
            .copied()
            .filter(|point| point.1.is_finite())
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))
            .map_err(|error| draw(error.to_string()))?
            .label(line.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(width))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|point| Circle::new(point, 5, color.filled())),
            )
            .map_err(|error| draw(error.to_string()))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    root.present().map_err(|error| draw(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_monotone_ends_at_one_and_is_thinned() {
        let values: Vec<f64> = (0..10_000).rev().map(f64::from).collect();
        let points = cdf_points(&values);
        assert!(points.len() <= CDF_POINTS + 1);
        assert_eq!(points.last().copied(), Some((9999.0, 1.0)));
        assert!(
            points
                .windows(2)
                .all(|pair| pair[0].0 <= pair[1].0 && pair[0].1 < pair[1].1)
        );
    }

    #[test]
    fn windowed_p99_uses_nearest_rank_per_window() {
        let mut points: Vec<(f64, f64)> = (1..=100).map(|value| (1.0, f64::from(value))).collect();
        points.push((25.0, 7.0));
        assert_eq!(windowed_p99(&points, 10.0), vec![(5.0, 99.0), (25.0, 7.0)]);
    }

    #[test]
    fn plots_are_written_as_png() {
        let directory =
            std::env::temp_dir().join(format!("myelin-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let legs = vec![
            LegSeries {
                name: "round-robin".into(),
                points: (0..500)
                    .map(|index| (f64::from(index) * 0.2, 100.0 + f64::from(index % 97) * 20.0))
                    .collect(),
            },
            LegSeries {
                name: "oracle".into(),
                points: (0..500)
                    .map(|index| (f64::from(index) * 0.2, 50.0 + f64::from(index % 31) * 5.0))
                    .collect(),
            },
        ];
        let cdf = directory.join("cdf.png");
        let over_time = directory.join("over_time.png");
        ttft_cdf(&cdf, &legs, "TTFT CDF").unwrap();
        ttft_over_time(&over_time, &legs, 10.0, "TTFT P99 over time").unwrap();
        let xy = directory.join("xy.png");
        xy_lines(
            &xy,
            &[
                XySeries {
                    name: "myelin short".into(),
                    points: vec![(1.0, 20_000.0), (2.0, 39_000.0)],
                    secondary: false,
                },
                XySeries {
                    name: "other short".into(),
                    points: vec![(1.0, -0.2)],
                    secondary: true,
                },
            ],
            "req/s vs router cores",
            "router cores",
            "req/s",
        )
        .unwrap();
        for path in [&cdf, &over_time, &xy] {
            let bytes = std::fs::read(path).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        }
        let _ = std::fs::remove_dir_all(directory);
    }
}
