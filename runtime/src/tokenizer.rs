//! Text ⇄ token ids: `tokenizer.json` through the `tokenizers` crate, plus what
//! `tokenizer_config.json` adds (BOS policy, special-token strings, the chat template).

use std::path::Path;

use crate::RuntimeError;

pub struct TextTokenizer {
    /// Special tokens (`<|im_start|>`…) in the text become their ids.
    special: tokenizers::Tokenizer,
    /// Special-token strings in the text are ordinary text (built on first use: a clone of the
    /// whole vocabulary is not worth paying at every start).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    pub add_bos: bool,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub chat_template: Option<String>,
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        // Older configs store {"content": "..."} objects.
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    pub fn load(dir: &Path) -> Result<TextTokenizer, RuntimeError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| RuntimeError::io(&path, e))?;
        let special = match fast::bpe_from_json(&bytes) {
            Some(t) => t,
            None => tokenizers::Tokenizer::from_bytes(&bytes)
                .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", path.display())))?,
        };
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", cfg_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(RuntimeError::io(&cfg_path, e)),
        };
        let bos_token = token_string(cfg.get("bos_token"));
        let eos_token = token_string(cfg.get("eos_token"));
        let id = |t: &Option<String>| t.as_deref().and_then(|s| special.token_to_id(s));
        Ok(TextTokenizer {
            add_bos: cfg
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            bos_id: id(&bos_token),
            eos_id: id(&eos_token),
            bos_token,
            eos_token,
            chat_template: cfg
                .get("chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            special,
            plain: std::sync::OnceLock::new(),
        })
    }

    /// Encodes `text`; with `parse_special`, special-token strings become their ids. A BOS id is
    /// prepended only when the tokenizer config asks for it.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, RuntimeError> {
        let tk: &tokenizers::Tokenizer = if parse_special {
            &self.special
        } else {
            self.plain.get_or_init(|| {
                let mut p = self.special.clone();
                p.set_encode_special_tokens(true);
                p
            })
        };
        let enc = tk
            .encode(text, false)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, RuntimeError> {
        self.special
            .decode(ids, skip_special)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.special.get_vocab_size(true)
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.special.token_to_id(s)
    }

    /// Whether `id` is an added (special or user-defined) token rather than a model piece.
    pub fn is_added(&self, id: u32) -> bool {
        self.special
            .get_added_vocabulary()
            .simple_id_to_token(id)
            .is_some()
    }

    /// The bytes one token stands for on its own (what OpenAI's `logprobs.bytes` holds): added
    /// tokens' text; byte-level BPE pieces mapped back through GPT-2's byte ↔ character table
    /// (a piece may be part of a UTF-8 character, so this is bytes, not text); `<0xHH>`
    /// byte-fallback pieces their byte; anything else the decoder's text for the id alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let tk = &self.special;
        if let Some(t) = tk.get_added_vocabulary().simple_id_to_token(id) {
            return t.into_bytes();
        }
        let Some(piece) = tk.id_to_token(id) else {
            return Vec::new();
        };
        if matches!(
            tk.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        ) {
            if let Some(b) = piece.chars().map(byte_level_byte).collect() {
                return b;
            }
        }
        if let Some(b) = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| h.len() == 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![b];
        }
        match tk.decode(&[id], false) {
            Ok(t) => t.into_bytes(),
            Err(_) => piece.into_bytes(),
        }
    }
}

/// GPT-2's byte-level alphabet backwards: printable Latin-1 characters stand for their own byte,
/// and the 68 other bytes (controls, space, …) were moved to U+0100.. in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    (0u32..0x100)
        .filter(|&b| !printable(b))
        .nth((c - 0x100) as usize)
        .map(|b| b as u8)
}

/// Incremental detokenization: turns a growing id sequence into text deltas, holding back bytes
/// of a character that is not complete yet (byte-level BPE splits multi-byte UTF-8).
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, RuntimeError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len()
            && !now.ends_with('\u{fffd}')
            && now.is_char_boundary(before.len())
        {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }
}

/// A faster way to the same `tokenizers::Tokenizer` for the common case, a BPE model: the big
/// parts (vocabulary and merges, ~100k entries) are parsed with typed serde straight into the BPE
/// builder, and only the small parts (normalizer, pre-tokenizer, post-processor, decoder) go
/// through `tokenizers`' own (generic, buffering) deserialization. Measured on the default
/// model: ~45–60 ms for `Tokenizer::from_bytes`, the largest phase of a warm cold start. Anything
/// unusual (another model type, unknown version, an added token whose id the vocabulary does not
/// give it) returns `None` and the caller uses `from_bytes`, so results never differ.
pub mod fast {
    use std::collections::HashMap;

