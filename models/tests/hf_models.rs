//! Llama checkpoints from Hugging Face folders against transformers itself: the folders of
//! `tests/fixtures/llama_*` were written by transformers' `save_pretrained`, and their
//! `reference.safetensors` holds its logits, loss and gradients for one batch, computed in
//! float64 (`scripts/hf_models_reference.py`). Also `config.json` and checkpoint files that are
//! wrong in each way a user's can be, each refused with an error naming what is wrong.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use wgpipe_autograd::{sum_tied_grads, ForwardCtx, Tape};
use wgpipe_models::hf::{
    load_gpt2, load_llama, save_hf, save_shard, write_index, HfCheckpoint, HfFolder, SaveOptions,
};
use wgpipe_models::{cross_entropy, forward_all, sequence_parameters, HfNames, LlamaConfig};
use wgpipe_tensor::DType;
use wgpipe_tensor::{Device, Tensor};

/// The whole model from `folder` (loaded by `load`), one forward and backward of the
/// reference batch on `dev`: logits within 1e-5 of transformers' (largest error over largest
/// value), the loss within 1e-6 relatively, every parameter's gradient within 1e-4 (a tied
/// table's: the sum over its two uses, as torch accumulates it on the one shared tensor).
fn equals_transformers<M: HfNames>(
    folder: &str,
    dev: &Device,
    load: impl Fn(&Path, &Device) -> (M, Vec<Box<dyn wgpipe_autograd::Module>>),
) {
    let dir = fixture_path(folder);
    let r = read_reference(&dir.join("reference.safetensors"));
    let (model, layers) = load(&dir, dev);
    let tensor = |name: &str| {
        let (shape, v) = &r[name];
        Tensor::from_vec(v.clone(), shape, dev).unwrap()
    };
    let tape = Tape::new();
    let logits = forward_all(
        &layers,
        &tape.constant(tensor("input_ids")),
        &ForwardCtx::eval(),
    )
    .unwrap();
    assert_near(
        &vals(logits.value()),
        &r["logits"].1,
        1e-5,
        &format!("{folder} logits"),
    );
    let loss = cross_entropy(&logits, &tensor("targets")).unwrap();
    let want = r["loss"].1[0];
    let got = loss.to_scalar().unwrap();
    assert!(
        (got - want).abs() <= 1e-6 * want.abs(),
        "{folder} loss {got} vs {want}"
    );
    tape.backward(&loss).unwrap();
    let params = sequence_parameters(&layers);
    sum_tied_grads(&params).unwrap();
    let mut compared = std::collections::HashSet::new();
    for (k, layer) in layers.iter().enumerate() {
        for (name, p) in layer.parameters() {
            let (key, transposed) = model.checkpoint_key(k, &name);
            let mut g = p.grad().unwrap();
            if transposed {
                g = g.t().unwrap().contiguous().unwrap();
            }
            let key = format!("grad.{key}");
            assert_near(&vals(&g), &r[&key].1, 1e-4, &format!("{folder} {key}"));
            compared.insert(key);
        }
    }
    let all = r.keys().filter(|n| n.starts_with("grad.")).count();
    assert_eq!(
        compared.len(),
        all,
        "{folder}: every reference gradient compared"
    );
}

fn llama(
    dir: &Path,
    dev: &Device,
) -> (wgpipe_models::Llama, Vec<Box<dyn wgpipe_autograd::Module>>) {
    let cfg = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    load_llama(dir, 0..cfg.num_hidden_layers + 3, dev).unwrap()
}

fn gpt2(dir: &Path, dev: &Device) -> (wgpipe_models::Gpt2, Vec<Box<dyn wgpipe_autograd::Module>>) {
    load_gpt2(dir, 0..5, dev).unwrap()
}

#[test]
fn a_gpt2_with_its_conv1d_weights_equals_transformers() {
    equals_transformers("gpt2", &cpu(), gpt2);
}

#[test]
fn a_gqa_llama_with_llama3_rope_equals_transformers() {
    equals_transformers("llama_gqa", &cpu(), llama);
}

#[test]
fn a_tied_llama_equals_transformers() {
    equals_transformers("llama_tied", &cpu(), llama);
}

