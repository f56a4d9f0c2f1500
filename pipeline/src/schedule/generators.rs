//! The schedules users of torch's pipelining, Megatron-LM and the zero-bubble papers expect, as
//! generators of [`Schedule`]s. Each builds compute-only lists per device, adds the recomputes
//! that the checkpoint mode asks for, lets [`Schedule::from_compute`] insert the transfers, and
//! validates the result, so a generator can never hand out a schedule that would hang.
//!
//! Closed forms below assume equal costs: a forward F, input-gradient part B and weight part W
//! of one stage all take one unit (a full backward two), transfers are free, no recompute.
//! "Bubble" is the idle share of the step, 1 − busy / (K × makespan); "steady bubble" is the idle
//! share inside each device's own span from its first to its last action (the zero-bubble
//! papers' measure: the ramps at the two ends are filled by the neighbouring steps when steps run
//! back to back).

use super::validate::check_counts;
use super::{Action, ActionKind, CheckpointMode, Schedule, ScheduleError};

/// How virtual stages are laid out on K devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// `chunks` stages per device, chunk c of device d being stage c·K + d (Megatron's
    /// interleaving, looped BFS); one chunk is the plain GPipe layout.
    Looped { chunks: usize },
    /// Two chunks in a V: device d holds stages d and 2K−1−d (ZB-V, DualPipeV), so the first and
    /// last stages share device 0 and the turn of the V stays on device K−1.
    V,
}

impl Placement {
    /// The device of each of the S virtual stages.
    pub fn devices(self, k: usize) -> Vec<usize> {
        match self {
            Placement::Looped { chunks } => (0..chunks * k).map(|s| s % k).collect(),
            Placement::V => (0..2 * k)
                .map(|s| if s < k { s } else { 2 * k - 1 - s })
                .collect(),
        }
    }
}

/// [`check_counts`], and at least one chunk per device.
fn check_looped(k: usize, v: usize, m: usize) -> Result<(), ScheduleError> {
    check_counts(k, m)?;
    if v == 0 {
        return Err(ScheduleError::NoStages);
    }
    Ok(())
}

/// Adds the recomputes `mode` asks for (right before each backward or input part), inserts the
/// transfers, declares the in-flight limit and validates (the synthesizer's placer ends the
/// same way).
pub(super) fn finish(
    name: &str,
    m: usize,
    placement: Vec<usize>,
    compute: Vec<Vec<Action>>,
    mode: CheckpointMode,
    in_flight_limit: Option<Vec<usize>>,
) -> Result<Schedule, ScheduleError> {
    let compute = compute
        .into_iter()
        .map(|list| {
            let mut out = Vec::with_capacity(list.len() * 2);
            for a in list {
                let backward = matches!(a.kind, ActionKind::Backward | ActionKind::BackwardInput);
                if backward && mode.recomputes(a.micro_batch, m) {
                    out.push(Action::new(ActionKind::Recompute, a.stage, a.micro_batch));
                }
                out.push(a);
            }
            out
        })
        .collect();
    let mut schedule = Schedule::from_compute(name, m, placement, compute);
    schedule.in_flight_limit = in_flight_limit;
    schedule.validate()?;
    Ok(schedule)
}

fn f(stage: usize, m: usize) -> Action {
    Action::new(ActionKind::Forward, stage, m)
}
fn b(stage: usize, m: usize) -> Action {
    Action::new(ActionKind::Backward, stage, m)
}

/// GPipe fill-drain (Huang et al. 2019; torchgpipe): every device runs all forwards in order
/// 0..M, then all backwards in reverse order M−1..0. Micro-batch i reaches stage j at clock
/// i + j. Bubble (K−1)/(M+K−1); M micro-batches in flight.
pub fn gpipe(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let compute = (0..k)
        .map(|j| {
            let mut list: Vec<Action> = (0..m).map(|mb| f(j, mb)).collect();
            list.extend((0..m).rev().map(|mb| b(j, mb)));
            list
        })
        .collect();
    finish(
        "gpipe",
        m,
        (0..k).collect(),
        compute,
        mode,
        Some(vec![m; k]),
    )
}

/// 1F1B (PipeDream-Flush, Narayanan et al. 2021): device j runs a warm-up of min(K−j−1, M)
/// forwards, then alternates one forward and one backward, then drains the remaining backwards.
/// Same bubble as GPipe, (K−1)/(M+K−1), but at most K−j micro-batches in flight on device j.
pub fn one_f_one_b(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let compute = one_forward_one_backward(k, m, ActionKind::Backward, |j| k - 1 - j);
    let limit = (0..k).map(|j| (k - j).min(m)).collect();
    finish("1f1b", m, (0..k).collect(), compute, mode, Some(limit))
}

