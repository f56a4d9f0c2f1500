//! Hugging Face tokenizers: a `tokenizer.json` read with the `tokenizers` crate (pure Rust, no
//! network), text and JSON Lines files read as documents and encoded into one training stream
//! (documents joined with the tokenizer's end-of-text token), and ids decoded back to text.

use std::path::{Path, PathBuf};

use super::{DataError, TextDataset};

/// The names the end-of-text token goes by in common models' tokenizers, in the order looked
/// for: GPT-2's, Llama 3's, Llama 2's and Mistral's, Gemma's.
const END_OF_TEXT: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// A tokenizer read from a `tokenizer.json`.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HfTokenizer({}, {} tokens)",
            self.path.display(),
            self.vocab_size()
        )
    }
}

impl HfTokenizer {
    /// Reads `path` (a `tokenizer.json` as transformers saves it). A missing file, or one that
    /// is not a tokenizer, is an error naming it.
    pub fn from_file(path: &Path) -> Result<HfTokenizer, DataError> {
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, "read", e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            DataError::format(path, format!("not a Hugging Face tokenizer.json: {e}"))
        })?;
        Ok(HfTokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Tokens, added and special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of the end-of-text token (see [`END_OF_TEXT`]), if the tokenizer has one.
    pub fn end_of_text(&self) -> Option<u32> {
        END_OF_TEXT.iter().find_map(|t| self.inner.token_to_id(t))
    }

    /// The ids of `text`, without the special tokens a template would add around it (special
    /// tokens written in the text itself are kept).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| DataError::format(&self.path, format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= self.vocab_size()) {
            return Err(DataError::invalid(format!(
                "token id {id} is beyond the tokenizer's {} tokens ({})",
                self.vocab_size(),
                self.path.display()
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::format(&self.path, format!("decoding failed: {e}")))
    }

    /// One token stream of `documents`, each followed by the end-of-text token (when the
    /// tokenizer has one), as a dataset of `vocab_size` tokens (the model's): an id at or past
    /// it is an error naming it.
    pub fn dataset(
        &self,
        documents: &[String],
        vocab_size: usize,
    ) -> Result<TextDataset, DataError> {
        let eot = self.end_of_text();
        let mut tokens = Vec::new();
        for d in documents {
            tokens.extend(self.encode(d)?);
            tokens.extend(eot);
        }
        TextDataset::from_tokens(tokens, vocab_size)
    }
}

/// The documents of `paths`: a `.jsonl` file gives one per line (its `text` field), any other
/// file is one document of UTF-8 text. Errors name the file (and the line).
pub fn read_documents(paths: &[PathBuf]) -> Result<Vec<String>, DataError> {
    let mut docs = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, "read", e))?;
        if path.extension().is_some_and(|e| e == "jsonl") {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                docs.push(json_text(path, i + 1, line)?);
            }
        } else {
            docs.push(text);
        }
    }
    Ok(docs)
}

/// The `text` field of JSON Lines line `line`.
fn json_text(path: &Path, line: usize, text: &str) -> Result<String, DataError> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| DataError::format(path, format!("line {line} is not JSON: {e}")))?;
    value
        .get("text")
        .and_then(|t| t.as_str())
        .map(String::from)
        .ok_or_else(|| DataError::format(path, format!("line {line} has no \"text\" string")))
}
