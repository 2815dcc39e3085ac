//! The worker's lifecycle and admission control.
//!
//! One state machine — `cold → loading → ready ⇄ parked`, `draining`, (`failed`) — held in a
//! `watch` channel: handlers read it without locks, requests that arrive while the model is cold,
//! loading or parked wait on it (and trigger the load if nobody has), and every change is logged,
//! mirrored in `thaw_state` and sent to the autoscaler webhook.
//!
//! Admission is a counter of requests in flight, not a queue of our own: the engine already
//! queues; the server only bounds how many it hands over (`max_running + max_waiting`, beyond
//! that a 429), so a burst cannot grow memory without limit.
//!
//! Idle transitions (park, exit) race with arriving requests. Both sides use the same
//! two-step handshake with sequentially consistent atomics: a request first counts itself in
//! flight, then reads the state; the idle timer first publishes the new state, then reads the
//! count. Either the request sees `draining` (and gets a 503) or the timer sees it in flight
//! (and backs off) — a request is never admitted and then dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{watch, Notify};

use super::error::ApiError;
use super::log;
use super::metrics::METRICS;
use super::telemetry::ColdStart;
use super::webhook::Webhook;
use super::ServeOptions;
use crate::engine::Engine;
use crate::TextTokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Cold,
    Loading,
    Ready,
    Draining,
    /// Weights and KV cache released; the page cache keeps the checkpoint warm for a fast return.
    Parked,
    /// Loading failed; the process exits.
    Failed,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Cold => "cold",
            State::Loading => "loading",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Parked => "parked",
            State::Failed => "failed",
        }
    }
}

/// What a loaded model brings: weights, tokenizer, the engine that runs them.
pub struct Worker {
    pub model_cfg: crate::ModelConfig,
    pub tok: TextTokenizer,
    pub engine: Engine,
    /// Ids that end a generation.
    pub eos: Vec<u32>,
    /// Longest prompt + output one request may have (context, and the KV store).
    pub max_seq: usize,
    /// max_tokens when a request gives none (None: up to `max_seq`).
    pub default_max_tokens: Option<usize>,
    pub load_s: f64,
    /// The vocabulary's bytes for JSON mode, built by the first request that asks for it.
    pub json_vocab: std::sync::OnceLock<std::sync::Arc<crate::json_mode::Vocab>>,
}

impl Worker {
    /// The vocabulary as JSON mode masks it (special tokens excluded).
    pub fn json_vocab(&self) -> std::sync::Arc<crate::json_mode::Vocab> {
        self.json_vocab
            .get_or_init(|| {
                let n = self.model_cfg.vocab_size;
                let bytes = (0..n as u32)
                    .map(|id| {
                        (!self.tok.is_added(id))
                            .then(|| self.tok.token_bytes(id))
                            .filter(|b| !b.is_empty())
                    })
                    .collect();
                std::sync::Arc::new(crate::json_mode::Vocab::new(bytes))
            })
            .clone()
    }
}

/// What happens once a drain has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDrain {
    Park,
    Exit,
}

pub struct App {
    pub opts: ServeOptions,
    pub served_name: String,
    pub capacity: usize,
    pub started: Instant,
    state: watch::Sender<State>,
    worker: Mutex<Option<Arc<Worker>>>,
    inflight: AtomicUsize,
    /// Milliseconds since `started` when the last request left or arrived.
    last_active_ms: AtomicU64,
    /// Signalled whenever a request leaves (drain waits on it).
    left: Notify,
    /// Set when the process should shut down (idle exit, drain → exit, signal).
    exit: watch::Sender<bool>,
    /// The load error, when state is Failed.
    pub failure: Mutex<Option<String>>,
    /// The last cold start's phases; `first_token` is filled by the first request after it.
    pub cold_start: Mutex<Option<ColdStart>>,
    first_token_pending: AtomicBool,
    pub webhook: Option<Webhook>,
}

/// One admitted request; dropping it gives its slot back.
pub struct Admission {
    app: Arc<App>,
}

impl Admission {
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.app.touch();
        self.app.inflight.fetch_sub(1, SeqCst);
        self.app.left.notify_waiters();
    }
}

impl App {
    pub fn new(opts: ServeOptions, served_name: String, webhook: Option<Webhook>) -> App {
        METRICS.set_state(State::Cold.as_str());
        App {
            capacity: opts.max_running + opts.max_waiting,
            opts,
            served_name,
            started: Instant::now(),
            state: watch::channel(State::Cold).0,
            worker: Mutex::new(None),
            inflight: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(0),
            left: Notify::new(),
            exit: watch::channel(false).0,
            failure: Mutex::new(None),
            cold_start: Mutex::new(None),
            first_token_pending: AtomicBool::new(false),
            webhook,
        }
    }

