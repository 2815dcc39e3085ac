//! The HTTP routes. Handlers parse and check a request, take admission slots, wait for the
//! model if it is still loading, then drive their [`Run`]s (one per choice) — the only way they
//! touch the engine; streamed answers go through `sse.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api::{
    chat_messages, parse, ChatRequest, CompletionRequest, InvokeRequest, Message, Params, Prompt,
    Route,
};
use super::error::ApiError;
use super::logprobs::{chat_json, completion_json, Entry};
use super::metrics::METRICS;
use super::run::{Asked, Out, Run, Spec, Usage};
use super::sse::{sse, Kind};
use super::state::{App, State as Life, Worker};
use crate::chat::render_chat;
use crate::generate::FinishReason;

pub(crate) type AppState = State<Arc<App>>;
pub(crate) type Body = Result<Bytes, BytesRejection>;

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(crate) fn request_id(prefix: &str) -> String {
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

pub(crate) fn finish_str(r: FinishReason) -> &'static str {
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

pub(crate) fn check_auth(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    if app.authorized(bearer(headers)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

pub(crate) fn body_bytes(b: Body) -> Result<Bytes, ApiError> {
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

/// A request's runs, started: `n` per prompt (or `best_of` candidates), prompt by prompt (the
/// choices' order).
struct Started {
    runs: Vec<Run>,
    /// Runs per prompt.
    n: usize,
    /// Choices per prompt to answer with (fewer than `n`: the likeliest of the candidates).
    keep: usize,
    /// How long the request waited for a load.
    waited: Option<f64>,
    /// With `echo`: each prompt's text, which its choices' outputs start with.
    echo: Vec<Option<String>>,
    /// The request asked for log probabilities.
    logprobs: bool,
}

/// Most engine requests one HTTP request may make (prompts × n).
const MAX_RUNS: usize = 64;

/// How many prompts `input` holds.
fn prompt_count(input: &Input) -> usize {
    match input {
        Input::Prompt(Prompt::Texts(v)) => v.len(),
        Input::Prompt(Prompt::Batch(v)) => v.len(),
        _ => 1,
    }
}

/// Checks, admits and starts a request's generations (`n` per prompt, one admission slot and
/// one engine request each; a prompt's choices share it through the prefix cache).
async fn start(
    app: &Arc<App>,
    arrival: Instant,
    input: Input,
    p: &Params,
    route: Route,
) -> Result<Started, ApiError> {
    p.check_supported()?;
    let logprobs = p.logprobs(route)?;
    let echo = p.echo(route)?;
    let keep = p.choices()?;
    let n = p.candidates(route, keep)?;
    let prompts = prompt_count(&input);
    if prompts == 0 || prompts * n > MAX_RUNS {
        return Err(ApiError::bad_request(format!(
            "{prompts} prompts × n = {n}: give 1 to {MAX_RUNS} generations per request"
        ))
        .param("prompt"));
    }
    if let Some(m) = &p.model {
        if m != &app.served_name && m != &app.opts.model_arg {
            return Err(ApiError::model_not_found(m, &app.served_name));
        }
    }
    let sampling = p.sampling()?;
    let stop = p.stops()?;
    let mut slots = (0..prompts * n)
        .map(|_| app.admit())
        .collect::<Result<Vec<_>, _>>()?;
    let (w, waited) = app.worker().await?;
    let wt = w.clone();
    // Rendering and tokenizing a long prompt is CPU work: keep it off the async workers.
    let json = p.json_mode()?;
    let prompts = tokio::task::spawn_blocking(move || {
        if json {
            wt.json_vocab(); // built once, here off the async workers
        }
        let mut out = Vec::new();
        for (ids, text) in prompt_ids(&wt, input)? {
            // The echoed text: the client's own, or the decoded ids it sent.
            let text = match (echo, text) {
                (false, _) => None,
                (true, Some(t)) => Some(t),
                (true, None) => Some(
                    wt.tok
                        .decode(&ids, false)
                        .map_err(|e| ApiError::bad_request(e.to_string()))?,
                ),
            };
            out.push((ids, text));
        }
        Ok::<_, ApiError>(out)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
    let asked = Asked {
        max_tokens: p.max_new_tokens(),
        sampling,
        stop,
        ignore_eos: p.ignore_eos.unwrap_or(false),
        // Ranking candidates needs each token's log probability, asked for or not.
        logprobs: logprobs.or((n > keep).then_some(0)),
        stop_token_ids: p.stop_token_ids()?,
        min_tokens: p.min_tokens,
        echo,
        json,
    };
    // Every prompt is checked before any starts.
    let mut specs = Vec::with_capacity(prompts.len());
    let mut echoes = Vec::with_capacity(prompts.len() * n);
    for (ids, text) in prompts {
        specs.push(Spec::new(&w, ids, asked.clone())?);
        echoes.extend(std::iter::repeat_n(text, n));
    }
    METRICS.params_n.observe(keep as f64);
    if let Some(s) = specs.first() {
        METRICS.params_max_tokens.observe(s.max_tokens as f64);
    }
    let mut runs = Vec::with_capacity(slots.len());
    for spec in specs {
        for (j, slot) in slots.drain(..n).enumerate() {
            let mut spec = spec.clone();
            // Seeded choices differ from each other and are each reproducible.
            spec.sampling.seed = spec.sampling.seed.map(|s| s.wrapping_add(j as u64));
            runs.push(Run::start(w.clone(), spec, arrival, slot));
        }
    }
    Ok(Started {
        runs,
        n,
        keep,
        waited,
        echo: echoes,
        logprobs: logprobs.is_some(),
    })
}

/// Each prompt's token ids, and its text where the client sent text (not for chat, whose text
/// the template makes).
type Prompts = Vec<(Vec<u32>, Option<String>)>;

fn prompt_ids(w: &Worker, input: Input) -> Result<Prompts, ApiError> {
    let enc = |s: &str| {
        w.tok
            .encode(s, true)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    };
    match input {
        Input::Chat(m) => {
            let msgs = chat_messages(&m)?;
            let text = render_chat(&w.tok, &msgs, true)
                .map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?;
            Ok(vec![(enc(&text)?, None)])
        }
        Input::Prompt(Prompt::Text(s)) => Ok(vec![(enc(&s)?, Some(s))]),
        Input::Prompt(Prompt::Ids(v)) => Ok(vec![(v, None)]),
        Input::Prompt(Prompt::Texts(v)) => v.into_iter().map(|s| Ok((enc(&s)?, Some(s)))).collect(),
        Input::Prompt(Prompt::Batch(v)) => Ok(v.into_iter().map(|ids| (ids, None)).collect()),
    }
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

/// A run's whole output.
struct Whole {
    text: String,
    logprobs: Vec<Entry>,
    /// The generated tokens' log probabilities summed (`best_of`'s ranking), where known.
    score: f64,
    reason: FinishReason,
    usage: Usage,
}

/// Drives a run to its end; its text starts with `echo` (the prompt) where asked.
async fn run_to_end(run: &mut Run, echo: Option<&str>) -> Result<Whole, ApiError> {
    let (mut text, mut logprobs, mut score) = (String::new(), Vec::new(), 0.0);
    while let Some(o) = run.next().await {
        match o {
            Out::Prompt(lp) => {
                text.push_str(echo.unwrap_or(""));
                logprobs.extend(lp);
            }
            Out::Text(t, lp) => {
                text.push_str(&t);
                score += lp.iter().map(|e| e.chosen.logprob).sum::<f64>();
                logprobs.extend(lp);
            }
            Out::Done(reason, usage) => {
                return Ok(Whole {
                    text,
                    logprobs,
                    score,
                    reason,
                    usage,
                })
            }
            Out::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

/// Both OpenAI generation routes: start the run, then stream it or answer in one document.
async fn openai(
    app: &Arc<App>,
    arrival: Instant,
    kind: Kind,
    input: Input,
    p: &Params,
) -> Result<Response, ApiError> {
    let route = match kind {
        Kind::Chat => Route::Chat,
        Kind::Completion => Route::Completions,
    };
    let Started {
        mut runs,
        n,
        keep,
        waited,
        echo,
        logprobs: want_lp,
    } = start(app, arrival, input, p, route).await?;
    let model = app.served_name.clone();
    if p.stream() {
        let mut r = sse(runs, kind, model, p.include_usage(), want_lp, n, echo).into_response();
        cold_headers(&mut r, None, waited);
        return Ok(r);
    }
    let wholes = futures_util::future::join_all(
        runs.iter_mut()
            .zip(&echo)
            .map(|(r, e)| run_to_end(r, e.as_deref())),
    )
    .await;
    let wholes = wholes.into_iter().collect::<Result<Vec<_>, _>>()?;
    // Every candidate's tokens count in the usage; each prompt's `keep` likeliest are answered.
    let usages: Vec<(usize, Usage)> = wholes
        .iter()
        .enumerate()
        .map(|(i, w)| (i / n, w.usage))
        .collect();
    let mut kept = Vec::with_capacity(wholes.len());
    let mut group = Vec::with_capacity(n);
    for w in wholes {
        group.push(w);
        if group.len() == n {
            if keep < n {
                group.sort_by(|a, b| b.score.total_cmp(&a.score));
                group.truncate(keep);
            }
            kept.append(&mut group);
        }
    }
    let mut choices = Vec::with_capacity(kept.len());
    for (index, w) in kept.into_iter().enumerate() {
        let Whole {
            text,
            logprobs,
            reason,
            ..
        } = w;
        choices.push(match kind {
            Kind::Chat => {
                json!({"index": index, "message": {"role": "assistant", "content": text},
                       "logprobs": if want_lp { chat_json(&logprobs) } else { Value::Null },
                       "finish_reason": finish_str(reason)})
            }
            Kind::Completion => json!({"index": index, "text": text,
                   "logprobs": if want_lp { completion_json(&logprobs, &mut 0) } else { Value::Null },
                   "finish_reason": finish_str(reason)}),
        });
    }
    let (id, object) = match kind {
        Kind::Chat => (request_id("chatcmpl"), "chat.completion"),
        Kind::Completion => (request_id("cmpl"), "text_completion"),
    };
    let mut r = Json(json!({
        "id": id, "object": object, "created": unix_now(), "model": model,
        "choices": choices, "usage": Usage::total(&usages).json(),
    }))
    .into_response();
    cold_headers(&mut r, runs[0].queue_s, waited);
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
        if req.params.choices()? != 1 {
            return Err(ApiError::bad_request(
                "/invoke answers with one text; use /v1/chat/completions for n > 1",
            )
            .param("n"));
        }
        if prompt_count(&input) != 1 {
            return Err(ApiError::bad_request("/invoke takes one prompt").param("prompt"));
        }
        let Started {
            mut runs, waited, ..
        } = start(&app, arrival, input, &req.params, Route::Invoke).await?;
        let mut run = runs.swap_remove(0);
        let Whole {
            text,
            reason,
            usage,
            ..
        } = run_to_end(&mut run, None).await?;
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
