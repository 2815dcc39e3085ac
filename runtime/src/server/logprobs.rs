//! Log probabilities as the OpenAI APIs write them. The engine hands over ids and numbers
//! ([`TokenLogprobs`]); here they become token strings and bytes, in chat's form (a list of
//! `{token, logprob, bytes, top_logprobs}`) or the legacy completions form (parallel lists
//! `tokens`, `token_logprobs`, `top_logprobs` as `{token: logprob}` maps, `text_offset`).

use serde_json::{json, Map, Value};

use crate::sampling::TokenLogprobs;
use crate::TextTokenizer;

/// What OpenAI writes for a probability too small for a float (JSON has no -inf).
const FLOOR: f32 = -9999.0;

/// A log probability for JSON: floored, and written with an f32's shortest digits (-1.8107718,
/// not the -1.8107718229293823 its f64 widening would print).
fn number(lp: f32) -> f64 {
    let lp = if lp.is_finite() { lp.max(FLOOR) } else { FLOOR };
    lp.to_string().parse().unwrap_or(lp as f64)
}

/// One token as the client sees it: its text (lossy where the token is part of a UTF-8
/// character; `bytes` are exact) and log probability.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f64,
}

impl Piece {
    fn new(tok: &TextTokenizer, id: u32, logprob: f32) -> Piece {
        let bytes = tok.token_bytes(id);
        Piece {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: number(logprob),
        }
    }

    fn chat(&self) -> Value {
        json!({"token": self.token, "logprob": self.logprob, "bytes": self.bytes})
    }
}

/// A generated (or echoed prompt) token and its likeliest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub chosen: Piece,
    pub top: Vec<Piece>,
    /// The prompt's first token: nothing before it to score it by (`null` in the output).
    pub unscored: bool,
}

impl Entry {
    /// An echoed prompt's first token.
    pub fn unscored(tok: &TextTokenizer, id: u32) -> Entry {
        Entry {
            chosen: Piece::new(tok, id, 0.0),
            top: vec![],
            unscored: true,
        }
    }

    pub fn new(tok: &TextTokenizer, id: u32, lp: &TokenLogprobs) -> Entry {
        Entry {
            chosen: Piece::new(tok, id, lp.logprob),
            top: lp.top.iter().map(|&(t, l)| Piece::new(tok, t, l)).collect(),
            unscored: false,
        }
    }
}

/// Chat's `choices[].logprobs`.
pub fn chat_json(entries: &[Entry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = e.chosen.chat();
            v["top_logprobs"] = e.top.iter().map(Piece::chat).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

/// The completions API's `choices[].logprobs`; `offset` is where the first token's text starts
/// in the completion (in characters), advanced past these tokens for the next stream chunk.
pub fn completion_json(entries: &[Entry], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut lps = Vec::with_capacity(entries.len());
    let mut tops = Vec::with_capacity(entries.len());
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        tokens.push(json!(e.chosen.token));
        offsets.push(json!(*offset));
        *offset += e.chosen.token.chars().count();
        if e.unscored {
            lps.push(Value::Null);
            tops.push(Value::Null);
            continue;
        }
        lps.push(json!(e.chosen.logprob));
        let mut m = Map::new();
        for p in &e.top {
            // Two tokens can print alike (lossy halves of a character): the likelier stays.
            m.entry(p.token.clone()).or_insert(json!(p.logprob));
        }
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(token: &str, lp: f32, top: &[(&str, f32)]) -> Entry {
        let p = |t: &str, l: f32| Piece {
            token: t.into(),
            bytes: t.as_bytes().to_vec(),
            logprob: number(l),
        };
        Entry {
            chosen: p(token, lp),
            top: top.iter().map(|&(t, l)| p(t, l)).collect(),
            unscored: false,
        }
    }

    #[test]
    fn both_forms() {
        let e = [
            entry("Hé", -0.5, &[("Hé", -0.5), ("A", -1.5)]),
            entry(" x", f32::NEG_INFINITY, &[]),
        ];
        let c = chat_json(&e);
        assert_eq!(c["content"][0]["token"], "Hé");
        assert_eq!(c["content"][0]["bytes"], json!([72, 195, 169]));
        assert_eq!(c["content"][0]["top_logprobs"][1]["token"], "A");
        assert_eq!(c["content"][1]["logprob"], json!(-9999.0));
        assert_eq!(c["content"][1]["top_logprobs"], json!([]));
        let mut off = 3;
        let l = completion_json(&e, &mut off);
        assert_eq!(l["tokens"], json!(["Hé", " x"]));
        assert_eq!(l["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(number(-1.8107718).to_string(), "-1.8107718");
        assert_eq!(l["top_logprobs"][0], json!({"Hé": -0.5, "A": -1.5}));
        assert_eq!(l["text_offset"], json!([3, 5]));
        assert_eq!(off, 7);
        let mut first = entry("The", 0.0, &[]);
        first.unscored = true;
        let l = completion_json(&[first, e[0].clone()], &mut 0);
        assert_eq!(l["tokens"], json!(["The", "Hé"]));
        assert_eq!(l["token_logprobs"], json!([null, -0.5]));
        assert_eq!(l["top_logprobs"][0], json!(null));
        assert_eq!(l["text_offset"], json!([0, 3]));
    }
}
