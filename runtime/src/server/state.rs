//! The worker's lifecycle and admission control.
//!
//! One state machine (`cold → loading → ready → draining`, `parked` arrives with the idle
//! handling) held in a `watch` channel: handlers read it without locks, requests that arrive
//! while the model loads wait on it, and every change is logged and mirrored in `thaw_state`.
//!
//! Admission is a counter of requests in flight, not a queue of our own: the engine already
//! queues; the server only bounds how many it hands over (`max_running + max_waiting`, beyond
//! that a 429), so a burst cannot grow memory without limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tokio::sync::{watch, Notify};

use super::error::ApiError;
use super::log;
use super::metrics::METRICS;
use crate::engine::Engine;
use crate::{Llama, TextTokenizer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Cold,
    Loading,
    Ready,
    Draining,
    /// Loading failed; the process is about to exit.
    Failed,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Cold => "cold",
            State::Loading => "loading",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Failed => "failed",
        }
    }
}

/// What a loaded model brings: weights, tokenizer, the engine that runs them.
pub struct Worker {
    pub model: Arc<Llama>,
    pub tok: TextTokenizer,
    pub engine: Engine,
    /// Ids that end a generation.
    pub eos: Vec<u32>,
    /// Longest prompt + output one request may have (context, and the KV store).
    pub max_seq: usize,
    /// max_tokens when a request gives none (None: up to `max_seq`).
    pub default_max_tokens: Option<usize>,
    pub load_s: f64,
}

pub struct App {
    pub served_name: String,
    /// The `--model` argument, accepted as a model name too.
    pub model_arg: String,
    pub api_key: Option<String>,
    pub capacity: usize,
    pub started: Instant,
    state: watch::Sender<State>,
    worker: OnceLock<Arc<Worker>>,
    inflight: AtomicUsize,
    /// Signalled whenever a request leaves (drain waits on it).
    left: Notify,
}

/// One admitted request; dropping it gives its slot back.
pub struct Admission {
    app: Arc<App>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.app.inflight.fetch_sub(1, Ordering::AcqRel);
        self.app.left.notify_waiters();
    }
}

impl App {
    pub fn new(
        served_name: String,
        model_arg: String,
        api_key: Option<String>,
        capacity: usize,
    ) -> App {
        METRICS.set_state(State::Cold.as_str());
        App {
            served_name,
            model_arg,
            api_key,
            capacity,
            started: Instant::now(),
            state: watch::channel(State::Cold).0,
            worker: OnceLock::new(),
            inflight: AtomicUsize::new(0),
            left: Notify::new(),
        }
    }

    pub fn state(&self) -> State {
        *self.state.borrow()
    }

    pub fn set_state(&self, s: State) {
        let old = self.state.send_replace(s);
        if old != s {
            METRICS.set_state(s.as_str());
            log(format_args!("state {} -> {}", old.as_str(), s.as_str()));
        }
    }

    /// Installs the loaded worker and opens for traffic.
    pub fn set_ready(&self, w: Arc<Worker>) {
        let _ = self.worker.set(w);
        if self.state() == State::Loading || self.state() == State::Cold {
            self.set_state(State::Ready);
        }
    }

    pub fn loaded(&self) -> Option<&Arc<Worker>> {
        self.worker.get()
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// Takes a slot for a new request: 503 while draining, 429 when full.
    pub fn admit(self: &Arc<Self>) -> Result<Admission, ApiError> {
        match self.state() {
            State::Draining => return Err(ApiError::unavailable("the worker is draining")),
            State::Failed => return Err(ApiError::unavailable("the model failed to load")),
            _ => {}
        }
        let n = self.inflight.fetch_add(1, Ordering::AcqRel);
        let a = Admission { app: self.clone() };
        if n >= self.capacity {
            return Err(ApiError::overloaded(self.capacity));
        }
        Ok(a)
    }

    /// The loaded worker, waiting for the load if it is still running. Also returns how long
    /// this call waited (the request's share of a cold start).
    pub async fn worker(&self) -> Result<(Arc<Worker>, Option<f64>), ApiError> {
        if let Some(w) = self.worker.get() {
            return Ok((w.clone(), None));
        }
        let t = Instant::now();
        let mut rx = self.state.subscribe();
        let _ = rx
            .wait_for(|s| !matches!(s, State::Cold | State::Loading))
            .await;
        match self.worker.get() {
            Some(w) => Ok((w.clone(), Some(t.elapsed().as_secs_f64()))),
            None => Err(ApiError::unavailable(format!(
                "the worker is {}",
                self.state().as_str()
            ))),
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

    /// Constant-time check of a presented key against the configured one.
    pub fn authorized(&self, presented: Option<&str>) -> bool {
        let Some(want) = &self.api_key else {
            return true;
        };
        let Some(got) = presented else {
            return false;
        };
        // Compare every byte whatever the first mismatch, so timing says nothing about the key
        // (the length is not secret).
        let (a, b) = (want.as_bytes(), got.as_bytes());
        let mut diff = a.len() ^ b.len();
        for i in 0..a.len() {
            diff |= (a[i] ^ b.get(i).copied().unwrap_or(0)) as usize;
        }
        diff == 0
    }
}
