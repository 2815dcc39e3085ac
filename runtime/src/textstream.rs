//! Token ids → streamed text with stop strings: the one place that decides what text a client
//! may see yet. Used by `thaw generate` and by the HTTP server, so both stream the same bytes.
//!
//! Text that could still be the start of a stop string is held back until the next tokens
//! prove it is not; text from the first stop string on is never shown.

use crate::tokenizer::StreamDecoder;
use crate::{RuntimeError, TextTokenizer};

/// Length of the longest suffix of `text` that is a proper prefix of some stop string: that much
/// text must be held back from the stream until we know it is not the start of a stop.
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for l in (1..s.len()).rev() {
            if l <= text.len()
                && text.is_char_boundary(text.len() - l)
                && s.is_char_boundary(l)
                && text.ends_with(&s[..l])
            {
                keep = keep.max(l);
                break;
            }
        }
    }
    keep
}

/// What one more token did to the visible text.
#[derive(Debug, PartialEq)]
pub enum Delta {
    /// New text that is safe to show (may be empty).
    Text(String),
    /// A stop string appeared: show this last text, then stop generating.
    Stop(String),
}

#[derive(Default)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> TextStream {
        TextStream {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Delta, RuntimeError> {
        if self.stopped {
            return Ok(Delta::Stop(String::new()));
        }
        self.text.push_str(&self.decoder.push(tok, id)?);
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            self.text.truncate(pos);
            self.stopped = true;
            let tail = self.text[self.emitted.min(pos)..].to_string();
            self.emitted = self.text.len();
            return Ok(Delta::Stop(tail));
        }
        let safe = self.text.len() - held_back(&self.text, &self.stops);
        if safe > self.emitted {
            let d = self.text[self.emitted..safe].to_string();
            self.emitted = safe;
            Ok(Delta::Text(d))
        } else {
            Ok(Delta::Text(String::new()))
        }
    }

    /// The text held back at the end of generation (it turned out not to be a stop).
    pub fn finish(&mut self) -> String {
        let d = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        d
    }

    /// All visible text so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</end>".to_string(), "\n\n".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello\n", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("é", &["éa".to_string()]), 2);
    }
}
