//! One rank of an MPI test job (`mpirun -np N mpi_worker <job> <out-dir>`): trains the job's
//! pipeline with the MPI transport and writes `rank<r>.json` into the folder: the losses, the
//! errors of failed steps (with how long the step took), and the values of the parameters of
//! the stages this rank runs.

use std::path::Path;
use std::time::Instant;

use serde_json::json;
use wgpipe_pipeline::MpiComm;
use wgpipe_pipeline::{LoadOptions, SaveOptions, Transport};
use wgpipe_tensor::memory::Tag;
use wgpipe_tests::{mse, try_sim_pipeline, FaultKind, MpiFault, MpiJob, PipeCfg};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (job_args, out) = args.split_at(args.len().saturating_sub(1));
    let (Some(job), Some(out)) = (MpiJob::from_args(job_args), out.first()) else {
        eprintln!("usage: mpi_worker <schedule> <K> <M> <steps> <R> <save at>[s] <resume|-> [<fault rank> <step> <panic>] <out dir>");
        std::process::exit(2);
    };
    let comm = match MpiComm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    // For the test that stops a rank: how to end it.
    let pid = Path::new(out).join(format!("rank{}.pid", comm.rank()));
    std::fs::write(&pid, std::process::id().to_string()).expect("writing the rank's pid");
    let result = run(&job, &comm, Path::new(out));
    let rank = comm.rank();
    // What the rank has to say is said before MPI ends: under mpirun the first rank to exit
    // with an error (or, with a rank dead, without finalizing MPI) ends the others.
    let path = Path::new(out).join(format!("rank{rank}.json"));
    let mut results = match result {
        Ok(v) => {
            std::fs::write(&path, v.to_string()).expect("writing the rank's results");
            Some(v)
        }
        Err(e) => {
            // One write, so that mpirun does not interleave it with another rank's line.
            let line = format!("rank {rank}: {e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            None
        }
    };
    // How long ending MPI takes (with a peer taken for dead: no wait for sends to it), added
    // to the results when the rank gets that far.
    let t0 = Instant::now();
    comm.finish();
    let finish_secs = t0.elapsed().as_secs_f64();
    match results.as_mut() {
        Some(v) => {
            v["finish_secs"] = json!(finish_secs);
            std::fs::write(&path, v.to_string()).expect("writing the rank's results");
        }
        None => std::process::exit(1),
    }
}

