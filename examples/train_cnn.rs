//! A ResNet- or AmoebaNet-style CNN trained through a GPipe pipeline on synthetic images
//! (or `--cifar` / `--mnist` files), with transfer learning (`--init`, `--freeze-body`).
//! `--help` lists the flags.

use wgpipe_apps::train_cnn::{run, CnnArgs};
use wgpipe_apps::{exit_on_error, install_ctrl_c};

fn main() {
    install_ctrl_c();
    exit_on_error(run(CnnArgs::from_command_line()));
}
