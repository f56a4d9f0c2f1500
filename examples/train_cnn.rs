//! A ResNet- or AmoebaNet-style CNN trained through a GPipe pipeline on synthetic images
//! (or `--cifar` / `--mnist` files), with transfer learning (`--init`, `--freeze-body`).
//! `--help` lists the flags.

use wgpipe_apps::train_cnn::{run, CnnArgs};
use wgpipe_apps::{exit_on_error, install_ctrl_c};

fn main() {
    install_ctrl_c();
    let args = CnnArgs::from_command_line();
    // --consolidate / --split convert a checkpoint and end the program.
    exit_on_error(args.pipe.convert_checkpoint().and_then(|done| {
        if done {
            Ok(())
        } else {
            run(args).map(drop)
        }
    }));
}
