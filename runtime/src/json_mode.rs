//! JSON mode (`response_format: {"type": "json_object"}`): the output is held to a JSON object
//! by masking, at every step, each token whose bytes would take the text so far out of every
//! valid JSON document, and the request ends the moment the object closes.
//!
//! The checker is a byte-level pushdown automaton ([`JsonState`], `Copy`: a bounded nesting
//! stack inline, so trying a token is a copy and a few byte steps, no allocation). A step's mask
//! tries every token of the vocabulary from the current state (tokens grouped by their first
//! byte, so a byte the state refuses rules out its whole group at once) — unless the same state
//! came before: inside a string, say, every step starts from the same state, so a request keeps
//! the masks of its last few states and most steps reuse one. Special (added) tokens
//! never come in JSON mode. Runs of whitespace are capped, so a model cannot stall in
//! indentation forever; strings take any byte from 0x20 up except `"` and `\` (multi-byte UTF-8
//! may be split across tokens), control characters only escaped.

use std::sync::Arc;

use crate::constraint::Constraint;

/// Deepest nesting accepted.
const MAX_DEPTH: usize = 32;
/// Longest run of whitespace bytes between tokens of the document.
const MAX_WS_RUN: u8 = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Mode {
    /// Before the document: whitespace, then `{`.
    Start,
    /// A value is expected; `close` allows `]` (just after `[`).
    Value { close: bool },
    /// Just after `{`: a key or `}`.
    KeyOrEnd,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value: `,`, or the bracket that closes the container.
    After,
    /// In a string (`key`: an object key, then `:`); `esc`: 0 none, 1 after `\`, 2..=5 hex
    /// digits of `\u` still to come (5 - esc + 1).
    Str { key: bool, esc: u8 },
    /// In a number (see [`Num`]).
    Num(Num),
    /// In `true`, `false` or `null`: which, and how many bytes are in.
    Lit { word: u8, at: u8 },
    /// The object is closed.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }
}

