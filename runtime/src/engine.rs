//! The serving engine: one thread owns the model, the paged KV store, the block manager and the
//! scheduler. Callers talk to it only through [`Engine::submit`] (a request in, a stream of
//! [`Event`]s out); dropping the stream cancels the request and frees its blocks at the next step.
//!
//! Every step the scheduler builds one batch under a token budget (`max_batch_tokens`):
//! 1. running sequences that are decoding, one token each — decodes go first so a long prompt
//!    never stalls them;
//! 2. prompt chunks (chunked prefill) of running sequences, then of waiting ones, admitted in
//!    arrival order while `max_running` and the budget allow; a new sequence first takes the
//!    longest cached prefix of full blocks (prefix caching) and skips computing it; one whose
//!    leading full blocks another sequence is computing at the moment waits for them instead
//!    (four choices of an 828-token prompt: 1.55–1.77 s → 1.18–1.22 s, docs/PERFORMANCE.md).
//!
//! When blocks run out, the newest running sequence is preempted: its blocks are released and it
//! goes back to the head of the queue to be recomputed later (its sampler state is kept, and the
//! kernels are batch-invariant, so it produces the same tokens it would have). The whole batch
//! is one [`StepModel::forward_batch`] call (CPU or CUDA backend): every weight matrix is read
//! once per step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::constraint::constrained;
pub use crate::constraint::Constraint;
use crate::generate::FinishReason;
use crate::kv::{BlockId, BlockManager};
use crate::model::{SeqChunk, DEFAULT_BLOCK_SIZE};
use crate::sampling::{logprobs, Sampler, SamplingParams, TokenLogprobs};
use crate::step::StepModel;
use crate::RuntimeError;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    /// KV blocks in the store (see [`EngineConfig::with_kv_bytes`]).
    pub num_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
}

impl EngineConfig {
    /// A configuration whose KV store takes about `bytes` of memory.
    pub fn with_kv_bytes<M: StepModel>(model: &M, bytes: usize) -> EngineConfig {
        let per = model.kv_bytes_per_block(DEFAULT_BLOCK_SIZE);
        EngineConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: (bytes / per).max(1),
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

/// One generation request: prompt token ids and limits.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Ids that end the sequence (EOS); ignored with `ignore_eos`.
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The stop ids cannot be sampled before this many tokens are out (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Report each generated token's log probability and this many likeliest alternatives
    /// (see [`crate::sampling::logprobs`]); `None`: no log probabilities. Such a request's
    /// steps take the logits path, never the model's on-device argmax.
    pub logprobs: Option<usize>,
    /// Log probabilities of the prompt's tokens (each given the ones before it) with this many
    /// alternatives, sent as [`Event::PromptLogprobs`] while the prompt is computed. Such a
    /// request skips the prefix cache: a cached position has no logits.
    pub prompt_logprobs: Option<usize>,
    /// What the output must be (`None`: anything). Its steps take the logits path.
    pub constraint: Option<Box<dyn Constraint>>,
}

/// The most alternatives a request may ask log probabilities for (OpenAI's and vLLM's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Log probabilities of prompt tokens (id, its log probability given the tokens before
    /// it), in order from the second token on, over one or more events.
    PromptLogprobs(Vec<(u32, TokenLogprobs)>),
    /// A generated token, with its log probabilities when the request asked for them.
    Token {
        id: u32,
        logprobs: Option<Box<TokenLogprobs>>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
        /// Seconds from submission until the request was first scheduled (vLLM's queue time).
        queue_s: f64,
    },
    Error(String),
}

/// Counters the engine publishes after every step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub blocks_total: usize,
    pub blocks_used: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub cached_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
}

enum Command {
    Submit(
        Box<Request>,
        UnboundedSender<Event>,
        Arc<AtomicBool>,
        Instant,
    ),
    Stop,
}

/// The events of one request. Dropping it cancels the request: the engine notices at its next
/// step and frees the request's KV blocks.
///
/// The channel is tokio's unbounded one: the engine thread sends without blocking or awaiting,
/// and the receiver works from plain threads ([`EventStream::recv`]) and from async tasks
/// ([`EventStream::next`]) alike, so the HTTP server needs no bridge thread per request.
pub struct EventStream {
    rx: UnboundedReceiver<Event>,
    cancelled: Arc<AtomicBool>,
}

