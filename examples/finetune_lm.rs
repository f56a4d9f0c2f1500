//! Fine-tunes a Llama or a GPT-2 from a Hugging Face folder through a pipeline and saves it
//! back (`--from DIR`, `--save-hf DIR`); `--help` lists the flags.

use wgpipe_apps::finetune_lm::{run, FinetuneArgs};
use wgpipe_apps::{exit_on_error, install_ctrl_c};

fn main() {
    install_ctrl_c();
    exit_on_error(run(FinetuneArgs::from_command_line()).map(drop));
}
