//! The gradient reduction across replicas over MPI (feature `mpi`), overlapped with the
//! backward: each stage's gradients are one bucket, handed to the communication thread's
//! collectives (see [`crate::exec::transport::mpi_reduce`]) as soon as the device's worker
//! ran the stage's last backward or weight action, while it goes on with the rest.
//!
//! MPI matches collectives on a communicator by the order they are started, so every replica
//! of a device starts the same buckets in the same order every step: the order in which the
//! schedule makes the stages' gradients final (the same list of actions on every replica).
//! A replica whose step failed, or that stopped early, starts the buckets it did not start
//! (zeros: the step's results are dropped everywhere), so that the next step's collectives
//! never meet this one's. Stages with tied parameters are reduced after the tied exchange, at
//! the end of the step, in stage order.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::Instant;

use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result};
use crate::exec::threads::lock;
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::mpi_reduce::Reduction;
use crate::exec::Stage;
use crate::schedule::{ActionKind, Schedule};

use super::mpi::rank_error;
use super::GradsFinal;

/// A bucket's sum and when it was complete.
type Sum = Receiver<std::result::Result<(Vec<f32>, Instant), String>>;

/// One step's buckets on one rank.
pub(crate) struct Buckets {
    comm: MpiComm,
    pub round: u64,
    k: usize,
    weights: Vec<f32>,
    /// This device's stages without tied parameters, in the order their gradients become
    /// final in the schedule.
    order: Vec<usize>,
    /// Each such stage's number of gradient values.
    sizes: HashMap<usize, usize>,
    /// The step's clock.
    pub clock: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// How many of `order` were started.
    next: usize,
    sums: HashMap<usize, Sum>,
    /// When each bucket started, on the step's clock.
    started: HashMap<usize, f64>,
    /// A stage whose gradients could not be read (its bucket went as zeros).
    error: Option<String>,
}

/// Every gradient value of `stage`, parameter by parameter (zeros for a parameter without a
/// gradient).
pub(crate) fn grads_of(stage: &Stage) -> Result<Vec<f32>> {
    let mut values = Vec::new();
    for l in &stage.layers {
        for (_, p) in l.parameters() {
            match p.grad() {
                Some(g) => values.extend(g.to_vec()?),
                None => values.extend(std::iter::repeat_n(0.0, p.value().numel())),
            }
        }
    }
    Ok(values)
}

/// Sets each parameter of `stage`'s gradient from `sum` (in [`grads_of`]'s order), every new
/// tensor built before any is set.
pub(crate) fn set_grads(stage: &Stage, sum: &[f32]) -> Result<()> {
    let params: Vec<_> = stage
        .layers
        .iter()
        .flat_map(|l| l.parameters())
        .map(|(_, p)| p)
        .collect();
    let mut at = 0;
    let mut grads = Vec::with_capacity(params.len());
    for p in &params {
        let n = p.value().numel();
        let part = sum.get(at..at + n).ok_or_else(|| {
            PipelineError::Config(format!(
                "the reduced gradients of stage {} hold {} values, its parameters more",
                stage.index,
                sum.len()
            ))
        })?;
        grads.push(Tensor::from_slice(
            part,
            p.value().shape(),
            p.value().device(),
        )?);
        at += n;
    }
    for (p, g) in params.iter().zip(grads) {
        p.set_grad(Some(g));
    }
    Ok(())
}

impl Buckets {
    /// The buckets of round `round` for this rank's device of `schedule`, over `stages` (the
    /// held replica's).
    pub(crate) fn new(
        comm: &MpiComm,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        weights: &[f32],
        clock: Instant,
    ) -> Buckets {
        let k = schedule.num_devices();
        let device = comm.rank() % k;
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (i, a) in schedule.devices[device].iter().enumerate() {
            if matches!(a.kind, ActionKind::Backward | ActionKind::BackwardWeight) {
                last.insert(a.stage, i);
            }
        }
        let mut order: Vec<usize> = stages
            .iter()
            .filter(|s| schedule.placement[s.index] == device && last.contains_key(&s.index))
            .filter(|s| {
                s.layers
                    .iter()
                    .flat_map(|l| l.parameters())
                    .all(|(_, p)| p.tie_group().is_none())
            })
            .map(|s| s.index)
            .collect();
        order.sort_by_key(|s| last[s]);
        let sizes = stages
            .iter()
            .filter(|s| order.contains(&s.index))
            .map(|s| (s.index, s.num_params()))
            .collect();
        Buckets {
            comm: comm.clone(),
            round,
            k,
            weights: weights.to_vec(),
            order,
            sizes,
            clock,
            state: Mutex::new(State::default()),
        }
    }

    /// Hands a bucket of `values` to the communication thread: its sum, and when it started.
    fn post(&self, values: Vec<f32>) -> (Sum, f64, std::result::Result<(), String>) {
        let (reply, sum) = channel();
        let red = Reduction::new(self.k, values, self.weights.clone(), reply);
        let started = self.clock.elapsed().as_secs_f64();
        (sum, started, self.comm.start_reduction(red))
    }

    fn start(&self, state: &mut State, stage: usize, values: Vec<f32>) {
        let (sum, started, posted) = self.post(values);
        if let Err(why) = posted {
            state.error.get_or_insert(why);
        }
        state.sums.insert(stage, sum);
        state.started.insert(stage, started);
    }

    /// Starts the buckets not started yet, in order: from `stages` when the step went well
    /// here, else zeros.
    pub(crate) fn start_rest(&self, stages: Option<&[Stage]>) {
        let mut state = lock(&self.state);
        while let Some(&index) = self.order.get(state.next) {
            state.next += 1;
            let values = stages
                .and_then(|all| all.iter().find(|s| s.index == index))
                .and_then(|s| grads_of(s).ok())
                .unwrap_or_else(|| vec![0.0; self.sizes[&index]]);
            self.start(&mut state, index, values);
        }
    }

    /// The sum of `stage`'s bucket and when it started, when it was started early (`None`
    /// when not).
    pub(crate) fn take(&self, stage: usize) -> Result<Option<(Sum, f64)>> {
        let mut state = lock(&self.state);
        if let Some(why) = state.error.take() {
            return Err(rank_error(self.comm.rank(), self.comm.rank() % self.k, why));
        }
        let started = state.started.get(&stage).copied().unwrap_or(0.0);
        Ok(state.sums.remove(&stage).map(|s| (s, started)))
    }

    /// Starts a bucket now (a stage with tied parameters, after the tied exchange).
    pub(crate) fn start_late(&self, stage: &Stage) -> Result<(Sum, f64)> {
        let (sum, started, posted) = self.post(grads_of(stage)?);
        posted.map_err(|why| rank_error(self.comm.rank(), self.comm.rank() % self.k, why))?;
        Ok((sum, started))
    }
}

impl GradsFinal for Buckets {
    fn stage_final(&self, stage: &Stage) {
        let mut state = lock(&self.state);
        // Only in the agreed order (a stage out of it waits for `start_rest`).
        if self.order.get(state.next) != Some(&stage.index) {
            return;
        }
        state.next += 1;
        let values = match grads_of(stage) {
            Ok(v) => v,
            Err(e) => {
                state.error.get_or_insert(e.to_string());
                vec![0.0; self.sizes[&stage.index]]
            }
        };
        self.start(&mut state, stage.index, values);
    }
}
