//! Pictures of a simulated timeline: a Chrome trace (load it in `chrome://tracing` or Perfetto)
//! and a self-contained SVG.
//!
//! Users of pipeline systems complain that they cannot see the schedule; these two views show
//! every compute and transfer interval per stage, with the bubble visible as empty space.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::schedule::ActionKind;
use crate::sim::timeline::{Collective, Event, Timeline};

/// Which clock a timeline's times are on; every picture says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The simulated cluster's clock (`timeline::simulate`).
    Simulated,
    /// Measured wall-clock time (`StepReport::wall_timeline`).
    Wall,
}

impl Clock {
    pub fn name(self) -> &'static str {
        match self {
            Clock::Simulated => "simulated",
            Clock::Wall => "wall clock",
        }
    }
}

/// Short event name: `F3`, `B3`, `I3`, `W3`, `R3` for compute, `A3` / `G3` for activation /
/// gradient transfers of micro-batch 3, `S3` / `T3` for a skip and its gradient; `c1` is added
/// for a stage's chunk when devices hold several stages.
fn event_name(e: &Event, chunked: bool) -> String {
    let letter = match e.kind {
        ActionKind::SendGrad => 'G',
        ActionKind::SendActivation => 'A',
        ActionKind::SendSkip => 'S',
        ActionKind::SendSkipGrad => 'T',
        kind => kind.letter(),
    };
    if chunked {
        format!("{letter}{}c{}", e.micro_batch, e.chunk)
    } else {
        format!("{letter}{}", e.micro_batch)
    }
}

fn is_chunked(timeline: &Timeline) -> bool {
    timeline.events.iter().any(|e| e.chunk > 0)
}

/// The directed device links that carry transfers in `timeline`, sorted. In the trace each gets
/// its own thread after the K device threads, because a transfer overlaps the sender's compute
/// and overlapping "X" events on one thread render badly.
fn links_of(timeline: &Timeline) -> Vec<(usize, usize)> {
    let mut links: Vec<(usize, usize)> = timeline
        .events
        .iter()
        .filter_map(|e| e.peer.map(|p| (e.device, p)))
        .collect();
    links.sort();
    links.dedup();
    links
}

fn thread_of(e: &Event, num_devices: usize, links: &[(usize, usize)]) -> usize {
    match e.peer {
        Some(peer) => num_devices + links.binary_search(&(e.device, peer)).unwrap_or(0),
        None => e.device,
    }
}

fn thread_name_event(tid: usize, name: String) -> Value {
    json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
}

/// Metadata naming the process, each device thread and each link thread.
fn metadata_events(
    num_devices: usize,
    links: &[(usize, usize)],
    label: &str,
    clock: Clock,
) -> Vec<Value> {
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
        "args": {"name": format!("{label} ({})", clock.name())}
    })];
    for device in 0..num_devices {
        events.push(thread_name_event(device, format!("device {device}")));
    }
    for (i, (from, to)) in links.iter().enumerate() {
        events.push(thread_name_event(
            num_devices + i,
            format!("link {from}->{to}"),
        ));
    }
    events
}

fn complete_event(e: &Event, num_devices: usize, links: &[(usize, usize)], chunked: bool) -> Value {
    let mut args = json!({
        "device": e.device, "stage": e.stage, "chunk": e.chunk, "micro_batch": e.micro_batch
    });
    if let Some(peer) = e.peer {
        args["to_device"] = json!(peer);
        args["message"] = json!(match e.kind {
            ActionKind::SendGrad => "gradient",
            ActionKind::SendSkip => "skip",
            ActionKind::SendSkipGrad => "skip gradient",
            ActionKind::ExchangeTied => "tied gradients",
            _ => "activation",
        });
    }
    json!({
        "name": event_name(e, chunked),
        "cat": e.kind.category(),
        "ph": "X",
        "ts": e.start * 1e6,
        "dur": (e.end - e.start) * 1e6,
        "pid": 0,
        "tid": thread_of(e, num_devices, links),
        "args": args,
    })
}

/// The timeline in Chrome trace-event JSON: one complete ("X") event per timeline event, times
/// in microseconds of simulated time, plus metadata naming the stages and links.
pub fn chrome_trace_json(timeline: &Timeline, label: &str) -> String {
    chrome_trace_json_on(timeline, label, Clock::Simulated)
}

