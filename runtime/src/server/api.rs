//! The OpenAI request bodies this worker accepts, and their checks. Parameters it cannot honour
//! (tools, chat's echo, JSON schemas, ...) are refused with a 400 that names them, never silently ignored;
//! fields that change nothing about the output (`user`, `metadata`) are accepted. Log
//! probabilities take each API's own form: chat's `logprobs: true` + `top_logprobs: 0..=20`,
//! completions' `logprobs: 0..=20`.

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use crate::chat::ChatMessage;
use crate::engine::MAX_TOP_LOGPROBS;
use crate::sampling::SamplingParams;

/// Choices per request (`n`): each is a sequence in the engine and an admission slot.
pub const MAX_CHOICES: u64 = 16;

/// OpenAI allows 300 biased tokens per request.
const MAX_LOGIT_BIAS: usize = 300;

/// The route a request came by: fields the routes read differently (`logprobs`) or only some
/// take (`echo`, `best_of`) are checked against it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Route {
    /// `/v1/chat/completions`: `logprobs: true`, `top_logprobs: k`.
    Chat,
    /// `/v1/completions`: `logprobs: k`, `echo`, `best_of`.
    Completions,
    /// `/invoke`: no log probabilities.
    Invoke,
}

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
    // vLLM's extensions.
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<u64>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// Chat: a boolean; completions: how many alternatives (checked by [`Params::logprobs`]).
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub logit_bias: Option<Value>,
    /// `text` or `json_object` ([`Params::json_mode`]).
    pub response_format: Option<Value>,
    /// Completions only ([`Params::echo`], [`Params::candidates`]).
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    // Refused when set to anything that would change the answer.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub suffix: Option<Value>,
}

