//! What a run leaves besides its checkpoint: the per-step figures as JSON Lines (`--metrics`)
//! and the loss curve as an SVG picture (training loss per step, held-out points, the
//! references the run prints as horizontal lines).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use crate::error::{AppResult, Context};

/// One training step's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f32,
    /// Items (tokens, images) per second since the run began.
    pub items_per_sec: f64,
    /// The step's bubble fraction (simulated in simulated mode, else measured).
    pub bubble: f64,
    pub lr: f32,
    pub loss_scale: Option<f32>,
    /// Skipped (loss scaling found an overflow): its loss is not a training loss.
    pub skipped: bool,
}

/// The metrics file: one JSON object per step, the held-out figure (`name`, value) on the
/// step after which it was measured.
pub fn metrics_jsonl(steps: &[StepMetrics], held_out: Option<(&str, u64, f32)>) -> String {
    let mut out = String::new();
    for m in steps {
        let mut line = json!({
            "step": m.step,
            // A non-finite loss (an overflowed, skipped step) is no JSON number.
            "loss": m.loss.is_finite().then_some(m.loss),
            "items_per_sec": m.items_per_sec,
            "bubble": m.bubble,
            "lr": m.lr,
            "loss_scale": m.loss_scale,
            "skipped": m.skipped,
        });
        if let Some((name, _, value)) = held_out.filter(|h| h.1 == m.step) {
            line[name] = json!(value);
        }
        let _ = writeln!(out, "{line}");
    }
    out
}

/// Writes [`metrics_jsonl`] to `path` (creating its folder).
pub fn write_metrics(
    path: &Path,
    steps: &[StepMetrics],
    held_out: Option<(&str, u64, f32)>,
) -> AppResult<()> {
    crate::output::create_parent(path)?;
    std::fs::write(path, metrics_jsonl(steps, held_out))
        .context(format!("writing {}", path.display()))
}

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 420.0;
/// Margins: left (the loss axis), right, top (the title), bottom (the step axis).
const MARGIN: [f64; 4] = [60.0, 150.0, 40.0, 40.0];