impl EventStream {
    /// The next event, or `None` once the engine is gone. Blocks the thread: not for async code
    /// (tokio panics there); use [`EventStream::next`].
    pub fn recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    /// The next event, awaited.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }
    /// Waits for the request to finish: its tokens and the final event.
    pub fn collect(mut self) -> (Vec<u32>, Event) {
        let mut ids = Vec::new();
        while let Some(e) = self.recv() {
            match e {
                Event::Token { id, .. } => ids.push(id),
                Event::PromptLogprobs(_) => {}
                other => return (ids, other),
            }
        }
        (ids, Event::Error("the engine stopped".into()))
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

pub struct Engine {
    cfg: EngineConfig,
    tx: Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine thread over `model`, with a KV store of `cfg.num_blocks` blocks
    /// (allocated here: a store the backend cannot provide is an error, not a later crash).
    pub fn start<M: StepModel>(model: Arc<M>, cfg: EngineConfig) -> Result<Engine, RuntimeError> {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let st = stats.clone();
        let config = cfg.clone();
        let kv = model.new_kv(cfg.block_size, cfg.num_blocks)?;
        let thread = std::thread::Builder::new()
            .name("thaw-engine".into())
            .spawn(move || Scheduler::new(model, kv, cfg, st).run(rx))
            .map_err(|e| RuntimeError::Config(format!("spawning the engine thread: {e}")))?;
        Ok(Engine {
            cfg: config,
            tx,
            stats,
            thread: Some(thread),
        })
    }

    /// Queues `req`; its events arrive on the returned stream. Drop the stream to cancel.
    pub fn submit(&self, req: Request) -> EventStream {
        let (etx, erx) = unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        if self
            .tx
            .send(Command::Submit(
                Box::new(req),
                etx.clone(),
                cancelled.clone(),
                Instant::now(),
            ))
            .is_err()
        {
            let _ = etx.send(Event::Error("the engine has stopped".into()));
        }
        EventStream { rx: erx, cancelled }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Most tokens (prompt + output) one request may hold: the whole KV store.
    pub fn max_tokens_per_request(&self) -> usize {
        self.cfg.num_blocks * self.cfg.block_size
    }

    /// False once the engine thread has ended (it only ends on drop, or by a bug).
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Engine {
    /// Finishes the requests in flight, then stops the engine thread.
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a step gave back: every sequence's logits, or (all greedy) every sequence's argmax.
enum StepOut {
    Logits(Vec<f32>),
    Ids(Vec<u32>),
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the store.
    done: usize,
    table: Vec<BlockId>,
    /// Full blocks registered in the prefix cache, and the chain hash of the last one.
    registered: usize,
    last_hash: u64,
    cached: usize,
    req: Box<Request>,
    sampler: Sampler,
    events: UnboundedSender<Event>,
    cancelled: Arc<AtomicBool>,
    arrival: u64,
    submitted: Instant,
    /// Seconds from submission to the first step that scheduled it.
    queue_s: Option<f64>,
    /// The next prompt position whose log probability is to be sent (from 1; the first token
    /// has none). Kept across preemption, so a recomputed prompt is not reported twice.
    prompt_scored: usize,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
    /// Whether a chunk of `n` tokens from `done` needs the logits of all its rows (it holds
    /// positions whose successors' prompt log probabilities are still to be sent).
    fn scores_prompt(&self, n: usize) -> bool {
        self.req.prompt_logprobs.is_some()
            && self.prompt_scored < self.prompt_len
            && self.done + n >= self.prompt_scored
    }
}

struct Scheduler<M: StepModel> {
    model: Arc<M>,
    cfg: EngineConfig,
    blocks: BlockManager,
    kv: M::Kv,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    stats: Arc<Mutex<EngineStats>>,
    counters: EngineStats,
    next_arrival: u64,
}

impl<M: StepModel> Scheduler<M> {
    fn new(
        model: Arc<M>,
        kv: M::Kv,
        cfg: EngineConfig,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Scheduler<M> {
        Scheduler {
            blocks: BlockManager::new(cfg.num_blocks, cfg.block_size),
            kv,
            model,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats,
            counters: EngineStats::default(),
            next_arrival: 0,
        }
    }

    fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn run(mut self, rx: Receiver<Command>) {
        loop {
            let cmd = if self.idle() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => Some(Command::Stop),
                }
            };
            match cmd {
                Some(Command::Submit(req, events, cancelled, at)) => {
                    self.admit(req, events, cancelled, at)
                }
                Some(Command::Stop) => {
                    while !self.idle() {
                        self.step();
                    }
                    return;
                }
                None => self.step(),
            }
        }
    }

    fn admit(
        &mut self,
        req: Box<Request>,
        events: UnboundedSender<Event>,
        cancelled: Arc<AtomicBool>,
        submitted: Instant,
    ) {
        let ctx = self.model.config().max_position_embeddings;
        let err = if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if req.prompt.len().saturating_add(req.max_tokens) > ctx {
            Some(format!(
                "prompt ({}) + max_tokens ({}) exceed the context of {ctx}",
                req.prompt.len(),
                req.max_tokens
            ))
        } else if self
            .blocks
            .blocks_for(req.prompt.len().saturating_add(req.max_tokens))
            > self.blocks.total()
        {
            Some(format!(
                "prompt + max_tokens need more KV blocks than the cache has ({})",
                self.blocks.total()
            ))
        } else if let Some(&t) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.model.config().vocab_size)
        {
            Some(format!("token id {t} is outside the vocabulary"))
        } else if req.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            Some(format!(
                "at most {MAX_TOP_LOGPROBS} alternatives' log probabilities per token"
            ))
        } else {
            req.sampling.validate().err()
        };
        if let Some(e) = err {
            let _ = events.send(Event::Error(e));
            return;
        }
        self.next_arrival += 1;
        let mut sampler = Sampler::new(req.sampling.clone());
        sampler.observe_prompt(&req.prompt);
        if req.min_tokens > 0 && !req.ignore_eos {
            sampler.set_banned(&req.stop_ids);
        }
        self.waiting.push_back(Seq {
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            done: 0,
            table: vec![],
            registered: 0,
            last_hash: 0,
            cached: 0,
            sampler,
            req,
            events,
            cancelled,
            arrival: self.next_arrival,
            submitted,
            queue_s: None,
            prompt_scored: 1,
        });
    }

    /// Gives back a sequence's blocks and rewinds it to be recomputed from scratch.
    fn evict(&mut self, s: &mut Seq) {
        self.blocks.release(&s.table);
        s.table.clear();
        s.done = 0;
        s.registered = 0;
        s.last_hash = 0;
    }

    fn step(&mut self) {
        // Cancelled requests leave first, freeing their blocks.
        for mut s in std::mem::take(&mut self.running) {
            if s.cancelled() {
                self.evict(&mut s);
            } else {
                self.running.push(s);
            }
        }
        self.waiting.retain(|s| !s.cancelled());

        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<(Seq, usize)> = Vec::new();
        // 1. Running sequences, oldest first; the newest are preempted when blocks run out.
        let mut queue: VecDeque<Seq> = std::mem::take(&mut self.running).into();
        queue.make_contiguous().sort_by_key(|s| s.arrival);
        let mut keep = Vec::new();
        while let Some(mut s) = queue.pop_front() {
            let n = (s.tokens.len() - s.done).min(budget);
            if n == 0 {
                keep.push(s);
                continue;
            }
            loop {
                let need = self
                    .blocks
                    .blocks_for(s.done + n)
                    .saturating_sub(s.table.len());
                if let Some(b) = self.blocks.allocate(need) {
                    s.table.extend(b);
                    budget -= n;
                    plan.push((s, n));
                    break;
                }
                if let Some(mut v) = queue.pop_back() {
                    self.evict(&mut v);
                    self.counters.preemptions += 1;
                    self.waiting.push_front(v);
                    continue;
                }
                self.evict(&mut s);
                self.counters.preemptions += 1;
                self.waiting.push_front(s);
                break;
            }
        }
        self.running = keep;
        // 2. Waiting sequences in arrival order, while slots, budget and blocks allow. One whose
        //    prompt starts with full blocks another sequence is computing right now waits for
        //    them to reach the prefix cache instead of computing them again (n choices of one
        //    prompt, requests behind one system prompt).
        let mut deferred = Vec::new();
        while budget > 0 && self.running.len() + plan.len() < self.cfg.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if self.sibling_computes_prefix(&s, &plan) {
                deferred.push(s);
                continue;
            }
            let pm = if s.req.prompt_logprobs.is_some() && s.prompt_scored < s.prompt_len {
                crate::kv::PrefixMatch::default()
            } else {
                self.blocks.match_prefix(&s.tokens, s.tokens.len() - 1)
            };
            s.done = pm.tokens;
            s.registered = pm.blocks.len();
            s.last_hash = pm.last_hash;
            s.cached = s.cached.max(pm.tokens);
            s.table = pm.blocks;
            let n = (s.tokens.len() - s.done).min(budget);
            let need = self
                .blocks
                .blocks_for(s.done + n)
                .saturating_sub(s.table.len());
            match self.blocks.allocate(need) {
                Some(b) => {
                    self.counters.cached_tokens += pm.tokens as u64;
                    s.table.extend(b);
                    budget -= n;
                    plan.push((s, n));
                }
                None => {
                    self.evict(&mut s);
                    self.waiting.push_front(s);
                    break;
                }
            }
        }
        for s in deferred.into_iter().rev() {
            self.waiting.push_front(s);
        }
        if plan.is_empty() {
            if self.running.is_empty() {
                // Nothing runs and the head of the queue cannot get blocks: it never will.
                if let Some(s) = self.waiting.pop_front() {
                    let _ = s
                        .events
                        .send(Event::Error("the KV cache cannot hold this request".into()));
                }
            }
            self.publish();
            return;
        }
        for (s, _) in plan.iter_mut() {
            s.queue_s
                .get_or_insert_with(|| s.submitted.elapsed().as_secs_f64());
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|(s, n)| SeqChunk {
                tokens: &s.tokens[s.done..s.done + n],
                start: s.done,
                table: &s.table,
            })
            .collect();
        // Chunks whose rows all give logits (prompt log probabilities), and where each chunk's
        // rows start in the result.
        let all_rows: Vec<bool> = plan.iter().map(|(s, n)| s.scores_prompt(*n)).collect();
        let mut row0 = Vec::with_capacity(plan.len());
        let mut rows = 0;
        for ((_, n), &all) in plan.iter().zip(&all_rows) {
            row0.push(rows);
            rows += if all { *n } else { 1 };
        }
        // A step where every sequence that samples is greedy (and wants no log probabilities)
        // asks the model for ids only.
        let greedy = !all_rows.contains(&true)
            && plan.iter().all(|(s, n)| {
                s.done + n < s.tokens.len()
                    || (s.sampler.is_greedy()
                        && s.req.logprobs.is_none()
                        && s.req.constraint.is_none())
            });
        let result = if greedy {
            self.model
                .forward_batch_greedy(&chunks, &mut self.kv)
                .map(StepOut::Ids)
        } else if all_rows.contains(&true) {
            self.model
                .forward_batch_rows(&chunks, &mut self.kv, &all_rows)
                .map(StepOut::Logits)
        } else {
            self.model
                .forward_batch(&chunks, &mut self.kv)
                .map(StepOut::Logits)
        };
        drop(chunks);
        self.counters.steps += 1;
        let vocab = self.model.config().vocab_size;
        let out = match result {
            Ok(l) => l,
            Err(e) => {
                for (mut s, _) in plan {
                    let _ = s.events.send(Event::Error(e.to_string()));
                    self.evict(&mut s);
                }
                self.publish();
                return;
            }
        };
        for (j, (mut s, n)) in plan.into_iter().enumerate() {
            // The row each chunk samples from: its last.
            let last = row0[j] + if all_rows[j] { n - 1 } else { 0 };
            if all_rows[j] {
                if let (StepOut::Logits(l), Some(k)) = (&out, s.req.prompt_logprobs) {
                    let mut lps = Vec::new();
                    for r in 0..n {
                        // Row r (position done + r) predicts the token at done + r + 1.
                        let q = s.done + r + 1;
                        if q >= s.prompt_scored && q < s.prompt_len {
                            let row = &l[(row0[j] + r) * vocab..(row0[j] + r + 1) * vocab];
                            lps.push((s.tokens[q], logprobs(row, s.tokens[q], k)));
                        }
                    }
                    s.prompt_scored += lps.len();
                    if !lps.is_empty() {
                        let _ = s.events.send(Event::PromptLogprobs(lps));
                    }
                }
            }
            s.done += n;
            self.register_full_blocks(&mut s);
            if s.done < s.tokens.len() {
                self.running.push(s); // more prompt to go
                continue;
            }
            if s.req.max_tokens == 0 {
                // Only the prompt was asked for (its log probabilities, say).
                let _ = s.events.send(Event::Finished {
                    reason: FinishReason::Length,
                    prompt_tokens: s.prompt_len,
                    completion_tokens: 0,
                    cached_tokens: s.cached,
                    queue_s: s.queue_s.unwrap_or(0.0),
                });
                self.evict(&mut s);
                continue;
            }
            let (id, lp) = match &out {
                StepOut::Ids(ids) => (ids[j], None),
                StepOut::Logits(l) => {
                    let row = &l[last * vocab..(last + 1) * vocab];
                    let id = match s.req.constraint.as_mut() {
                        None => s.sampler.sample(row),
                        Some(c) => match constrained(&mut s.sampler, c.as_mut(), row) {
                            Some(id) => id,
                            None => {
                                let _ = s.events.send(Event::Error(
                                    "the output's format allows no next token".into(),
                                ));
                                self.evict(&mut s);
                                continue;
                            }
                        },
                    };
                    (id, s.req.logprobs.map(|k| Box::new(logprobs(row, id, k))))
                }
            };
            s.sampler.observe(id);
            if s.generated() + 1 == s.req.min_tokens {
                s.sampler.set_banned(&[]); // this token is the last one that had to come
            }
            let stop = !s.req.ignore_eos && s.req.stop_ids.contains(&id);
            let mut alive = true;
            if !stop {
                s.tokens.push(id);
                alive = s.events.send(Event::Token { id, logprobs: lp }).is_ok();
            }
            if let Some(c) = s.req.constraint.as_mut() {
                c.advance(id);
            }
            let reason = if stop || s.req.constraint.as_ref().is_some_and(|c| c.complete()) {
                Some(FinishReason::Stop)
            } else if s.generated() >= s.req.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let _ = s.events.send(Event::Finished {
                    reason,
                    prompt_tokens: s.prompt_len,
                    completion_tokens: s.generated(),
                    cached_tokens: s.cached,
                    queue_s: s.queue_s.unwrap_or(0.0),
                });
                self.evict(&mut s);
            } else if !alive {
                self.evict(&mut s); // the client went away
            } else {
                self.running.push(s);
            }
        }
        self.publish();
    }

