//! The fine-tuning example (`finetune_lm`) run in-process on the committed Hugging Face
//! fixtures (`models/tests/fixtures`): it trains, its saved folder resumes exactly, and bad
//! flags or folders are refused by name.

use std::path::{Path, PathBuf};

use wgpipe_apps::finetune_lm::{run, FinetuneArgs};

/// `--trace` and `--timeline` into a folder of the test's own (the tests run side by side).
fn outputs(test: &str) -> Vec<String> {
    let dir =
        std::env::temp_dir().join(format!("wgpipe-finetune-out-{}-{test}", std::process::id()));
    ["trace.json", "timeline.svg"]
        .iter()
        .zip(["--trace", "--timeline"])
        .flat_map(|(f, flag)| [flag.to_string(), dir.join(f).display().to_string()])
        .collect()
}

/// The flags of a small run of the folder `from` (`--stages`, `--seq-len` as given; 2
/// micro-batches of 2 sequences on simulated devices), then `extra` and [`outputs`] for `test`.
fn small(from: &Path, stages: &str, seq_len: &str, extra: &[&str], test: &str) -> FinetuneArgs {
    let from = from.display().to_string();
    let mut all: Vec<String> = [
        "--from",
        &from,
        "--quiet",
        "--device",
        "sim",
        "--stages",
        stages,
        "--micro-batches",
        "2",
        "--batch",
        "4",
        "--seq-len",
        seq_len,
        "--plan",
        "off",
    ]
    .iter()
    .chain(extra)
    .map(|f| f.to_string())
    .collect();
    all.extend(outputs(test));
    FinetuneArgs::parse_from_args(all).unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/tests/fixtures")
        .join(name)
}

/// `finetune_lm` on the GPT-2 fixture through K=2: the held-out loss falls, and the folder it
/// saves (`--save-hf`) fine-tunes on from where it stopped: loaded again with `--steps 0`, its
/// held-out loss is the trained run's, bit for bit. Bad flags and folders are refused by name.
#[test]
fn finetune_lm_trains_a_gpt2_folder_and_its_save_resumes_exactly() {
    let out = std::env::temp_dir().join(format!("wgpipe-finetune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let args = |from: &Path, steps: &str, extra: &[&str]| {
        let mut v = vec!["--lr", "3e-3", "--steps", steps];
        v.extend_from_slice(extra);
        small(from, "2", "8", &v, "gpt2")
    };
    let save = out.display().to_string();
    let trained = run(args(&fixture("gpt2"), "40", &["--save-hf", &save])).unwrap();
    assert!(
        trained.eval_after < trained.eval_before - 0.2,
        "held-out loss {} -> {}",
        trained.eval_before,
        trained.eval_after
    );
    let again = run(args(&out, "0", &[])).unwrap();
    assert_eq!(again.eval_before.to_bits(), trained.eval_after.to_bits());

    let e = run(args(&fixture("gpt2"), "0", &["--seq-len", "100000"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--seq-len"), "{e}");
    let bit = fixture("bit");
    let e = run(args(&bit, "0", &[])).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    std::fs::remove_dir_all(&out).unwrap();
}

/// The tiny Llama with its own tokenizer (`llama_tok`, `scripts/hf_tokenizer_reference.py`):
/// through K=2, greedy generation after a prompt gives the ids transformers' `generate` gives,
/// with the KV cache in each stage and without it;
/// fine-tuned on a text this checkout has (README.md) through its tokenizer, the held-out loss
/// falls.
#[test]
fn finetune_lm_generates_like_transformers_and_fine_tunes_on_a_text_file() {
    let dir = fixture("llama_tok");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("generate_reference.json")).unwrap(),
    )
    .unwrap();
    let want: Vec<u32> = reference["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let mut flags: Vec<&str> = Vec::new();
    flags.extend([
        "--steps",
        "0",
        "--prompt",
        "The pipeline",
        "--new-tokens",
        "12",
    ]);
    let r = run(small(&dir, "2", "16", &flags, "generate")).unwrap();
    assert_eq!(r.generated, want, "greedy ids with the KV cache");
    assert!(r.generated_text.chars().count() > 0);
    flags.push("--no-kv-cache");
    let uncached = run(small(&dir, "2", "16", &flags, "generate")).unwrap();
    assert_eq!(uncached.generated, want, "greedy ids without it");

    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = readme.display().to_string();
    let mut flags: Vec<&str> = Vec::new();
    flags.extend(["--steps", "30", "--lr", "3e-3", "--data", &readme]);
    let r = run(small(&dir, "2", "16", &flags, "generate")).unwrap();
    assert!(
        r.eval_after < r.eval_before - 0.3,
        "held-out loss {} -> {}",
        r.eval_before,
        r.eval_after
    );
    let e = run(FinetuneArgs::parse_from_args([
        "--from",
        &fixture("gpt2").display().to_string(),
        "--data",
        &readme,
    ])
    .unwrap())
    .unwrap_err()
    .to_string();
    assert!(e.contains("--data needs a tokenizer"), "{e}");
}

/// `--freeze 1` keeps the embedding and the first decoder layer as they were (the saved folder
/// holds their tensors bit for bit) while the rest trains; the held-out loss through K=2 is the
/// one through K=1, bit for bit.
#[test]
fn finetune_lm_freezes_the_first_layers_and_evaluates_alike_at_any_k() {
    let dir = fixture("llama_tok");
    let out = std::env::temp_dir().join(format!("wgpipe-freeze-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let save = out.display().to_string();
    let run_with =
        |stages: &str, extra: &[&str]| run(small(&dir, stages, "16", extra, "freeze")).unwrap();
    let one = run_with("1", &["--steps", "0"]);
    let two = run_with("2", &["--steps", "0"]);
    assert_eq!(one.eval_before.to_bits(), two.eval_before.to_bits());

    let r = run_with(
        "2",
        &[
            "--steps",
            "5",
            "--lr",
            "1e-2",
            "--freeze",
            "1",
            "--save-hf",
            &save,
        ],
    );
    assert!(r.eval_after < r.eval_before);
    let tensors = |d: &Path| {
        let ck = wgpipe::models::hf::HfCheckpoint::open(d).unwrap();
        ck.names()
            .into_iter()
            .map(|n| {
                let shape = ck.shape(&n).unwrap().to_vec();
                let t = ck.read(&n, &shape, "the test", &wgpipe::tensor::Device::cpu());
                (n, t.unwrap().to_vec().unwrap())
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (before, after) = (tensors(&dir), tensors(&out));
    for (name, was) in &before {
        let frozen = name.starts_with("model.embed_tokens") || name.starts_with("model.layers.0.");
        assert_eq!(&after[name] == was, frozen, "{name}: frozen {frozen}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}
