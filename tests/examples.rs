//! The examples, run in-process through their `run` functions in short configurations: they
//! train, write a valid Chrome trace and an SVG timeline, give clear errors for bad flags,
//! save and resume bit-exactly, stop cleanly on Ctrl-C; and the models learn (a Transformer LM on
//! the default corpus, a CNN on synthetic images, transfer learning beats training from scratch).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use wgpipe::autograd::optim::{zero_grad, Optimizer};
use wgpipe::autograd::serialize::load_tensors;
use wgpipe::autograd::{AdamW, ForwardCtx, Tape, Var};
use wgpipe::models::data::TextDataset;
use wgpipe::models::{cross_entropy, forward_all, sequence_parameters, TransformerLm};
use wgpipe::pipeline::{Balance, CheckpointMode, LinkSpec, Pipeline, SimCluster};
use wgpipe::tensor::{Device, Tensor};
use wgpipe_apps::bench_train::{self, BenchArgs};
use wgpipe_apps::train_cnn::{self, CnnArgs};
use wgpipe_apps::train_transformer::{self, TransformerArgs};

/// A fresh folder for one test's files.
fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wgpipe-examples-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `base` flags, then the trace and timeline paths in `dir`, then `extra` (later flags win).
fn run_flags(base: &[&str], dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = base.iter().map(|x| x.to_string()).collect();
    v.extend([
        "--trace".into(),
        s(&dir.join("trace.json")),
        "--timeline".into(),
        s(&dir.join("timeline.svg")),
    ]);
    v.extend(extra.iter().map(|x| x.to_string()));
    v
}

/// Flags of a tiny transformer run writing its pictures into `dir`.
fn tiny_lm(dir: &Path, extra: &[&str]) -> Vec<String> {
    run_flags(
        &[
            "--quiet",
            "--device",
            "sim",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--layers",
            "2",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--seq-len",
            "16",
            "--batch",
            "4",
            "--sample-len",
            "8",
            "--steps",
            "3",
        ],
        dir,
        extra,
    )
}

fn lm(args: &[String]) -> Result<train_transformer::TrainSummary, String> {
    let a = TransformerArgs::parse_from_args(args).map_err(|e| e.to_string())?;
    train_transformer::run_with(a, &AtomicBool::new(false)).map_err(|e| e.to_string())
}

fn tiny_cnn(dir: &Path, extra: &[&str]) -> Vec<String> {
    run_flags(
        &[
            "--quiet",
            "--device",
            "sim",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--width",
            "4",
            "--image-size",
            "8",
            "--train-size",
            "64",
            "--batch",
            "8",
            "--steps",
            "3",
        ],
        dir,
        extra,
    )
}

fn cnn(args: &[String]) -> Result<train_cnn::CnnSummary, String> {
    let a = CnnArgs::parse_from_args(args).map_err(|e| e.to_string())?;
    train_cnn::run_with(a, &AtomicBool::new(false)).map_err(|e| e.to_string())
}

