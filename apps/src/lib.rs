//! wgpipe-apps: the code of wgpipe's example programs, as a library so that tests run each
//! example in-process through its `run` function. The library crates (and the `wgpipe`
//! facade) do not depend on it, nor on its command-line and terminal dependencies (clap,
//! indicatif, ctrlc).
//!
//! - [`error`]: one error type whose messages name the flag to change;
//! - [`limits`]: the checked range of every flag, and memory estimates made from the flags
//!   before anything is allocated;
//! - [`placement`]: the stage devices of `--device`;
//! - [`args`]: the pipeline flags every training example shares, and building the pipeline;
//! - [`plan`]: `--plan`, the pipeline chosen by the planner;
//! - [`files`]: `--save` / `--resume` checkpoint files (through `wgpipe_pipeline::train::persist`);
//! - [`train`]: the training loop and Ctrl-C;
//! - [`finetune`]: freezing the first layers and saving a Hugging Face / timm folder, for
//!   both fine-tuning examples;
//! - [`cnn_data`]: train_cnn's images (synthetic, CIFAR-10, MNIST, image folders) and accuracy;
//! - [`bit`]: train_cnn's `--from`, a BiT ResNetV2 from a timm checkpoint with a fresh head;
//! - [`lm`]: token ids as tensors and the held-out loss, for the language-model examples;
//! - [`generate`]: text generation through the pipeline (greedy, temperature, top-k, top-p);
//! - [`output`]: the progress bar, the per-device table, the trace and the SVG timeline;
//! - [`metrics`]: `--metrics` (JSON Lines) and the loss-curve SVG;
//! - the programs: [`train_transformer`], [`train_cnn`], [`finetune_lm`], [`bench_train`] (and the model only it
//!   runs, [`prim_block`]).

pub use clap::Parser;
pub use wgpipe_autograd as autograd;
pub use wgpipe_models as models;
pub use wgpipe_pipeline as pipeline;
pub use wgpipe_tensor as tensor;

pub mod args;
pub mod bit;
pub mod cnn_data;
pub mod error;
pub mod files;
pub mod finetune;
pub mod generate;
pub mod limits;
pub mod lm;
pub mod metrics;
pub mod output;
pub mod peak;
pub mod placement;
pub mod plan;
pub mod prim_block;
pub mod train;

pub mod bench_train;
pub mod finetune_lm;
pub mod train_cnn;
pub mod train_transformer;

pub use error::{exit_on_error, AppError, AppResult, Context};
pub use train::{ctrl_c_flag, install_ctrl_c};
