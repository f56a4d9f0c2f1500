//! The main job: a Transformer LM trained through a 4-stage GPipe pipeline on the best device
//! found (a simulated cluster on the CPU when there is no GPU). `--help` lists the flags.

use wgpipe_apps::train_transformer::{run, TransformerArgs};
use wgpipe_apps::{exit_on_error, install_ctrl_c};

fn main() {
    install_ctrl_c();
    exit_on_error(run(TransformerArgs::from_command_line()));
}
