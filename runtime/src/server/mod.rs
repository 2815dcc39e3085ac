//! `thaw serve`: the HTTP worker (tokio + axum on hyper).
//!
//! * **One narrow seam to the engine.** Handlers never see the scheduler: a request becomes a
//!   [`run::Run`] (submit, then a stream of events), and SSE bodies are streams over it, so a
//!   client that disconnects drops its run, which cancels the request and frees its KV blocks.
//! * **Bind first, load after.** The port is listening before the weights are read; `/health`
//!   answers at once, `/ready` turns 200 only after the load and a warmup request, and requests
//!   that arrive meanwhile wait in the bounded admission queue (`cold_start: true` on /invoke).
//! * **Bounded.** At most `max_running + max_waiting` requests are admitted; beyond that a 429
//!   with Retry-After, so a burst costs memory in proportion to the bound, not the burst.
//! * **Drain.** SIGTERM/SIGINT: new requests get 503 (with `Connection: close`), in-flight ones
//!   finish (up to `--drain-timeout`), then the process exits 0 — what Kubernetes and Knative
//!   expect. The port closes without resetting a connection the kernel already accepted
//!   ([`listener`]).
//! * Errors are OpenAI-shaped ([`error::ApiError`]); metrics are defined in [`metrics`] only.

pub mod admin;
pub mod api;
mod backend;
pub mod error;
mod listener;
pub mod logprobs;
pub mod metrics;
pub mod routes;
pub mod run;
mod sse;
pub mod state;
pub mod telemetry;
mod tokenize;
pub mod webhook;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use thaw_loader::{LoadOptions, LoadStats};

use crate::device::Device;
use crate::engine::Request;
use crate::sampling::SamplingParams;
use crate::{RuntimeError, TextTokenizer};
use backend::Loaded;
use metrics::METRICS;
use state::{AfterDrain, App, State, Worker};
use telemetry::ColdStart;

/// The body limit in force (for the 413 message).
pub(crate) static MAX_BODY_BYTES: AtomicU64 = AtomicU64::new(0);

static START: OnceLock<Instant> = OnceLock::new();

/// One log line on stderr, stamped with seconds since the server started.
pub(crate) fn log(args: std::fmt::Arguments) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("thaw [{t:9.3}s] {args}");
}

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub model_dir: PathBuf,
    /// The `--model` argument as given (also accepted as the model name in requests).
    pub model_arg: String,
    /// Name in `/v1/models` and responses; default: the model directory's name.
    pub served_name: Option<String>,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_waiting: usize,
    pub max_running: usize,
    pub max_batch_tokens: usize,
    pub kv_cache_bytes: usize,
    pub drain_timeout: Duration,
    pub max_body_bytes: usize,
    /// max_tokens for requests that give none (None: up to the context).
    pub default_max_tokens: Option<usize>,
    pub load: LoadOptions,
    /// Listen first, load on the first request (or /admin/prewarm).
    pub lazy: bool,
    /// Park or exit after this long without requests.
    pub idle_timeout: Option<Duration>,
    pub on_idle: AfterDrain,
    /// Bearer token for /admin/*; without it those routes are refused.
    pub admin_token: Option<String>,
    pub webhook_url: Option<String>,
    pub webhook_secret: Option<String>,
    /// In-flight requests one replica should carry (autoscaler hints).
    pub target_concurrency: usize,
    /// Start serving before the weights have all landed (forward passes wait layer by layer).
    pub serve_while_loading: bool,
    /// The backend (resolved from `--device`).
    pub device: Device,
    /// Seconds resolving `--device` spent probing the GPU driver (None: not probed).
    pub device_probe_s: Option<f64>,
}

/// The reader thread of a streaming load: final stats, or the load's error.
pub(crate) type LoadDone = std::thread::JoinHandle<Result<LoadStats, thaw_loader::LoadError>>;

