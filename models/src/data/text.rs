//! Text data for language-model training: tokenisers, datasets and a synthetic corpus.
//!
//! Two tokenisations are offered:
//! * [`ByteTokenizer`]: byte level, vocabulary 256, works on any file (including non-UTF-8).
//! * [`CharVocab`]: a compact character-level vocabulary (the distinct characters of a text,
//!   sorted, mapped to `0..V`). Used by [`TextDataset::from_text`] and
//!   [`TextDataset::synthetic`].
//!
//! # The synthetic corpus and how to judge learning
//!
//! [`TextDataset::synthetic`] generates sentences from a small grammar, one per line:
//! arithmetic with numbers spelled out (`"three plus four is seven."`,
//! `"nine minus two is seven."`), counting (`"four, five, six."`), possession with
//! number agreement (`"the old dog has three balls."` / `"... has one ball."`) and
//! subject–verb–object sentences (`"a small cat sees the red bird."`). Its vocabulary is
//! [`CharVocab::synthetic`]: lowercase letters used by the grammar, space, `'.'`, `','`
//! and `'\n'` — [`SYNTHETIC_VOCAB_SIZE`] characters.
//!
//! Reference points for the per-character cross-entropy (nats) of a model on this corpus
//! (the empirical values are measured on 200 000 characters, seed 0; see the tests):
//! * uniform guessing: `ln(V) = ln(28) ≈ 3.33`;
//! * unigram entropy ([`empirical_unigram_entropy`]) ≈ 2.92 — character frequencies only;
//! * bigram conditional entropy ([`empirical_bigram_entropy`]) ≈ 1.75 — the best a model
//!   that sees only the previous character can do;
//! * trigram conditional entropy ≈ 0.8 (measured on 800 000 characters);
//! * the entropy rate of the grammar itself ≈ 0.30 (≈ 8.25 nats of random choices per
//!   sentence of ≈ 27.2 characters) — the floor for a perfect model.
//!
//! A small model that reaches a validation loss clearly below the bigram value (say under
//! 1.5) has learnt spelling and sentence structure; under about 1.0 it uses word-level
//! context. The remaining gap to 0.30 is mostly arithmetic and the genuinely random choices.

use super::{read_file, DataError, Rng};
use std::path::Path;

/// Byte-level tokeniser: each byte of the UTF-8 text is one token (vocabulary 256).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size of the byte tokeniser.
    pub const VOCAB_SIZE: usize = 256;

    /// Tokens of the UTF-8 bytes of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Text from byte tokens; invalid UTF-8 and ids above 255 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Vocabulary size (256).
    pub fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }
}

/// A compact character vocabulary: `chars[i]` has id `i`. Characters are sorted and unique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    /// The characters, sorted and unique; a character's id is its index.
    pub chars: Vec<char>,
}

impl CharVocab {
    /// The distinct characters of `text`, sorted.
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharVocab { chars }
    }

    /// The fixed vocabulary of [`TextDataset::synthetic`] (independent of seed and length):
    /// every character the grammar can emit.
    pub fn synthetic() -> Self {
        let mut text = String::from(" .,\n");
        for list in [
            NUMBERS, SUBJECTS, NAMES, ADJECTIVES, NOUNS, VERBS, THINGS, FILLER,
        ] {
            for w in list {
                text.push_str(w);
            }
        }
        Self::from_text(&text)
    }

    /// Number of characters.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// True if there are no characters.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The id of `c`, if it is in the vocabulary.
    pub fn id(&self, c: char) -> Option<u32> {
        self.chars.binary_search(&c).ok().map(|i| i as u32)
    }

    /// Ids of the characters of `text`; error naming the first character not in the
    /// vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                self.id(c).ok_or_else(|| {
                    DataError::invalid(format!(
                        "character {c:?} at position {i} is not in the {}-character vocabulary",
                        self.len()
                    ))
                })
            })
            .collect()
    }

    /// Text of `ids`; ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{FFFD}'))
            .collect()
    }
}

