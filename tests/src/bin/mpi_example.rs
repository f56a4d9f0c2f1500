//! The transformer example as one rank of an MPI job: `mpirun -np N mpi_example <summary.json>
//! <example flags...>` runs `train_transformer` with the flags and, on rank 0, writes the
//! losses, held-out loss and text sample it reports to the summary file (what the MPI tests
//! compare with one process).

use std::sync::atomic::AtomicBool;

use wgpipe_apps::train_transformer::{run_with, TransformerArgs};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((summary, flags)) = args.split_first() else {
        eprintln!("usage: mpi_example <summary.json> <train_transformer flags...>");
        std::process::exit(2);
    };
    let run =
        TransformerArgs::parse_from_args(flags).and_then(|a| run_with(a, &AtomicBool::new(false)));
    // What this rank's process held at most on the CPU device, where the model's layers are
    // built before they go to their stage's device (the MPI tests check that a rank builds
    // only its own layers): a `<summary>.rank<r>.json` per rank.
    if let Ok(rank) = std::env::var("OMPI_COMM_WORLD_RANK") {
        let cpu = wgpipe_tensor::Device::cpu().memory_stats();
        let text = serde_json::json!({ "cpu_peak_bytes": cpu.peak });
        std::fs::write(format!("{summary}.rank{rank}.json"), text.to_string())
            .expect("writing the rank's memory");
    }
    match run {
        Ok(r) => {
            if wgpipe_apps::output::is_root() {
                let text = serde_json::json!({
                    "losses": r.losses,
                    "eval_loss": r.eval_loss,
                    "sample": r.sample,
                });
                std::fs::write(summary, text.to_string()).expect("writing the summary");
            }
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
