//! The OpenAI request bodies this worker accepts, and their checks. Parameters it cannot honour
//! (logprobs, n > 1, tools, logit_bias, ...) are refused with a 400 that names them, never
//! silently ignored; fields that change nothing about the output (`user`, `metadata`) are
//! accepted.

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use crate::chat::ChatMessage;
use crate::sampling::SamplingParams;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and limit fields shared by chat, completions and /invoke.
#[derive(Debug, Deserialize, Default)]
pub struct Params {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    // Refused when set to anything that would change the answer.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub logit_bias: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    pub suffix: Option<Value>,
}

fn truthy(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty() && s != "none",
        Some(Value::Bool(true)) => true,
    }
}

impl Params {
    /// Refuses what this worker cannot do.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        let unsupported = |p: &'static str, what: &str| {
            Err(ApiError::bad_request(format!("{what} is not supported by this worker")).param(p))
        };
        if self.n.unwrap_or(1) != 1 {
            return unsupported("n", "n other than 1");
        }
        if self.best_of.unwrap_or(1) != 1 {
            return unsupported("best_of", "best_of other than 1");
        }
        if truthy(&self.logprobs) || truthy(&self.top_logprobs) {
            return unsupported("logprobs", "logprobs");
        }
        if truthy(&self.logit_bias) {
            return unsupported("logit_bias", "logit_bias");
        }
        if truthy(&self.tools) || truthy(&self.tool_choice) {
            return unsupported("tools", "tool calling");
        }
        if self.echo == Some(true) {
            return unsupported("echo", "echo");
        }
        if truthy(&self.suffix) {
            return unsupported("suffix", "suffix");
        }
        if let Some(rf) = &self.response_format {
            let t = rf.get("type").and_then(|t| t.as_str());
            if !rf.is_null() && t != Some("text") {
                return unsupported("response_format", "a response_format other than text");
            }
        }
        Ok(())
    }

    pub fn sampling(&self) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::bad_request(format!(
                    "top_k must be -1, 0 or positive, got {k}"
                ))
                .param("top_k"))
            }
        };
        let s = SamplingParams {
            // OpenAI's default temperature is 1.
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
        };
        s.validate().map_err(ApiError::bad_request)?;
        Ok(s)
    }

    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        let v = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if v.len() > 16 {
            return Err(ApiError::bad_request("at most 16 stop strings").param("stop"));
        }
        Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
    }

    pub fn max_new_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .map(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

/// Messages as the chat template takes them (text parts joined; other parts refused).
pub fn chat_messages(msgs: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").param("messages"));
    }
    msgs.iter()
        .map(|m| {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer"
            ) {
                return Err(ApiError::bad_request(format!(
                    "unsupported message role '{}' (system, user, assistant)",
                    m.role
                ))
                .param("messages"));
            }
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(p)) => {
                    let mut s = String::new();
                    for part in p {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (k, _) => {
                                return Err(ApiError::bad_request(format!(
                                    "unsupported content part type '{k}' (text only)"
                                ))
                                .param("messages"))
                            }
                        }
                    }
                    s
                }
            };
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role.clone()
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub params: Params,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    Batch(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub params: Params,
}

/// `/invoke`: a prompt or chat messages, the same sampling fields, one JSON answer.
#[derive(Debug, Deserialize)]
pub struct InvokeRequest {
    pub prompt: Option<Prompt>,
    pub messages: Option<Vec<Message>>,
    #[serde(flatten)]
    pub params: Params,
}

/// Parses a JSON body into `T`, turning every failure into a 400 that says what was wrong.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_request("the request body is empty"));
    }
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let c: ChatRequest = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                 "stop":"x","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(chat_messages(&c.messages).unwrap()[0].content, "hi");
        assert_eq!(c.params.stops().unwrap(), vec!["x"]);
        assert!(c.params.stream() && c.params.include_usage());
        for bad in [
            &br#"{"messages": 3}"#[..],
            br#"{"messages":[], "temperature":"hot"}"#,
            br#"[1,2]"#,
            b"\xff\xfe",
            br#"{"prompt": "x", "max_tokens": -1}"#,
            br#"{"prompt": "x", "max_tokens": 1e999}"#,
        ] {
            let r = parse::<ChatRequest>(bad).err().map(|e| e.status.as_u16());
            let r2 = parse::<CompletionRequest>(bad)
                .err()
                .map(|e| e.status.as_u16());
            assert_eq!(
                (r, r2),
                (Some(400), Some(400)),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let p: CompletionRequest = parse(br#"{"prompt":"x","logprobs":2}"#).unwrap();
        assert!(p.params.check_supported().is_err());
        let p: CompletionRequest = parse(br#"{"prompt":"x","logprobs":null,"n":1}"#).unwrap();
        assert!(p.params.check_supported().is_ok());
        let p: CompletionRequest = parse(br#"{"prompt":"x","temperature":1e300}"#).unwrap();
        assert!(p.params.sampling().is_err());
    }
}
