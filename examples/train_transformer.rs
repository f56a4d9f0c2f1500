//! The main job: a Transformer LM trained through a 4-stage GPipe pipeline on the best device
//! found (a simulated cluster on the CPU when there is no GPU). `--help` lists the flags.

use wgpipe_apps::train_transformer::{run, TransformerArgs};
use wgpipe_apps::{exit_on_error, install_ctrl_c};

fn main() {
    install_ctrl_c();
    let args = TransformerArgs::from_command_line();
    // --consolidate / --split convert a checkpoint and end the program.
    exit_on_error(args.pipe.convert_checkpoint().and_then(|done| {
        if done {
            Ok(())
        } else {
            run(args).map(drop)
        }
    }));
}
