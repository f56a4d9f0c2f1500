//! Test layers: fault injection, an equal-cost linear layer, the wgpu test device.

use super::*;

/// What a [`Fault`] layer does when triggered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Panics in forward.
    Panic,
    /// Returns an error from forward.
    Error,
    /// Returns an error from its backward.
    BackwardError,
    /// Panics in its backward.
    BackwardPanic,
    /// Returns an error from the parameter part of its backward only (the W of a split
    /// backward; part of the full backward otherwise).
    WeightBackwardError,
    /// Sleeps this long in forward (a stuck layer), then goes on.
    Slow(std::time::Duration),
    /// Ends the whole process at once (`std::process::abort`): a rank of an MPI job that dies
    /// outright.
    Abort,
    /// Stops the whole process (SIGSTOP to itself, every thread frozen until a SIGCONT or a
    /// kill): a rank of an MPI job that hangs without dying.
    Stop,
    /// Multiplies its output by 1e30 twice, in the forward and its recompute alike: values that
    /// overflow to infinity (what loss scaling must skip).
    Overflow,
    /// Asks its device for a tensor larger than any it can hold (2^40 elements: on wgpu past
    /// u32 indexing and every adapter's `max_buffer_size`), so the device reports the error.
    DeviceError,
}

/// The trigger of a [`Fault`] layer, shared with the test.
#[derive(Debug, Default)]
pub struct FaultState {
    /// Fire on this micro-batch's (first, not recomputed) forward, or its backward.
    pub armed: Option<(FaultKind, u64)>,
    /// Fire in an evaluation's forward (not training) instead: a rank that fails while the
    /// pipeline evaluates.
    pub in_evaluation: bool,
    /// Stop the process (as [`FaultKind::Stop`]) at the next call of `parameters()`, once: a
    /// save reads them, so this is a rank that hangs in the middle of a save.
    pub stop_in_parameters: bool,
    /// When it fired.
    pub fired_at: Option<Instant>,
}

/// A layer `y = x * gate` (a trainable scalar, initially 1) that fails on demand at a given
/// micro-batch (of the stage it lands on).
pub struct Fault {
    pub state: Arc<Mutex<FaultState>>,
    pub gate: Param,
}

impl Fault {
    pub fn new() -> (Fault, Arc<Mutex<FaultState>>) {
        let state = Arc::new(Mutex::new(FaultState::default()));
        let gate = Param::new("gate", Tensor::ones(&[1], &Device::cpu()).unwrap());
        (
            Fault {
                state: state.clone(),
                gate,
            },
            state,
        )
    }
}

fn fire(state: &Arc<Mutex<FaultState>>) {
    state.lock().unwrap_or_else(|p| p.into_inner()).fired_at = Some(Instant::now());
}

