//! Simulated time: the bubble of the simulated timeline built from the measured FLOPs and bytes.

use wgpipe_autograd::Module;
use wgpipe_pipeline::{CheckpointMode, LinkSpec, ScheduleKind, StepReport};
use wgpipe_tests::*;

const N: usize = 16;
const WIDTH: usize = 128;

/// K identical stages of two `ShiftLinear(128)` layers: every stage does the same FLOPs in
/// forward and in backward. Only the last stage also runs the loss; with the cheap loss below
/// that is under 0.1% of its work (with MSE on width 64 it was 0.8%, which already moves the
/// bubble by 2.7% of its value at K=2, M=8: the formula assumes exactly equal stages).
fn equal_stages(k: usize) -> Vec<Box<dyn Module>> {
    (0..2 * k)
        .map(|i| Box::new(ShiftLinear::new(WIDTH, 60 + i as u64)) as Box<dyn Module>)
        .collect()
}

/// `mean(output)`: one reduction forward, one broadcast backward.
fn cheap_loss(
    out: &wgpipe_autograd::Var,
    _target: &wgpipe_tensor::Tensor,
) -> wgpipe_tensor::Result<wgpipe_autograd::Var> {
    out.mean(&[], false)
}

fn step(k: usize, m: usize, schedule: ScheduleKind, link: LinkSpec) -> StepReport {
    let x = normal_data(&[N, WIDTH], 71);
    let y = normal_data(&[N, WIDTH], 72);
    let mut cfg = PipeCfg::new(k, m, CheckpointMode::Never, schedule);
    cfg.link = link;
    cfg.flops_per_sec = 1e9;
    let mut pipe = sim_pipeline(equal_stages(k), &cfg);
    pipe.train_step(&x, &y, &cheap_loss).unwrap()
}

fn ideal(k: usize, m: usize) -> f64 {
    (k - 1) as f64 / (m + k - 1) as f64
}

#[test]
fn equal_stages_and_free_links_give_the_ideal_bubble() {
    for schedule in CLASSIC_SCHEDULES {
        for k in [1, 2, 3, 4] {
            for m in [1, 2, 4, 8, 16] {
                let r = step(k, m, schedule, LinkSpec::FREE);
                let sim = r.simulated.as_ref().expect("simulated mode");
                let b = sim.bubble_fraction;
                let want = ideal(k, m);
                eprintln!(
                    "{schedule:?} K={k} M={m}: simulated bubble {b:.4}, (K-1)/(M+K-1) = {want:.4}"
                );
                assert!(
                    (b - want).abs() <= 0.02 * want.max(1e-9) + 1e-12,
                    "{schedule:?} K={k} M={m}: bubble {b:.5} vs ideal {want:.5}"
                );
            }
        }
    }
}

/// A slow link adds its latency and bytes / bandwidth to every hand-off on the critical path:
/// the simulated step gets longer and the bubble grows with it; with one stage nothing moves.
#[test]
fn a_slow_link_grows_the_bubble() {
    for schedule in CLASSIC_SCHEDULES {
        for (k, m) in [(2, 4), (4, 8), (3, 16)] {
            let mut last = (0.0f64, 0.0f64);
            for (i, (bandwidth, latency)) in
                [(f64::INFINITY, 0.0), (1e9, 1e-6), (1e8, 2e-5), (1e7, 2e-4)]
                    .into_iter()
                    .enumerate()
            {
                let link = LinkSpec {
                    bandwidth_bytes_per_sec: bandwidth,
                    latency_sec: latency,
                };
                let r = step(k, m, schedule, link);
                let sim = r.simulated.as_ref().unwrap();
                eprintln!(
                    "{schedule:?} K={k} M={m} link {bandwidth:e} B/s + {latency:e} s: simulated {:.1} us, bubble {:.4} (ideal {:.4})",
                    sim.makespan_secs * 1e6,
                    sim.bubble_fraction,
                    ideal(k, m)
                );
                if i > 0 {
                    assert!(
                        sim.makespan_secs > last.0 && sim.bubble_fraction > last.1 + 1e-3,
                        "{schedule:?} K={k} M={m}: a slower link did not slow the step: {:?} -> {:?}",
                        last,
                        (sim.makespan_secs, sim.bubble_fraction)
                    );
                }
                last = (sim.makespan_secs, sim.bubble_fraction);
            }
        }
        let slow = LinkSpec {
            bandwidth_bytes_per_sec: 1e7,
            latency_sec: 2e-4,
        };
        let one = step(1, 4, schedule, slow);
        assert_eq!(one.simulated.unwrap().bubble_fraction, 0.0);
    }
}

/// Simulated time is a function of the measured FLOPs and bytes only: the same step twice gives
/// the same timeline, bit for bit, whatever the host did meanwhile.
#[test]
fn the_simulated_timeline_is_deterministic() {
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e8,
        latency_sec: 1e-5,
    };
    let a = step(3, 6, ScheduleKind::OneFOneB, link);
    let b = step(3, 6, ScheduleKind::OneFOneB, link);
    assert_eq!(a.simulated.unwrap().timeline, b.simulated.unwrap().timeline);
}