/// The trace parses as JSON with complete events on every stage; the SVG has a row per stage.
fn check_pictures(dir: &Path, stages: usize) {
    let text = std::fs::read_to_string(dir.join("trace.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).expect("the trace is valid JSON");
    let events = v["traceEvents"]
        .as_array()
        .expect("traceEvents is an array");
    for stage in 0..stages {
        assert!(
            events.iter().any(|e| e["ph"] == "X" && e["tid"] == stage),
            "no complete event on stage {stage}"
        );
    }
    assert!(events.iter().any(|e| e["cat"] == "forward"));
    // A full backward, or the input part of a split one.
    assert!(events
        .iter()
        .any(|e| e["cat"] == "backward" || e["cat"] == "backward-input"));
    let svg = std::fs::read_to_string(dir.join("timeline.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"));
    for stage in 0..stages {
        assert!(
            svg.contains(&format!(">device {stage}<")),
            "no row for device {stage}"
        );
    }
    assert!(svg.contains("<rect"), "no boxes in the timeline");
}

#[test]
fn transformer_example_runs_end_to_end_and_writes_trace_and_svg() {
    let dir = tmp("lm-e2e");
    for (device, sched) in [("sim", "gpipe"), ("cpu", "1f1b")] {
        let args = tiny_lm(&dir, &["--device", device, "--schedule", sched]);
        let r = lm(&args).unwrap();
        assert_eq!(r.losses.len(), 3);
        assert!(r.losses.iter().all(|l| l.is_finite()));
        assert!(r.eval_loss.is_finite());
        assert!(!r.sample.is_empty());
        assert_eq!(
            r.last_report.as_ref().unwrap().simulated.is_some(),
            device == "sim"
        );
        check_pictures(&dir, 2);
    }
}

#[test]
fn transformer_example_reads_a_text_file_byte_level() {
    let dir = tmp("lm-file");
    let file = dir.join("text.txt");
    std::fs::write(&file, "héllo wörld, pipelines everywhere. ".repeat(20)).unwrap();
    let r = lm(&tiny_lm(&dir, &["--data", &s(&file)])).unwrap();
    assert!((r.uniform_loss - 256f32.ln()).abs() < 1e-6);
    check_pictures(&dir, 2);
}

#[test]
fn cnn_example_runs_end_to_end_for_both_models() {
    let dir = tmp("cnn-e2e");
    for model in ["resnet", "amoebanet"] {
        let r = cnn(&tiny_cnn(&dir, &["--model", model, "--stages", "3"])).unwrap();
        if model == "amoebanet" {
            // The hand count of models/tests/models.rs (width 4, depth 1, 3 channels: 6783
            // with 3 classes) with the 10-class head: 6783 - (64 x 3 + 3) + (64 x 10 + 10).
            assert_eq!(r.num_params, 7238);
        }
        assert_eq!(r.losses.len(), 3);
        assert!(r.losses.iter().all(|l| l.is_finite()));
        assert!((0.0..=1.0).contains(&r.test_accuracy));
        check_pictures(&dir, 3);
    }
}

#[test]
fn cnn_example_reads_cifar_and_mnist_files() {
    use wgpipe::models::data::{write_cifar10_bin, write_idx_images, write_idx_labels};
    let dir = tmp("cnn-files");
    // 40 random-ish images each; the readers, normalisation and the pipeline run on them.
    let n = 40;
    let cifar_px: Vec<u8> = (0..n * 3 * 32 * 32).map(|i| (i * 7 % 251) as u8).collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    write_cifar10_bin(dir.join("c.bin"), &labels, &cifar_px).unwrap();
    let r = cnn(&tiny_cnn(
        &dir,
        &["--cifar", &s(&dir.join("c.bin")), "--steps", "2"],
    ))
    .unwrap();
    assert_eq!(r.losses.len(), 2);
    let mnist_px: Vec<u8> = (0..n * 28 * 28).map(|i| (i * 13 % 253) as u8).collect();
    write_idx_images(dir.join("i.idx"), n, 28, 28, &mnist_px).unwrap();
    write_idx_labels(dir.join("l.idx"), &labels).unwrap();
    let mnist = format!("{},{}", s(&dir.join("i.idx")), s(&dir.join("l.idx")));
    let r = cnn(&tiny_cnn(&dir, &["--mnist", &mnist, "--steps", "2"])).unwrap();
    assert_eq!(r.losses.len(), 2);
    let e = cnn(&tiny_cnn(&dir, &["--cifar", &s(&dir.join("missing.bin"))])).unwrap_err();
    assert!(e.contains("missing.bin") && e.contains("not found"), "{e}");
}

/// The bench tests run one at a time: products are timed process-wide, and both run the MLP.
static BENCHES: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn bench_example_measures_every_workload() {
    let _one = BENCHES.lock().unwrap_or_else(|e| e.into_inner());
    let args = BenchArgs::parse_from_args([
        "--devices",
        "cpu",
        "--seconds",
        "0.01",
        "--max-steps",
        "1",
        "--warmup",
        "0",
        "--torch-python",
        "",
        "--rounds",
        "2",
    ])
    .unwrap();
    let rows = bench_train::run(args).unwrap();
    // Every workload, the primitive-op block among them, in order.
    let workloads: Vec<_> = rows.iter().map(|r| r.workload).collect();
    assert_eq!(workloads, bench_train::Workload::ALL.to_vec());
    for r in &rows {
        assert!(r.plain > 0.0 && r.pipelined.unwrap() > 0.0 && r.loss.is_finite());
        assert!(r.torch.is_none(), "no torch Python was given");
        let (own, torch) = r.spreads();
        let (lo, hi) = r
            .plain_rounds
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert_eq!(own, Some(hi / lo - 1.0), "two rounds: {:?}", r.plain_rounds);
        assert_eq!(torch, None, "no PyTorch rounds");
        assert_eq!(r.torch_ratio(), None);
        let ceiling = r.steps_at_peak().expect("a CPU row has the FMA peak");
        assert!(ceiling.is_finite() && ceiling > 0.0, "{r:?}");
    }
    // The FLOPs per step the device counted, against the matmuls' 2 m k n counted by hand; the
    // elementwise ops (activations, norms, loss, SGD) add under 1%.
    // - MLP: 4 forward products, 4 weight gradients, 3 input gradients (the input needs none),
    //   each 256 x 1024 x 1024.
    // - Block (8 x 128 tokens, d 256, 4 heads of 64): the Q/K/V, output and two FFN linears
    //   (256 x 768, 256 x 256, 256 x 1024, 1024 x 256 per token), forward and both gradients;
    //   scores and scores @ V (32 heads of 128 x 128 x 64), forward and two gradients each.
    let mlp = 11.0 * 2.0 * 256.0 * 1024.0 * 1024.0;
    let linears = 3.0 * 2.0 * 1024.0 * 256.0 * (768.0 + 256.0 + 1024.0 + 1024.0);
    let attention = 3.0 * 2.0 * 2.0 * 32.0 * 128.0 * 128.0 * 64.0;
    for (r, by_hand) in rows.iter().zip([mlp, linears + attention]) {
        let ratio = r.flops_per_step / by_hand;
        assert!((1.0..1.01).contains(&ratio), "{:?}: {ratio}", r.workload);
    }
    let t = bench_train::table(&rows);
    assert!(
        t.contains("PyTorch CPU, this run")
            && t.contains("main job's LM")
            && t.contains("| - |")
            && t.contains("FMA peak")
            && t.contains("spread over rounds"),
        "{t}"
    );
}

/// `--matmul-times`: the products of the MLP's measured steps, by kind, against the count by
/// hand: per step 4 forward `x @ w.t()`, 3 input gradients `dy @ w` (the input needs none), 4
/// weight gradients `dy.t() @ x`, each 256 x 1024 x 1024 multiply-adds.
#[test]
fn bench_example_times_the_products_of_a_step() {
    use wgpipe::tensor::OperandLayout::{RowMajor, Transposed};
    let _one = BENCHES.lock().unwrap_or_else(|e| e.into_inner());
    let args = BenchArgs::parse_from_args([
        "--devices",
        "cpu",
        "--workloads",
        "mlp",
        "--no-pipeline",
        "--seconds",
        "100",
        "--max-steps",
        "2",
        "--warmup",
        "1",
        "--torch-python",
        "",
        "--matmul-times",
    ])
    .unwrap();
    let rows = bench_train::run(args).unwrap();
    let timed = &rows[0].matmuls;
    assert_eq!(timed.steps, 2, "the measured steps, not the warm-up");
    let calls = |m, k, n, a, b| -> u64 {
        timed
            .times
            .iter()
            .filter(|t| (t.batch, t.m, t.k, t.n, t.a, t.b) == (1, m, k, n, a, b))
            .map(|t| t.calls)
            .sum()
    };
    assert_eq!(calls(256, 1024, 1024, RowMajor, Transposed), 8, "x @ w.t()");
    assert_eq!(calls(256, 1024, 1024, RowMajor, RowMajor), 6, "dy @ w");
    assert_eq!(
        calls(1024, 256, 1024, Transposed, RowMajor),
        8,
        "dy.t() @ x"
    );
    // (Other kinds may be there: the tests beside this one in this binary, a CNN's and an LM's
    // training, multiply while the timing is on. None multiplies these shapes.)
    assert!(timed.times.iter().all(|t| t.seconds > 0.0));
    let table = timed.table(1.0 / rows[0].plain);
    assert!(
        table.contains("| 1 x 256 x 1024 x 1024 | RowMajor | Transposed |")
            && table.contains("all products:"),
        "{table}"
    );
}

#[test]
fn bad_flags_give_clear_errors() {
    let dir = tmp("bad-flags");
    let err = |extra: &[&str]| lm(&tiny_lm(&dir, extra)).unwrap_err();
    // 2 blocks + embedding + norm + head = 5 layers.
    let e = err(&["--stages", "6"]);
    assert!(e.contains("--stages 6") && e.contains("5 layers"), "{e}");
    let e = err(&["--micro-batches", "0"]);
    assert!(
        e.contains("--micro-batches") && e.contains("at least 1"),
        "{e}"
    );
    let e = err(&["--batch", "2", "--micro-batches", "3"]);
    assert!(
        e.contains("--batch 2") && e.contains("--micro-batches 3"),
        "{e}"
    );
    let e = err(&["--data", "/definitely/not/here.txt"]);
    assert!(
        e.contains("/definitely/not/here.txt") && e.contains("not found"),
        "{e}"
    );
    let e = err(&["--balance", "1,1"]);
    assert!(e.contains("--balance 1,1") && e.contains("5 layers"), "{e}");
    let e = err(&["--balance", "fast"]);
    assert!(e.contains("fast"), "{e}");
    let e = err(&["--heads", "3"]);
    assert!(e.contains("--heads 3") && e.contains("--d-model 16"), "{e}");
    let e = err(&["--resume", "/definitely/not/here.safetensors"]);
    assert!(e.contains("not found"), "{e}");
    let e = err(&["--schedule", "zigzag"]);
    assert!(e.contains("zigzag") && e.contains("1f1b"), "{e}");

    // A checkpoint of another model: the shape mismatch is named.
    let ckpt = dir.join("small.safetensors");
    lm(&tiny_lm(&dir, &["--save", &s(&ckpt)])).unwrap();
    let e = err(&["--resume", &s(&ckpt), "--d-model", "32"]);
    assert!(
        e.contains("cannot resume") && e.contains("shape mismatch"),
        "{e}"
    );
    assert!(
        e.contains("d_model: 16") && e.contains("d_model: 32"),
        "{e}"
    );
    let e = err(&["--resume", &s(&ckpt), "--layers", "3", "--steps", "4"]);
    assert!(e.contains("cannot resume") && e.contains("missing"), "{e}");

    let e = cnn(&tiny_cnn(&dir, &["--classes", "11"])).unwrap_err();
    assert!(e.contains("--classes 11"), "{e}");
    let e = cnn(&tiny_cnn(&dir, &["--stages", "9"])).unwrap_err();
    assert!(e.contains("--stages 9"), "{e}");
    let e = cnn(&tiny_cnn(&dir, &["--init", &s(&ckpt)])).unwrap_err();
    assert!(e.contains("no tensor matches"), "{e}");
}

#[test]
fn save_and_resume_continue_bit_exactly() {
    // With dropout on: the resumed run must also continue the step-keyed RNG streams.
    let dir = tmp("resume");
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let straight = lm(&tiny_lm(
        &dir,
        &["--steps", "6", "--dropout", "0.1", "--save", &s(&a)],
    ))
    .unwrap();
    let first = lm(&tiny_lm(
        &dir,
        &[
            "--steps",
            "6",
            "--dropout",
            "0.1",
            "--stop-at",
            "3",
            "--save",
            &s(&b),
        ],
    ))
    .unwrap();
    assert!(first.interrupted);
    let second = lm(&tiny_lm(
        &dir,
        &[
            "--steps",
            "6",
            "--dropout",
            "0.1",
            "--resume",
            &s(&b),
            "--save",
            &s(&b),
        ],
    ))
    .unwrap();
    assert_eq!(second.start_step, 3);
    let mut resumed = first.losses.clone();
    resumed.extend(&second.losses);
    assert_eq!(straight.losses, resumed, "losses differ after resuming");
    let ta = load_tensors(&a, &Device::cpu()).unwrap();
    let tb = load_tensors(&b, &Device::cpu()).unwrap();
    assert_eq!(ta.len(), tb.len());
    assert!(
        ta.iter().any(|(n, _)| n.starts_with("optim.")),
        "no optimizer state saved"
    );
    for ((na, xa), (nb, xb)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        assert_eq!(xa.to_vec().unwrap(), xb.to_vec().unwrap(), "{na} differs");
    }
}

/// `--save dir/` writes a sharded checkpoint (one file per device and the index), which
/// `--resume` continues with other `--stages` bit-exactly (the next step's loss as in the
/// uninterrupted run, then as from the one file `--consolidate` makes of it); `--split`
/// shards a file again.
#[test]
fn a_sharded_save_resumes_with_other_stages_and_converts_to_one_file_and_back() {
    let dir = tmp("sharded");
    let sharded = format!("{}/", s(&dir.join("sharded")));
    let flags = |extra: &[&str]| {
        let mut v = vec!["--steps", "5", "--dropout", "0.1"];
        v.extend(extra);
        tiny_lm(&dir, &v)
    };
    let straight = lm(&flags(&[])).unwrap();
    let first = lm(&flags(&["--stop-at", "3", "--save", &sharded])).unwrap();
    assert!(first.interrupted);
    let index = dir.join("sharded").join(wgpipe::pipeline::INDEX_FILE);
    assert!(index.is_file(), "no index");
    // Convert with the examples' flags (what `main` does before `run`).
    let convert = |extra: &[&str]| {
        let a = TransformerArgs::parse_from_args(flags(extra)).unwrap();
        assert!(a.pipe.convert_checkpoint().unwrap());
    };
    let one = dir.join("one.safetensors");
    convert(&["--consolidate", &sharded, &s(&one)]);
    let resplit = format!("{}/", s(&dir.join("resplit")));
    convert(&["--stages", "3", "--split", &s(&one), &resplit]);
    // Resumed with K = 1 from each form: the same bits; the next step as uninterrupted.
    let mut runs = Vec::new();
    for from in [&sharded, &s(&one), &resplit] {
        let r = lm(&flags(&["--stages", "1", "--resume", from])).unwrap();
        assert_eq!(r.start_step, 3, "{from}");
        assert_eq!(
            r.losses[0].to_bits(),
            straight.losses[3].to_bits(),
            "{from}: the first step after resuming"
        );
        runs.push(r.losses);
    }
    assert_eq!(runs[0], runs[1], "the sharded folder and its one file");
    assert_eq!(
        runs[0], runs[2],
        "the sharded folder and the file split again"
    );
    // A folder without a finished save is refused naming the index.
    let empty = format!("{}/", s(&dir.join("empty")));
    std::fs::create_dir_all(&empty).unwrap();
    let e = lm(&flags(&["--resume", &empty])).unwrap_err();
    assert!(e.contains("model.safetensors.index.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CNN's sharded checkpoint carries its batch-norm buffers: resumed with one stage, its
/// next step is the uninterrupted run's, bit for bit.
#[test]
fn the_cnn_resumes_from_a_sharded_save_with_other_stages() {
    let dir = tmp("cnn-sharded");
    let sharded = format!("{}/", s(&dir.join("sharded")));
    let flags = |extra: &[&str]| {
        let mut v = vec!["--steps", "4"];
        v.extend(extra);
        tiny_cnn(&dir, &v)
    };
    let straight = cnn(&flags(&[])).unwrap();
    cnn(&flags(&["--stop-at", "2", "--save", &sharded])).unwrap();
    let index =
        std::fs::read_to_string(dir.join("sharded").join(wgpipe::pipeline::INDEX_FILE)).unwrap();
    assert!(
        index.contains("running_mean"),
        "no batch-norm buffer saved: {index}"
    );
    let resumed = cnn(&flags(&["--stages", "1", "--resume", &sharded])).unwrap();
    assert_eq!(resumed.start_step, 2);
    assert_eq!(resumed.losses[0].to_bits(), straight.losses[2].to_bits());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ctrl_c_stops_after_the_step_and_saves() {
    let dir = tmp("ctrl-c");
    let ckpt = dir.join("stopped.safetensors");
    let a =
        TransformerArgs::parse_from_args(tiny_lm(&dir, &["--steps", "50", "--save", &s(&ckpt)]))
            .unwrap();
    let r = train_transformer::run_with(a, &AtomicBool::new(true)).unwrap();
    assert!(r.interrupted);
    assert_eq!(r.losses.len(), 1);
    let meta = wgpipe::autograd::serialize::load_metadata(&ckpt).unwrap();
    assert!(
        meta.iter().any(|(k, v)| k == "wgpipe.step" && v == "1"),
        "{meta:?}"
    );
}

/// The uniform guess costs ln(28) = 3.33 nats/char, the unigram entropy of the corpus is 2.92
/// and its bigram conditional entropy 1.75 (the best loss from the previous character alone).
/// The threshold, 1.5 on held-out text, is below the bigram entropy: the model must use longer
/// context (spelling of whole words), which a broken pipeline (wrong gradients, lost or
/// mis-scaled micro-batches) does not reach. Measured: about 0.93 after 250 steps, in ~9 s.
#[test]
fn transformer_lm_learns_the_default_corpus() {
    let dir = tmp("lm-learns");
    let r = lm(&tiny_lm(
        &dir,
        &[
            "--steps",
            "250",
            "--d-model",
            "32",
            "--heads",
            "4",
            "--seq-len",
            "32",
            "--batch",
            "16",
            "--micro-batches",
            "4",
            "--lr",
            "1e-2",
        ],
    ))
    .unwrap();
    eprintln!(
        "TransformerLm: loss {:.3} -> {:.3}, held-out {:.3} (uniform {:.3}) in {:.1} s",
        r.losses[0],
        r.losses.last().unwrap(),
        r.eval_loss,
        r.uniform_loss,
        r.wall_secs
    );
    assert!(
        r.losses[0] > 3.0,
        "starts near the uniform loss: {}",
        r.losses[0]
    );
    assert!(
        r.eval_loss < 1.5,
        "held-out loss {:.3} is not below 1.5",
        r.eval_loss
    );
}

#[test]
fn cnn_learns_synthetic_shapes() {
    let dir = tmp("cnn-learns");
    let r = cnn(&tiny_cnn(
        &dir,
        &[
            "--width",
            "8",
            "--image-size",
            "16",
            "--train-size",
            "1000",
            "--batch",
            "32",
            "--steps",
            "120",
            "--micro-batches",
            "4",
        ],
    ))
    .unwrap();
    eprintln!(
        "ResNet on shapes: accuracy {:.1}% (chance {:.1}%)",
        r.test_accuracy * 100.0,
        r.chance * 100.0
    );
    assert!(r.test_accuracy > 0.6, "accuracy {:.3}", r.test_accuracy);
}

/// Pre-train on `Shapes` (10 classes), fine-tune on `Stripes` (10 orientations) from 5 images per
/// class, against the same budget (30 steps) from scratch. Measured on 500 test images over 5
/// fine-tuning seeds and 2 pre-training seeds: scratch 27-30%, transfer 52-68% (the smallest gap
/// 24 points), so the assertion asks for 10.
#[test]
fn transfer_learning_beats_training_from_scratch() {
    let dir = tmp("transfer");
    let pre = dir.join("shapes.safetensors");
    let common = ["--width", "8", "--image-size", "16", "--micro-batches", "2"];
    let mut args = common.to_vec();
    args.extend(["--train-size", "2000", "--batch", "32", "--steps", "150"]);
    args.extend(["--save", pre.to_str().unwrap()]);
    let p = cnn(&tiny_cnn(&dir, &args)).unwrap();
    eprintln!("pre-trained on shapes: {:.1}%", p.test_accuracy * 100.0);
    let mut few = common.to_vec();
    few.extend([
        "--task",
        "stripes",
        "--train-size",
        "2000",
        "--per-class",
        "5",
    ]);
    few.extend(["--batch", "20", "--steps", "30"]);
    let mut scratch = Vec::new();
    let mut transfer = Vec::new();
    for seed in ["1", "2"] {
        let mut a = few.clone();
        a.extend(["--seed", seed]);
        scratch.push(cnn(&tiny_cnn(&dir, &a)).unwrap().test_accuracy);
        a.extend(["--init", pre.to_str().unwrap()]);
        let t = cnn(&tiny_cnn(&dir, &a)).unwrap();
        assert!(t.loaded_tensors > 0);
        transfer.push(t.test_accuracy);
    }
    eprintln!("stripes, 5 per class: scratch {scratch:?}, transfer {transfer:?}");
    for (s, t) in scratch.iter().zip(&transfer) {
        assert!(
            t - s > 0.1,
            "transfer {t:.3} does not beat scratch {s:.3} by 10 points"
        );
    }
}

/// The example's model and optimizer: pipelined (K = 3, M = 4, sim cluster) and plain training
/// on the same batches give the same losses and parameters, up to summation order.
#[test]
fn pipelined_and_plain_training_of_transformer_lm_agree() {
    let cfg = TransformerLm {
        vocab: 28,
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 16,
        dropout: 0.1,
        tie_embeddings: true,
    };
    let data = TextDataset::synthetic(0, 5000);
    let cpu = Device::cpu();
    let (b, t) = (8, 16);
    let batch = |step: u64| {
        let (x, y) = data.batch(b, t, 0, step).unwrap();
        let f = |v: Vec<u32>| {
            Tensor::from_vec(v.iter().map(|&i| i as f32).collect(), &[b, t], &cpu).unwrap()
        };
        (f(x), f(y))
    };
    let loss_fn = |y: &Var, t: &Tensor| cross_entropy(y, t);
    let steps = 3;
    let seed = 5;

    let plain = cfg.build(1, &cpu).unwrap();
    let params = sequence_parameters(&plain);
    let mut opt = AdamW::new(1e-2);
    let mut plain_losses = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(step);
        let tape = Tape::new();
        let out =
            forward_all(&plain, &tape.constant(x), &ForwardCtx::train(seed, step, 0)).unwrap();
        let loss = loss_fn(&out, &y).unwrap();
        plain_losses.push(loss.to_scalar().unwrap());
        tape.backward(&loss).unwrap();
        wgpipe::autograd::sum_tied_grads(&params).unwrap();
        opt.step(&params).unwrap();
        zero_grad(&params);
    }

    let cluster = SimCluster::uniform(&cpu, 3, u64::MAX, 1e12, LinkSpec::FREE);
    // Dropout is keyed by micro-batch too, so compare with M = 1 for the losses' randomness:
    // with dropout the plain run is one micro-batch.
    let mut pipe = Pipeline::builder(cfg.build(1, &cpu).unwrap())
        .sim(cluster)
        .balance(Balance::Explicit(vec![2, 1, 2]))
        .micro_batches(1)
        .checkpoint(CheckpointMode::Always)
        .seed(seed)
        .optimizer(|| Box::new(AdamW::new(1e-2)))
        .build()
        .unwrap();
    let mut pipe_losses = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(step);
        pipe_losses.push(pipe.train_step(&x, &y, &loss_fn).unwrap().loss);
        pipe.optimizer_step().unwrap();
    }
    for (a, b) in plain_losses.iter().zip(&pipe_losses) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "loss {a} vs {b}");
    }
    let worst = params
        .iter()
        .zip(pipe.named_parameters())
        .map(|((na, pa), (nb, pb))| {
            assert_eq!(na, &nb);
            let (a, b) = (pa.value().to_vec().unwrap(), pb.value().to_vec().unwrap());
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            a.iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale
        })
        .fold(0f32, f32::max);
    eprintln!(
        "pipelined vs plain TransformerLm (dropout 0.1, K=3): worst relative error {worst:.2e}"
    );
    assert!(worst <= 1e-5, "parameters differ: {worst:.2e}");
}

/// Without dropout, any M gives the plain result (the loss of each micro-batch is scaled by its
/// share of the mini-batch).
#[test]
fn pipelined_with_micro_batches_equals_plain_without_dropout() {
    let cfg = TransformerLm {
        vocab: 28,
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 16,
        dropout: 0.0,
        tie_embeddings: true,
    };
    let data = TextDataset::synthetic(3, 5000);
    let cpu = Device::cpu();
    let (b, t) = (8, 16);
    let (x, y) = data.batch(b, t, 0, 0).unwrap();
    let f = |v: Vec<u32>| {
        Tensor::from_vec(v.iter().map(|&i| i as f32).collect(), &[b, t], &cpu).unwrap()
    };
    let (x, y) = (f(x), f(y));
    let loss_fn = |o: &Var, t: &Tensor| cross_entropy(o, t);

    let plain = cfg.build(2, &cpu).unwrap();
    let params = sequence_parameters(&plain);
    let tape = Tape::new();
    let out = forward_all(
        &plain,
        &tape.constant(x.clone()),
        &ForwardCtx::train(0, 0, 0),
    )
    .unwrap();
    let loss = loss_fn(&out, &y).unwrap();
    tape.backward(&loss).unwrap();
    // The tied embedding and head are one parameter: both copies' gradient is the sum.
    wgpipe::autograd::sum_tied_grads(&params).unwrap();

    for (k, m, balance) in [(2, 4, vec![3, 2]), (4, 8, vec![1, 2, 1, 1])] {
        let mut pipe = Pipeline::builder(cfg.build(2, &cpu).unwrap())
            .sim(SimCluster::uniform(&cpu, k, u64::MAX, 1e12, LinkSpec::FREE))
            .balance(Balance::Explicit(balance))
            .micro_batches(m)
            .checkpoint(CheckpointMode::ExceptLast)
            .build()
            .unwrap();
        let r = pipe.train_step(&x, &y, &loss_fn).unwrap();
        assert!((r.loss - loss.to_scalar().unwrap()).abs() < 1e-5);
        for ((na, pa), (nb, pb)) in params.iter().zip(pipe.named_parameters()) {
            assert_eq!(na, &nb);
            let (ga, gb) = (
                pa.grad().unwrap().to_vec().unwrap(),
                pb.grad().unwrap().to_vec().unwrap(),
            );
            let scale = ga.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            let e = ga
                .iter()
                .zip(&gb)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            // Relative to the tensor's largest gradient, with an absolute floor for gradients
            // that are zero in exact arithmetic (the key bias: softmax ignores a constant shift).
            assert!(
                e <= 1e-4 * scale + 1e-6,
                "K={k} M={m}: gradient of {na} differs by {e:.2e} (largest {scale:.2e})"
            );
        }
    }
}

#[test]
fn huge_and_non_finite_flags_are_refused_up_front_naming_the_flag() {
    let dir = tmp("limits");
    let t0 = std::time::Instant::now();
    let err = |extra: &[&str]| lm(&tiny_lm(&dir, extra)).unwrap_err();
    for (flags, flag) in [
        (&["--batch", "1000000000"][..], "--batch 1000000000"),
        (&["--d-model", "65536"][..], "--d-model 65536"),
        (&["--layers", "1000000"][..], "--layers 1000000"),
        (&["--seq-len", "0"][..], "--seq-len 0"),
        (&["--lr", "nan"][..], "--lr NaN"),
        (&["--lr", "inf"][..], "--lr inf"),
        (&["--dropout", "1.5"][..], "--dropout 1.5"),
        (&["--sim-memory-gib", "0"][..], "--sim-memory-gib 0"),
        (&["--stages", "100000"][..], "--stages 100000"),
    ] {
        let e = err(flags);
        assert!(e.starts_with(flag), "{flags:?}: {e}");
        assert!(!e.contains('\n'), "{flags:?}: one line: {e}");
    }
    // Within every range but too big together: the memory estimate names a flag and the limit.
    let e = err(&["--d-model", "16384", "--layers", "1024", "--heads", "16"]);
    assert!(
        (e.starts_with("--d-model 16384") || e.starts_with("--layers 1024"))
            && e.contains("GiB")
            && e.contains("the limit is"),
        "{e}"
    );
    for (flags, flag) in [
        (&["--image-size", "65536"][..], "--image-size 65536"),
        (&["--batch", "1000000000"][..], "--batch 1000000000"),
        (&["--width", "0"][..], "--width 0"),
        (&["--lr", "nan"][..], "--lr NaN"),
    ] {
        let e = cnn(&tiny_cnn(&dir, flags)).unwrap_err();
        assert!(e.starts_with(flag), "{flags:?}: {e}");
    }
    let e = cnn(&tiny_cnn(
        &dir,
        &["--image-size", "4096", "--train-size", "1000000"],
    ))
    .unwrap_err();
    assert!(e.contains("the limit is") && e.contains("GiB"), "{e}");
    // Nothing was built or trained: all of the above took well under a second each.
    assert!(t0.elapsed().as_secs_f64() < 10.0, "{:?}", t0.elapsed());
}

#[test]
fn output_paths_are_checked_before_training() {
    let dir = tmp("paths");
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let bad = s(&blocker.join("ckpt.safetensors"));
    for flag in ["--save", "--trace", "--timeline"] {
        let t0 = std::time::Instant::now();
        let e = lm(&tiny_lm(&dir, &[flag, &bad, "--steps", "1000"])).unwrap_err();
        assert!(e.starts_with(&format!("{flag} {bad}")), "{e}");
        // 1000 steps would take many seconds: the path was refused before training.
        assert!(
            t0.elapsed().as_secs_f64() < 2.0,
            "{flag}: {:?}",
            t0.elapsed()
        );
    }
    let e = lm(&tiny_lm(&dir, &["--save", &s(&dir)])).unwrap_err();
    assert!(e.contains("a folder, not a file"), "{e}");
}

#[test]
fn resume_tells_a_broken_file_from_another_model() {
    let dir = tmp("resume-kinds");
    let ckpt = dir.join("good.safetensors");
    lm(&tiny_lm(&dir, &["--save", &s(&ckpt)])).unwrap();
    let bytes = std::fs::read(&ckpt).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"\x00\x01 definitely not safetensors").unwrap();
    for p in [&truncated, &garbage] {
        let e = lm(&tiny_lm(&dir, &["--resume", &s(p)])).unwrap_err();
        assert!(
            e.starts_with(&format!("--resume {}", s(p)))
                && e.contains("not a usable checkpoint")
                && e.contains("the flags are not at fault")
                && !e.contains("does not match"),
            "{e}"
        );
    }
    let e = lm(&tiny_lm(
        &dir,
        &["--resume", &s(&ckpt), "--d-model", "32", "--heads", "2"],
    ))
    .unwrap_err();
    assert!(
        e.contains("does not match the model of these flags")
            && e.contains("tensor '0.")
            && e.contains("shape mismatch")
            && !e.contains("not a usable checkpoint"),
        "{e}"
    );
    assert_eq!(e.matches("cannot resume").count(), 1, "one prefix: {e}");
}

/// `--schedule` takes every schedule (with `--chunks` where it applies), and the grid and the
/// trace of each show its chunks and split backward; a schedule's condition comes back naming it.
#[test]
fn transformer_example_runs_every_schedule() {
    let dir = tmp("lm-schedules");
    for (sched, chunks) in [
        ("interleaved-1f1b", "2"),
        ("looped-bfs", "2"),
        ("zb-h1", "1"),
        ("zb-h2", "1"),
        ("zb-v", "2"),
    ] {
        let args = tiny_lm(&dir, &["--schedule", sched, "--chunks", chunks]);
        let r = lm(&args).unwrap_or_else(|e| panic!("{sched}: {e}"));
        assert!(r.losses.iter().all(|l| l.is_finite()), "{sched}");
        check_pictures(&dir, 2);
        let trace = std::fs::read_to_string(dir.join("trace.json")).unwrap();
        if sched.starts_with("zb") {
            assert!(
                trace.contains("backward-weight"),
                "{sched}: no W in the trace"
            );
        }
        if chunks == "2" {
            assert!(
                trace.contains("c1\""),
                "{sched}: no chunk labels in the trace"
            );
        }
    }
    let e = lm(&tiny_lm(&dir, &["--schedule", "dualpipe-v"])).unwrap_err();
    assert!(
        e.contains("dualpipe-v needs at least 4 micro-batches, got 2"),
        "{e}"
    );
    let e = lm(&tiny_lm(
        &dir,
        &["--schedule", "interleaved-1f1b", "--chunks", "3"],
    ))
    .unwrap_err();
    assert!(
        e.contains("--stages 2 x 3 chunk(s) = 6 pieces is more than the 5 layers"),
        "{e}"
    );
}

/// `--plan on`: both examples train the planner's pipeline on the simulated cluster, and the
/// last step's simulated time and per-device peaks are what the plan predicted (time within 5%,
/// memory at most predicted).
#[test]
fn plan_on_trains_the_planned_pipeline_as_predicted() {
    let dir = tmp("plan");
    let check = |plan: &Option<wgpipe_pipeline::PlanReport>,
                 last: &Option<wgpipe_pipeline::StepReport>,
                 what: &str| {
        let plan = plan.as_ref().expect("--plan on plans");
        let last = last.as_ref().expect("a step ran");
        let measured = last.simulated.as_ref().unwrap().makespan_secs;
        let p = &plan.best.prediction;
        assert!(
            (p.step_secs / measured - 1.0).abs() <= 0.05,
            "{what}: predicted {} s, simulated {measured} s",
            p.step_secs
        );
        assert_eq!(last.stages.len(), p.step_peak_bytes.len(), "{what}");
        for (d, s) in last.stages.iter().enumerate() {
            assert!(
                s.memory.peak as u64 <= p.step_peak_bytes[d],
                "{what} device {d}: {} > {}",
                s.memory.peak,
                p.step_peak_bytes[d]
            );
        }
    };
    let r = lm(&tiny_lm(&dir, &["--plan", "on"])).unwrap();
    assert!(r.losses.iter().all(|l| l.is_finite()));
    check(&r.plan, &r.last_report, "train_transformer");
    let r = cnn(&tiny_cnn(&dir, &["--plan", "on"])).unwrap();
    check(&r.plan, &r.last_report, "train_cnn");
    // On real CPU devices: planned from layer times measured there (no simulated report).
    let r = lm(&tiny_lm(&dir, &["--plan", "on", "--device", "cpu"])).unwrap();
    let plan = r.plan.as_ref().expect("--plan on plans real devices too");
    assert!(plan.basis.contains("measured"), "{}", plan.basis);
    assert!(r.losses.iter().all(|l| l.is_finite()));
    assert!(r.last_report.as_ref().unwrap().simulated.is_none());
    // Off (and auto from parse_from_args, which does not know the command line): no plan.
    assert!(lm(&tiny_lm(&dir, &[])).unwrap().plan.is_none());
}

#[test]
fn both_examples_train_with_replicas() {
    let dir = tmp("replicas");
    // Without dropout, 2 replicas x 2 micro-batches learn what one pipeline of 4 micro-batches
    // does (up to the order of the gradient sums).
    let base = ["--dropout", "0", "--batch", "8"];
    let one = lm(&tiny_lm(
        &dir,
        &[&base[..], &["--micro-batches", "4"]].concat(),
    ))
    .unwrap();
    let two = lm(&tiny_lm(&dir, &[&base[..], &["--replicas", "2"]].concat())).unwrap();
    for (a, b) in two.losses.iter().zip(&one.losses) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "{:?} vs {:?}",
            two.losses,
            one.losses
        );
    }
    let report = two.last_report.as_ref().unwrap();
    assert_eq!(report.stages.len(), 4, "R x K rows");
    check_pictures(&dir, 4);
    let trace = std::fs::read_to_string(dir.join("trace.json")).unwrap();
    assert!(trace.contains("\"all-reduce\""));
    let r = cnn(&tiny_cnn(&dir, &["--replicas", "2"])).unwrap();
    assert!(r.losses.iter().all(|l| l.is_finite()));
    check_pictures(&dir, 4);
    for (flags, want) in [
        (&["--replicas", "0"][..], "--replicas"),
        (&["--replicas", "3"][..], "cannot be shared by --replicas 3"),
    ] {
        let e = lm(&tiny_lm(&dir, flags)).unwrap_err();
        assert!(e.contains(want), "{flags:?}: {e}");
    }
}