/// Loads the model, tokenizer and engine. With `serve_while_loading` it returns as soon as the
/// weights' arenas exist (no warm-up: the first request's forward pass waits layer by layer),
/// along with the reader thread to join.
fn load_worker(o: &ServeOptions) -> Result<(Worker, ColdStart, Option<LoadDone>), RuntimeError> {
    let mut cs = ColdStart::new();
    if o.model_arg.starts_with("s3://") {
        // The listing, small files and headers: fetched here, after the port is open, so that
        // probes and waiting requests are answered while the store is asked.
        let t = Instant::now();
        let st = crate::fetch::refresh_remote(&o.model_arg, &o.model_dir)?;
        cs.push("remote_metadata", t.elapsed().as_secs_f64());
        log(format_args!(
            "{}: {} files ({:.1} MB) and {} weight headers ({:.0} MB of weights) in {:.0} ms",
            o.model_arg,
            st.files,
            st.file_bytes as f64 / 1e6,
            st.shards,
            st.weight_bytes as f64 / 1e6,
            st.total_s * 1e3
        ));
    }
    let t = Instant::now();
    if o.device == Device::Cpu {
        let _ = thaw_kernels::ThreadPool::global();
    }
    let device_init_s = t.elapsed().as_secs_f64();
    let t0 = Instant::now();
    // The tokenizer (tens of ms of JSON parsing and vocabulary building) loads on its own thread
    // while the weights stream in: the two share nothing, and the load is mostly waiting on I/O.
    let (model, tok) = std::thread::scope(|sc| {
        let tok = sc.spawn(|| {
            let t = Instant::now();
            TextTokenizer::load(&o.model_dir).map(|tk| (tk, t.elapsed().as_secs_f64()))
        });
        let model = Loaded::load(o);
        let tok = tok.join().unwrap_or_else(|_| {
            Err(RuntimeError::Tokenizer(
                "the tokenizer thread panicked".into(),
            ))
        });
        (model, tok)
    });
    let (model, done) = model?;
    let (tok, tok_s) = tok?;
    let st = model.stats().clone();
    if done.is_none() {
        model.push_phases(&mut cs, device_init_s);
    } else {
        cs.push("device_init", device_init_s);
    }
    // Overlapped with plan/read/verify: not on the critical path unless it is the longest.
    cs.push("tokenizer", tok_s);
    let load_s = t0.elapsed().as_secs_f64();
    let engine = model.engine(o)?;
    let model_cfg = model.cfg().clone();
    let mut eos = model_cfg.eos_ids();
    eos.extend(tok.eos_id);
    // Warm up: one forward pass touches the KV store, the weights and the thread pool, so the
    // first real request does not pay for first touches (a second pass measured ~20 ms more
    // and warmed nothing the first had not).
    let t1 = Instant::now();
    if done.is_none() {
        let warm = tok.encode("Hello", false)?;
        let (_, end) = engine
            .submit(Request {
                prompt: warm,
                max_tokens: 1,
                sampling: SamplingParams::default(),
                stop_ids: vec![],
                ignore_eos: true,
                logprobs: None,
                min_tokens: 0,
                prompt_logprobs: None,
                constraint: None,
            })
            .collect();
        if let crate::engine::Event::Error(e) = end {
            return Err(RuntimeError::Request(format!("warmup failed: {e}")));
        }
        cs.push("warmup", t1.elapsed().as_secs_f64());
    }
    let max_seq = model_cfg
        .max_position_embeddings
        .min(engine.max_tokens_per_request());
    METRICS.load_bytes.set(st.bytes as i64);
    if done.is_none() {
        METRICS.load_seconds.set(load_s);
        log(format_args!(
            "loaded {} ({:.0} MB, {}) in {:.0} ms, warmed up in {:.0} ms; {} KV blocks of {} tokens",
            o.model_dir.display(),
            st.bytes as f64 / 1e6,
            st.strategy,
            load_s * 1e3,
            t1.elapsed().as_secs_f64() * 1e3,
            engine.config().num_blocks,
            engine.config().block_size,
        ));
    } else {
        log(format_args!(
            "serving while loading {} ({:.0} MB) after {:.0} ms; {} KV blocks of {} tokens",
            o.model_dir.display(),
            st.bytes as f64 / 1e6,
            load_s * 1e3,
            engine.config().num_blocks,
            engine.config().block_size,
        ));
    }
    Ok((
        Worker {
            model_cfg,
            tok,
            engine,
            eos,
            max_seq,
            default_max_tokens: o.default_max_tokens,
            load_s,
            json_vocab: Default::default(),
        },
        cs,
        done,
    ))
}