    use serde::Deserialize;
    use serde_json::Value;
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        Tokenizer,
    };

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Merge {
        Text(String),
        Pair(String, String),
    }

    #[derive(Deserialize)]
    struct Bpe {
        #[serde(rename = "type")]
        kind: String,
        vocab: HashMap<String, u32>,
        merges: Vec<Merge>,
        dropout: Option<f32>,
        unk_token: Option<String>,
        continuing_subword_prefix: Option<String>,
        end_of_word_suffix: Option<String>,
        #[serde(default)]
        fuse_unk: bool,
        #[serde(default)]
        byte_fallback: bool,
        #[serde(default)]
        ignore_merges: bool,
    }

    #[derive(Deserialize)]
    struct Added {
        id: u32,
        content: String,
        #[serde(default)]
        single_word: bool,
        #[serde(default)]
        lstrip: bool,
        #[serde(default)]
        rstrip: bool,
        #[serde(default)]
        normalized: bool,
        #[serde(default)]
        special: bool,
    }

    #[derive(Deserialize)]
    struct File {
        version: Option<String>,
        #[serde(default)]
        added_tokens: Vec<Added>,
        normalizer: Option<Value>,
        pre_tokenizer: Option<Value>,
        post_processor: Option<Value>,
        decoder: Option<Value>,
        truncation: Option<Value>,
        padding: Option<Value>,
        model: Bpe,
    }

    fn part<T: serde::de::DeserializeOwned>(v: Option<Value>) -> Option<Option<T>> {
        match v {
            None | Some(Value::Null) => Some(None),
            Some(v) => serde_json::from_value(v).ok().map(Some),
        }
    }

    pub fn bpe_from_json(bytes: &[u8]) -> Option<Tokenizer> {
        let f: File = serde_json::from_slice(bytes).ok()?;
        if f.model.kind != "BPE"
            || f.version.as_deref().is_some_and(|v| v != "1.0")
            || !matches!(f.truncation, None | Some(Value::Null))
            || !matches!(f.padding, None | Some(Value::Null))
        {
            return None;
        }
        let m = f.model;
        let merges: Vec<(String, String)> = m
            .merges
            .into_iter()
            .map(|x| match x {
                Merge::Pair(a, b) => Some((a, b)),
                Merge::Text(s) => s
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string())),
            })
            .collect::<Option<_>>()?;
        let vocab: Vocab = m.vocab.into_iter().collect();
        let mut b = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .fuse_unk(m.fuse_unk)
            .byte_fallback(m.byte_fallback)
            .ignore_merges(m.ignore_merges);
        if let Some(d) = m.dropout {
            b = b.dropout(d);
        }
        if let Some(u) = m.unk_token {
            b = b.unk_token(u);
        }
        if let Some(p) = m.continuing_subword_prefix {
            b = b.continuing_subword_prefix(p);
        }
        if let Some(s) = m.end_of_word_suffix {
            b = b.end_of_word_suffix(s);
        }
        let mut t = Tokenizer::new(b.build().ok()?);
        t.with_normalizer(part::<NormalizerWrapper>(f.normalizer)?);
        t.with_pre_tokenizer(part::<PreTokenizerWrapper>(f.pre_tokenizer)?);
        t.with_post_processor(part::<PostProcessorWrapper>(f.post_processor)?);
        t.with_decoder(part::<DecoderWrapper>(f.decoder)?);
        let added: Vec<AddedToken> = f
            .added_tokens
            .iter()
            .map(|a| AddedToken {
                content: a.content.clone(),
                single_word: a.single_word,
                lstrip: a.lstrip,
                rstrip: a.rstrip,
                normalized: a.normalized,
                special: a.special,
            })
            .collect();
        t.add_tokens(&added);
        // The file's ids must be the ones the tokenizer gives (as `from_bytes` checks).
        if f.added_tokens
            .iter()
            .any(|a| t.token_to_id(&a.content) != Some(a.id))
        {
            return None;
        }
        Some(t)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        #[ignore]
        fn timing() {
            let p = std::path::PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/thaw/models/smollm2-135m-instruct/tokenizer.json");
            let bytes = std::fs::read(&p).unwrap();
            for _ in 0..3 {
                let t = std::time::Instant::now();
                let f: super::File = serde_json::from_slice(&bytes).unwrap();
                let a = t.elapsed();
                let t = std::time::Instant::now();
                let merges: Vec<(String, String)> = f
                    .model
                    .merges
                    .into_iter()
                    .map(|x| match x {
                        super::Merge::Pair(a, b) => (a, b),
                        super::Merge::Text(s) => {
                            let (a, b) = s.split_once(' ').unwrap();
                            (a.to_string(), b.to_string())
                        }
                    })
                    .collect();
                let vocab: super::Vocab = f.model.vocab.into_iter().collect();
                let b = t.elapsed();
                let t = std::time::Instant::now();
                let bpe = super::BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .unwrap();
                let c = t.elapsed();
                let t = std::time::Instant::now();
                let tk = super::bpe_from_json(&bytes).unwrap();
                let d = t.elapsed();
                drop((bpe, tk));
                eprintln!("parse {a:?} convert {b:?} build {c:?} whole {d:?}");
            }
        }

        /// The fast path builds the same tokenizer as `from_bytes`: same encodings, same decodes.
        #[test]
        fn fast_path_equals_from_bytes() {
            let json = r#"{"version":"1.0","truncation":null,"padding":null,
              "added_tokens":[{"id":0,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
              "normalizer":null,
              "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
              "post_processor":null,
              "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
              "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
                "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
                "vocab":{"<s>":0,"h":1,"e":2,"l":3,"o":4,"he":5,"ll":6,"hell":7,"hello":8,"Ġ":9,"w":10,"r":11,"d":12,"Ġw":13},
                "merges":["h e","l l","he ll","hell o","Ġ w"]}}"#
                .as_bytes();
            let fast = super::bpe_from_json(json).expect("fast path");
            let slow = tokenizers::Tokenizer::from_bytes(json).unwrap();
            for text in ["hello", "hello world", "<s>hello", "hell", "whole"] {
                let a = fast.encode(text, false).unwrap();
                let b = slow.encode(text, false).unwrap();
                assert_eq!(a.get_ids(), b.get_ids(), "{text}");
                assert_eq!(
                    fast.decode(a.get_ids(), false).unwrap(),
                    slow.decode(b.get_ids(), false).unwrap()
                );
            }
        }
    }
}
