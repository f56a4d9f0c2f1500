//! One rank of an MPI test job (`mpirun -np N mpi_worker <job> <out-dir>`): trains the job's
//! pipeline with the MPI transport and writes `rank<r>.json` into the folder: the losses, the
//! errors of failed steps (with how long the step took), and the values of the parameters of
//! the stages this rank runs.

use std::path::Path;
use std::time::Instant;

use serde_json::json;
use wgpipe_pipeline::mpi_comm::MpiComm;
use wgpipe_pipeline::{LoadOptions, SaveOptions, Transport};
use wgpipe_tests::{mse, try_sim_pipeline, FaultKind, MpiJob, PipeCfg};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (job_args, out) = args.split_at(args.len().saturating_sub(1));
    let (Some(job), Some(out)) = (MpiJob::from_args(job_args), out.first()) else {
        eprintln!("usage: mpi_worker <schedule> <K> <M> <steps> <R> <save at> <resume|-> [<fault rank> <step> <panic>] <out dir>");
        std::process::exit(2);
    };
    let comm = match MpiComm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let result = run(&job, &comm, Path::new(out));
    let rank = comm.rank();
    comm.finish();
    match result {
        Ok(v) => {
            let path = Path::new(out).join(format!("rank{rank}.json"));
            std::fs::write(&path, v.to_string()).expect("writing the rank's results");
        }
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            std::process::exit(1);
        }
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
    let (x, y) = MpiJob::data();
    let mut losses = Vec::new();
    let mut errors = Vec::new();
    let mut rows = 0;
    for step in 0..job.steps {
        if job.save_at == Some(step) {
            // The whole model on every rank, then one file from rank 0.
            pipe.gather_stages().map_err(|e| e.to_string())?;
            if pipe.rank() == 0 {
                pipe.save(out.join("ckpt.safetensors"), &SaveOptions::default())
                    .map_err(|e| e.to_string())?;
            }
        }
        let armed = job
            .fault
            .filter(|&(r, s, _)| r == comm.rank() && s == step)
            .map(|(_, _, panic)| {
                let kind = if panic {
                    FaultKind::Panic
                } else {
                    FaultKind::Error
                };
                (kind, 1)
            });
        fault.lock().unwrap().armed = armed;
        let t0 = Instant::now();
        match pipe.train_step(&x, &y, &mse) {
            Ok(report) => {
                losses.push(report.loss);
                rows = report.stages.len();
                pipe.optimizer_step().map_err(|e| e.to_string())?;
            }
            Err(e) => errors.push(json!({
                "step": step,
                "text": e.to_string(),
                "secs": t0.elapsed().as_secs_f64()
            })),
        }
    }
    // This rank's stages: those placed on its device.
    let k = pipe.num_devices();
    let me = comm.rank() % k;
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
    Ok(json!({
        "rank": comm.rank(),
        "size": comm.size(),
        "losses": losses,
        "errors": errors,
        "params": params,
        "report_rows": rows,
    }))
}
