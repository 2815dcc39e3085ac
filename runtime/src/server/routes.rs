//! The HTTP routes. Handlers parse and check a request, take an admission slot, wait for the
//! model if it is still loading, then drive one [`Run`] — the only way they touch the engine.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};

use super::api::{
    chat_messages, parse, ChatRequest, CompletionRequest, InvokeRequest, Message, Params, Prompt,
};
use super::error::ApiError;
use super::metrics::METRICS;
use super::run::{Out, Run, Spec, Usage};
use super::state::{App, State as Life};
use crate::chat::render_chat;
use crate::generate::FinishReason;

type AppState = State<Arc<App>>;
type Body = Result<Bytes, BytesRejection>;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // SplitMix64 of (time, counter): unique within the process, unpredictable enough for ids.
    let mut z = t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    format!("{prefix}-{:016x}{:04x}", z ^ (z >> 31), n & 0xffff)
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// The token of an `Authorization: Bearer <token>` header.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
}

fn check_auth(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    if app.authorized(bearer(headers)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

fn body_bytes(b: Body) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(super::MAX_BODY_BYTES.load(Ordering::Relaxed) as usize)
        } else {
            ApiError::bad_request(format!("could not read the body: {}", r.body_text()))
        }
    })
}

enum Input {
    Chat(Vec<Message>),
    Prompt(Prompt),
}