/// `(inputs, targets)` of a batch of windows, each row-major `[batch, seq_len]`, where
/// `targets[b][t] = inputs[b][t + 1]` in the stream.
pub type TokenBatch = (Vec<u32>, Vec<u32>);

/// Vocabulary size of [`TextDataset::synthetic`] (`CharVocab::synthetic().len()`).
pub const SYNTHETIC_VOCAB_SIZE: usize = 28;

/// A token stream for next-token prediction, with its vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct TextDataset {
    tokens: Vec<u32>,
    vocab_size: usize,
    /// `Some` for character-level data, `None` for byte-level data.
    vocab: Option<CharVocab>,
}

impl TextDataset {
    /// Tokens and vocabulary size; every token must be `< vocab_size`. Decodes as bytes if
    /// `vocab_size <= 256`, otherwise [`TextDataset::decode`] maps ids to U+FFFD.
    pub fn from_tokens(tokens: Vec<u32>, vocab_size: usize) -> Result<Self, DataError> {
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab_size)
        {
            return Err(DataError::invalid(format!(
                "token {t} at position {i} is outside the vocabulary of size {vocab_size}"
            )));
        }
        Ok(TextDataset {
            tokens,
            vocab_size,
            vocab: None,
        })
    }

    /// Byte-level dataset (vocabulary 256) from any file. Fails, naming the path, if the
    /// file is missing or unreadable, or has fewer than `seq_len + 1` bytes (too short for
    /// one input/target sequence of length `seq_len`).
    pub fn from_file(path: impl AsRef<Path>, seq_len: usize) -> Result<Self, DataError> {
        let path = path.as_ref();
        let bytes = read_file(path)?;
        let needed = seq_len.max(1) + 1;
        if bytes.len() < needed {
            return Err(DataError::format(
                path,
                format!(
                    "file has {} bytes (tokens), too short for one sequence: need at least \
                     seq_len + 1 = {needed}",
                    bytes.len()
                ),
            ));
        }
        Ok(TextDataset {
            tokens: bytes.into_iter().map(u32::from).collect(),
            vocab_size: ByteTokenizer::VOCAB_SIZE,
            vocab: None,
        })
    }

    /// Character-level dataset with the compact vocabulary of `text`
    /// ([`CharVocab::from_text`]).
    pub fn from_text(text: &str) -> Self {
        let vocab = CharVocab::from_text(text);
        Self::with_vocab(text, vocab)
    }

    /// The deterministic synthetic corpus (see the [module docs](self)): exactly
    /// `num_chars` characters of grammar sentences, one per line, generated from `seed`,
    /// with vocabulary [`CharVocab::synthetic`] ([`SYNTHETIC_VOCAB_SIZE`] characters).
    pub fn synthetic(seed: u64, num_chars: usize) -> Self {
        let text = synthetic_text(seed, num_chars);
        Self::with_vocab(&text, CharVocab::synthetic())
    }

    fn with_vocab(text: &str, vocab: CharVocab) -> Self {
        // Not reachable by input: `from_text` builds the vocabulary from `text`, and the
        // synthetic grammar emits only characters of `CharVocab::synthetic`.
        let tokens = vocab
            .encode(text)
            .expect("text characters are in its vocabulary");
        TextDataset {
            tokens,
            vocab_size: vocab.len(),
            vocab: Some(vocab),
        }
    }

    /// The token stream.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True if there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Vocabulary size: 256 for byte-level data, the number of characters for
    /// character-level data. The uniform-guess loss is `ln(vocab_size)`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The character vocabulary (`None` for byte-level data).
    pub fn vocab(&self) -> Option<&CharVocab> {
        self.vocab.as_ref()
    }

    /// Text of `ids` under this dataset's tokenisation.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.vocab {
            Some(v) => v.decode(ids),
            None if self.vocab_size <= 256 => ByteTokenizer.decode(ids),
            None => ids.iter().map(|_| '\u{FFFD}').collect(),
        }
    }

    /// Encodes `text` under this dataset's tokenisation (e.g. a generation prompt).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match &self.vocab {
            Some(v) => v.encode(text),
            None => Ok(ByteTokenizer.encode(text)),
        }
    }

    /// A random batch: `batch` windows of `seq_len` tokens at uniformly random offsets.
    /// Returns `(inputs, targets)`, each row-major `[batch, seq_len]`, where
    /// `targets[b][t] = inputs[b][t + 1]` in the stream (the next token). Deterministic in
    /// `(rng_seed, step)`.
    ///
    /// Fails ([`DataError::Zero`], [`DataError::TooShort`]) if `seq_len == 0` or the dataset
    /// has fewer than `seq_len + 1` tokens.
    pub fn batch(
        &self,
        batch: usize,
        seq_len: usize,
        rng_seed: u64,
        step: u64,
    ) -> Result<TokenBatch, DataError> {
        if seq_len == 0 {
            return Err(DataError::Zero { what: "seq_len" });
        }
        if self.tokens.len() <= seq_len {
            return Err(DataError::TooShort {
                tokens: self.tokens.len(),
                seq_len,
            });
        }
        let starts = (self.tokens.len() - seq_len) as u64;
        let mut inputs = Vec::with_capacity(batch * seq_len);
        let mut targets = Vec::with_capacity(batch * seq_len);
        for row in 0..batch {
            let s = Rng::from_parts(&[rng_seed, step, row as u64]).below(starts) as usize;
            inputs.extend_from_slice(&self.tokens[s..s + seq_len]);
            targets.extend_from_slice(&self.tokens[s + 1..s + seq_len + 1]);
        }
        Ok((inputs, targets))
    }

    /// Deterministic evaluation batches: consecutive non-overlapping windows from the start
    /// of the stream, grouped into full batches of `batch` rows (the remainder is dropped).
    /// Each element is `(inputs, targets)` as in [`TextDataset::batch`]. Fails
    /// ([`DataError::Zero`]) if `batch` or `seq_len` is zero.
    pub fn eval_batches(&self, batch: usize, seq_len: usize) -> Result<Vec<TokenBatch>, DataError> {
        if batch == 0 {
            return Err(DataError::Zero { what: "batch" });
        }
        if seq_len == 0 {
            return Err(DataError::Zero { what: "seq_len" });
        }
        let windows = self.tokens.len().saturating_sub(1) / seq_len;
        let batches = (0..windows / batch)
            .map(|b| {
                let mut inputs = Vec::with_capacity(batch * seq_len);
                let mut targets = Vec::with_capacity(batch * seq_len);
                for r in 0..batch {
                    let s = (b * batch + r) * seq_len;
                    inputs.extend_from_slice(&self.tokens[s..s + seq_len]);
                    targets.extend_from_slice(&self.tokens[s + 1..s + seq_len + 1]);
                }
                (inputs, targets)
            })
            .collect();
        Ok(batches)
    }

    /// Contiguous split: the first `fraction` of the tokens (rounded down) for training,
    /// the rest for validation. Both keep this dataset's vocabulary. Fails
    /// ([`DataError::Fraction`]) if `fraction` is not within `[0, 1]`.
    pub fn split(&self, fraction: f64) -> Result<(TextDataset, TextDataset), DataError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(DataError::Fraction { fraction });
        }
        let k = ((self.tokens.len() as f64) * fraction).floor() as usize;
        let k = k.min(self.tokens.len());
        let part = |t: &[u32]| TextDataset {
            tokens: t.to_vec(),
            vocab_size: self.vocab_size,
            vocab: self.vocab.clone(),
        };
        Ok((part(&self.tokens[..k]), part(&self.tokens[k..])))
    }
}