/// The sizes of the rounds of Megatron's interleaving: floor(M/K) rounds (at least one), as
/// even as possible, so every round has at least K micro-batches when M >= K (torch's
/// Interleaved1F1B asks M to divide evenly; here the first M mod rounds get one more).
fn rounds(k: usize, m: usize) -> Vec<usize> {
    let n = (m / k).max(1);
    (0..n).map(|i| m / n + usize::from(i < m % n)).collect()
}

/// The order in which one device visits (chunk, micro-batch) pairs in Megatron's interleaving:
/// round by round, each round through the chunks in order (forward) or in reverse order
/// (backward).
fn interleaved_order(k: usize, v: usize, m: usize, backward: bool) -> Vec<(usize, usize)> {
    let mut order = Vec::with_capacity(v * m);
    let mut start = 0;
    for size in rounds(k, m) {
        let round = start..start + size;
        start += size;
        for c in 0..v {
            let chunk = if backward { v - 1 - c } else { c };
            order.extend(round.clone().map(|mb| (chunk, mb)));
        }
    }
    order
}

/// Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM): v chunks per device in the looped
/// placement; micro-batches go in rounds of R ≥ K (floor(M/K) rounds as even as possible), each
/// round through the chunks in order; warm-up of 2(K−d−1) + (v−1)·R chunk forwards on device d,
/// then one forward and one backward in turn. Bubble (K−1)/(v·M+K−1) of the step, i.e.
/// (K−1)/(v·M) of the ideal time, when M is a multiple of K; any M ≥ 1 is accepted (uneven
/// rounds cost a little more). v = 1 is 1F1B.
pub fn interleaved_one_f_one_b(
    k: usize,
    v: usize,
    m: usize,
    mode: CheckpointMode,
) -> Result<Schedule, ScheduleError> {
    check_looped(k, v, m)?;
    let total = v * m;
    let round = rounds(k, m)[0];
    let fwd = interleaved_order(k, v, m, false);
    let bwd = interleaved_order(k, v, m, true);
    let compute: Vec<Vec<Action>> = (0..k)
        .map(|d| {
            let stage = |c: usize| c * k + d;
            let warmup = (2 * (k - d - 1) + (v - 1) * round).min(total);
            let mut list: Vec<Action> = fwd[..warmup]
                .iter()
                .map(|&(c, mb)| f(stage(c), mb))
                .collect();
            for i in 0..total - warmup {
                let (c, mb) = fwd[warmup + i];
                list.push(f(stage(c), mb));
                let (c, mb) = bwd[i];
                list.push(b(stage(c), mb));
            }
            list.extend(bwd[total - warmup..].iter().map(|&(c, mb)| b(stage(c), mb)));
            list
        })
        .collect();
    let placement = Placement::Looped { chunks: v }.devices(k);
    finish("interleaved-1f1b", m, placement, compute, mode, None)
}

/// Looped BFS (Lamy-Poirier 2022; torch's ScheduleLoopedBFS): looped placement, each device runs
/// the forwards of all micro-batches through its first chunk, then its second, ...; then the
/// backwards chunk by chunk in reverse, micro-batches in reverse. Bubble as interleaved 1F1B,
/// (K−1)/(v·M+K−1) when M ≥ K, with GPipe-like memory (all v·M forwards in flight).
pub fn looped_bfs(
    k: usize,
    v: usize,
    m: usize,
    mode: CheckpointMode,
) -> Result<Schedule, ScheduleError> {
    check_looped(k, v, m)?;
    let compute = (0..k)
        .map(|d| {
            let mut list = Vec::with_capacity(2 * v * m);
            for c in 0..v {
                list.extend((0..m).map(|mb| f(c * k + d, mb)));
            }
            for c in (0..v).rev() {
                list.extend((0..m).rev().map(|mb| b(c * k + d, mb)));
            }
            list
        })
        .collect();
    let placement = Placement::Looped { chunks: v }.devices(k);
    finish(
        "looped-bfs",
        m,
        placement,
        compute,
        mode,
        Some(vec![v * m; k]),
    )
}

