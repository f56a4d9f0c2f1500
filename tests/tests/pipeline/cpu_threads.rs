//! Where a pipeline's stage work runs on the CPU: a stage thread that has the CPU to itself (the
//! step's only one, on a CPU device) runs its actions and its optimizer step on one of the CPU
//! backend's own threads, so that its kernels share their work out from inside the pool;
//! several stage threads each run on their own thread and share the CPU's threads. Either way
//! the results are the same bits, and a panic there comes back as an error naming where it
//! happened. Each test checks in a child process of its own, where no other test's stage holds
//! a pool thread.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use wgpipe_autograd::optim::{Optimizer, Sgd};
use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_models::{mse, Linear, Relu};
use wgpipe_pipeline::{
    CheckpointMode, Pipeline, PipelineError, StageCause, StepsOptions, StepsPath,
};
use wgpipe_tensor::{Device, Result, Tensor};
use wgpipe_tests::*;

/// The names of the threads a forward ran on (`None`: an unnamed thread, such as the CPU
/// pool's), one per call.
type Seen = Arc<Mutex<Vec<Option<String>>>>;

/// Passes its input on, noting the thread it ran on; panics instead where `panics` is set.
struct WhereRan {
    seen: Seen,
    panics: bool,
}

impl Module for WhereRan {
    fn name(&self) -> String {
        "WhereRan".into()
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        if self.panics {
            panic!("injected panic in WhereRan");
        }
        let name = std::thread::current().name().map(str::to_string);
        self.seen.lock().unwrap().push(name);
        Ok(x.clone())
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// Linear, ReLU, the probe, Linear, ReLU, the probe, Linear (8 -> 16 -> 16 -> 4).
fn model(seen: &Seen, panics: bool) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let probe = || -> Box<dyn Module> {
        Box::new(WhereRan {
            seen: seen.clone(),
            panics,
        })
    };
    vec![
        Box::new(Linear::new(8, 16, 1, &d).unwrap()),
        Box::new(Relu),
        probe(),
        Box::new(Linear::new(16, 16, 2, &d).unwrap()),
        Box::new(Relu),
        probe(),
        Box::new(Linear::new(16, 4, 3, &d).unwrap()),
    ]
}

/// SGD, noting the thread each step ran on.
struct WhereStepped {
    sgd: Sgd,
    seen: Seen,
}

impl Optimizer for WhereStepped {
    fn step(&mut self, params: &[(String, Param)]) -> Result<()> {
        let name = std::thread::current().name().map(str::to_string);
        self.seen.lock().unwrap().push(name);
        self.sgd.step(params)
    }
    fn lr(&self) -> f32 {
        self.sgd.lr()
    }
    fn set_lr(&mut self, lr: f32) {
        self.sgd.set_lr(lr)
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        self.sgd.state()
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.sgd.load_state(state)
    }
    fn steps(&self) -> u64 {
        self.sgd.steps()
    }
}

/// A pipeline of [`model`] on `k` CPU devices, 2 micro-batches, SGD; the forwards' threads go
/// to `seen`, the optimizer steps' to `stepped`.
fn pipeline(seen: &Seen, stepped: &Seen, k: usize, panics: bool) -> Pipeline {
    let stepped = stepped.clone();
    Pipeline::builder(model(seen, panics))
        .devices(vec![Device::cpu(); k])
        .micro_batches(2)
        .checkpoint(CheckpointMode::Never)
        .optimizer(move || {
            Box::new(WhereStepped {
                sgd: Sgd::new(0.05),
                seen: stepped.clone(),
            }) as Box<dyn Optimizer>
        })
        .build()
        .unwrap()
}

/// Set in the child process of [`alone_in_a_process`].
const CHILD: &str = "WGPIPE_TEST_CPU_THREADS_CHILD";

/// Whether the caller (test `name` of this module) should run its checks here: in a child
/// process of this test binary that runs only it, where no other test's stage holds a CPU pool
/// thread (a stage is lent one only while another stays free). In the parent, runs the child
/// and asserts that it passed.
fn alone_in_a_process(name: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let name = format!("cpu_threads::{name}");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &name, "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in its own process: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// Whether every call noted in `names` ran on a stage thread (`wgpipe-stage-N`).
fn on_stage_threads(names: &[Option<String>]) -> bool {
    names
        .iter()
        .all(|n| n.as_deref().is_some_and(|n| n.starts_with("wgpipe-stage-")))
}

/// Whether the CPU pool can lend a lone stage a thread (it keeps another free); says why the
/// test is skipped where not.
fn pool_lends() -> bool {
    let lends = wgpipe_tensor::cpu_threads() >= 2;
    if !lends {
        eprintln!("skipped: the CPU pool has one thread, so a lone stage runs where it is");
    }
    lends
}

fn batch() -> (Tensor, Tensor) {
    (normal_data(&[8, 8], 1), normal_data(&[8, 4], 2))
}

/// Two steps of `pipe`: its parameters after them, and its losses.
fn train(pipe: &mut Pipeline) -> (Vec<(String, Vec<f32>)>, Vec<u32>) {
    let (x, y) = batch();
    let mut losses = Vec::new();
    for _ in 0..2 {
        losses.push(pipe.train_step(&x, &y, &mse).unwrap().loss.to_bits());
        pipe.optimizer_step().unwrap();
    }
    (snapshot(&pipe.named_parameters()), losses)
}

#[test]
fn a_lone_cpu_stage_runs_on_the_cpu_pool_and_gives_the_same_bits() {
    if !alone_in_a_process("a_lone_cpu_stage_runs_on_the_cpu_pool_and_gives_the_same_bits") {
        return;
    }
    if !pool_lends() {
        return;
    }
    let (alone, alone_stepped): (Seen, Seen) = Default::default();
    let (params_alone, losses_alone) = train(&mut pipeline(&alone, &alone_stepped, 1, false));
    let (shared, shared_stepped): (Seen, Seen) = Default::default();
    let (params_shared, losses_shared) = train(&mut pipeline(&shared, &shared_stepped, 2, false));

    let alone = alone.lock().unwrap().clone();
    // 2 steps x 2 micro-batches x 2 probes.
    assert_eq!(alone.len(), 8);
    assert!(
        alone.iter().all(|n| n.is_none()),
        "a lone stage ran on its own thread, not the CPU pool's: {alone:?}"
    );
    let shared = shared.lock().unwrap().clone();
    assert_eq!(shared.len(), 8);
    assert!(
        on_stage_threads(&shared),
        "two stages did not run on their own threads: {shared:?}"
    );
    // The optimizer steps likewise: 2 steps of one stage, and of two.
    let alone_stepped = alone_stepped.lock().unwrap().clone();
    assert_eq!(
        alone_stepped,
        vec![None, None],
        "a lone stage's optimizer step"
    );
    let shared_stepped = shared_stepped.lock().unwrap().clone();
    assert_eq!(shared_stepped.len(), 4);
    assert!(on_stage_threads(&shared_stepped), "{shared_stepped:?}");
    // Where the work ran changes no bit: one stage and two give the same steps.
    assert_eq!(losses_alone, losses_shared);
    assert_eq!(params_alone, params_shared);
}

#[test]
fn steps_back_to_back_run_a_lone_cpu_stage_on_the_cpu_pool_too() {
    if !alone_in_a_process("steps_back_to_back_run_a_lone_cpu_stage_on_the_cpu_pool_too") {
        return;
    }
    if !pool_lends() {
        return;
    }
    let run = |k: usize| {
        let (seen, stepped): (Seen, Seen) = Default::default();
        let mut pipe = pipeline(&seen, &stepped, k, false);
        let opts = StepsOptions {
            steps: 3,
            clip: None,
            lr: None,
            step_at_a_time: false,
        };
        let mut losses = Vec::new();
        let report = pipe
            .train_steps(
                &opts,
                |_| Ok(batch()),
                &mse,
                |r| {
                    losses.push(r.loss.to_bits());
                    ControlFlow::Continue(())
                },
            )
            .unwrap();
        assert_eq!(report.path, StepsPath::BackToBack, "k = {k}");
        let seen = seen.lock().unwrap().clone();
        (seen, losses, snapshot(&pipe.named_parameters()))
    };
    let (alone, losses_alone, params_alone) = run(1);
    assert_eq!(alone.len(), 12);
    assert!(alone.iter().all(|n| n.is_none()), "{alone:?}");
    let (shared, losses_shared, params_shared) = run(2);
    assert!(on_stage_threads(&shared), "{shared:?}");
    assert_eq!(losses_alone, losses_shared);
    assert_eq!(params_alone, params_shared);
}

#[test]
fn a_panic_of_a_lone_cpu_stage_comes_back_naming_where_it_happened() {
    if !alone_in_a_process("a_panic_of_a_lone_cpu_stage_comes_back_naming_where_it_happened") {
        return;
    }
    let seen: Seen = Arc::default();
    let mut pipe = pipeline(&seen, &seen, 1, true);
    let (x, y) = batch();
    let err = pipe.train_step(&x, &y, &mse).unwrap_err();
    match &err {
        PipelineError::Stage { cause, .. } => match cause.as_ref() {
            StageCause::Panic(m) => {
                assert!(m.contains("injected panic in WhereRan"), "{m}");
                // The location is kept only where the panic was taken for a stage's.
                assert!(m.contains("(at ") && m.contains("cpu_threads.rs"), "{m}");
            }
            other => panic!("not a panic: {other:?}"),
        },
        other => panic!("not a stage error: {other:?}"),
    }
    // A pipeline without the fault then trains in the same process.
    let mut clean = pipeline(&seen, &seen, 1, false);
    clean.train_step(&x, &y, &mse).unwrap();
    clean.optimizer_step().unwrap();
}