/// Plug-in estimate (nats) of the unigram entropy `H(X)` of a token stream; 0 if empty.
pub fn empirical_unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    entropy_of_counts(counts.values().copied(), tokens.len())
}

/// Plug-in estimate (nats) of the bigram conditional entropy `H(X_t | X_{t-1})` of a token
/// stream — the loss of the best model that sees only the previous token. A language model
/// whose loss falls clearly below this has learnt longer-range structure. 0 if fewer than
/// two tokens.
pub fn empirical_bigram_entropy(tokens: &[u32]) -> f64 {
    if tokens.len() < 2 {
        return 0.0;
    }
    let mut pairs = std::collections::HashMap::<(u32, u32), usize>::new();
    let mut prev = std::collections::HashMap::<u32, usize>::new();
    for w in tokens.windows(2) {
        *pairs.entry((w[0], w[1])).or_default() += 1;
        *prev.entry(w[0]).or_default() += 1;
    }
    let n = tokens.len() - 1;
    // H(X_t | X_{t-1}) = H(X_{t-1}, X_t) - H(X_{t-1}).
    entropy_of_counts(pairs.values().copied(), n) - entropy_of_counts(prev.values().copied(), n)
}

fn entropy_of_counts(counts: impl Iterator<Item = usize>, total: usize) -> f64 {
    if total == 0 {
        return 0.0;
    }
    let n = total as f64;
    counts
        .filter(|&c| c > 0)
        .map(|c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

// ---- The synthetic grammar -------------------------------------------------------------

const NUMBERS: &[&str] = &[
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
];
const SUBJECTS: &[&str] = &["the", "a"];
const NAMES: &[&str] = &["tom", "anna", "the king", "my friend"];
const ADJECTIVES: &[&str] = &["big", "small", "red", "old", "happy", "green"];
const NOUNS: &[&str] = &["cat", "dog", "bird", "frog", "girl", "boy", "horse", "cow"];
const VERBS: &[&str] = &["sees", "likes", "finds", "wants", "follows", "hears"];
/// Nouns that pluralise by adding `s`.
const THINGS: &[&str] = &["apple", "ball", "book", "hat", "cup", "stone", "toy"];
const FILLER: &[&str] = &["plus", "minus", "is", "has", "s"];

fn pick<'a>(rng: &mut Rng, list: &[&'a str]) -> &'a str {
    list[rng.below(list.len() as u64) as usize]
}