/// [`chrome_trace_json`] for a timeline on `clock` (labelled accordingly).
pub fn chrome_trace_json_on(timeline: &Timeline, label: &str, clock: Clock) -> String {
    let k = timeline.num_devices();
    let links = links_of(timeline);
    let chunked = is_chunked(timeline);
    let mut events = metadata_events(k, &links, label, clock);
    events.extend(
        timeline
            .events
            .iter()
            .map(|e| complete_event(e, k, &links, chunked)),
    );
    events.extend(timeline.collectives.iter().map(collective_event));
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"label": label, "clock": clock.name()},
    })
    .to_string()
}

/// An all-reduce on its device's thread (it follows the device's last compute, so it does not
/// overlap the device's own events).
fn collective_event(c: &Collective) -> Value {
    json!({
        "name": "all-reduce",
        "cat": "all-reduce",
        "ph": "X",
        "ts": c.start * 1e6,
        "dur": (c.end - c.start) * 1e6,
        "pid": 0,
        "tid": c.device,
        "args": {"device": c.device, "bytes": c.bytes, "replicas": c.replicas},
    })
}

/// Height of a line of the legend.
const LEGEND_LINE: f64 = 20.0;

/// Colour of the gradient all-reduce across replicas.
const ALL_REDUCE_COLOUR: &str = "#bab0ac";

fn draw_collective(svg: &mut String, layout: &Layout, c: &Collective) {
    let (x, y) = (layout.x(c.start), layout.row_y(c.device));
    let w = (c.end - c.start) * layout.scale;
    let _ = writeln!(
        svg,
        r#"<rect class="event all-reduce" x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{ROW:.2}" fill="{ALL_REDUCE_COLOUR}" stroke="white" stroke-width="0.5"><title>all-reduce device {} over {} replicas, {} bytes: {:.6}-{:.6} s</title></rect>"#,
        c.device, c.replicas, c.bytes, c.start, c.end
    );
}

/// Escapes text for XML content and attribute values.
fn escape_xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

/// The event kinds the pictures tell apart (every transfer looks alike), in legend order.
const LEGEND: [ActionKind; 6] = [
    ActionKind::Forward,
    ActionKind::Backward,
    ActionKind::BackwardInput,
    ActionKind::BackwardWeight,
    ActionKind::Recompute,
    ActionKind::SendActivation,
];

fn colour(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::Forward => "#4e79a7",
        ActionKind::Backward => "#f28e2b",
        ActionKind::BackwardInput => "#e15759",
        ActionKind::BackwardWeight => "#b07aa1",
        ActionKind::Recompute => "#59a14f",
        _ => "#9c755f",
    }
}

/// A display unit for a span of seconds, so tick labels stay short: (name, factor).
fn time_unit(span_sec: f64) -> (&'static str, f64) {
    if span_sec >= 1.0 {
        ("s", 1.0)
    } else if span_sec >= 1e-3 {
        ("ms", 1e3)
    } else if span_sec >= 1e-6 {
        ("µs", 1e6)
    } else {
        ("ns", 1e9)
    }
}

/// A 1-2-5 tick step giving about eight ticks over `span` (in display units).
fn tick_step(span: f64) -> f64 {
    let raw = span / 8.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|f| f * magnitude)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * magnitude)
}

/// Geometry shared by the drawing helpers.
struct Layout {
    num_devices: usize,
    chunked: bool,
    /// Pixels per second of simulated time.
    scale: f64,
}

const LEFT: f64 = 90.0;
const PLOT_WIDTH: f64 = 900.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const ROW: f64 = 26.0;
/// Height of the lane between two stage rows where that link's transfers are drawn.
const LANE: f64 = 12.0;
const CHAR_WIDTH: f64 = 7.0;

impl Layout {
    fn row_y(&self, device: usize) -> f64 {
        TOP + device as f64 * (ROW + LANE)
    }

    fn plot_bottom(&self) -> f64 {
        self.row_y(self.num_devices) - LANE
    }

    fn x(&self, t: f64) -> f64 {
        LEFT + t * self.scale
    }