/// A field that is present and not `null`.
fn set(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
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
        if truthy(&self.tools) || truthy(&self.tool_choice) {
            return unsupported("tools", "tool calling");
        }
        if truthy(&self.suffix) {
            return unsupported("suffix", "suffix");
        }
        self.json_mode()?;
        Ok(())
    }

    /// Whether the output must be a JSON object (`response_format: {"type": "json_object"}`;
    /// `text` or none: free text; JSON schemas are refused).
    pub fn json_mode(&self) -> Result<bool, ApiError> {
        let Some(rf) = set(&self.response_format) else {
            return Ok(false);
        };
        match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => Ok(false),
            Some("json_object") => Ok(true),
            _ => Err(ApiError::bad_request(format!(
                "response_format must be {{\"type\": \"text\"}} or {{\"type\": \"json_object\"}} \
                 (JSON schemas are not supported), got {rf}"
            ))
            .param("response_format")),
        }
    }

    /// Whether the output starts with the prompt (`echo`: the completions API only; with
    /// `logprobs`, the prompt's tokens are scored too).
    pub fn echo(&self, route: Route) -> Result<bool, ApiError> {
        match (self.echo.unwrap_or(false), route) {
            (false, _) | (true, Route::Completions) => Ok(self.echo.unwrap_or(false)),
            (true, _) => {
                Err(ApiError::bad_request("echo is taken by /v1/completions only").param("echo"))
            }
        }
    }

    /// How many choices to generate (`n`, 1 to [`MAX_CHOICES`]).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => Ok(n as usize),
            n => Err(
                ApiError::bad_request(format!("n must be from 1 to {MAX_CHOICES}, got {n}"))
                    .param("n"),
            ),
        }
    }

    /// How many candidates each prompt gets (`best_of`, the completions API's: from `n` up to
    /// [`MAX_CHOICES`]; the `n` likeliest are returned, so it cannot stream when larger).
    pub fn candidates(&self, route: Route, n: usize) -> Result<usize, ApiError> {
        let bad = |m: String| Err(ApiError::bad_request(m).param("best_of"));
        match self.best_of {
            None => Ok(n),
            Some(b) if route != Route::Completions && b as usize != n => {
                bad("best_of is taken by /v1/completions only".into())
            }
            Some(b) if (b as usize) < n || b > MAX_CHOICES => bad(format!(
                "best_of must be from n ({n}) to {MAX_CHOICES}, got {b}"
            )),
            Some(b) if b as usize > n && self.stream() => {
                bad("best_of larger than n cannot stream (the best are known at the end)".into())
            }
            Some(b) => Ok(b as usize),
        }
    }

    /// How many alternatives' log probabilities each generated token should carry (`None`: no
    /// log probabilities), read the way `route`'s API defines the fields.
    pub fn logprobs(&self, route: Route) -> Result<Option<usize>, ApiError> {
        let bad = |p: &'static str, m: String| ApiError::bad_request(m).param(p);
        let count = |p: &'static str, v: &Value| match v.as_u64() {
            Some(k) if k as usize <= MAX_TOP_LOGPROBS => Ok(k as usize),
            _ => Err(bad(
                p,
                format!("{p} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
            )),
        };
        match route {
            Route::Chat => {
                let on = match set(&self.logprobs) {
                    None => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(bad(
                            "logprobs",
                            format!("logprobs must be a boolean, got {v}"),
                        ))
                    }
                };
                let top = set(&self.top_logprobs)
                    .map(|v| count("top_logprobs", v))
                    .transpose()?;
                match (on, top) {
                    (false, Some(_)) => Err(bad(
                        "top_logprobs",
                        "top_logprobs needs logprobs: true".to_string(),
                    )),
                    (false, None) => Ok(None),
                    (true, top) => Ok(Some(top.unwrap_or(0))),
                }
            }
            Route::Completions => {
                if set(&self.top_logprobs).is_some() {
                    return Err(bad(
                        "top_logprobs",
                        "completions take logprobs: N (top_logprobs is chat's)".to_string(),
                    ));
                }
                set(&self.logprobs)
                    .map(|v| count("logprobs", v))
                    .transpose()
            }
            Route::Invoke => {
                if truthy(&self.logprobs) || truthy(&self.top_logprobs) {
                    return Err(bad(
                        "logprobs",
                        "logprobs are given by /v1/chat/completions and /v1/completions".into(),
                    ));
                }
                Ok(None)
            }
        }
    }

    /// `logit_bias`: token id (a string key, as JSON objects have) → a value in [-100, 100].
    /// Ids are checked against the vocabulary once the model is known (`Spec::new`).
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let bad = |m: String| Err(ApiError::bad_request(m).param("logit_bias"));
        let map = match &self.logit_bias {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Object(m)) => m,
            Some(v) => {
                return bad(format!(
                    "logit_bias must be an object of token id → bias, got {v}"
                ))
            }
        };
        if map.len() > MAX_LOGIT_BIAS {
            return bad(format!("at most {MAX_LOGIT_BIAS} logit_bias entries"));
        }
        let mut out = Vec::with_capacity(map.len());
        for (k, v) in map {
            let Ok(id) = k.trim().parse::<u32>() else {
                return bad(format!("logit_bias keys must be token ids, got '{k}'"));
            };
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => out.push((id, b as f32)),
                _ => {
                    return bad(format!(
                        "logit_bias values must be numbers in [-100, 100], got {v}"
                    ))
                }
            }
        }
        out.sort_unstable_by_key(|e| e.0);
        Ok(out)
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
            logit_bias: self.logit_bias()?,
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
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

    /// Token ids that end the output besides EOS (vLLM's `stop_token_ids`; ids are checked
    /// against the vocabulary in `Spec::new`).
    pub fn stop_token_ids(&self) -> Result<Vec<u32>, ApiError> {
        let ids = self.stop_token_ids.clone().unwrap_or_default();
        if ids.len() > 64 {
            return Err(ApiError::bad_request("at most 64 stop_token_ids").param("stop_token_ids"));
        }
        Ok(ids)
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
        let p: CompletionRequest = parse(br#"{"prompt":"x","logprobs":null,"n":1}"#).unwrap();
        assert!(p.params.check_supported().is_ok());
        let p: CompletionRequest = parse(br#"{"prompt":"x","n":3}"#).unwrap();
        assert_eq!(p.params.choices().ok(), Some(3));
        for bad in [r#"{"prompt":"x","n":0}"#, r#"{"prompt":"x","n":17}"#] {
            let p: CompletionRequest = parse(bad.as_bytes()).unwrap();
            assert!(p.params.choices().is_err(), "{bad}");
        }
        let cands = |body: &str, form| {
            let p: CompletionRequest = parse(body.as_bytes()).unwrap();
            p.params.candidates(form, p.params.choices().unwrap()).ok()
        };
        let c = Route::Completions;
        assert_eq!(cands(r#"{"prompt":"x","best_of":3,"n":2}"#, c), Some(3));
        assert_eq!(cands(r#"{"prompt":"x","n":2}"#, c), Some(2));
        for bad in [
            r#"{"prompt":"x","best_of":1,"n":2}"#,
            r#"{"prompt":"x","best_of":17}"#,
            r#"{"prompt":"x","best_of":2,"stream":true}"#,
        ] {
            assert_eq!(cands(bad, c), None, "{bad}");
        }
        assert_eq!(cands(r#"{"prompt":"x","best_of":2}"#, Route::Chat), None);
        let p: CompletionRequest = parse(br#"{"prompt":"x","temperature":1e300}"#).unwrap();
        assert!(p.params.sampling().is_err());
    }

    #[test]
    fn logprobs_in_each_apis_form() {
        use Route::*;
        let lp = |body: &str, form| {
            parse::<CompletionRequest>(body.as_bytes())
                .unwrap()
                .params
                .logprobs(form)
                .map_err(|e| e.status.as_u16())
        };
        assert_eq!(lp(r#"{"prompt":"x"}"#, Chat), Ok(None));
        assert_eq!(lp(r#"{"prompt":"x","logprobs":true}"#, Chat), Ok(Some(0)));
        assert_eq!(
            lp(r#"{"prompt":"x","logprobs":true,"top_logprobs":5}"#, Chat),
            Ok(Some(5))
        );
        assert_eq!(lp(r#"{"prompt":"x","logprobs":false}"#, Chat), Ok(None));
        for bad in [
            r#"{"prompt":"x","top_logprobs":5}"#,
            r#"{"prompt":"x","logprobs":true,"top_logprobs":21}"#,
            r#"{"prompt":"x","logprobs":true,"top_logprobs":-1}"#,
            r#"{"prompt":"x","logprobs":3}"#,
        ] {
            assert_eq!(lp(bad, Chat), Err(400), "{bad}");
        }
        assert_eq!(
            lp(r#"{"prompt":"x","logprobs":3}"#, Completions),
            Ok(Some(3))
        );
        assert_eq!(
            lp(r#"{"prompt":"x","logprobs":0}"#, Completions),
            Ok(Some(0))
        );
        assert_eq!(
            lp(r#"{"prompt":"x","logprobs":null}"#, Completions),
            Ok(None)
        );
        for bad in [
            r#"{"prompt":"x","logprobs":true}"#,
            r#"{"prompt":"x","logprobs":2.5}"#,
            r#"{"prompt":"x","logprobs":99}"#,
            r#"{"prompt":"x","logprobs":1,"top_logprobs":1}"#,
        ] {
            assert_eq!(lp(bad, Completions), Err(400), "{bad}");
        }
        assert_eq!(lp(r#"{"prompt":"x","logprobs":2}"#, Invoke), Err(400));
        assert_eq!(lp(r#"{"prompt":"x","logprobs":false}"#, Invoke), Ok(None));
    }

    #[test]
    fn logit_bias_parses_and_refuses() {
        let bias = |body: &str| {
            parse::<CompletionRequest>(body.as_bytes())
                .unwrap()
                .params
                .sampling()
                .map(|s| s.logit_bias)
                .map_err(|e| e.status.as_u16())
        };
        assert_eq!(
            bias(r#"{"prompt":"x","logit_bias":{"50":-100,"7":2.5}}"#),
            Ok(vec![(7, 2.5), (50, -100.0)])
        );
        assert_eq!(bias(r#"{"prompt":"x","logit_bias":null}"#), Ok(vec![]));
        for bad in [
            r#"{"prompt":"x","logit_bias":{"a":1}}"#,
            r#"{"prompt":"x","logit_bias":{"-3":1}}"#,
            r#"{"prompt":"x","logit_bias":{"3":101}}"#,
            r#"{"prompt":"x","logit_bias":{"3":"1"}}"#,
            r#"{"prompt":"x","logit_bias":[1,2]}"#,
        ] {
            assert_eq!(bias(bad), Err(400), "{bad}");
        }
    }
}
