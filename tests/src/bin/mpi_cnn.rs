//! The CNN example as one rank of an MPI job: `mpirun -np N mpi_cnn <summary.json>
//! <train_cnn flags...>` runs `train_cnn` with the flags and, on rank 0, writes the losses and
//! held-out accuracies it reports to the summary file (what the MPI tests compare with one
//! process).

use std::sync::atomic::AtomicBool;

use wgpipe_apps::train_cnn::{run_with, CnnArgs};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((summary, flags)) = args.split_first() else {
        eprintln!("usage: mpi_cnn <summary.json> <train_cnn flags...>");
        std::process::exit(2);
    };
    match CnnArgs::parse_from_args(flags).and_then(|a| run_with(a, &AtomicBool::new(false))) {
        Ok(r) => {
            if wgpipe_apps::output::is_root() {
                let text = serde_json::json!({
                    "losses": r.losses,
                    "epoch_accuracy": r.epoch_accuracy,
                    "loaded_tensors": r.loaded_tensors,
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