    pub fn state(&self) -> State {
        *self.state.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<State> {
        self.state.subscribe()
    }

    pub fn set_state(&self, s: State) {
        let old = self.state.send_replace(s);
        if old != s {
            self.announce(old, s, "");
        }
    }

    /// Moves the state to `f(state)` when that is `Some`, atomically, without announcing it.
    /// Returns the state it replaced.
    fn swap_if(&self, f: impl FnOnce(State) -> Option<State>) -> Option<State> {
        let mut from = None;
        self.state.send_if_modified(|s| match f(*s) {
            Some(n) if n != *s => {
                from = Some(*s);
                *s = n;
                true
            }
            _ => false,
        });
        from
    }

    /// Every state change goes out the same way: `thaw_state`, the log, the webhook.
    fn announce(&self, old: State, new: State, why: &str) {
        METRICS.set_state(new.as_str());
        log(format_args!(
            "state {} -> {}{why}",
            old.as_str(),
            new.as_str()
        ));
        if let Some(w) = &self.webhook {
            w.send_state(old.as_str(), new.as_str(), self.inflight());
        }
    }

    /// Installs a loaded (or loading, when streaming) worker and its cold-start record.
    fn install(&self, w: Worker, cs: ColdStart) {
        *self.cold_start.lock().unwrap_or_else(|e| e.into_inner()) = Some(cs);
        self.first_token_pending.store(true, SeqCst);
        *self.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(w));
    }

    fn touch(&self) {
        self.last_active_ms
            .store(self.started.elapsed().as_millis() as u64, SeqCst);
    }

    /// Seconds since the last request arrived or left.
    pub fn idle_for(&self) -> f64 {
        let now = self.started.elapsed().as_millis() as u64;
        now.saturating_sub(self.last_active_ms.load(SeqCst)) as f64 / 1e3
    }

    pub fn loaded(&self) -> Option<Arc<Worker>> {
        self.worker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(SeqCst)
    }

    /// Takes a slot for a new request: 503 while draining, 429 when full.
    pub fn admit(self: &Arc<Self>) -> Result<Admission, ApiError> {
        // Count first, then look at the state (see the module docs).
        let n = self.inflight.fetch_add(1, SeqCst);
        let a = Admission { app: self.clone() };
        self.touch();
        match self.state() {
            State::Draining => return Err(ApiError::unavailable("the worker is draining")),
            State::Failed => return Err(ApiError::unavailable("the model failed to load")),
            _ => {}
        }
        if n >= self.capacity {
            return Err(ApiError::overloaded(self.capacity));
        }
        Ok(a)
    }

    /// Starts loading if the model is cold or parked (idempotent: a load in progress or a loaded
    /// model is left alone). Returns the state after the call.
    pub fn prewarm(self: &Arc<Self>) -> State {
        let from =
            self.swap_if(|s| matches!(s, State::Cold | State::Parked).then_some(State::Loading));
        if let Some(from) = from {
            self.announce(from, State::Loading, "");
            let app = self.clone();
            tokio::spawn(async move {
                let opts = app.opts.clone();
                let t = Instant::now();
                let r = tokio::task::spawn_blocking(move || super::load_worker(&opts)).await;
                match r {
                    Ok(Ok((w, mut cs, None))) => {
                        cs.set_total(t.elapsed().as_secs_f64());
                        log(format_args!("cold start: {}", cs.summary()));
                        cs.publish();
                        app.install(w, cs);
                        app.touch(); // the idle clock starts when the worker is ready
                        app.set_state(State::Ready);
                    }
                    Ok(Ok((w, mut cs, Some(done)))) => {
                        // Serving while loading: requests may start now; /ready waits for the
                        // last byte.
                        cs.set_total(t.elapsed().as_secs_f64());
                        app.install(w, cs);
                        app.state.send_modify(|_| {}); // wake the requests waiting for it
                        match tokio::task::spawn_blocking(move || done.join()).await {
                            Ok(Ok(Ok(st))) => {
                                let total = t.elapsed().as_secs_f64();
                                if let Some(cs) = app
                                    .cold_start
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .as_mut()
                                {
                                    cs.push_load(&st, 0.0);
                                    cs.load_s = total;
                                    cs.publish();
                                    log(format_args!("cold start: {}", cs.summary()));
                                }
                                METRICS.load_seconds.set(total);
                                app.touch();
                                app.set_state(State::Ready);
                            }
                            Ok(Ok(Err(e))) => app.fail(e.to_string()),
                            _ => app.fail("the load thread panicked".into()),
                        }
                    }
                    Ok(Err(e)) => app.fail(e.to_string()),
                    Err(e) => app.fail(format!("the load task failed: {e}")),
                }
            });
        }
        self.state()
    }

