//! The synthesizer against the generators on the grid of issue 33: K in {2, 4, 8}, M in
//! {K, 2K, 4K}, I/F in {1, 2}, W/F in {0.5, 1}, transfer/F in {0, 0.5}, and a memory cap of
//! 1F1B's peak and of twice that. Costs are per device and per micro-batch (F = 1), split evenly
//! among a schedule's chunks; every schedule is simulated with them, each generator with its
//! default chunks and only where it fits the cap (its pairs in flight over its chunks).

use crate::schedule::{CheckpointMode, ScheduleKind, StageCosts, SynthError, SynthSpec};

use super::{fits_cap, simulate_spec, synthesize_uniform, Synthesis};

/// One cell of the grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cell {
    pub k: usize,
    pub m: usize,
    /// I / F.
    pub input: f64,
    /// W / F.
    pub weight: f64,
    /// Transfer / F.
    pub transfer: f64,
    /// The cap in multiples of 1F1B's peak.
    pub cap_factor: usize,
}

impl Cell {
    /// The costs of one micro-batch on one device.
    pub fn device_costs(&self) -> StageCosts {
        StageCosts {
            forward: 1.0,
            input: self.input,
            weight: self.weight,
        }
    }
}

/// The 144 cells, K slowest, the cap fastest.
pub fn cells() -> Vec<Cell> {
    let mut out = Vec::new();
    for k in [2, 4, 8] {
        for m in [k, 2 * k, 4 * k] {
            for input in [1.0, 2.0] {
                for weight in [0.5, 1.0] {
                    for transfer in [0.0, 0.5] {
                        for cap_factor in [1, 2] {
                            out.push(Cell {
                                k,
                                m,
                                input,
                                weight,
                                transfer,
                                cap_factor,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// A cell's outcome.
#[derive(Debug, Clone)]
pub struct CellResult {
    pub cell: Cell,
    /// The cap, in micro-batches of a device's share of the model.
    pub cap: usize,
    /// The fastest generator that fits the cap, and its simulated step.
    pub best_generator: (ScheduleKind, f64),
    pub synthesis: Synthesis,
}

impl CellResult {
    /// Synthesized step over the best generator's (below 1: the synthesizer is faster).
    pub fn ratio(&self) -> f64 {
        self.synthesis.step / self.best_generator.1
    }
}

/// 1F1B's peak on K devices and M micro-batches: the most micro-batches a device holds.
pub fn one_f_one_b_peak(k: usize, m: usize) -> Result<usize, SynthError> {
    let s = ScheduleKind::OneFOneB.generate(k, 1, m, CheckpointMode::Never)?;
    Ok(s.max_in_flight().into_iter().max().unwrap_or(1))
}

/// Simulates the generators and the synthesizer in `cell`.
pub fn evaluate(cell: Cell) -> Result<CellResult, SynthError> {
    let cap = cell.cap_factor * one_f_one_b_peak(cell.k, cell.m)?;
    let device = cell.device_costs();
    let mut best: Option<(ScheduleKind, f64)> = None;
    for kind in ScheduleKind::ALL {
        if kind == ScheduleKind::Synthesized {
            continue;
        }
        let v = kind.default_chunks();
        let Ok(s) = kind.generate(cell.k, v, cell.m, CheckpointMode::Never) else {
            continue; // DualPipeV below M = 2K
        };
        let placement = kind.def().chunks.placement(v);
        let spec = SynthSpec::uniform(cell.k, placement, cell.m, device, cell.transfer, cap);
        if !fits_cap(&s, &spec) {
            continue;
        }
        let step = simulate_spec(&s, &spec).map_err(|e| SynthError::Simulation(e.to_string()))?;
        if best.is_none_or(|(_, b)| step < b) {
            best = Some((kind, step));
        }
    }
    let (synthesis, _) = synthesize_uniform(cell.k, cell.m, device, cell.transfer, cap)?;
    Ok(CellResult {
        cell,
        cap,
        best_generator: best.expect("1F1B fits 1F1B's peak"),
        synthesis,
    })
}