    /// The box of an event: compute fills its device row; a transfer takes the upper
    /// (activation) or lower (gradient) half of the lane below the lower-numbered of the two
    /// devices it connects.
    fn event_box(&self, e: &Event) -> (f64, f64, f64, f64) {
        let x = self.x(e.start);
        let w = (e.end - e.start) * self.scale;
        match e.peer {
            Some(peer) => {
                let lane_y = self.row_y(peer.min(e.device)) + ROW;
                let y = if e.kind.carries_grad() {
                    lane_y + LANE / 2.0
                } else {
                    lane_y
                };
                (x, y, w, LANE / 2.0)
            }
            None => (x, self.row_y(e.device), w, ROW),
        }
    }
}

fn draw_event(svg: &mut String, layout: &Layout, e: &Event) {
    let (x, y, w, h) = layout.event_box(e);
    let tooltip = format!(
        "{} device {}{} stage {} chunk {}: {:.6}-{:.6} s",
        event_name(e, layout.chunked),
        e.device,
        e.peer.map_or(String::new(), |p| format!("->{p}")),
        e.stage,
        e.chunk,
        e.start,
        e.end
    );
    let _ = write!(
        svg,
        r#"<rect class="event {}" x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{}" stroke="white" stroke-width="0.5"><title>{}</title></rect>"#,
        e.kind.category(),
        colour(e.kind),
        escape_xml(&tooltip)
    );
    svg.push('\n');
    let label = if layout.chunked && e.peer.is_none() {
        format!("{}c{}", e.micro_batch, e.chunk)
    } else {
        e.micro_batch.to_string()
    };
    let fits = w >= CHAR_WIDTH * label.len() as f64 + 4.0 && h >= ROW;
    if fits {
        let _ = writeln!(
            svg,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="white">{label}</text>"#,
            x + w / 2.0,
            y + h / 2.0 + 4.0
        );
    }
}

fn draw_device_labels(svg: &mut String, layout: &Layout) {
    for device in 0..layout.num_devices {
        let y = layout.row_y(device) + ROW / 2.0 + 4.0;
        let _ = writeln!(
            svg,
            r#"<text x="{:.2}" y="{y:.2}" text-anchor="end">device {device}</text>"#,
            LEFT - 8.0
        );
    }
}

fn draw_axis(svg: &mut String, layout: &Layout, makespan: f64, clock: Clock) {
    let y = layout.plot_bottom() + 6.0;
    let (unit, factor) = time_unit(makespan);
    let span = makespan * factor;
    let _ = writeln!(
        svg,
        r#"<line x1="{LEFT}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="black"/>"#,
        LEFT + PLOT_WIDTH
    );
    if span > 0.0 {
        let step = tick_step(span);
        let decimals = (-step.log10().floor()).max(0.0) as usize;
        let mut i = 0;
        while i as f64 * step <= span * (1.0 + 1e-9) {
            let value = i as f64 * step;
            let x = layout.x(value / factor);
            let _ = writeln!(
                svg,
                r#"<line x1="{x:.2}" y1="{y:.2}" x2="{x:.2}" y2="{:.2}" stroke="black"/><text x="{x:.2}" y="{:.2}" text-anchor="middle">{value:.decimals$}</text>"#,
                y + 5.0,
                y + 18.0
            );
            i += 1;
        }
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">time ({}, {})</text>"#,
        LEFT + PLOT_WIDTH / 2.0,
        y + 34.0,
        escape_xml(unit),
        clock.name()
    );
}

fn draw_legend(svg: &mut String, y: f64, all_reduce: bool) {
    if all_reduce {
        // On a line of its own below the others.
        let y = y + LEGEND_LINE;
        let _ = writeln!(
            svg,
            r#"<rect class="legend" x="{LEFT:.2}" y="{y:.2}" width="14" height="14" fill="{ALL_REDUCE_COLOUR}"/><text x="{:.2}" y="{:.2}">all-reduce</text>"#,
            LEFT + 20.0,
            y + 11.0
        );
    }
    for (i, kind) in LEGEND.into_iter().enumerate() {
        let x = LEFT + i as f64 * 140.0;
        let _ = writeln!(
            svg,
            r#"<rect class="legend" x="{x:.2}" y="{y:.2}" width="14" height="14" fill="{}"/><text x="{:.2}" y="{:.2}">{}</text>"#,
            colour(kind),
            x + 20.0,
            y + 11.0,
            kind.category()
        );
    }
}