    fn fail(&self, e: String) {
        log(format_args!("error: loading the model failed: {e}"));
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        self.set_state(State::Failed);
        self.request_exit();
    }

    /// The loaded worker, loading it first if needed. Also returns how long this call waited
    /// (the request's share of a cold start).
    pub async fn worker(self: &Arc<Self>) -> Result<(Arc<Worker>, Option<f64>), ApiError> {
        if self.state() == State::Ready {
            if let Some(w) = self.loaded() {
                return Ok((w, None));
            }
        }
        let t = Instant::now();
        let mut rx = self.state.subscribe();
        self.prewarm();
        // Ready, or (serving while loading) a worker installed during the load.
        let _ = rx
            .wait_for(|s| {
                !matches!(s, State::Cold | State::Loading | State::Parked)
                    || (*s == State::Loading && self.loaded().is_some())
            })
            .await;
        match (self.state(), self.loaded()) {
            (State::Ready | State::Draining | State::Loading, Some(w)) => {
                Ok((w, Some(t.elapsed().as_secs_f64())))
            }
            (s, _) => Err(ApiError::unavailable(format!(
                "the worker is {}",
                s.as_str()
            ))),
        }
    }

    /// Called when a request produced its first token: completes the `first_token` phase of
    /// the cold start that preceded it.
    pub fn first_token_seen(&self) {
        if self.first_token_pending.swap(false, SeqCst) {
            if let Some(cs) = self
                .cold_start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
            {
                cs.first_token_now();
                cs.publish();
                log(format_args!("cold start, first token: {}", cs.summary()));
            }
        }
    }

    /// Waits until no request is in flight.
    pub async fn idle(&self) {
        loop {
            let notified = self.left.notified();
            if self.inflight() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Moves Ready → `to` only if no request is in flight (the handshake in the module docs).
    fn leave_ready(&self, to: State) -> bool {
        if self
            .swap_if(|s| (s == State::Ready).then_some(to))
            .is_none()
        {
            return false;
        }
        if self.inflight() > 0 {
            // A request slipped in: back to ready, as if nothing happened (nothing announced).
            self.state.send_replace(State::Ready);
            return false;
        }
        self.announce(State::Ready, to, " (idle)");
        true
    }

    /// Releases the weights and the KV cache if idle; the next request reloads them.
    pub fn park_if_idle(&self) -> bool {
        if !self.leave_ready(State::Parked) {
            return false;
        }
        self.release();
        true
    }

    fn release(&self) {
        // Requests still holding the worker keep it alive; it is freed when the last one ends.
        let w = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(w);
    }

    /// Exits (scale to zero) if idle.
    pub fn exit_if_idle(&self) -> bool {
        if !self.leave_ready(State::Draining) {
            return false;
        }
        self.request_exit();
        true
    }

    /// Stops admitting, waits for in-flight requests (up to the drain timeout), then parks or
    /// exits.
    pub async fn drain(self: &Arc<Self>, then: AfterDrain) {
        self.set_state(State::Draining);
        log(format_args!(
            "draining: {} request(s) in flight, up to {:?}",
            self.inflight(),
            self.opts.drain_timeout
        ));
        if tokio::time::timeout(self.opts.drain_timeout, self.idle())
            .await
            .is_err()
        {
            log(format_args!(
                "drain timeout: {} request(s) still in flight are cut off",
                self.inflight()
            ));
        }
        match then {
            AfterDrain::Exit => self.request_exit(),
            AfterDrain::Park => {
                self.release();
                self.set_state(State::Parked);
            }
        }
    }

    pub fn request_exit(&self) {
        self.exit.send_replace(true);
    }

    /// Turns true when the process is to exit (after a drain, or idle).
    pub fn exit_watch(&self) -> watch::Receiver<bool> {
        self.exit.subscribe()
    }

    /// Constant-time check of a presented key against `want`.
    pub fn key_matches(want: Option<&str>, presented: Option<&str>) -> bool {
        let Some(want) = want else {
            return true;
        };
        let Some(got) = presented else {
            return false;
        };
        // Compare every byte whatever the first mismatch, so timing says nothing about the key
        // (the length is not secret).
        let (a, b) = (want.as_bytes(), got.as_bytes());
        let mut diff = a.len() ^ b.len();
        for (i, &x) in a.iter().enumerate() {
            diff |= (x ^ b.get(i).copied().unwrap_or(0)) as usize;
        }
        diff == 0
    }

    pub fn authorized(&self, presented: Option<&str>) -> bool {
        App::key_matches(self.opts.api_key.as_deref(), presented)
    }
}
