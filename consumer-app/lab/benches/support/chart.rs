//! The report's SVG: messages/s per row, one bar per concurrency, log scale.

use plotters::prelude::*;

/// One row of the chart: a label and its rate at each concurrency (`None`:
/// not measured).
pub(crate) struct Bars {
    pub(crate) label: String,
    pub(crate) rates: Vec<Option<f64>>,
}

const COLOURS: [RGBColor; 4] = [
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0x55, 0xa8, 0x68),
    RGBColor(0xc4, 0x4e, 0x52),
];

/// Draws `rows` as grouped horizontal bars into an SVG string.
pub(crate) fn svg(title: &str, tasks: &[usize], rows: &[Bars]) -> Result<String, String> {
    let mut out = String::new();
    let bar_h = 9_u32;
    let group_h = bar_h * u32::try_from(tasks.len()).unwrap_or(3) + 10;
    let height = 110 + group_h * u32::try_from(rows.len()).unwrap_or(1);
    {
        let root = SVGBackend::with_string(&mut out, (1000, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let max = rows
            .iter()
            .flat_map(|r| r.rates.iter().flatten())
            .fold(10.0_f64, |a, b| a.max(*b));
        let n = rows.len() as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(300)
            .build_cartesian_2d((10.0_f64..max * 2.0).log_scale(), 0.0_f64..n)
            .map_err(|e| e.to_string())?;
        let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("messages/s (log scale)")
            .y_labels(rows.len() * 2 + 1)
            .y_label_formatter(&|y| {
                // Labels at the middle of each group.
                let i = (n - y - 0.5).round();
                if ((n - y) - 0.5 - i).abs() < 0.01 && i >= 0.0 && (i as usize) < labels.len() {
                    labels[i as usize].clone()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(|e| e.to_string())?;
        let k = tasks.len() as f64;
        for (c, &t) in tasks.iter().enumerate() {
            let colour = COLOURS[c % COLOURS.len()];
            let bars = rows.iter().enumerate().filter_map(|(i, row)| {
                let rate = row.rates.get(c).copied().flatten()?;
                // Row i from the top; each group 1 unit high, bars inside.
                let top = n - i as f64 - 0.1 - 0.8 * c as f64 / k;
                let bottom = top - 0.8 / k;
                Some(Rectangle::new(
                    [(10.0, bottom), (rate.max(10.0), top)],
                    colour.filled(),
                ))
            });
            chart
                .draw_series(bars)
                .map_err(|e| e.to_string())?
                .label(format!("{t} concurrent"))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}