/// The timeline as an SVG document: one row per device, transfers in the lanes between rows,
/// micro-batch numbers in boxes wide enough to hold them, a time axis (simulated time, unit
/// chosen from the makespan), a legend and the title.
pub fn svg_timeline(timeline: &Timeline, title: &str) -> String {
    svg_timeline_on(timeline, title, Clock::Simulated)
}

/// [`svg_timeline`] for a timeline on `clock` (the time axis says which).
pub fn svg_timeline_on(timeline: &Timeline, title: &str, clock: Clock) -> String {
    let num_devices = timeline.num_devices();
    let scale = if timeline.makespan > 0.0 {
        PLOT_WIDTH / timeline.makespan
    } else {
        0.0
    };
    let layout = Layout {
        num_devices,
        chunked: is_chunked(timeline),
        scale,
    };
    let legend_y = layout.plot_bottom() + 56.0;
    let width = LEFT + PLOT_WIDTH + RIGHT;
    let extra_legend = if timeline.collectives.is_empty() {
        0.0
    } else {
        LEGEND_LINE
    };
    let height = legend_y + 30.0 + extra_legend;
    let mut svg = String::new();
    let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0}" viewBox="0 0 {width} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape_xml(title)
    );
    draw_device_labels(&mut svg, &layout);
    for e in &timeline.events {
        draw_event(&mut svg, &layout, e);
    }
    for c in &timeline.collectives {
        draw_collective(&mut svg, &layout, c);
    }
    draw_axis(&mut svg, &layout, timeline.makespan, clock);
    draw_legend(&mut svg, legend_y, !timeline.collectives.is_empty());
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{gpipe, CheckpointMode};
    use crate::sim::timeline::{simulate, ActionCost, DeviceSpec, LinkSpec};

    fn sample(k: usize, m: usize, latency_sec: f64) -> Timeline {
        let s = gpipe(k, m, CheckpointMode::ExceptLast).unwrap();
        let devices = vec![
            DeviceSpec {
                flops_per_sec: 1e12,
                memory_bytes: 1 << 30,
            };
            k
        ];
        let link = LinkSpec {
            bandwidth_bytes_per_sec: 1e9,
            latency_sec,
        };
        simulate(&s, &devices, &link, |_, _| ActionCost {
            flops: 1e9,
            bytes: 1 << 20,
        })
        .unwrap()
    }

    #[test]
    fn chrome_trace_parses_and_has_one_x_event_per_timeline_event() {
        let t = sample(3, 4, 1e-5);
        let label = "run \"A\"\n<ünïcode> & \\";
        let text = chrome_trace_json(&t, label);
        let v: Value = serde_json::from_str(&text).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let xs: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(xs.len(), t.events.len());
        assert_eq!(v["displayTimeUnit"], "ms");
        assert_eq!(v["otherData"]["label"], label);
        let threads = events.iter().filter(|e| e["name"] == "thread_name").count();
        assert_eq!(threads, 3 + 2 * 2);
        // The first event is F0 on stage 0 at t = 0, lasting 1 ms = 1000 µs.
        assert_eq!(xs[0]["name"], "F0");
        assert_eq!(xs[0]["cat"], "forward");
        assert_eq!(xs[0]["tid"], 0);
        assert_eq!(xs[0]["ts"].as_f64(), Some(0.0));
        assert!((xs[0]["dur"].as_f64().unwrap() - 1000.0).abs() < 1e-6);
        for cat in ["forward", "backward", "recompute", "transfer"] {
            assert!(xs.iter().any(|e| e["cat"] == cat), "no {cat} event");
        }
        assert!(xs.iter().any(|e| e["name"] == "G2"));
        assert!(xs.iter().any(|e| e["name"] == "A2"));
    }

    #[test]
    fn transfer_threads_are_per_directed_link() {
        let t = sample(3, 2, 0.0);
        let v: Value = serde_json::from_str(&chrome_trace_json(&t, "x")).unwrap();
        for e in v["traceEvents"].as_array().unwrap() {
            if e["ph"] != "X" {
                continue;
            }
            let tid = e["tid"].as_u64().unwrap();
            let device = e["args"]["device"].as_u64().unwrap();
            // Links of a 3-device chain, sorted: 0->1, 1->0, 1->2, 2->1.
            match e["args"]["to_device"].as_u64() {
                Some(to) => {
                    let links = [(0, 1), (1, 0), (1, 2), (2, 1)];
                    let i = links.iter().position(|&l| l == (device, to)).unwrap() as u64;
                    assert_eq!(tid, 3 + i);
                    let grad = e["args"]["message"] == "gradient";
                    assert_eq!(grad, to < device);
                }
                None => assert_eq!(tid, device),
            }
        }
    }

    /// Checks that tags nest and close properly and that every `&` starts an entity.
    fn assert_well_formed(xml: &str) {
        let mut stack: Vec<&str> = Vec::new();
        let mut roots = 0;
        let mut rest = xml;
        while let Some(open) = rest.find('<') {
            assert_entities(&rest[..open]);
            let after = &rest[open..];
            let close = after.find('>').expect("unterminated tag");
            let tag = &after[1..close];
            rest = &after[close + 1..];
            if tag.starts_with('?') || tag.starts_with('!') {
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop(), Some(name.trim()), "mismatched </{name}>");
                continue;
            }
            assert!(
                tag.matches('"').count().is_multiple_of(2),
                "bad quoting in <{tag}>"
            );
            assert_entities(tag);
            let name = tag
                .split(|c: char| c.is_whitespace() || c == '/')
                .next()
                .unwrap();
            if stack.is_empty() {
                roots += 1;
            }
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        assert!(stack.is_empty(), "unclosed: {stack:?}");
        assert_eq!(roots, 1);
        assert_entities(rest);
    }

    fn assert_entities(text: &str) {
        for (i, _) in text.match_indices('&') {
            let ok = ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                .iter()
                .any(|ent| text[i..].starts_with(ent));
            assert!(ok, "raw & in {text:?}");
        }
    }

    #[test]
    fn svg_has_one_event_rect_per_event_and_is_well_formed() {
        let t = sample(4, 6, 2e-5);
        let title = "GPipe <K=4> & \"M=6\" 'sim'";
        let svg = svg_timeline(&t, title);
        assert_well_formed(&svg);
        assert_eq!(svg.matches("<rect class=\"event ").count(), t.events.len());
        assert_eq!(svg.matches("<rect class=\"legend\"").count(), LEGEND.len());
        assert!(svg.contains("GPipe &lt;K=4&gt; &amp; &quot;M=6&quot; &apos;sim&apos;"));
        assert!(svg.contains("time (ms, simulated)"));
        for kind in LEGEND.map(ActionKind::category) {
            assert!(
                svg.contains(&format!(">{kind}</text>")),
                "legend lacks {kind}"
            );
        }
        // Compute boxes are wide here (≈ 900 px / 22 ms per ms), so they carry numbers.
        assert!(svg.contains(r#"fill="white">5</text>"#));
    }

    #[test]
    fn svg_handles_degenerate_timelines() {
        let empty = Timeline {
            events: Vec::new(),
            makespan: 0.0,
            busy: vec![0.0],
            collectives: Vec::new(),
        };
        let svg = svg_timeline(&empty, "");
        assert_well_formed(&svg);
        assert_eq!(svg.matches("<rect class=\"event").count(), 0);
    }

    #[test]
    fn units_and_ticks() {
        assert_eq!(time_unit(3.0).0, "s");
        assert_eq!(time_unit(0.02).0, "ms");
        assert_eq!(time_unit(2e-5).0, "µs");
        assert_eq!(time_unit(2e-9).0, "ns");
        assert_eq!(tick_step(22.0), 5.0);
        assert_eq!(tick_step(8.0), 1.0);
        assert_eq!(tick_step(0.15), 0.02);
    }

    #[test]
    fn escape_covers_xml_specials() {
        assert_eq!(
            escape_xml(r#"<a & 'b' "c">"#),
            "&lt;a &amp; &apos;b&apos; &quot;c&quot;&gt;"
        );
    }
}