/// The loss curve: one polyline point per step that has a finite loss, a dot per held-out
/// figure (step, loss), a dashed line per reference (label, loss).
pub fn loss_svg(
    steps: &[StepMetrics],
    held_out: &[(u64, f32)],
    references: &[(String, f32)],
    title: &str,
) -> String {
    let finite: Vec<&StepMetrics> = steps.iter().filter(|m| m.loss.is_finite()).collect();
    let first = steps.first().map_or(0, |m| m.step) as f64;
    let last = steps.last().map_or(1, |m| m.step).max(first as u64 + 1) as f64;
    let top = finite
        .iter()
        .map(|m| m.loss)
        .chain(held_out.iter().map(|h| h.1))
        .chain(references.iter().map(|r| r.1))
        .fold(0.0f32, f32::max)
        .max(1e-6) as f64
        * 1.05;
    let [left, right, upper, lower] = MARGIN;
    let x = |step: f64| left + (step - first) / (last - first) * (WIDTH - left - right);
    let y = |loss: f64| HEIGHT - lower - loss / top * (HEIGHT - upper - lower);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="24" font-size="15">{}</text>"#,
        escape(title)
    );
    // Axes, with the loss at 0, half and the top, and the first and last step.
    let (x0, x1, y0) = (x(first), x(last), y(0.0));
    let _ = writeln!(
        s,
        r#"<path d="M{x0:.1},{:.1} V{y0:.1} H{x1:.1}" stroke="black" fill="none"/>"#,
        y(top)
    );
    for frac in [0.0, 0.5, 1.0] {
        let v = top / 1.05 * frac;
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{v:.2}</text>"#,
            x0 - 6.0,
            y(v) + 4.0
        );
    }
    for step in [first, last] {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step {step}</text>"#,
            x(step),
            y0 + 18.0
        );
    }
    for (label, value) in references {
        let yv = y(*value as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{x0:.1}" y1="{yv:.1}" x2="{x1:.1}" y2="{yv:.1}" stroke="#888" stroke-dasharray="5,4"/>"##
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#555">{} {value:.2}</text>"##,
            x1 + 6.0,
            yv + 4.0,
            escape(label)
        );
    }
    let points: Vec<String> = finite
        .iter()
        .map(|m| format!("{:.1},{:.1}", x(m.step as f64), y(m.loss as f64)))
        .collect();
    let _ = writeln!(
        s,
        r##"<polyline class="training-loss" points="{}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>"##,
        points.join(" ")
    );
    for (step, value) in held_out {
        let _ = writeln!(
            s,
            r##"<circle class="held-out" cx="{:.1}" cy="{:.1}" r="4" fill="#d62728"/>"##,
            x(*step as f64),
            y(*value as f64)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" fill="#1f77b4">training loss</text>"##,
        x1 + 6.0,
        upper + 10.0
    );
    if !held_out.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#d62728">held-out loss</text>"##,
            x1 + 6.0,
            upper + 26.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Writes [`loss_svg`] to `path` (creating its folder).
pub fn write_loss_svg(
    path: &Path,
    steps: &[StepMetrics],
    held_out: &[(u64, f32)],
    references: &[(String, f32)],
    title: &str,
) -> AppResult<()> {
    crate::output::create_parent(path)?;
    std::fs::write(path, loss_svg(steps, held_out, references, title))
        .context(format!("writing {}", path.display()))
}

/// After training, on rank 0: the loss curve beside the timeline (`loss_name` in its folder)
/// and, when asked, the metrics file.
pub fn write_curves(
    steps: &[StepMetrics],
    held_out: Option<(&str, u64, f32)>,
    references: &[(String, f32)],
    title: &str,
    timeline: &Path,
    loss_name: &str,
    metrics: Option<&Path>,
) -> AppResult<()> {
    if !crate::output::is_root() {
        return Ok(());
    }
    let loss_svg = timeline.with_file_name(loss_name);
    // The curve shows held-out losses (an accuracy has another scale).
    let dots: Vec<(u64, f32)> = held_out
        .filter(|(name, _, _)| name.ends_with("loss"))
        .map(|(_, step, v)| (step, v))
        .into_iter()
        .collect();
    write_loss_svg(&loss_svg, steps, &dots, references, title)?;
    println!("wrote the loss curve to {}", loss_svg.display());
    if let Some(path) = metrics {
        write_metrics(path, steps, held_out)?;
        println!(
            "wrote the metrics of {} steps to {}",
            steps.len(),
            path.display()
        );
    }
    Ok(())
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(n: u64) -> Vec<StepMetrics> {
        (0..n)
            .map(|step| StepMetrics {
                step,
                loss: 3.0 / (step + 1) as f32,
                items_per_sec: 100.0,
                bubble: 0.1,
                lr: 0.01,
                loss_scale: None,
                skipped: false,
            })
            .collect()
    }

    #[test]
    fn the_curve_has_a_point_per_finite_step_and_a_dot_per_held_out_figure() {
        let mut s = steps(5);
        s[2].loss = f32::INFINITY;
        s[2].skipped = true;
        let svg = loss_svg(&s, &[(4, 0.9)], &[("uniform".into(), 3.3)], "a <test>");
        let points = svg
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(points.split(' ').count(), 4);
        assert_eq!(svg.matches("class=\"held-out\"").count(), 1);
        assert!(svg.contains("a &lt;test&gt;") && svg.contains("uniform 3.30"));
    }

    #[test]
    fn the_metrics_lines_parse_and_carry_the_held_out_figure_on_its_step() {
        let text = metrics_jsonl(&steps(3), Some(("held_out_loss", 2, 0.75)));
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1]["loss"].as_f64().unwrap() as f32, 1.5);
        assert!(lines[1].get("held_out_loss").is_none());
        assert_eq!(lines[2]["held_out_loss"].as_f64().unwrap() as f32, 0.75);
    }
}
