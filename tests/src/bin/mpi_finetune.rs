//! The fine-tuning example as one rank of an MPI job: `mpirun -np N mpi_finetune
//! <summary.json> <finetune_lm flags...>` runs `finetune_lm` with the flags and, on rank 0,
//! writes the held-out losses and training losses it reports to the summary file (what the
//! MPI tests compare with one process).

use wgpipe_apps::finetune_lm::{run, FinetuneArgs};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((summary, flags)) = args.split_first() else {
        eprintln!("usage: mpi_finetune <summary.json> <finetune_lm flags...>");
        std::process::exit(2);
    };
    match FinetuneArgs::parse_from_args(flags).and_then(run) {
        Ok(r) => {
            if wgpipe_apps::output::is_root() {
                let text = serde_json::json!({
                    "eval_before": r.eval_before,
                    "losses": r.losses,
                    "eval_after": r.eval_after,
                    "generated": r.generated,
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