/// Checks that `svg` is well-formed XML as far as tags go (every element closed, in order)
/// with `<svg>` as its root.
fn assert_well_formed_svg(svg: &str, what: &str) {
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = svg;
    let mut roots = 0;
    while let Some(start) = rest.find('<') {
        let end = rest[start..]
            .find('>')
            .map(|e| start + e)
            .unwrap_or_else(|| panic!("{what}: an unclosed tag"));
        let tag = &rest[start + 1..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop(),
                Some(name.trim()),
                "{what}: </{name}> out of order"
            );
            continue;
        }
        let name = tag.split_whitespace().next().unwrap_or_default();
        if stack.is_empty() {
            roots += 1;
            assert_eq!(name, "svg", "{what}: the root is <{name}>");
        }
        if !tag.ends_with('/') {
            stack.push(name);
        }
    }
    assert!(stack.is_empty() && roots == 1, "{what}: unclosed {stack:?}");
}

/// The points of the training-loss polyline of a loss curve.
fn curve_points(svg: &str) -> usize {
    let line = svg
        .lines()
        .find(|l| l.contains("class=\"training-loss\""))
        .expect("a training-loss polyline");
    let points = line
        .split("points=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    points.split_whitespace().count()
}

/// The metrics file's lines as JSON.
fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is a JSON object"))
        .collect()
}