impl Module for Fault {
    fn name(&self) -> String {
        "Fault".into()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let armed = self.state.lock().unwrap_or_else(|p| p.into_inner()).armed;
        let gated = || x.mul(&x.param(&self.gate)?);
        let Some((kind, m)) = armed else {
            return gated();
        };
        let in_evaluation = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_evaluation;
        if ctx.train == in_evaluation || ctx.micro_batch != m {
            return gated();
        }
        match kind {
            FaultKind::Panic if !ctx.recompute => {
                fire(&self.state);
                panic!("injected panic at micro-batch {m}");
            }
            FaultKind::Error if !ctx.recompute => {
                fire(&self.state);
                Err(Error::Invalid {
                    op: "Fault",
                    msg: format!("injected error at micro-batch {m}"),
                })
            }
            FaultKind::Abort if !ctx.recompute => std::process::abort(),
            FaultKind::Stop if !ctx.recompute => {
                fire(&self.state);
                stop_this_process();
                gated()
            }
            FaultKind::DeviceError if !ctx.recompute => {
                fire(&self.state);
                // 2^40 floats = 4 TiB: past every adapter's largest buffer.
                let huge = Tensor::zeros(&[1 << 40], x.value().device())?;
                Ok(x.add(&x.tape().constant(huge.narrow(0, 0, 1)?))?)
            }
            FaultKind::BackwardError | FaultKind::BackwardPanic => {
                let state = self.state.clone();
                Var::from_op("fault", &[x], x.value().clone(), move |g, _| {
                    fire(&state);
                    if kind == FaultKind::BackwardPanic {
                        panic!("injected backward panic at micro-batch {m}");
                    }
                    let _ = g;
                    Err(Error::Invalid {
                        op: "Fault",
                        msg: format!("injected backward error at micro-batch {m}"),
                    })
                })
            }
            FaultKind::Overflow => {
                fire(&self.state);
                gated()?.mul_scalar(1e30)?.mul_scalar(1e30)
            }
            FaultKind::Slow(d) if !ctx.recompute => {
                fire(&self.state);
                std::thread::sleep(d);
                gated()
            }
            FaultKind::WeightBackwardError => {
                let state = self.state.clone();
                let gate = x.param(&self.gate)?;
                let (xv, gv) = (x.value().clone(), gate.value().clone());
                let y = xv.mul(&gv)?;
                Var::from_op("fault", &[x, &gate], y, move |g, wants| {
                    if wants[1] {
                        fire(&state);
                        return Err(Error::Invalid {
                            op: "Fault",
                            msg: format!("injected weight-gradient error at micro-batch {m}"),
                        });
                    }
                    Ok(vec![Some(g.mul(&gv)?), None])
                })
            }
            _ => gated(),
        }
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::take(&mut state.stop_in_parameters) {
            state.fired_at = Some(Instant::now());
            drop(state);
            stop_this_process();
        }
        vec![("gate".into(), self.gate.clone())]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// SIGSTOP to this process: every thread frozen until a SIGCONT or a kill.
fn stop_this_process() {
    let me = std::process::id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &me])
        .status();
    if !stopped.as_ref().is_ok_and(|s| s.success()) {
        panic!("cannot stop this process with `kill -STOP` (procps): {stopped:?}");
    }
}

/// `y = (x + shift) W^T`: a linear layer whose input always needs a gradient (through `shift`),
/// so that the first stage does exactly the work of every other stage (with a plain `Linear`
/// first, stage 0 skips the input-gradient matmul because its input is data).
pub struct ShiftLinear {
    pub shift: Param,
    pub weight: Param,
    width: usize,
}

impl ShiftLinear {
    pub fn new(width: usize, seed: u64) -> ShiftLinear {
        let d = Device::cpu();
        let b = 1.0 / (width as f32).sqrt();
        ShiftLinear {
            shift: Param::new("shift", Tensor::zeros(&[width], &d).unwrap()),
            weight: Param::new(
                "weight",
                Tensor::rand_uniform(&[width, width], -b, b, seed, &d).unwrap(),
            ),
            width,
        }
    }
}

impl Module for ShiftLinear {
    fn name(&self) -> String {
        format!("ShiftLinear({})", self.width)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        let h = x.add(&x.param(&self.shift)?)?;
        h.matmul(&h.param(&self.weight)?.t()?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("shift".into(), self.shift.clone()),
            ("weight".into(), self.weight.clone()),
        ]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let rows: usize = input_shape[..input_shape.len() - 1].iter().product();
        CostHint {
            param_bytes: 4 * (self.width * self.width + self.width),
            flops: (2 * rows * self.width * self.width + rows * self.width) as f64,
            activation_bytes: 4 * rows * self.width,
            output_shape: input_shape.to_vec(),
        }
    }
}

/// A wgpu device for the tests ([`Device::test_wgpu`]: lavapipe unless `WGPIPE_TEST_WGPU` names
/// another adapter), or why there is none: `SKIPPED: <reason>` on stderr.
pub fn test_wgpu_or_skip(test: &str) -> Option<Device> {
    match std::panic::catch_unwind(Device::test_wgpu) {
        Ok(Ok(d)) => Some(d),
        Ok(Err(e)) => {
            eprintln!("SKIPPED: {test}: no wgpu device to test on: {e}");
            None
        }
        Err(_) => {
            eprintln!("SKIPPED: {test}: opening the wgpu test device panicked");
            None
        }
    }
}