/// `"the big cat"`, `"a dog"`, `"tom"`.
fn noun_phrase(rng: &mut Rng, out: &mut String) {
    if rng.below(4) == 0 {
        out.push_str(pick(rng, NAMES));
        return;
    }
    out.push_str(pick(rng, SUBJECTS));
    out.push(' ');
    if rng.below(2) == 0 {
        out.push_str(pick(rng, ADJECTIVES));
        out.push(' ');
    }
    out.push_str(pick(rng, NOUNS));
}

fn sentence(rng: &mut Rng, out: &mut String) {
    match rng.below(10) {
        // Addition with the sum at most twenty.
        0..=2 => {
            let a = rng.below(21) as usize;
            let b = rng.below(21 - a as u64) as usize;
            out.push_str(&format!(
                "{} plus {} is {}.",
                NUMBERS[a],
                NUMBERS[b],
                NUMBERS[a + b]
            ));
        }
        // Subtraction with a non-negative result.
        3..=4 => {
            let a = rng.below(21) as usize;
            let b = rng.below(a as u64 + 1) as usize;
            out.push_str(&format!(
                "{} minus {} is {}.",
                NUMBERS[a],
                NUMBERS[b],
                NUMBERS[a - b]
            ));
        }
        // Counting: 3 to 5 consecutive numbers.
        5 => {
            let len = 3 + rng.below(3) as usize;
            let start = rng.below((NUMBERS.len() - len + 1) as u64) as usize;
            let words: Vec<&str> = NUMBERS[start..start + len].to_vec();
            out.push_str(&words.join(", "));
            out.push('.');
        }
        // Possession with number agreement.
        6..=7 => {
            noun_phrase(rng, out);
            let k = 1 + rng.below(9) as usize;
            out.push_str(" has ");
            out.push_str(NUMBERS[k]);
            out.push(' ');
            out.push_str(pick(rng, THINGS));
            if k != 1 {
                out.push('s');
            }
            out.push('.');
        }
        // Subject, verb, object.
        _ => {
            noun_phrase(rng, out);
            out.push(' ');
            out.push_str(pick(rng, VERBS));
            out.push(' ');
            noun_phrase(rng, out);
            out.push('.');
        }
    }
    out.push('\n');
}