/// A Llama transformers saved as bf16 shards with an index (`llama_bf16_shards`, from
/// `scripts/hf_bf16_shards_reference.py`; a stage's layers span several files): read into f32
/// (exactly: bf16 values are f32 values) it computes like the float64 reference of the model
/// the files hold, at f32's tolerances. Computing in bf16 (autocast), its logits' error from
/// the float64 ones is at most 2x transformers' own in bf16.
#[test]
fn a_llama_in_bf16_shards_equals_transformers() {
    equals_transformers("llama_bf16_shards", &cpu(), llama);
    let dir = fixture_path("llama_bf16_shards");
    let r = read_reference(&dir.join("reference.safetensors"));
    let (_, layers) = llama(&dir, &cpu());
    let ids = Tensor::from_vec(r["input_ids"].1.clone(), &r["input_ids"].0, &cpu()).unwrap();
    let ctx = ForwardCtx {
        compute: DType::BF16,
        ..ForwardCtx::eval()
    };
    let logits = forward_all(&layers, &Tape::new().constant(ids), &ctx).unwrap();
    assert_eq!(logits.value().dtype(), DType::BF16);
    let ours = norm_err(
        &vals(&logits.value().to_dtype(DType::F32).unwrap()),
        &r["logits"].1,
    );
    let theirs = norm_err(&r["logits_bf16"].1, &r["logits"].1);
    eprintln!("bf16 logits: wgpipe {ours:.2e}, transformers {theirs:.2e}");
    assert!(
        ours <= 2.0 * theirs,
        "bf16 logits off by {ours:.2e} (transformers {theirs:.2e})"
    );
}

#[test]
fn a_llama_on_wgpu_equals_transformers() {
    match Device::test_wgpu() {
        Ok(dev) => {
            equals_transformers("llama_gqa", &dev, llama);
            equals_transformers("gpt2", &dev, gpt2);
        }
        Err(e) => eprintln!("SKIPPED: no wgpu test device: {e}"),
    }
}

/// A stage reads only its own layers: layers 1..3 of the GQA model (the two decoder layers)
/// equal the same layers of the whole model, and need no embedding or head tensors.
#[test]
fn a_range_of_layers_reads_its_own_tensors() {
    let dir = fixture_path("llama_gqa");
    let (_, whole) = load_llama(&dir, 0..5, &cpu()).unwrap();
    let (_, part) = load_llama(&dir, 1..3, &cpu()).unwrap();
    let names = |ls: &[Box<dyn wgpipe_autograd::Module>]| {
        ls.iter()
            .flat_map(|l| l.parameters())
            .map(|(n, p)| (n, vals(&p.value())))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&part), names(&whole[1..3]));
}

#[test]
fn configs_read_both_rope_key_styles_and_transformers_defaults() {
    let cfg = LlamaConfig::from_json(
        r#"{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
            "rope_theta": 250000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}"#,
    )
    .unwrap();
    assert_eq!(cfg.layer.rope_theta, 250000.0);
    assert_eq!(
        cfg.layer.rope_scaling,
        wgpipe_models::RopeScaling::Linear { factor: 4.0 }
    );
    // Absent keys: transformers' defaults (kv heads = heads, head_dim = hidden / heads).
    assert_eq!(cfg.layer.num_key_value_heads, 4);
    assert_eq!(cfg.layer.head_dim, 8);
    assert_eq!(cfg.layer.rms_norm_eps, 1e-6);
    assert_eq!(cfg.vocab_size, 32000);
    assert!(!cfg.tie_word_embeddings);
}