/// ZB-H1 (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism", §2.1): 1F1B with the backward
/// split into B and W; every device keeps at most K micro-batches in flight (1F1B's first-device
/// peak), B passes run as soon as they can and W passes fill what would be bubbles. Bubble
/// (K−1)(F+B−W) against 1F1B's (K−1)(F+B+W): (K−1)/(3M+K−1) of the step with equal costs,
/// a third of 1F1B's idle time.
pub fn zb_h1(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let placement: Vec<usize> = (0..k).collect();
    let limit = vec![k.min(m); k];
    let skeleton = one_forward_one_backward(k, m, ActionKind::BackwardInput, |j| k - 1 - j);
    let compute = fill_weights(m, &placement, &skeleton, &limit)?;
    finish("zb-h1", m, placement, compute, mode, Some(limit))
}

/// ZB-H2 (Qi et al. §2.2): as ZB-H1 with up to 2K−1 micro-batches in flight, so that extra
/// warm-up forwards fill the start and W passes the end: each device is busy without a gap from
/// its first to its last action (steady bubble 0 once M ≥ 2K−1), about twice 1F1B's memory. The
/// step still has the (K−1)-unit ramps at both ends, which back-to-back steps overlap.
pub fn zb_h2(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let placement: Vec<usize> = (0..k).collect();
    let limit = vec![(2 * k - 1).min(m); k];
    let skeleton = one_forward_one_backward(k, m, ActionKind::BackwardInput, |j| 2 * (k - 1 - j));
    let compute = fill_weights(m, &placement, &skeleton, &limit)?;
    finish("zb-h2", m, placement, compute, mode, Some(limit))
}

/// ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory" §6; torch's
/// ScheduleZBVZeroBubble): two chunks per device in a V, split backward. Device d warms up with
/// 2(K−d)−1 chunk-0 forwards, d pairs (chunk-1 forward, chunk-0 forward) and K−d rounds of
/// (chunk-1 forward, input, weight); the steady phase repeats (F, I, W) on chunk 0 then chunk 1;
/// the cool-down runs the remaining input parts and the deferred W passes. Zero bubble with
/// equal costs (F = B = W) once M ≥ 2K−1 in the steady measure, at 1F1B's activation memory:
/// at most 2K chunk micro-batches (K of a 1F1B stage, each chunk holding half its layers).
pub fn zb_v(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let placement = Placement::V.devices(k);
    let compute = (0..k).map(|d| zb_v_device(k, m, d)).collect();
    finish("zb-v", m, placement, compute, mode, Some(vec![2 * k; k]))
}

/// One device's list of ZB-V (see [`zb_v`]); the construction assumes at least 2K−1
/// micro-batches, so it runs with that many and drops the actions of the ones beyond M.
fn zb_v_device(k: usize, m: usize, d: usize) -> Vec<Action> {
    let n = m.max(2 * k - 1);
    let (s0, s1) = (d, 2 * k - 1 - d);
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    let input = |s, mb| Action::new(ActionKind::BackwardInput, s, mb);
    let weight = |s, mb| Action::new(ActionKind::BackwardWeight, s, mb);
    let mut list = Vec::with_capacity(6 * n);
    for _ in 0..2 * (k - d) - 1 {
        list.push(f(s0, f0));
        f0 += 1;
    }
    for _ in 0..d {
        list.push(f(s1, f1));
        f1 += 1;
        list.push(f(s0, f0));
        f0 += 1;
    }
    for _ in 0..k - d {
        list.push(f(s1, f1));
        f1 += 1;
        list.extend([input(s1, b1), weight(s1, b1)]);
        b1 += 1;
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            list.push(f(s0, f0));
            f0 += 1;
        }
        list.extend([input(s0, b0), weight(s0, b0)]);
        b0 += 1;
        list.push(f(s1, f1));
        f1 += 1;
        list.extend([input(s1, b1), weight(s1, b1)]);
        b1 += 1;
    }
    let (mut w0, w1) = (b0, b1);
    for _ in 0..d {
        list.extend([input(s0, b0), input(s1, b1)]);
        b0 += 1;
        b1 += 1;
    }
    for _ in 0..k - d {
        list.extend([input(s0, b0), weight(s0, w0)]);
        b0 += 1;
        w0 += 1;
    }
    list.extend((w1..b1).map(|mb| weight(s1, mb)));
    list.extend((w0..b0).map(|mb| weight(s0, mb)));
    list.retain(|a| a.micro_batch < m);
    list
}

