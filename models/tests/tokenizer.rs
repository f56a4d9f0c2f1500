//! Tokenizers (issue 58): a `tokenizer.json` trained with the `tokenizers` library
//! (`models/tests/fixtures/llama_tok`, from `scripts/hf_tokenizer_reference.py`) gives the ids
//! the library gives, for texts with Unicode, whitespace runs and the special token, and decodes
//! them back to the same text; documents become one stream joined by the end-of-text token;
//! bad files and ids are refused by name.

mod common;

use std::path::{Path, PathBuf};

use common::fixture_path;
use wgpipe_models::data::tokenizer::{read_documents, HfTokenizer};

fn tokenizer() -> HfTokenizer {
    HfTokenizer::from_file(&fixture_path("llama_tok").join("tokenizer.json")).unwrap()
}

fn reference() -> serde_json::Value {
    let path = fixture_path("llama_tok").join("tokenizer_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn ids_and_decoded_text_equal_the_tokenizers_library() {
    let tok = tokenizer();
    let r = reference();
    assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.end_of_text().map(u64::from), r["end_of_text"].as_u64());
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok.encode(text).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.decode(&got).unwrap(), case["decoded"].as_str().unwrap());
        // Byte-level BPE loses nothing: the text comes back as it was.
        assert_eq!(tok.decode(&got).unwrap(), text);
    }
    let special = tok.encode("a<|endoftext|>b").unwrap();
    assert!(special.contains(&tok.end_of_text().unwrap()), "{special:?}");
}

fn temp(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpipe-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn documents_join_into_one_stream_with_end_of_text_between() {
    let tok = tokenizer();
    let plain = temp("a.txt", "The stages run.".as_bytes());
    let lines = temp(
        "b.jsonl",
        "{\"text\": \"naïve café\"}\n\n{\"text\": \"one more\", \"id\": 2}\n".as_bytes(),
    );
    let docs = read_documents(&[plain, lines]).unwrap();
    assert_eq!(docs, ["The stages run.", "naïve café", "one more"]);
    let data = tok.dataset(&docs, 384).unwrap();
    let eot = tok.end_of_text().unwrap();
    let mut want = Vec::new();
    for d in &docs {
        want.extend(tok.encode(d).unwrap());
        want.push(eot);
    }
    assert_eq!(data.tokens(), want.as_slice());
    assert_eq!(data.vocab_size(), 384);
}

#[test]
fn bad_files_and_ids_are_refused_naming_them() {
    let missing = Path::new("/nonexistent/tokenizer.json");
    let e = HfTokenizer::from_file(missing).unwrap_err().to_string();
    assert!(
        e.contains("/nonexistent/tokenizer.json") && e.contains("not found"),
        "{e}"
    );
    let garbage = temp("bad.json", b"{\"model\": 3}");
    let e = HfTokenizer::from_file(&garbage).unwrap_err().to_string();
    assert!(
        e.contains("bad.json") && e.contains("not a Hugging Face tokenizer.json"),
        "{e}"
    );

    let tok = tokenizer();
    let e = tok
        .dataset(&["The stages run.".into()], 100)
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary of size 100"), "{e}");
    let e = tok.decode(&[1, 384]).unwrap_err().to_string();
    assert!(
        e.contains("token id 384 is beyond the tokenizer's 384 tokens"),
        "{e}"
    );

    let no_text = temp("c.jsonl", b"{\"text\": \"ok\"}\n{\"body\": \"no\"}\n");
    let e = read_documents(&[no_text]).unwrap_err().to_string();
    assert!(
        e.contains("c.jsonl") && e.contains("line 2 has no \"text\" string"),
        "{e}"
    );
    let not_json = temp("d.jsonl", b"not json\n");
    let e = read_documents(&[not_json]).unwrap_err().to_string();
    assert!(e.contains("line 1 is not JSON"), "{e}");
}