#[test]
fn both_examples_write_a_loss_curve_and_their_metrics() {
    let dir = tmp("curves");
    let metrics = dir.join("metrics.jsonl");
    let r = lm(&tiny_lm(&dir, &["--steps", "5", "--metrics", &s(&metrics)])).unwrap();
    let svg = std::fs::read_to_string(dir.join("loss.svg")).unwrap();
    assert_well_formed_svg(&svg, "loss.svg");
    assert_eq!(curve_points(&svg), 5);
    assert_eq!(svg.matches("class=\"held-out\"").count(), 1);
    assert!(
        svg.contains("uniform ln(28)") && svg.contains("bigram"),
        "references"
    );
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 5);
    for (i, (line, loss)) in lines.iter().zip(&r.losses).enumerate() {
        assert_eq!(line["step"], i as u64);
        assert_eq!(line["loss"].as_f64().unwrap() as f32, *loss);
        for key in ["items_per_sec", "bubble", "lr", "skipped", "loss_scale"] {
            assert!(line.get(key).is_some(), "line {i} has no {key}: {line}");
        }
        assert!(line["lr"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(
        lines[4]["held_out_loss"].as_f64().unwrap() as f32,
        r.eval_loss
    );
    assert!(lines[..4].iter().all(|l| l.get("held_out_loss").is_none()));

    let c = cnn(&tiny_cnn(&dir, &["--metrics", &s(&metrics)])).unwrap();
    let svg = std::fs::read_to_string(dir.join("cnn_loss.svg")).unwrap();
    assert_well_formed_svg(&svg, "cnn_loss.svg");
    assert_eq!(curve_points(&svg), 3);
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 3);
    assert_eq!(
        lines[2]["held_out_accuracy"].as_f64().unwrap() as f32,
        c.test_accuracy as f32
    );
}

#[test]
fn a_bad_value_of_any_flag_is_one_line_naming_the_flag_and_the_accepted_values() {
    let dir = tmp("one-line");
    for (flag, value, accepted) in [
        ("--schedule", "zigzag", "dualpipe-v"),
        ("--precision", "f64", "bf16"),
        ("--plan", "maybe", "auto"),
        ("--checkpoint", "sometimes", "except-last"),
        ("--device", "tpu", "sim"),
    ] {
        let e = lm(&tiny_lm(&dir, &[flag, value])).unwrap_err();
        assert_eq!(e.lines().count(), 1, "{flag}: {e}");
        assert!(
            e.contains(flag) && e.contains(value) && e.contains(accepted),
            "{flag}: {e}"
        );
    }
    // A value clap cannot parse as a number is one line too.
    let e = lm(&tiny_lm(&dir, &["--stages", "two"])).unwrap_err();
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("--stages"), "{e}");
}

/// The main job as a process (the example binary `cargo test` builds beside this test), a few
/// steps on a headless machine: nothing on stderr says "error", with the Vulkan drivers as
/// installed (lavapipe in CI) and with none (hidden as `VK_DRIVER_FILES` hides them).
#[test]
fn the_main_job_leaves_no_error_on_stderr_with_or_without_a_vulkan_driver() {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join(format!("train_transformer{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: `cargo test` builds the examples before the tests",
        bin.display()
    );
    let dir = tmp("stderr");
    for hide in [false, true] {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(tiny_lm(&dir, &["--device", "auto"]))
            .current_dir(&dir)
            // Headless: no display server to find.
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("WAYLAND_DISPLAY")
            .env_remove("DISPLAY");
        if hide {
            let none = dir.join("no-driver.json");
            cmd.env("VK_DRIVER_FILES", &none)
                .env("VK_ICD_FILENAMES", &none);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "hidden drivers {hide}: {}\n{stderr}",
            out.status
        );
        let bad: Vec<&str> = stderr
            .lines()
            .filter(|l| l.to_lowercase().contains("error"))
            .collect();
        assert!(bad.is_empty(), "hidden drivers {hide}: stderr says {bad:?}");
    }
}