const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// Where a JSON object prefix stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct JsonState {
    mode: Mode,
    stack: [u8; MAX_DEPTH],
    depth: u8,
    ws: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        JsonState {
            mode: Mode::Start,
            stack: [0; MAX_DEPTH],
            depth: 0,
            ws: 0,
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonState {
    /// The object is complete.
    pub fn done(&self) -> bool {
        self.mode == Mode::Done
    }

    fn open(&mut self, b: u8) -> bool {
        if self.depth as usize == MAX_DEPTH {
            return false;
        }
        self.stack[self.depth as usize] = b;
        self.depth += 1;
        self.mode = if b == b'{' {
            Mode::KeyOrEnd
        } else {
            Mode::Value { close: true }
        };
        true
    }

    fn close(&mut self, b: u8) -> bool {
        let want = if b == b'}' { b'{' } else { b'[' };
        if self.depth == 0 || self.stack[self.depth as usize - 1] != want {
            return false;
        }
        self.depth -= 1;
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::After
        };
        true
    }

    /// Starts a value at `b`.
    fn value(&mut self, b: u8) -> bool {
        self.mode = match b {
            b'{' | b'[' => return self.open(b),
            b'"' => Mode::Str { key: false, esc: 0 },
            b'-' => Mode::Num(Num::Minus),
            b'0' => Mode::Num(Num::Zero),
            b'1'..=b'9' => Mode::Num(Num::Int),
            b't' => Mode::Lit { word: 0, at: 1 },
            b'f' => Mode::Lit { word: 1, at: 1 },
            b'n' => Mode::Lit { word: 2, at: 1 },
            _ => return false,
        };
        true
    }

    /// Takes one byte; false if no JSON object starts with the text so far plus `b` (the state
    /// is then unspecified).
    pub fn feed(&mut self, b: u8) -> bool {
        let ws = is_ws(b);
        let in_token = matches!(self.mode, Mode::Str { .. });
        if ws && !in_token && !matches!(self.mode, Mode::Num(_)) {
            if self.mode == Mode::Done || self.ws >= MAX_WS_RUN {
                return false;
            }
            self.ws += 1;
            return true;
        }
        self.ws = 0;
        match self.mode {
            Mode::Start => b == b'{' && self.open(b),
            Mode::Value { close } => (close && b == b']' && self.close(b)) || self.value(b),
            Mode::KeyOrEnd => match b {
                b'}' => self.close(b),
                b'"' => {
                    self.mode = Mode::Str { key: true, esc: 0 };
                    true
                }
                _ => false,
            },
            Mode::Key => {
                self.mode = Mode::Str { key: true, esc: 0 };
                b == b'"'
            }
            Mode::Colon => {
                self.mode = Mode::Value { close: false };
                b == b':'
            }
            Mode::After => match b {
                b',' => {
                    self.mode = if self.stack[self.depth as usize - 1] == b'{' {
                        Mode::Key
                    } else {
                        Mode::Value { close: false }
                    };
                    true
                }
                b'}' | b']' => self.close(b),
                _ => false,
            },
            Mode::Str { key, esc } => {
                self.mode = match (esc, b) {
                    (0, b'"') if key => Mode::Colon,
                    (0, b'"') => Mode::After,
                    (0, b'\\') => Mode::Str { key, esc: 1 },
                    (0, 0x20..=0xff) => Mode::Str { key, esc: 0 },
                    (1, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                        Mode::Str { key, esc: 0 }
                    }
                    (1, b'u') => Mode::Str { key, esc: 2 },
                    (2..=5, _) if b.is_ascii_hexdigit() => Mode::Str {
                        key,
                        esc: if esc == 5 { 0 } else { esc + 1 },
                    },
                    _ => return false,
                };
                true
            }
            Mode::Num(n) => {
                let next = match (n, b) {
                    (Num::Minus, b'0') => Num::Zero,
                    (Num::Minus, b'1'..=b'9') => Num::Int,
                    (Num::Int, b'0'..=b'9') => Num::Int,
                    (Num::Zero | Num::Int, b'.') => Num::Dot,
                    (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
                    (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
                    (Num::E, b'+' | b'-') => Num::ESign,
                    (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Num::Exp,
                    // Anything else ends the number, and is the next thing after it.
                    _ if n.complete() => {
                        self.mode = Mode::After;
                        return self.feed(b);
                    }
                    _ => return false,
                };
                self.mode = Mode::Num(next);
                true
            }
            Mode::Lit { word, at } => {
                let w = WORDS[word as usize];
                if w[at as usize] != b {
                    return false;
                }
                self.mode = if at as usize + 1 == w.len() {
                    Mode::After
                } else {
                    Mode::Lit { word, at: at + 1 }
                };
                true
            }
            Mode::Done => false,
        }
    }

    /// Takes `bytes`; false if they lead out of JSON.
    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }
}

/// The vocabulary as JSON mode sees it: each token's bytes, `None` for special tokens (and
/// tokens with no bytes), grouped by first byte for the masks.
#[derive(Debug)]
pub struct Vocab {
    bytes: Vec<Option<Vec<u8>>>,
    /// Token ids by first byte.
    by_first: Vec<Vec<u32>>,
}

impl Vocab {
    pub fn new(bytes: Vec<Option<Vec<u8>>>) -> Vocab {
        let mut by_first = vec![Vec::new(); 256];
        for (id, b) in bytes.iter().enumerate() {
            if let Some(&f) = b.as_ref().and_then(|b| b.first()) {
                by_first[f as usize].push(id as u32);
            }
        }
        Vocab { bytes, by_first }
    }
}

/// Masks kept per request (a mask is one byte per vocabulary token).
const MASKS_KEPT: usize = 16;

/// A request's JSON mode: the state of its output so far.
#[derive(Debug, Clone)]
pub struct JsonObject {
    vocab: Arc<Vocab>,
    state: JsonState,
    /// Masks of recent states, newest last.
    masks: Vec<(JsonState, Vec<bool>)>,
}

impl JsonObject {
    pub fn new(vocab: Arc<Vocab>) -> JsonObject {
        JsonObject {
            vocab,
            state: JsonState::default(),
            masks: Vec::new(),
        }
    }

    fn compute(&self, allowed: &mut [bool]) {
        allowed.fill(false);
        for first in 0..=255u8 {
            let ids = &self.vocab.by_first[first as usize];
            if ids.is_empty() {
                continue;
            }
            let mut s = self.state;
            if !s.feed(first) {
                continue;
            }
            for &id in ids {
                let Some(b) = &self.vocab.bytes[id as usize] else {
                    continue;
                };
                let mut t = s;
                if t.feed_all(&b[1..]) {
                    if let Some(a) = allowed.get_mut(id as usize) {
                        *a = true;
                    }
                }
            }
        }
    }
}

impl Constraint for JsonObject {
    fn allowed(&mut self, allowed: &mut [bool]) {
        if let Some(i) = self
            .masks
            .iter()
            .position(|(s, m)| *s == self.state && m.len() == allowed.len())
        {
            let kept = self.masks.remove(i);
            allowed.copy_from_slice(&kept.1);
            self.masks.push(kept);
            return;
        }
        self.compute(allowed);
        if self.masks.len() == MASKS_KEPT {
            self.masks.remove(0);
        }
        self.masks.push((self.state, allowed.to_vec()));
    }

    fn advance(&mut self, id: u32) {
        if let Some(Some(b)) = self.vocab.bytes.get(id as usize) {
            self.state.feed_all(b);
        }
    }

    fn complete(&self) -> bool {
        self.state.done()
    }

    fn clone_box(&self) -> Box<dyn Constraint> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(s: &str) -> (bool, bool) {
        let mut st = JsonState::default();
        let ok = st.feed_all(s.as_bytes());
        (ok, ok && st.done())
    }

    #[test]
    fn objects_and_their_prefixes() {
        for doc in [
            r#"{}"#,
            r#" { "a" : 1 }"#,
            r#"{"a": [1, -2.5e+3, 0, 0.25, true, false, null, "x\"y\\u00e9\n"], "b": {"c": []}}"#,
            "{\n  \"name\": \"Zoë\",\n  \"tags\": [\"a\", \"b\"]\n}",
            r#"{"n":-0.0E5,"m":[[[]]]}"#,
        ] {
            assert_eq!(accepts(doc), (true, true), "{doc}");
            // Every prefix is a valid prefix, none complete before the end.
            for i in 0..doc.len() {
                if doc.is_char_boundary(i) {
                    assert_eq!(accepts(&doc[..i]), (true, false), "{:?}", &doc[..i]);
                }
            }
        }
        for bad in [
            "[1]",
            "\"x\"",
            "{,}",
            "{\"a\" 1}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":tru}",
            "{\"a\":[1,]}",
            "{\"a\":]",
            "{\"a\":\"\u{1}\"}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{} {}",
            "{\"a\":1]",
            "{'a':1}",
        ] {
            assert!(!accepts(bad).1, "{bad:?} accepted");
            let mut st = JsonState::default();
            assert!(!st.feed_all(bad.as_bytes()), "{bad:?} accepted as a prefix");
        }
        // Whitespace runs are capped; depth too.
        assert!(!accepts(&format!("{{{}", " ".repeat(40))).0);
        assert!(accepts(&format!("{{\"a\":{}", "[".repeat(20))).0);
        assert!(!accepts(&format!("{{\"a\":{}", "[".repeat(40))).0);
    }

    #[test]
    fn masks_allow_exactly_the_tokens_that_stay_json() {
        let words = [
            "{",
            "}",
            "\"",
            "a",
            "\":",
            " 1",
            "1}",
            "]",
            "{\"",
            "<|im_end|>",
            "\n  ",
        ];
        let mut bytes: Vec<Option<Vec<u8>>> =
            words.iter().map(|w| Some(w.as_bytes().to_vec())).collect();
        bytes[9] = None; // a special token
        let vocab = Arc::new(Vocab::new(bytes));
        let mut c = JsonObject::new(vocab);
        let mut allowed = vec![false; words.len()];
        let allowed_words = |c: &mut JsonObject, allowed: &mut Vec<bool>| -> Vec<&str> {
            c.allowed(allowed);
            (0..words.len())
                .filter(|&i| allowed[i])
                .map(|i| words[i])
                .collect()
        };
        assert_eq!(
            allowed_words(&mut c, &mut allowed),
            vec!["{", "{\"", "\n  "]
        );
        c.advance(8); // {"
                      // In a key: anything but the newline (raw control characters are not JSON text).
        assert_eq!(
            allowed_words(&mut c, &mut allowed),
            vec!["{", "}", "\"", "a", "\":", " 1", "1}", "]", "{\""]
        );
        c.advance(3); // a
        c.advance(4); // ":
                      // A value: `":` is a string that starts with a colon.
        assert_eq!(
            allowed_words(&mut c, &mut allowed),
            vec!["{", "\"", "\":", " 1", "1}", "{\"", "\n  "]
        );
        assert!(!c.complete());
        c.advance(6); // 1}
        assert!(c.complete());
        assert!(allowed_words(&mut c, &mut allowed).is_empty());
    }

    /// A kept mask is the one computing it afresh gives, over a real vocabulary's worth of
    /// states (a document fed byte by byte).
    #[test]
    fn kept_masks_equal_fresh_ones() {
        let words: Vec<String> = (0u8..128)
            .filter(|b| b.is_ascii_graphic() || *b == b' ' || *b == b'\n')
            .map(|b| (b as char).to_string())
            .chain(["\": ", "\"}", "{\"", "\",", "],", "true", "\n  "].map(String::from))
            .collect();
        let vocab = Arc::new(Vocab::new(
            words.iter().map(|w| Some(w.as_bytes().to_vec())).collect(),
        ));
        let doc = br#"{"a": [1, 2, {"b": "xyz"}], "c": "d", "e": true}"#;
        let mut c = JsonObject::new(vocab.clone());
        let (mut kept, mut fresh) = (vec![false; words.len()], vec![false; words.len()]);
        for &b in doc.iter() {
            c.allowed(&mut kept);
            c.compute(&mut fresh);
            assert_eq!(kept, fresh, "at {:?}", b as char);
            let id = words.iter().position(|w| w.as_bytes() == [b]).unwrap();
            assert!(kept[id], "{:?} refused", b as char);
            c.advance(id as u32);
        }
        assert!(c.complete());
        assert!(c.masks.len() <= MASKS_KEPT && c.masks.len() > 4);
    }
}
