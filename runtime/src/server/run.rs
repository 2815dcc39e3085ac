//! One request inside the engine, seen from the server: engine events in, visible text out, and
//! every per-request metric recorded on the way (TTFT, inter-token latency, queue time, E2E,
//! token counters, success by finish reason — `abort` when the client went away first).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::error::ApiError;
use super::logprobs::Entry;
use super::metrics::METRICS;
use super::state::{Admission, Worker};
use crate::engine::{Event, EventStream, Request};
use crate::generate::FinishReason;
use crate::sampling::SamplingParams;
use crate::textstream::{Delta, TextStream};

/// A checked generation request.
#[derive(Clone)]
pub struct Spec {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Alternatives per token to report log probabilities for (`None`: none).
    pub logprobs: Option<usize>,
    /// Ids that end the output besides EOS (they do also with `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// EOS and the stop ids cannot come before this many tokens.
    pub min_tokens: usize,
    /// The output starts with the prompt ([`Out::Prompt`]); with `logprobs`, scored.
    pub echo: bool,
    /// The output is held to a JSON object (and ends when it closes).
    pub json: bool,
}

/// What a request asks for besides its prompt (parsed from the body, checked by [`Spec::new`]).
#[derive(Clone)]
pub struct Asked {
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub logprobs: Option<usize>,
    pub stop_token_ids: Vec<u32>,
    pub min_tokens: Option<u64>,
    pub echo: bool,
    pub json: bool,
}

