//! OpenAI streaming: a request's choices as one SSE stream of chunks in the chat or the
//! completions form (deltas with their log probabilities, a finish chunk per choice, the usage
//! when asked for, then `data: [DONE]`), in whatever order the choices' tokens come.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};

use super::error::ApiError;
use super::logprobs::{chat_json, completion_json, Entry};
use super::routes::{finish_str, request_id, unix_now};
use super::run::{Out, Run, Usage};

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// Builds the JSON of OpenAI stream chunks for one request.
struct Chunker {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// Whether the request asked for log probabilities (`null` otherwise).
    logprobs: bool,
    /// Characters of each choice's completion text so far (the completions form's
    /// `text_offset`).
    offsets: Vec<usize>,
}

impl Chunker {
    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }

    /// `logprobs` as this API writes them (`null` when not asked for).
    fn logprobs(&mut self, index: usize, entries: &[Entry]) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Chat) => chat_json(entries),
            (true, Kind::Completion) => completion_json(entries, &mut self.offsets[index]),
        }
    }

    fn chunk(
        &mut self,
        index: usize,
        text: Option<&str>,
        finish: Option<&str>,
        role: bool,
        entries: &[Entry],
    ) -> SseEvent {
        // Chunks without tokens (the role, the finish) carry no log probabilities.
        let lp = if entries.is_empty() {
            Value::Null
        } else {
            self.logprobs(index, entries)
        };
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
            }
        };
        self.event(json!([choice]), None)
    }

    fn usage(&self, u: &Usage) -> SseEvent {
        self.event(json!([]), Some(u.json()))
    }

    fn event(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut v = json!({"id": self.id, "object": self.object(), "created": self.created,
                           "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    }
}

/// A request's choices as one stream of (choice index, output), in whatever order they come.
type Outputs = stream::SelectAll<std::pin::Pin<Box<dyn Stream<Item = (usize, Out)> + Send>>>;

fn outputs(runs: Vec<Run>) -> Outputs {
    stream::select_all(runs.into_iter().enumerate().map(|(i, run)| {
        let s = stream::unfold(run, move |mut run| async move {
            run.next().await.map(|o| ((i, o), run))
        });
        Box::pin(s) as std::pin::Pin<Box<dyn Stream<Item = (usize, Out)> + Send>>
    }))
}

struct StreamState {
    outputs: Outputs,
    queue: std::collections::VecDeque<SseEvent>,
    done: bool,
    chunker: Chunker,
    include_usage: bool,
    /// Choices still generating, and the (prompt, usage) of those that finished.
    open: usize,
    usages: Vec<(usize, Usage)>,
    /// Choices per prompt.
    n: usize,
    /// Each choice's prompt text, with `echo`.
    echo: Vec<Option<String>>,
}

/// An SSE stream of OpenAI chunks ending with `data: [DONE]`. Dropping it (the client went
/// away) drops the runs, which cancels their requests in the engine and frees their KV blocks.
pub(crate) fn sse(
    runs: Vec<Run>,
    kind: Kind,
    model: String,
    include_usage: bool,
    logprobs: bool,
    n: usize,
    echo: Vec<Option<String>>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let mut chunker = Chunker {
        kind,
        id: request_id(if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        created: unix_now(),
        model,
        logprobs,
        offsets: vec![0; runs.len()],
    };
    let mut queue = std::collections::VecDeque::new();
    if kind == Kind::Chat {
        for i in 0..runs.len() {
            queue.push_back(chunker.chunk(i, Some(""), None, true, &[]));
        }
    }
    let st = StreamState {
        open: runs.len(),
        outputs: outputs(runs),
        queue,
        done: false,
        chunker,
        include_usage,
        usages: Vec::new(),
        n,
        echo,
    };
    Sse::new(stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            match st.outputs.next().await {
                Some((i, Out::Prompt(lp))) => {
                    let text = st.echo[i].clone().unwrap_or_default();
                    let c = st.chunker.chunk(i, Some(&text), None, false, &lp);
                    st.queue.push_back(c)
                }
                Some((i, Out::Text(t, lp))) => {
                    let c = st.chunker.chunk(i, Some(&t), None, false, &lp);
                    st.queue.push_back(c)
                }
                Some((i, Out::Done(r, u))) => {
                    let c = st.chunker.chunk(i, None, Some(finish_str(r)), false, &[]);
                    st.queue.push_back(c);
                    st.usages.push((i / st.n, u));
                    st.open -= 1;
                    if st.open == 0 {
                        if st.include_usage {
                            let c = st.chunker.usage(&Usage::total(&st.usages));
                            st.queue.push_back(c);
                        }
                        st.queue.push_back(SseEvent::default().data("[DONE]"));
                        st.done = true;
                    }
                }
                Some((_, Out::Error(e))) => {
                    let body = ApiError::internal(e).body().to_string();
                    st.queue.push_back(SseEvent::default().data(body));
                    st.queue.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                None => st.done = true,
            }
        }
    }))
}