fn run(job: &MpiJob, comm: &MpiComm, out: &Path) -> Result<serde_json::Value, String> {
    let (layers, fault) = MpiJob::model();
    let cfg = PipeCfg {
        transport: Transport::Mpi(comm.clone()),
        ..job.cfg()
    };
    let mut pipe = try_sim_pipeline(layers, &cfg).map_err(|e| e.to_string())?;
    if let Some(path) = &job.resume {
        pipe.load(path, &LoadOptions::default())
            .map_err(|e| e.to_string())?;
    }
    // What this rank holds after the build, per simulated device: only its own stages'
    // parameters (the test compares with the stages' share of the model).
    let devices = pipe
        .sim_cluster()
        .map(|c| c.devices().to_vec())
        .unwrap_or_default();
    let live = |tag: Tag| -> Vec<usize> {
        devices
            .iter()
            .map(|d| d.memory_stats().live_of(tag))
            .collect()
    };
    let held_params: usize = pipe
        .named_parameters()
        .iter()
        .map(|(_, p)| 4 * p.value().numel())
        .sum();
    let built_param_bytes = live(Tag::Parameters);
    let k = pipe.num_devices();
    let my_device = devices[comm.rank() % k].clone();
    let (x, y) = MpiJob::data();
    let mut losses = Vec::new();
    let mut errors = Vec::new();
    let mut skipped = Vec::new();
    let mut rows = 0;
    // Each device's parameter bytes as the last step's report shows them.
    let mut report_param_bytes = Vec::new();
    let mut eval_losses = Vec::new();
    for step in 0..job.steps {
        let injected = job
            .fault
            .filter(|&(r, s, _)| r == comm.rank() && s == step)
            .map(|(_, _, f)| f);
        // This replica's micro-batch 1, as the layers number it (replica r's are rM..rM+M).
        let m1 = ((comm.rank() / job.k) * job.m + 1) as u64;
        if injected == Some(MpiFault::StopInSave) {
            // The stop halts the whole process, its communication thread too: give that thread
            // time to send what the last step queued (the optimizer step's verdict), which a
            // loaded machine may not have scheduled yet, so that the others reach the save.
            std::thread::sleep(std::time::Duration::from_millis(300));
            fault.lock().unwrap().stop_in_parameters = true;
        }
        // Every rank saves at the step where one of them is to stop in a save.
        let save_to_stop_in = matches!(job.fault, Some((_, s, MpiFault::StopInSave)) if s == step);
        if (job.save_at == Some(step) && job.sharded) || save_to_stop_in {
            // Each rank its own stages, then the index from rank 0.
            pipe.save_sharded(out.join("ckpt"), &SaveOptions::default())
                .map_err(|e| e.to_string())?;
        } else if job.save_at == Some(step) {
            // The whole model on every rank, then one file from rank 0.
            pipe.gather_stages(|| MpiJob::model().0)
                .map_err(|e| e.to_string())?;
            if pipe.rank() == 0 {
                pipe.save(out.join("ckpt.safetensors"), &SaveOptions::default())
                    .map_err(|e| e.to_string())?;
            }
        }
        // Every rank evaluates at the step where one of them is to stop in an evaluation.
        if matches!(job.fault, Some((_, s, MpiFault::StopInEvaluation)) if s == step) {
            let evaluating = injected == Some(MpiFault::StopInEvaluation);
            {
                let mut state = fault.lock().unwrap();
                state.in_evaluation = evaluating;
                state.armed = evaluating.then_some((FaultKind::Stop, m1));
            }
            eval_losses.push(pipe.evaluate(&x, &y, &mse).map_err(|e| e.to_string())?);
            fault.lock().unwrap().in_evaluation = false;
        }
        fault.lock().unwrap().armed = match injected {
            Some(MpiFault::Error) => Some((FaultKind::Error, m1)),
            Some(MpiFault::Panic) => Some((FaultKind::Panic, m1)),
            Some(MpiFault::Abort) => Some((FaultKind::Abort, m1)),
            Some(MpiFault::Stop) => Some((FaultKind::Stop, m1)),
            Some(MpiFault::Overflow) => Some((FaultKind::Overflow, m1)),
            _ => None,
        };
        // A memory cap on this rank's device: room for what lives now plus 192 bytes.
        if injected == Some(MpiFault::OutOfMemory) {
            let live = my_device.memory_stats().live;
            my_device.memory().set_capacity(Some(live + 192));
        }
        let t0 = Instant::now();
        let trained = pipe.train_step(&x, &y, &mse);
        my_device.memory().set_capacity(None);
        match trained {
            Ok(report) => {
                // A skipped step's loss is not finite (no JSON number): its step is listed.
                if report.skipped.is_some() {
                    skipped.push(step);
                } else {
                    losses.push(report.loss);
                }
                rows = report.stages.len();
                report_param_bytes = report
                    .stages
                    .iter()
                    .map(|s| s.memory.live_of(Tag::Parameters))
                    .collect();
                if injected == Some(MpiFault::Optimizer) {
                    // No room at all: the optimizer's first new tensor fails here.
                    let live = my_device.memory_stats().live;
                    my_device.memory().set_capacity(Some(live));
                }
                let t0 = Instant::now();
                let stepped = pipe.optimizer_step();
                my_device.memory().set_capacity(None);
                if let Err(e) = stepped {
                    errors.push(json!({
                        "step": step,
                        "phase": "optimizer",
                        "text": e.to_string(),
                        "secs": t0.elapsed().as_secs_f64(),
                        // The parameters right after the failed step (as before it).
                        "params_after": held_values(&pipe, comm.rank() % k)?,
                    }));
                    // Once more, with room: the gradients are still there.
                    pipe.optimizer_step().map_err(|e| e.to_string())?;
                }
            }
            Err(e) => errors.push(json!({
                "step": step,
                "phase": "train",
                "text": e.to_string(),
                "secs": t0.elapsed().as_secs_f64()
            })),
        }
    }
    let me = comm.rank() % k;
    Ok(json!({
        "rank": comm.rank(),
        "size": comm.size(),
        "losses": losses,
        "eval_losses": eval_losses,
        "skipped": skipped,
        "loss_scale": pipe.loss_scaler().map(|s| s.scale),
        "errors": errors,
        "params": held_values(&pipe, me)?,
        "report_rows": rows,
        "held_param_bytes": held_params,
        "built_param_bytes": built_param_bytes,
        "final_param_bytes": live(Tag::Parameters),
        "final_optimizer_bytes": live(Tag::OptimizerState),
        "report_param_bytes": report_param_bytes,
    }))
}

/// The values of the parameters of the stages on device `me` (this rank's), by name.
fn held_values(
    pipe: &wgpipe_pipeline::Pipeline,
    me: usize,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut params = serde_json::Map::new();
    for s in pipe.stages() {
        if pipe.schedule().placement[s.index] != me {
            continue;
        }
        for (i, l) in s.layers.iter().enumerate() {
            for (n, p) in l.parameters() {
                let name = wgpipe_autograd::layer_param_name(s.first_layer + i, &n);
                params.insert(name, json!(p.value().to_vec().map_err(|e| e.to_string())?));
            }
        }
    }
    Ok(params)
}