/// Exactly `num_chars` characters of grammar sentences (the last may be cut off).
fn synthetic_text(seed: u64, num_chars: usize) -> String {
    let mut rng = Rng::from_parts(&[seed, 0x7465_7874]);
    let mut out = String::with_capacity(num_chars + 64);
    while out.len() < num_chars {
        sentence(&mut rng, &mut out);
    }
    out.truncate(num_chars); // ASCII only, so any byte index is a char boundary
    out
}

#[cfg(test)]
mod tests {
    use super::super::temp_path;
    use super::*;

    #[test]
    fn byte_tokenizer_round_trip() {
        let t = ByteTokenizer;
        let s = "héllo, wörld\n";
        let ids = t.encode(s);
        assert_eq!(ids.len(), s.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids), s);
        assert_eq!(t.vocab_size(), 256);
        // Invalid UTF-8 and out-of-range ids decode lossily instead of failing.
        assert_eq!(t.decode(&[0xff, 104]), "\u{FFFD}h");
        assert_eq!(t.decode(&[300]), "\u{FFFD}");
    }

    #[test]
    fn char_vocab_round_trip_and_unknown() {
        let v = CharVocab::from_text("banana split");
        assert_eq!(v.chars, vec![' ', 'a', 'b', 'i', 'l', 'n', 'p', 's', 't']);
        let ids = v.encode("a nab").unwrap();
        assert_eq!(v.decode(&ids), "a nab");
        let e = v.encode("bank").unwrap_err();
        assert!(e.to_string().contains("'k'"), "{e}");
        assert_eq!(v.decode(&[99]), "\u{FFFD}");
    }

    #[test]
    fn synthetic_vocab_is_compact_and_fixed() {
        let v = CharVocab::synthetic();
        assert_eq!(v.len(), SYNTHETIC_VOCAB_SIZE);
        for c in v.chars.iter() {
            assert!(c.is_ascii_lowercase() || " .,\n".contains(*c), "{c:?}");
        }
        let d = TextDataset::synthetic(3, 5000);
        assert_eq!(d.vocab_size(), SYNTHETIC_VOCAB_SIZE);
        assert_eq!(d.vocab(), Some(&v));
    }

    #[test]
    fn synthetic_uses_only_its_vocab_and_every_char() {
        let d = TextDataset::synthetic(0, 50_000);
        assert_eq!(d.len(), 50_000);
        let mut seen = vec![false; d.vocab_size()];
        for &t in d.tokens() {
            assert!((t as usize) < d.vocab_size());
            seen[t as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "some vocab chars never occur");
        let text = d.decode(d.tokens());
        assert!(text
            .chars()
            .all(|c| c.is_ascii_lowercase() || " .,\n".contains(c)));
    }

    #[test]
    fn synthetic_is_deterministic_and_seed_dependent() {
        let a = TextDataset::synthetic(42, 3000);
        let b = TextDataset::synthetic(42, 3000);
        let c = TextDataset::synthetic(43, 3000);
        assert_eq!(a, b);
        assert_ne!(a.tokens(), c.tokens());
        // A prefix property: a longer corpus starts with the shorter one.
        let long = TextDataset::synthetic(42, 6000);
        assert_eq!(&long.tokens()[..3000], a.tokens());
    }

    #[test]
    fn synthetic_sentences_are_correct() {
        let d = TextDataset::synthetic(1, 20_000);
        let text = d.decode(d.tokens());
        let num = |w: &str| NUMBERS.iter().position(|&n| n == w);
        let mut checked = 0;
        for line in text.lines().take(300) {
            let Some(body) = line.strip_suffix('.') else {
                continue; // the final, cut-off line
            };
            let words: Vec<&str> = body.split(' ').collect();
            if words.len() == 5 && (words[1] == "plus" || words[1] == "minus") {
                let (a, b, r) = (
                    num(words[0]).unwrap(),
                    num(words[2]).unwrap(),
                    num(words[4]).unwrap(),
                );
                if words[1] == "plus" {
                    assert_eq!(a + b, r, "{line}");
                } else {
                    assert_eq!(a - b, r, "{line}");
                }
                checked += 1;
            }
            if let Some(i) = words.iter().position(|&w| w == "has") {
                let k = num(words[i + 1]).unwrap();
                assert_eq!(words[i + 2].ends_with('s'), k != 1, "{line}");
            }
        }
        assert!(checked > 50, "only {checked} arithmetic sentences");
        assert!(text.contains(", "));
    }

    #[test]
    fn entropy_reference_points() {
        let d = TextDataset::synthetic(0, 200_000);
        let uniform = (d.vocab_size() as f64).ln();
        let h1 = empirical_unigram_entropy(d.tokens());
        let h2 = empirical_bigram_entropy(d.tokens());
        // The values quoted in the module docs.
        assert!((uniform - 3.332).abs() < 0.01, "{uniform}");
        assert!((h1 - 2.92).abs() < 0.05, "unigram {h1}");
        assert!((h2 - 1.75).abs() < 0.05, "bigram {h2}");
        assert!(h2 < h1 && h1 < uniform);
    }

    #[test]
    fn entropy_of_simple_streams() {
        assert_eq!(empirical_unigram_entropy(&[]), 0.0);
        assert_eq!(empirical_bigram_entropy(&[1]), 0.0);
        assert!(empirical_unigram_entropy(&[5, 5, 5]).abs() < 1e-12);
        let alt: Vec<u32> = (0..1000).map(|i| i % 2).collect();
        assert!((empirical_unigram_entropy(&alt) - 2f64.ln()).abs() < 1e-9);
        // Alternating is perfectly predictable from the previous token.
        assert!(empirical_bigram_entropy(&alt).abs() < 1e-9);
    }

    #[test]
    fn batch_shapes_shift_and_determinism() {
        let d = TextDataset::synthetic(0, 10_000);
        let (x, y) = d.batch(4, 16, 7, 3).unwrap();
        assert_eq!(x.len(), 64);
        assert_eq!(y.len(), 64);
        for r in 0..4 {
            let row_x = &x[r * 16..(r + 1) * 16];
            let row_y = &y[r * 16..(r + 1) * 16];
            assert_eq!(&row_x[1..], &row_y[..15]);
            // The row is a real window of the stream.
            let s = d
                .tokens()
                .windows(17)
                .position(|w| &w[..16] == row_x && w[16] == row_y[15]);
            assert!(s.is_some());
        }
        assert_eq!(d.batch(4, 16, 7, 3).unwrap(), (x.clone(), y.clone()));
        assert_ne!(d.batch(4, 16, 7, 4).unwrap().0, x);
        assert_ne!(d.batch(4, 16, 8, 3).unwrap().0, x);
    }

    #[test]
    fn batch_reaches_every_window_including_the_last() {
        let d = TextDataset::from_tokens((0..12).collect(), 12).unwrap();
        let mut seen = [false; 3];
        for step in 0..200 {
            let (x, y) = d.batch(1, 9, 0, step).unwrap();
            let s = x[0] as usize;
            assert_eq!(x, (s as u32..s as u32 + 9).collect::<Vec<_>>());
            assert_eq!(y, (s as u32 + 1..s as u32 + 10).collect::<Vec<_>>());
            seen[s] = true;
        }
        assert_eq!(seen, [true; 3]);
    }

    /// Was `batch_panics_when_too_short` (`should_panic(expected = "too short")`) while
    /// `batch` panicked; the same input now gives the error, with the same words.
    #[test]
    fn batch_is_an_error_when_too_short() {
        let e = TextDataset::from_text("abc").batch(1, 3, 0, 0).unwrap_err();
        assert!(e.to_string().contains("too short"), "{e}");
        assert!(
            matches!(
                e,
                DataError::TooShort {
                    tokens: 3,
                    seq_len: 3
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn bad_sizes_and_fractions_are_errors_naming_the_values() {
        let d = TextDataset::from_tokens((0..20).collect(), 20).unwrap();
        let zero = |r: Result<_, DataError>| match r {
            Err(DataError::Zero { what }) => what,
            other => panic!("expected DataError::Zero, got {other:?}"),
        };
        assert_eq!(zero(d.batch(2, 0, 0, 0).map(|_| ())), "seq_len");
        assert_eq!(zero(d.eval_batches(0, 4).map(|_| ())), "batch");
        assert_eq!(zero(d.eval_batches(2, 0).map(|_| ())), "seq_len");
        let e = d.batch(1, 20, 0, 0).unwrap_err();
        assert!(e.to_string().contains("20 tokens"), "{e}");
        assert!(d.batch(1, 19, 0, 0).is_ok());
        for f in [-0.1, 1.5, f64::NAN] {
            let e = d.split(f).unwrap_err();
            assert!(matches!(e, DataError::Fraction { .. }), "{e:?}");
            assert!(e.to_string().contains(&f.to_string()), "{e}");
        }
        assert!(e.path().is_none());
    }

    #[test]
    fn eval_batches_cover_stream_in_order() {
        let d = TextDataset::from_tokens((0..50).map(|i| i % 7).collect(), 7).unwrap();
        let b = d.eval_batches(2, 5).unwrap();
        // 49 usable windows of 5 -> 9 windows -> 4 full batches of 2.
        assert_eq!(b.len(), 4);
        assert_eq!(b[0].0, d.tokens()[0..10].to_vec());
        assert_eq!(b[0].1, d.tokens()[1..11].to_vec());
        assert_eq!(b[3].0, d.tokens()[30..40].to_vec());
    }

    #[test]
    fn split_keeps_vocab_and_partitions() {
        let d = TextDataset::synthetic(5, 1000);
        let (t, v) = d.split(0.9).unwrap();
        assert_eq!(t.len(), 900);
        assert_eq!(v.len(), 100);
        assert_eq!(t.vocab_size(), d.vocab_size());
        assert_eq!(v.vocab(), d.vocab());
        let mut joined = t.tokens().to_vec();
        joined.extend_from_slice(v.tokens());
        assert_eq!(joined, d.tokens());
    }

    #[test]
    fn from_text_and_from_tokens() {
        let d = TextDataset::from_text("hello world");
        assert_eq!(d.vocab_size(), 8);
        assert_eq!(d.decode(d.tokens()), "hello world");
        assert_eq!(d.encode("low").unwrap().len(), 3);
        assert!(TextDataset::from_tokens(vec![1, 2, 9], 5).is_err());
        let b = TextDataset::from_tokens(vec![104, 105], 256).unwrap();
        assert_eq!(b.decode(b.tokens()), "hi");
    }

    #[test]
    fn from_file_reads_bytes() {
        let p = temp_path("text-ok.txt");
        std::fs::write(&p, "some text\n").unwrap();
        let d = TextDataset::from_file(&p, 4).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(d.vocab_size(), 256);
        assert_eq!(d.len(), 10);
        assert_eq!(d.decode(d.tokens()), "some text\n");
        assert_eq!(d.encode("so").unwrap(), vec![115, 111]);
    }

    #[test]
    fn from_file_errors_name_the_path() {
        let missing = temp_path("text-missing.txt");
        let e = TextDataset::from_file(&missing, 8).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains(&*missing.to_string_lossy()) && s.contains("not found"),
            "{s}"
        );

        let short = temp_path("text-short.txt");
        std::fs::write(&short, "abc").unwrap();
        let e = TextDataset::from_file(&short, 8).unwrap_err();
        std::fs::remove_file(&short).unwrap();
        let s = e.to_string();
        assert!(s.contains(&*short.to_string_lossy()), "{s}");
        assert!(s.contains("too short") && s.contains("9"), "{s}");

        // A directory is not readable as a file.
        let dir = std::env::temp_dir();
        let e = TextDataset::from_file(&dir, 8).unwrap_err();
        assert!(matches!(e, DataError::Io { .. }), "{e}");
    }
}