pub fn router(app: Arc<App>, max_body_bytes: usize) -> Router {
    MAX_BODY_BYTES.store(max_body_bytes as u64, Ordering::Relaxed);
    Router::new()
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::models))
        .route("/invoke", post(routes::invoke))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/metrics", get(routes::metrics))
        .route("/admin/prewarm", post(admin::prewarm))
        .route("/admin/drain", post(admin::drain))
        .route("/autoscaler/metrics", get(admin::autoscaler_metrics))
        .fallback(routes::not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::map_response_with_state(
            app.clone(),
            close_when_draining,
        ))
        .with_state(app)
}

/// While draining, every response asks the client to close its connection: a keep-alive
/// connection would otherwise be cut by the exit while idle, and its next request reset.
async fn close_when_draining(
    axum::extract::State(app): axum::extract::State<Arc<App>>,
    mut r: axum::response::Response,
) -> axum::response::Response {
    if app.state() == State::Draining {
        r.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    r
}

async fn termination() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs the worker until SIGTERM/SIGINT and a drain; returns an error if the model fails to
/// load or the port cannot be bound.
pub fn serve(o: ServeOptions) -> Result<(), RuntimeError> {
    START.get_or_init(Instant::now);
    telemetry::mark_entry(o.device_probe_s);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("thaw-http")
        .enable_all()
        .build()
        .map_err(|e| RuntimeError::Serve(format!("starting the async runtime: {e}")))?;
    let r = rt.block_on(serve_async(o));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn serve_async(o: ServeOptions) -> Result<(), RuntimeError> {
    let listener = tokio::net::TcpListener::bind((o.host.as_str(), o.port))
        .await
        .map_err(|e| RuntimeError::Serve(format!("binding {}:{}: {e}", o.host, o.port)))?;
    let addr: SocketAddr = listener
        .local_addr()
        .map_err(|e| RuntimeError::Serve(e.to_string()))?;
    telemetry::mark_listening();
    let served = o.served_name.clone().unwrap_or_else(|| {
        o.model_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| o.model_arg.clone())
    });
    let webhook = o
        .webhook_url
        .clone()
        .map(|u| webhook::Webhook::start(u, o.webhook_secret.clone(), addr.to_string()));
    let app = Arc::new(App::new(o.clone(), served.clone(), webhook));
    log(format_args!(
        "listening on http://{addr} (model '{served}'{})",
        if o.lazy { ", lazy" } else { "" }
    ));
    if !o.lazy {
        app.prewarm();
    }
    tokio::spawn(admin::monitor(app.clone()));

    // SIGTERM/SIGINT → drain → exit; idle exit and `/admin/drain` (exit) also end here.
    let drain_app = app.clone();
    tokio::spawn(async move {
        termination().await;
        drain_app.drain(AfterDrain::Exit).await;
    });
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let listener = listener::ClosingListener::new(listener, app.exit_watch())
        .map_err(|e| RuntimeError::Serve(e.to_string()))?;
    let conns = listener.conns();
    // Exit: the listener answers its queue and closes; once those connections are answered (or
    // a second passes), hyper's graceful shutdown closes the idle rest.
    let shutdown = async move {
        conns.closed_and_quiet(Duration::from_secs(1)).await;
        let _ = drained_tx.send(());
    };
    let server = axum::serve(listener, router(app.clone(), o.max_body_bytes))
        .with_graceful_shutdown(shutdown)
        .into_future();
    // After the drain, connections still open get a moment to close, then we leave anyway.
    let hard_stop = async move {
        if drained_rx.await.is_ok() {
            tokio::time::sleep(Duration::from_secs(2)).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r.map_err(|e| RuntimeError::Serve(e.to_string()))?,
        _ = hard_stop => {}
    }
    if app.state() == State::Failed {
        let e = app
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        return Err(RuntimeError::Serve(
            e.unwrap_or_else(|| "the model failed to load".into()),
        ));
    }
    log(format_args!("drained; exiting"));
    Ok(())
}