impl Spec {
    /// Checks `prompt`, biased ids and the limit against the model's vocabulary and context.
    pub fn new(w: &Worker, prompt: Vec<u32>, asked: Asked) -> Result<Spec, ApiError> {
        let Asked {
            max_tokens,
            sampling,
            stop,
            ignore_eos,
            logprobs,
            stop_token_ids,
            min_tokens,
            echo,
            json,
        } = asked;
        if prompt.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
        }
        let vocab = w.model_cfg.vocab_size;
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            ))
            .param("prompt"));
        }
        if let Some(t) = stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(format!(
                "stop_token_ids names token {t}, outside the vocabulary ({vocab})"
            ))
            .param("stop_token_ids"));
        }
        if let Some((t, _)) = sampling
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= vocab)
        {
            return Err(ApiError::bad_request(format!(
                "logit_bias names token {t}, outside the vocabulary ({vocab})"
            ))
            .param("logit_bias"));
        }
        let limit = w.max_seq;
        if prompt.len() >= limit {
            return Err(ApiError::context(format!(
                "the prompt has {} tokens; this worker's limit for prompt + output is {limit}",
                prompt.len()
            )));
        }
        let max_tokens = match max_tokens {
            // Echoing the prompt (and scoring it) without generating: what evaluation
            // harnesses ask for.
            Some(0) if echo => 0,
            Some(0) => {
                return Err(
                    ApiError::bad_request("max_tokens must be at least 1").param("max_tokens")
                )
            }
            Some(m) if (prompt.len() as u64).saturating_add(m) > limit as u64 => {
                return Err(ApiError::context(format!(
                    "prompt ({} tokens) + max_tokens ({m}) exceed this worker's limit of {limit}",
                    prompt.len()
                )))
            }
            Some(m) => m as usize,
            None => (limit - prompt.len()).min(w.default_max_tokens.unwrap_or(usize::MAX)),
        };
        Ok(Spec {
            prompt,
            max_tokens,
            sampling,
            stop,
            ignore_eos,
            logprobs,
            stop_token_ids,
            echo,
            json,
            min_tokens: match min_tokens {
                Some(m) if m > max_tokens as u64 => {
                    return Err(ApiError::bad_request(format!(
                        "min_tokens ({m}) is more than max_tokens ({max_tokens})"
                    ))
                    .param("min_tokens"))
                }
                m => m.unwrap_or(0) as usize,
            },
        })
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    /// A request's usage from its choices' (prompt index, usage): each prompt counts once
    /// however many choices share it (its cached tokens: the most any of them found),
    /// completions add up.
    pub fn total(choices: &[(usize, Usage)]) -> Usage {
        let mut per_prompt: std::collections::BTreeMap<usize, Usage> = Default::default();
        let mut completion_tokens = 0;
        for (p, u) in choices {
            completion_tokens += u.completion_tokens;
            let e = per_prompt.entry(*p).or_default();
            e.prompt_tokens = u.prompt_tokens;
            e.cached_tokens = e.cached_tokens.max(u.cached_tokens);
        }
        Usage {
            prompt_tokens: per_prompt.values().map(|u| u.prompt_tokens).sum(),
            completion_tokens,
            cached_tokens: per_prompt.values().map(|u| u.cached_tokens).sum(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

pub enum Out {
    /// With `echo`, before anything else: the prompt's log probabilities when asked for (the
    /// first token unscored), else nothing; the caller has the prompt's text.
    Prompt(Vec<Entry>),
    /// Visible text, and the log probabilities of the tokens it completes when asked for
    /// (text is empty only when it carries the last tokens' log probabilities).
    Text(String, Vec<Entry>),
    Done(FinishReason, Usage),
    Error(String),
}

pub struct Run {
    worker: Arc<Worker>,
    events: Option<EventStream>,
    text: TextStream,
    prompt_tokens: usize,
    pub arrival: Instant,
    pub first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    pub queue_s: Option<f64>,
    pending: VecDeque<Out>,
    /// Log probabilities of tokens whose text is not out yet (held back or incomplete).
    logprobs: Vec<Entry>,
    /// With `echo`: the prompt's entries gathered so far, until [`Out::Prompt`] is out.
    echo: Option<Vec<Entry>>,
    /// No more engine events will be read.
    ended: bool,
    /// The outcome is in the metrics.
    recorded: bool,
    slot: Admission,
}

impl Run {
    pub fn start(worker: Arc<Worker>, spec: Spec, arrival: Instant, slot: Admission) -> Run {
        let prompt_tokens = spec.prompt.len();
        let prompt_first = spec.prompt[0];
        // The engine's `ignore_eos` ignores all its stop ids; stop_token_ids must still stop.
        let mut stop_ids = if spec.ignore_eos {
            vec![]
        } else {
            worker.eos.clone()
        };
        stop_ids.extend(&spec.stop_token_ids);
        let events = worker.engine.submit(Request {
            prompt: spec.prompt,
            max_tokens: spec.max_tokens,
            sampling: spec.sampling,
            stop_ids,
            ignore_eos: false,
            logprobs: spec.logprobs,
            min_tokens: spec.min_tokens,
            prompt_logprobs: spec.logprobs.filter(|_| spec.echo),
            constraint: spec.json.then(|| {
                Box::new(crate::json_mode::JsonObject::new(worker.json_vocab()))
                    as Box<dyn crate::engine::Constraint>
            }),
        });
        let echo = spec.echo.then(|| match spec.logprobs {
            Some(_) => vec![Entry::unscored(&worker.tok, prompt_first)],
            None => vec![],
        });
        Run {
            worker,
            events: Some(events),
            text: TextStream::new(spec.stop),
            prompt_tokens,
            arrival,
            first: None,
            last: None,
            tokens: 0,
            queue_s: None,
            pending: VecDeque::new(),
            logprobs: Vec::new(),
            echo,
            ended: false,
            recorded: false,
            slot,
        }
    }

    fn finish(&mut self, reason: FinishReason, cached: usize) -> Out {
        self.ended = true;
        self.recorded = true;
        self.events = None; // cancels the request if it was a stop string
        let m = &*METRICS;
        let end = self.last.unwrap_or_else(Instant::now);
        m.e2e.observe((end - self.arrival).as_secs_f64());
        if let Some(q) = self.queue_s {
            m.queue.observe(q);
        }
        m.prompt_tokens.inc_by(self.prompt_tokens as u64);
        let reason_label = match reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        };
        m.success.with_label_values(&[reason_label]).inc();
        Out::Done(
            reason,
            Usage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.tokens,
                cached_tokens: cached,
            },
        )
    }

    /// The next piece of output; `None` after `Done` or `Error`.
    pub async fn next(&mut self) -> Option<Out> {
        loop {
            if let Some(o) = self.pending.pop_front() {
                return Some(o);
            }
            if self.ended {
                return None;
            }
            let ev = match self.events.as_mut() {
                Some(e) => e.next().await,
                None => None,
            };
            match ev {
                Some(Event::PromptLogprobs(v)) => {
                    if let Some(e) = self.echo.as_mut() {
                        e.extend(
                            v.iter()
                                .map(|(id, lp)| Entry::new(&self.worker.tok, *id, lp)),
                        );
                    }
                }
                Some(Event::Token { id, logprobs }) => {
                    self.echo_prompt();
                    let now = Instant::now();
                    match self.last {
                        None => {
                            METRICS.ttft.observe((now - self.arrival).as_secs_f64());
                            self.slot.app().first_token_seen();
                        }
                        Some(prev) => METRICS.itl.observe((now - prev).as_secs_f64()),
                    }
                    self.first.get_or_insert(now);
                    self.last = Some(now);
                    self.tokens += 1;
                    METRICS.generation_tokens.inc();
                    if let Some(lp) = logprobs {
                        self.logprobs.push(Entry::new(&self.worker.tok, id, &lp));
                    }
                    match self.text.push(&self.worker.tok, id) {
                        Ok(Delta::Text(t)) => {
                            if !t.is_empty() {
                                self.emit(t);
                            }
                        }
                        Ok(Delta::Stop(t)) => {
                            self.emit(t);
                            let done = self.finish(FinishReason::Stop, 0);
                            self.pending.push_back(done);
                        }
                        Err(e) => self.fail(e.to_string()),
                    }
                }
                Some(Event::Finished {
                    reason,
                    cached_tokens,
                    queue_s,
                    ..
                }) => {
                    self.queue_s = Some(queue_s);
                    self.echo_prompt();
                    let tail = self.text.finish();
                    self.emit(tail);
                    let done = self.finish(reason, cached_tokens);
                    self.pending.push_back(done);
                }
                Some(Event::Error(e)) => self.fail(e),
                None => self.fail("the engine stopped".into()),
            }
        }
    }

    /// Queues the echoed prompt's output, once, before the first token's.
    fn echo_prompt(&mut self) {
        if let Some(e) = self.echo.take() {
            self.pending.push_back(Out::Prompt(e));
        }
    }

    /// Queues `text` with the log probabilities gathered so far (nothing if both are empty).
    fn emit(&mut self, text: String) {
        if !text.is_empty() || !self.logprobs.is_empty() {
            let lp = std::mem::take(&mut self.logprobs);
            self.pending.push_back(Out::Text(text, lp));
        }
    }

    fn fail(&mut self, e: String) {
        self.ended = true;
        self.recorded = true;
        self.events = None;
        METRICS.failure.with_label_values(&["engine_error"]).inc();
        self.pending.push_back(Out::Error(e));
    }

    /// All visible text so far.
    pub fn text(&self) -> &str {
        self.text.text()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.recorded {
            // The client went away (or the handler gave up) before the end.
            METRICS.success.with_label_values(&["abort"]).inc();
        }
    }
}