#[test]
fn bad_configs_name_the_key_and_the_value() {
    let base = r#""model_type": "llama", "hidden_size": 32, "num_attention_heads": 4"#;
    for (extra, says) in [
        (
            r#", "num_key_value_heads": 3"#,
            "num_key_value_heads = 3 does not divide num_attention_heads = 4",
        ),
        (r#", "head_dim": 5"#, "head_dim = 5 must be even"),
        (
            r#", "rms_norm_eps": -1e-6"#,
            "rms_norm_eps = -0.000001 must not be negative",
        ),
        (
            r#", "vocab_size": "many""#,
            "vocab_size must be a positive integer, got \"many\"",
        ),
        (
            r#", "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}"#,
            "rope_parameters.rope_type \"yarn\" is not supported",
        ),
        (
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
            "rope_scaling.low_freq_factor is missing",
        ),
        (
            r#", "hidden_act": "gelu""#,
            "hidden_act \"gelu\" is not supported",
        ),
    ] {
        let e = LlamaConfig::from_json(&format!("{{{base}{extra}}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra}: {e}");
    }
    let e = LlamaConfig::from_json(r#"{"model_type": "gpt2"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model_type must be \"llama\", got \"gpt2\""),
        "{e}"
    );
}

/// A copy of the tied fixture's folder, with its checkpoint replaced by `tensors` written by
/// the safetensors crate (or by raw `bytes`).
fn folder_with(test: &str, file: &str, bytes: Vec<u8>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpipe-hf-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture_path("llama_tied").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join(file), bytes).unwrap();
    dir
}

/// The tied fixture's tensors, edited by `edit`, as safetensors bytes.
fn edited_checkpoint(edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) -> Vec<u8> {
    let mut all: Vec<(String, Vec<usize>, Vec<f32>)> =
        read_reference(&fixture_path("llama_tied").join("model.safetensors"))
            .into_iter()
            .map(|(n, (s, v))| (n, s, v))
            .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut all);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = all
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn bad_checkpoints_are_refused_naming_what_is_wrong() {
    let load = |dir: &Path| {
        load_llama(dir, 0..4, &cpu())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };

    let missing = folder_with(
        "missing",
        "model.safetensors",
        edited_checkpoint(|t| t.retain(|(n, _, _)| n != "model.norm.weight")),
    );
    let e = load(&missing);
    assert!(
        e.contains("has no tensor model.norm.weight (wanted by layer 2"),
        "{e}"
    );

    let reshaped = folder_with(
        "reshaped",
        "model.safetensors",
        edited_checkpoint(|t| {
            let w = t
                .iter_mut()
                .find(|(n, _, _)| n == "model.norm.weight")
                .unwrap();
            w.1 = vec![2, 4];
        }),
    );
    let e = load(&reshaped);
    assert!(
        e.contains("tensor model.norm.weight has shape [2, 4], layer 2"),
        "{e}"
    );
    assert!(e.contains("expects [8]"), "{e}");

    let extra = folder_with(
        "extra",
        "model.safetensors",
        edited_checkpoint(|t| t.push(("classifier.weight".into(), vec![2], vec![0.0, 1.0]))),
    );
    let e = load(&extra);
    assert!(
        e.contains("tensors no layer of the model takes: classifier.weight"),
        "{e}"
    );

    let mut cut = edited_checkpoint(|_| {});
    cut.truncate(cut.len() - 100);
    let e = load(&folder_with("truncated", "model.safetensors", cut));
    assert!(
        e.contains("past the file's") && e.contains("(truncated?)"),
        "{e}"
    );

    let outside = folder_with(
        "outside",
        "model.safetensors.index.json",
        br#"{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}"#.to_vec(),
    );
    let e = load(&outside);
    assert!(
        e.contains("\"../elsewhere.safetensors\" is not a file inside the folder"),
        "{e}"
    );

    // A shard name inside the folder that is a link leading out of it.
    let linked = folder_with(
        "linked",
        "model.safetensors.index.json",
        br#"{"weight_map": {"model.norm.weight": "shard.safetensors"}}"#.to_vec(),
    );
    let outside_file = linked.with_extension("outside.safetensors");
    std::fs::write(&outside_file, edited_checkpoint(|_| {})).unwrap();
    std::os::unix::fs::symlink(&outside_file, linked.join("shard.safetensors")).unwrap();
    let e = load(&linked);
    assert!(
        e.contains("\"shard.safetensors\" leads out of the folder"),
        "{e}"
    );
    std::fs::remove_file(&outside_file).unwrap();

    // An index that places a tensor in a shard that does not hold it, or names a tensor no
    // shard holds.
    let misplaced = folder_with("misplaced", "a.safetensors", edited_checkpoint(|_| {}));
    std::fs::write(
        misplaced.join("b.safetensors"),
        edited_checkpoint(|t| t.retain(|_| false)),
    )
    .unwrap();
    let index =
        |map: &str| std::fs::write(misplaced.join("model.safetensors.index.json"), map).unwrap();
    index(
        r#"{"weight_map": {"model.norm.weight": "b.safetensors", "model.embed_tokens.weight": "a.safetensors"}}"#,
    );
    let e = load(&misplaced);
    assert!(
        e.contains(
            "weight_map[model.norm.weight] = \"b.safetensors\", but model.norm.weight is in"
        ) && e.contains("a.safetensors"),
        "{e}"
    );
    index(r#"{"weight_map": {"model.ghost.weight": "a.safetensors"}}"#);
    let e = load(&misplaced);
    assert!(e.contains("but no shard holds model.ghost.weight"), "{e}");

    // Two tensors on the same bytes.
    let mut bytes = edited_checkpoint(|_| {});
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut header = header.as_object().unwrap().clone();
    let names: Vec<String> = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let (a, b) = (&names[0], &names[1]);
    let (la, lb) = (
        header[a]["data_offsets"].clone(),
        header[b]["data_offsets"].clone(),
    );
    let size = |o: &serde_json::Value| o[1].as_u64().unwrap() - o[0].as_u64().unwrap();
    if size(&la) == size(&lb) {
        header.get_mut(b).unwrap()["data_offsets"] = la;
    } else {
        // Shift b to begin inside a's range, keeping its length.
        let start = la[0].as_u64().unwrap();
        header.get_mut(b).unwrap()["data_offsets"] = serde_json::json!([start, start + size(&lb)]);
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while text.len() < n {
        text.push(' ');
    }
    assert_eq!(
        text.len(),
        n,
        "the edited header fits the original's length"
    );
    bytes.splice(8..8 + n, text.into_bytes());
    let e = load(&folder_with("overlap", "model.safetensors", bytes));
    assert!(e.contains("overlap"), "{e}");

    let empty = folder_with("empty", "notes.txt", b"no checkpoint here".to_vec());
    let e = load(&empty);
    assert!(
        e.contains("has neither model.safetensors nor model.safetensors.index.json"),
        "{e}"
    );
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpipe-hf-save-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Every tensor of a folder (one file or shards), by name, as f32 bits.
fn folder_bits(dir: &Path) -> Vec<(String, Vec<u32>)> {
    let ck = wgpipe_models::hf::HfCheckpoint::open(dir).unwrap();
    let (_, layers) = load_llama(dir, 0..5, &cpu()).unwrap();
    let mut v: Vec<(String, Vec<u32>)> = sequence_parameters(&layers)
        .into_iter()
        .map(|(n, p)| (n, vals(&p.value()).iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    assert!(!ck.names().is_empty());
    v
}

/// Load, one SGD step, save; the saved folder loads back to the same bits, in one file and in
/// shards (an index and its files); in bf16, to the values rounded once.
#[test]
fn a_trained_llama_saves_back_and_loads_bit_identically() {
    use wgpipe_autograd::optim::{Optimizer, Sgd};
    let dir = fixture_path("llama_gqa");
    let r = read_reference(&dir.join("reference.safetensors"));
    let (llama, layers) = load_llama(&dir, 0..5, &cpu()).unwrap();
    let tensor = |name: &str| Tensor::from_vec(r[name].1.clone(), &r[name].0, &cpu()).unwrap();
    let tape = Tape::new();
    let logits = forward_all(
        &layers,
        &tape.constant(tensor("input_ids")),
        &ForwardCtx::eval(),
    )
    .unwrap();
    tape.backward(&cross_entropy(&logits, &tensor("targets")).unwrap())
        .unwrap();
    let params = sequence_parameters(&layers);
    Sgd::new(0.1).step(&params).unwrap();
    let trained: Vec<(String, Vec<u32>)> = {
        let mut v: Vec<_> = params
            .iter()
            .map(|(n, p)| {
                (
                    n.clone(),
                    vals(&p.value()).iter().map(|x| x.to_bits()).collect(),
                )
            })
            .collect();
        v.sort();
        v
    };

    let one = temp_dir("one");
    save_hf(&one, &llama, &params, SaveOptions::default()).unwrap();
    assert!(one.join("model.safetensors").exists());
    assert_eq!(folder_bits(&one), trained, "one file");

    let sharded = temp_dir("sharded");
    let options = SaveOptions {
        max_shard_bytes: Some(4096),
        ..SaveOptions::default()
    };
    save_hf(&sharded, &llama, &params, options).unwrap();
    assert!(sharded.join("model.safetensors.index.json").exists());
    let shards = std::fs::read_dir(&sharded)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("model-")
        })
        .count();
    assert!(shards > 2, "{shards} shards");
    assert_eq!(folder_bits(&sharded), trained, "shards");

    let bf16 = temp_dir("bf16");
    let options = SaveOptions {
        dtype: wgpipe_tensor::DType::BF16,
        ..SaveOptions::default()
    };
    save_hf(&bf16, &llama, &params, options).unwrap();
    let rounded: Vec<(String, Vec<u32>)> = trained
        .iter()
        .map(|(n, bits)| {
            let b = bits
                .iter()
                .map(|&x| half::bf16::from_f32(f32::from_bits(x)).to_f32().to_bits());
            (n.clone(), b.collect())
        })
        .collect();
    assert_eq!(folder_bits(&bf16), rounded, "bf16");
}

/// `params` of a layer sequence written as a pipeline's stages write them, one shard per
/// stage of `balance`, then the index.
fn save_by_stage<M: HfFolder>(
    dir: &Path,
    model: &M,
    layers: &[Box<dyn wgpipe_autograd::Module>],
    balance: &[usize],
) {
    let mut first = 0;
    for (shard, &n) in balance.iter().enumerate() {
        let params = sequence_parameters(&layers[first..first + n])
            .into_iter()
            .map(|(name, p)| {
                let (l, rest) = name.split_once('.').unwrap();
                (format!("{}.{rest}", first + l.parse::<usize>().unwrap()), p)
            })
            .collect::<Vec<_>>();
        save_shard(dir, model, &params, shard, balance.len(), DType::F32).unwrap();
        first += n;
    }
    write_index(dir, model, balance.len(), DType::F32).unwrap();
}

/// A tied Llama saved stage by stage (as each rank under MPI writes its own): the tied head's
/// table is written once, by the first stage; the folder loads back to the bits of the
/// one-file save; before the index is written it does not load at all.
#[test]
fn a_llama_saved_stage_by_stage_loads_like_one_file() {
    let dir = fixture_path("llama_tied");
    let (llama, layers) = load_llama(&dir, 0..4, &cpu()).unwrap();
    let whole = temp_dir("by-stage-whole");
    save_hf(
        &whole,
        &llama,
        &sequence_parameters(&layers),
        SaveOptions::default(),
    )
    .unwrap();
    let by_stage = temp_dir("by-stage");
    let params = sequence_parameters(&layers[..2]);
    save_shard(&by_stage, &llama, &params, 0, 2, DType::F32).unwrap();
    let e = HfCheckpoint::open(&by_stage).err().unwrap().to_string();
    assert!(e.contains("has neither model.safetensors"), "{e}");
    save_by_stage(&by_stage, &llama, &layers, &[2, 2]);
    let names = |d: &Path| HfCheckpoint::open(d).unwrap().names();
    assert_eq!(names(&by_stage), names(&whole));
    assert!(!names(&by_stage).contains(&"lm_head.weight".to_string()));
    let second = wgpipe_models::hf::shard_file(1, 2);
    let in_second = HfCheckpoint::open_file(&by_stage.join(&second))
        .unwrap()
        .names();
    assert_eq!(
        in_second,
        ["model.norm.weight"],
        "the head's table stays in shard 1"
    );
    let bits = |d: &Path| {
        let (_, ls) = load_llama(d, 0..4, &cpu()).unwrap();
        sequence_parameters(&ls)
            .iter()
            .map(|(n, p)| {
                (
                    n.clone(),
                    vals(&p.value())
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&by_stage), bits(&whole));
}

/// The saved folders (two Llamas, a GPT-2, and the tied Llama written stage by stage), read by transformers' `from_pretrained`, give the
/// logits wgpipe gives.
/// Needs a Python with torch and transformers (`WGPIPE_PYTHON`, else `python3`); skipped,
/// saying so, where there is none.
#[test]
fn transformers_loads_saved_models_and_agrees() {
    let Some(python) = python_with("torch, transformers") else {
        return;
    };
    for folder in ["llama_gqa", "llama_tied", "gpt2", "llama_tied by stage"] {
        let src = fixture_path(folder.trim_end_matches(" by stage"));
        let out = temp_dir(&format!("torch-{}", folder.replace(' ', "-")));
        let layers = if folder.ends_with("by stage") {
            let (model, layers) = llama(&src, &cpu());
            save_by_stage(&out, &model, &layers, &[1, 2, 1]);
            layers
        } else if folder == "gpt2" {
            let (model, layers) = gpt2(&src, &cpu());
            save_hf(
                &out,
                &model,
                &sequence_parameters(&layers),
                SaveOptions::default(),
            )
            .unwrap();
            // What was saved loads back bit for bit.
            let (_, again) = gpt2(&out, &cpu());
            let bits = |ls: &[Box<dyn wgpipe_autograd::Module>]| -> Vec<Vec<u32>> {
                sequence_parameters(ls)
                    .iter()
                    .map(|(_, p)| vals(&p.value()).iter().map(|x| x.to_bits()).collect())
                    .collect()
            };
            assert_eq!(bits(&again), bits(&layers), "gpt2 round trip");
            layers
        } else {
            let (model, layers) = llama(&src, &cpu());
            save_hf(
                &out,
                &model,
                &sequence_parameters(&layers),
                SaveOptions::default(),
            )
            .unwrap();
            layers
        };
        let ids: Vec<f32> = read_reference(&src.join("reference.safetensors"))["input_ids"]
            .1
            .clone();
        let t = ids.len() / 2;
        let script = format!(
            "import json, torch, transformers\n\
             m = transformers.AutoModelForCausalLM.from_pretrained({:?}, dtype=torch.float32).eval()\n\
             ids = torch.tensor({:?}).long().reshape(2, {t})\n\
             print(json.dumps(m(input_ids=ids).logits.flatten().tolist()))",
            out.display().to_string(),
            ids
        );
        let theirs = python_floats(&python, &script);
        let x = Tensor::from_vec(ids, &[2, t], &cpu()).unwrap();
        let ours = forward_all(&layers, &Tape::new().constant(x), &ForwardCtx::eval()).unwrap();
        assert_near(
            &vals(ours.value()),
            &theirs,
            1e-5,
            &format!("{folder} via from_pretrained"),
        );
    }
}

#[test]
fn bad_gpt2_configs_name_the_key_and_the_value() {
    use wgpipe_models::Gpt2Config;
    let base = r#""model_type": "gpt2", "n_embd": 16, "n_head": 4"#;
    for (extra, says) in [
        (r#", "n_head": 3"#, "n_head = 3 does not divide n_embd = 16"),
        (r#", "n_inner": 40"#, "n_inner = 40 is not supported"),
        (
            r#", "activation_function": "relu""#,
            "activation_function \"relu\" is not supported",
        ),
        (
            r#", "scale_attn_by_inverse_layer_idx": true"#,
            "scale_attn_by_inverse_layer_idx = true is not supported",
        ),
        (r#", "attn_pdrop": 0.2"#, "must be one rate in [0, 1)"),
    ] {
        let e = Gpt2Config::from_json(&format!("{{{base}{extra}}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra}: {e}");
    }
    let c = Gpt2Config::from_json(&format!("{{{base}}}")).unwrap();
    assert_eq!(
        (c.vocab_size, c.n_positions, c.n_layer, c.dropout),
        (50257, 1024, 12, 0.1)
    );
    assert!(c.tie_word_embeddings);
}