    /// Whether a running or just-planned sequence is still computing full blocks that `s`'s
    /// prompt starts with (and would otherwise compute too). Prompt-scoring requests skip the
    /// prefix cache, so they never wait.
    fn sibling_computes_prefix(&self, s: &Seq, plan: &[(Seq, usize)]) -> bool {
        if s.req.prompt_logprobs.is_some() {
            return false;
        }
        let bs = self.cfg.block_size;
        // The blocks `s` could take from the cache (its last prompt token is always computed).
        let usable = (s.tokens.len() - 1) / bs;
        if usable == 0 {
            return false;
        }
        let first = &s.tokens[..bs];
        self.running
            .iter()
            .chain(plan.iter().map(|(x, _)| x))
            .any(|x| {
                if x.prompt_len < bs || &x.tokens[..bs] != first {
                    return false;
                }
                let shared = s.tokens[..usable * bs]
                    .chunks_exact(bs)
                    .zip(x.tokens[..x.prompt_len].chunks_exact(bs))
                    .take_while(|(a, b)| a == b)
                    .count();
                x.registered < shared
            })
    }

    fn register_full_blocks(&mut self, s: &mut Seq) {
        let bs = self.cfg.block_size;
        while (s.registered + 1) * bs <= s.done {
            let i = s.registered;
            s.last_hash =
                self.blocks
                    .register_full(s.table[i], s.last_hash, &s.tokens[i * bs..(i + 1) * bs]);
            s.registered += 1;
        }
    }

    fn publish(&mut self) {
        let mut c = self.counters.clone();
        c.running = self.running.len();
        c.waiting = self.waiting.len();
        c.blocks_total = self.blocks.total();
        c.blocks_used = self.blocks.in_use();
        c.prefix_queries = self.blocks.prefix_queries;
        c.prefix_hits = self.blocks.prefix_hits;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = c;
    }
}
