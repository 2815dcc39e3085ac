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
        let special = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", path.display())))?;
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