/// Checks, admits and starts one generation; also returns how long it waited for a load.
async fn start(
    app: &Arc<App>,
    arrival: Instant,
    input: Input,
    p: &Params,
) -> Result<(Run, Option<f64>), ApiError> {
    p.check_supported()?;
    if let Some(m) = &p.model {
        if m != &app.served_name && m != &app.opts.model_arg {
            return Err(ApiError::model_not_found(m, &app.served_name));
        }
    }
    let sampling = p.sampling()?;
    let stop = p.stops()?;
    let slot = app.admit()?;
    let (w, waited) = app.worker().await?;
    let wt = w.clone();
    // Rendering and tokenizing a long prompt is CPU work: keep it off the async workers.
    let prompt = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let enc = |s: &str| {
            wt.tok
                .encode(s, true)
                .map_err(|e| ApiError::bad_request(e.to_string()))
        };
        match input {
            Input::Chat(m) => {
                let msgs = chat_messages(&m)?;
                let text = render_chat(&wt.tok, &msgs, true)
                    .map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?;
                enc(&text)
            }
            Input::Prompt(Prompt::Text(s)) => enc(&s),
            Input::Prompt(Prompt::Ids(v)) => Ok(v),
            Input::Prompt(Prompt::Texts(v)) if v.len() == 1 => enc(&v[0]),
            Input::Prompt(Prompt::Batch(mut v)) if v.len() == 1 => Ok(v.swap_remove(0)),
            Input::Prompt(_) => {
                Err(ApiError::bad_request("exactly one prompt per request").param("prompt"))
            }
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
    let spec = Spec::new(
        &w,
        prompt,
        p.max_new_tokens(),
        sampling,
        stop,
        p.ignore_eos.unwrap_or(false),
    )?;
    Ok((Run::start(w, spec, arrival, slot), waited))
}

/// Headers that tell a client its request waited for a cold start (and how long).
fn cold_headers(resp: &mut Response, run_queue_s: Option<f64>, waited: Option<f64>) {
    let h = resp.headers_mut();
    h.insert(
        "x-thaw-cold-start",
        HeaderValue::from_static(if waited.is_some() { "true" } else { "false" }),
    );
    if let Some(q) = run_queue_s {
        if let Ok(v) = HeaderValue::from_str(&format!("{:.1}", q * 1e3)) {
            h.insert("x-thaw-queue-ms", v);
        }
    }
    if let Some(l) = waited {
        if let Ok(v) = HeaderValue::from_str(&format!("{:.1}", l * 1e3)) {
            h.insert("x-thaw-load-ms", v);
        }
    }
}

/// Drives a run to its end: the whole text, the reason and usage.
async fn run_to_end(run: &mut Run) -> Result<(String, FinishReason, Usage), ApiError> {
    let mut text = String::new();
    while let Some(o) = run.next().await {
        match o {
            Out::Text(t) => text.push_str(&t),
            Out::Done(r, u) => return Ok((text, r, u)),
            Out::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// Builds the JSON of OpenAI stream chunks for one request.
struct Chunker {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Chunker {
    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }

    fn chunk(&self, text: Option<&str>, finish: Option<&str>, role: bool) -> SseEvent {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
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

struct StreamState {
    run: Run,
    queue: std::collections::VecDeque<SseEvent>,
    done: bool,
    chunker: Chunker,
    include_usage: bool,
}

/// An SSE stream of OpenAI chunks ending with `data: [DONE]`. Dropping it (the client went
/// away) drops the run, which cancels the request in the engine and frees its KV blocks.
fn sse(
    run: Run,
    kind: Kind,
    model: String,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let chunker = Chunker {
        kind,
        id: request_id(if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        created: unix_now(),
        model,
    };
    let mut queue = std::collections::VecDeque::new();
    if kind == Kind::Chat {
        queue.push_back(chunker.chunk(Some(""), None, true));
    }
    let st = StreamState {
        run,
        queue,
        done: false,
        chunker,
        include_usage,
    };
    Sse::new(stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            match st.run.next().await {
                Some(Out::Text(t)) => st.queue.push_back(st.chunker.chunk(Some(&t), None, false)),
                Some(Out::Done(r, u)) => {
                    let c = st.chunker.chunk(None, Some(finish_str(r)), false);
                    st.queue.push_back(c);
                    if st.include_usage {
                        let c = st.chunker.usage(&u);
                        st.queue.push_back(c);
                    }
                    st.queue.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                Some(Out::Error(e)) => {
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

/// Both OpenAI generation routes: start the run, then stream it or answer in one document.
async fn openai(
    app: &Arc<App>,
    arrival: Instant,
    kind: Kind,
    input: Input,
    p: &Params,
) -> Result<Response, ApiError> {
    let (mut run, waited) = start(app, arrival, input, p).await?;
    let model = app.served_name.clone();
    if p.stream() {
        let mut r = sse(run, kind, model, p.include_usage()).into_response();
        cold_headers(&mut r, None, waited);
        return Ok(r);
    }
    let (text, reason, usage) = run_to_end(&mut run).await?;
    let (id, object, choice) = match kind {
        Kind::Chat => (
            request_id("chatcmpl"),
            "chat.completion",
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": finish_str(reason)}),
        ),
        Kind::Completion => (
            request_id("cmpl"),
            "text_completion",
            json!({"index": 0, "text": text, "logprobs": null,
                   "finish_reason": finish_str(reason)}),
        ),
    };
    let mut r = Json(json!({
        "id": id, "object": object, "created": unix_now(), "model": model,
        "choices": [choice], "usage": usage.json(),
    }))
    .into_response();
    cold_headers(&mut r, run.queue_s, waited);
    Ok(r)
}

pub async fn chat_completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    let r = async {
        check_auth(&app, &headers)?;
        let req: ChatRequest = parse(&body_bytes(body)?)?;
        openai(
            &app,
            arrival,
            Kind::Chat,
            Input::Chat(req.messages),
            &req.params,
        )
        .await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

pub async fn completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    let r = async {
        check_auth(&app, &headers)?;
        let req: CompletionRequest = parse(&body_bytes(body)?)?;
        let input = Input::Prompt(req.prompt);
        openai(&app, arrival, Kind::Completion, input, &req.params).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /invoke`: the function-invocation entry point. One JSON answer with the text, token
/// counts and where the time went; `cold_start` says this request waited for a model load.
pub async fn invoke(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    let r = async {
        check_auth(&app, &headers)?;
        let req: InvokeRequest = parse(&body_bytes(body)?)?;
        if req.params.stream() {
            return Err(ApiError::bad_request(
                "/invoke answers in one JSON document; use /v1/chat/completions to stream",
            )
            .param("stream"));
        }
        let input = match (req.messages, req.prompt) {
            (Some(m), None) => Input::Chat(m),
            (None, Some(p)) => Input::Prompt(p),
            _ => {
                return Err(ApiError::bad_request(
                    "give exactly one of 'prompt' or 'messages'",
                ))
            }
        };
        let (mut run, waited) = start(&app, arrival, input, &req.params).await?;
        let (text, reason, usage) = run_to_end(&mut run).await?;
        let ms = |s: f64| (s * 1e4).round() / 10.0;
        let ttft = run.first.map(|t| ms((t - run.arrival).as_secs_f64()));
        let queue_ms = ms(run.queue_s.unwrap_or(0.0));
        let total_ms = ms(run.arrival.elapsed().as_secs_f64());
        let load_ms = waited.map(ms);
        let phases = if waited.is_some() {
            app.cold_start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(|c| c.json())
        } else {
            None
        };
        let mut resp = Json(json!({
            "id": request_id("inv"),
            "model": app.served_name,
            "text": text,
            "finish_reason": finish_str(reason),
            "usage": usage.json(),
            "timings": {
                "queue_ms": queue_ms,
                "load_ms": load_ms,
                "ttft_ms": ttft,
                "total_ms": total_ms,
            },
            "cold_start": waited.is_some(),
            "cold_start_phases": phases,
        }))
        .into_response();
        cold_headers(&mut resp, run.queue_s, waited);
        Ok(resp)
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

pub async fn models(State(app): AppState, headers: HeaderMap) -> Response {
    if let Err(e) = check_auth(&app, &headers) {
        return e.into_response();
    }
    let created = unix_now() - app.started.elapsed().as_secs();
    Json(json!({"object": "list", "data": [{
        "id": app.served_name, "object": "model", "created": created, "owned_by": "thaw",
        "max_model_len": app.loaded().map(|w| w.max_seq),
    }]}))
    .into_response()
}

/// 200 while the process can serve (or is still loading); 503 if the engine thread died, so
/// the platform replaces the replica.
pub async fn health(State(app): AppState) -> Response {
    match app.loaded() {
        Some(w) if !w.engine.is_alive() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine stopped"})),
        )
            .into_response(),
        _ => Json(json!({"status": "ok"})).into_response(),
    }
}

/// 200 once the model is loaded and warmed up; 503 with the state otherwise.
pub async fn ready(State(app): AppState) -> Response {
    let s = app.state();
    let body = json!({"state": s.as_str(), "inflight": app.inflight()});
    if s == Life::Ready {
        Json(body).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

pub async fn metrics(State(app): AppState) -> Response {
    if let Some(w) = app.loaded() {
        METRICS.observe_engine(&w.engine.stats());
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        METRICS.render(),
    )
        .into_response()
}

pub async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}