/// DualPipeV (DeepSeek-V3's DualPipe cut in half: deepseek-ai/DualPipe `dualpipev.py`, torch's
/// ScheduleDualPipeV): the V placement, and on device d of K the eight phases of that schedule:
/// 2(K−d−1) forwards of chunk 0; d+1 pairs of forwards of both chunks; K−d−1 rounds of (input
/// part, weight part, forward) on chunk 1; M−2K+d+1 rounds of the "F&B" pairs (forward of one
/// chunk with the full backward of the other, which DualPipe overlaps with communication; this
/// runtime runs them one after the other); K−d−1 rounds of chunk-1 backward and an F&B pair;
/// d+1 pairs of backwards whose second half defers W; K−d−1 rounds of (W, chunk-0 input part);
/// and the d+1 last W passes. Needs M ≥ 2K (every device reaches the main phase). At most
/// K+1 micro-batches of a 1F1B stage in flight (2K+2 chunk micro-batches). With equal costs the
/// steady bubble is (K/2−1)(F&B+B−3W) in DualPipe's accounting, which is 0 here (F&B = F+B).
pub fn dual_pipe_v(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    if m < 2 * k {
        return Err(ScheduleError::NeedsMicroBatches {
            schedule: "dualpipe-v",
            needed: 2 * k,
            found: m,
            why: "every device must reach the main F&B phase: M >= 2K",
        });
    }
    let placement = Placement::V.devices(k);
    let compute = (0..k).map(|d| dual_pipe_v_device(k, m, d)).collect();
    finish(
        "dualpipe-v",
        m,
        placement,
        compute,
        mode,
        Some(vec![2 * k + 2; k]),
    )
}

/// One device's list of DualPipeV (see [`dual_pipe_v`]): chunk 0 is stage d, chunk 1 stage
/// 2K−1−d; each chunk takes its micro-batches in order; deferred W passes run first in, first
/// out.
fn dual_pipe_v_device(k: usize, m: usize, d: usize) -> Vec<Action> {
    struct Dev {
        stages: [usize; 2],
        next_f: [usize; 2],
        next_b: [usize; 2],
        weights: std::collections::VecDeque<Action>,
        list: Vec<Action>,
    }
    impl Dev {
        fn forward(&mut self, c: usize) {
            let mb = self.next_f[c];
            self.next_f[c] += 1;
            self.list.push(f(self.stages[c], mb));
        }
        /// A backward of chunk `c`: split with its W deferred (`zb`), or full.
        fn backward(&mut self, c: usize, zb: bool) {
            let mb = self.next_b[c];
            self.next_b[c] += 1;
            let s = self.stages[c];
            if zb {
                self.list
                    .push(Action::new(ActionKind::BackwardInput, s, mb));
                self.weights
                    .push_back(Action::new(ActionKind::BackwardWeight, s, mb));
            } else {
                self.list.push(b(s, mb));
            }
        }
        fn weight(&mut self) {
            if let Some(w) = self.weights.pop_front() {
                self.list.push(w);
            }
        }
    }
    let mut dev = Dev {
        stages: [d, 2 * k - 1 - d],
        next_f: [0, 0],
        next_b: [0, 0],
        weights: Default::default(),
        list: Vec::with_capacity(6 * m),
    };
    // Phase 1: nF0.
    for _ in 0..2 * (k - d - 1) {
        dev.forward(0);
    }
    // Phase 2: nF0F1.
    for _ in 0..d + 1 {
        dev.forward(0);
        dev.forward(1);
    }
    // Phase 3: nB1W1F1 (zero bubble: the W right after its input part).
    for _ in 0..k - d - 1 {
        dev.backward(1, true);
        dev.weight();
        dev.forward(1);
    }
    // Phase 4, the main phase: nF0B1F1B0 (two F&B pairs per round).
    for _ in 0..m - 2 * k + d + 1 {
        dev.forward(0);
        dev.backward(1, false);
        dev.forward(1);
        dev.backward(0, false);
    }
    // Phase 5: nB1F1B0.
    for _ in 0..k - d - 1 {
        dev.backward(1, false);
        dev.forward(1);
        dev.backward(0, false);
    }
    // Phase 6: nB1B0, the second half deferring W.
    let mut zb = false;
    let steps = d + 1;
    let half = steps / 2;
    for i in 0..steps {
        if i == half && !d.is_multiple_of(2) {
            zb = true;
        }
        dev.backward(1, zb);
        if i == half && d.is_multiple_of(2) {
            zb = true;
        }
        dev.backward(0, zb);
    }
    // Phase 7: nWB0.
    for _ in 0..k - d - 1 {
        dev.weight();
        dev.backward(0, true);
    }
    // Phase 8: nW.
    while !dev.weights.is_empty() {
        dev.weight();
    }
    dev.list
}

/// The 1F1B order on one stage per device: `warmup(j)` forwards (capped by M), then one
/// forward and one `backward` (full, or the input part) in turn, then the remaining backwards.
fn one_forward_one_backward(
    k: usize,
    m: usize,
    backward: ActionKind,
    warmup: impl Fn(usize) -> usize,
) -> Vec<Vec<Action>> {
    let back = |s, mb| Action::new(backward, s, mb);
    (0..k)
        .map(|j| {
            let w = warmup(j).min(m);
            let mut list: Vec<Action> = (0..w).map(|mb| f(j, mb)).collect();
            for i in 0..m - w {
                list.push(f(j, w + i));
                list.push(back(j, i));
            }
            list.extend((m - w..m).map(|mb| back(j, mb)));
            list
        })
        .collect()
}

/// Runs each device's `skeleton` (its forwards and input parts, in order) over unit costs and
/// places the weight parts where the next skeleton action cannot start yet (its input has not
/// arrived, or a forward would exceed `limit[device]` micro-batches in flight, counted from the
/// forward to the end of the weight part): the zero-bubble construction of Qi et al., which
/// fills with W what 1F1B leaves idle. The result is an actual execution, so it cannot deadlock.
fn fill_weights(
    m: usize,
    placement: &[usize],
    skeleton: &[Vec<Action>],
    limit: &[usize],
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let k = skeleton.len();
    let s_total = placement.len();
    let last = s_total - 1;
    const NOT_YET: usize = usize::MAX;
    let mut done_f = vec![vec![NOT_YET; m]; s_total];
    let mut done_i = vec![vec![NOT_YET; m]; s_total];
    let mut pending_w: Vec<Vec<(usize, Action)>> = vec![Vec::new(); k]; // (ready at, W)
    let mut in_flight = vec![0usize; k];
    let mut next = vec![0usize; k];
    let mut lists: Vec<Vec<Action>> = vec![Vec::new(); k];
    let mut t = 0usize;
    // Per device: the tick its current action ends and the W it finishes (if any).
    let mut running: Vec<Option<(usize, bool)>> = vec![None; k];
    loop {
        for d in 0..k {
            if let Some((end, weight)) = running[d] {
                if end <= t {
                    running[d] = None;
                    if weight {
                        in_flight[d] -= 1;
                    }
                }
            }
        }
        let finished = (0..k).all(|d| next[d] == skeleton[d].len() && pending_w[d].is_empty());
        if finished && running.iter().all(Option::is_none) {
            return Ok(lists);
        }
        let mut progressed = false;
        for d in 0..k {
            if running[d].is_some() {
                continue;
            }
            let ready = |at: usize| at != NOT_YET && at <= t;
            let step = skeleton[d].get(next[d]).copied().filter(|a| {
                let (s, mb) = (a.stage, a.micro_batch);
                match a.kind {
                    ActionKind::Forward => {
                        in_flight[d] < limit[d] && (s == 0 || ready(done_f[s - 1][mb]))
                    }
                    _ => ready(done_f[s][mb]) && (s == last || ready(done_i[s + 1][mb])),
                }
            });
            let (action, weight) = if let Some(a) = step {
                next[d] += 1;
                if a.kind == ActionKind::Forward {
                    done_f[a.stage][a.micro_batch] = t + 1;
                    in_flight[d] += 1;
                } else {
                    done_i[a.stage][a.micro_batch] = t + 1;
                    pending_w[d].push((
                        t + 1,
                        Action::new(ActionKind::BackwardWeight, a.stage, a.micro_batch),
                    ));
                }
                (a, false)
            } else if let Some(i) = pending_w[d].iter().position(|(at, _)| *at <= t) {
                (pending_w[d].remove(i).1, true)
            } else {
                continue;
            };
            lists[d].push(action);
            running[d] = Some((t + 1, weight));
            progressed = true;
        }
        if !progressed && running.iter().all(Option::is_none) {
            let device = (0..k).find(|&d| next[d] < skeleton[d].len()).unwrap_or(0);
            return Err(ScheduleError::Deadlock {
                stuck: vec![(
                    device,
                    skeleton[device][next[device].min(skeleton[device].len() - 1)],
                )],
            });
        }
        t += 1;
    }
}
