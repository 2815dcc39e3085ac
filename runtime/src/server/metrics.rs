//! Every Prometheus metric the worker exports, defined here and nowhere else.
//!
//! Names and meanings follow vLLM's (`vllm:time_to_first_token_seconds` →
//! `thaw_time_to_first_token_seconds`: an underscore, because `promtool check metrics` rejects
//! the colon), so dashboards and alerts written for vLLM carry over. Engine-side figures
//! (running, waiting, KV usage, prefix-cache counters) are read from the engine's published
//! stats when `/metrics` is scraped, so the engine thread never touches Prometheus.

use std::sync::{LazyLock, Mutex};

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::engine::EngineStats;

pub const TTFT: &str = "thaw_time_to_first_token_seconds";
pub const ITL: &str = "thaw_inter_token_latency_seconds";
pub const E2E: &str = "thaw_e2e_request_latency_seconds";
pub const QUEUE: &str = "thaw_request_queue_time_seconds";
pub const RUNNING: &str = "thaw_num_requests_running";
pub const WAITING: &str = "thaw_num_requests_waiting";
pub const KV_USAGE: &str = "thaw_kv_cache_usage_perc";
pub const KV_BLOCKS: &str = "thaw_kv_cache_blocks";
pub const PROMPT_TOKENS: &str = "thaw_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "thaw_generation_tokens_total";
pub const PREFIX_HITS: &str = "thaw_prefix_cache_hits_total";
pub const PREFIX_QUERIES: &str = "thaw_prefix_cache_queries_total";
pub const PREEMPTIONS: &str = "thaw_num_preemptions_total";
pub const SUCCESS: &str = "thaw_request_success_total";
pub const FAILURE: &str = "thaw_request_failure_total";
pub const LOAD_SECONDS: &str = "thaw_model_load_seconds";
pub const LOAD_BYTES: &str = "thaw_model_load_bytes";
pub const STATE: &str = "thaw_state";
pub const COLD_START_PHASE: &str = "thaw_cold_start_phase_seconds";
pub const WEBHOOK_FAILURES: &str = "thaw_webhook_failures_total";
pub const WEBHOOK_EVENTS: &str = "thaw_webhook_events_total";
pub const PARAMS_N: &str = "thaw_request_params_n";
pub const PARAMS_MAX_TOKENS: &str = "thaw_request_params_max_tokens";

/// Lifecycle states, as the `state` label of [`STATE`].
pub const STATES: [&str; 5] = ["cold", "loading", "ready", "draining", "parked"];

pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    /// Choices asked for per prompt (`n`), per request.
    pub params_n: Histogram,
    /// The output limit each generation runs under (`max_tokens`, or the default it got).
    pub params_max_tokens: Histogram,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    kv_blocks: IntGauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    prefix_hits: IntCounter,
    prefix_queries: IntCounter,
    preemptions: IntCounter,
    /// By `finished_reason`: stop, length, abort (the client went away).
    pub success: IntCounterVec,
    /// By `reason`: the error code the client received.
    pub failure: IntCounterVec,
    pub load_seconds: Gauge,
    pub load_bytes: IntGauge,
    state: GaugeVec,
    /// Seconds of each phase of the last cold start.
    pub cold_start_phase: GaugeVec,
    /// Failed webhook delivery attempts.
    pub webhook_failures: IntCounter,
    /// Webhook events by outcome: delivered, dropped (after every retry failed).
    pub webhook_events: IntCounterVec,
    /// Serializes the engine-counter catch-up of concurrent scrapes.
    sync: Mutex<()>,
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid histogram options")
}

impl Metrics {
    fn new() -> Metrics {
        let m = Metrics {
            registry: Registry::new(),
            ttft: histogram(
                TTFT,
                "Time from request arrival to its first output token.",
                &[
                    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
                ],
            ),
            itl: histogram(
                ITL,
                "Time between consecutive output tokens of a request.",
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0,
                ],
            ),
            e2e: histogram(
                E2E,
                "Time from request arrival to its last output token.",
                &[
                    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                ],
            ),
            queue: histogram(
                QUEUE,
                "Time a request waited in the engine's queue before it was first scheduled.",
                &[
                    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 480.0,
                ],
            ),
            params_n: histogram(
                PARAMS_N,
                "Choices asked for per prompt (n) by each request.",
                &[1.0, 2.0, 5.0, 10.0, 20.0],
            ),
            params_max_tokens: histogram(
                PARAMS_MAX_TOKENS,
                "Output-token limit of each request (max_tokens, or the default it got).",
                &[
                    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
                    10000.0, 20000.0, 50000.0, 100000.0,
                ],
            ),
            running: IntGauge::new(RUNNING, "Requests being computed (prefill or decode).")
                .expect("gauge"),
            waiting: IntGauge::new(WAITING, "Requests waiting to be scheduled.").expect("gauge"),
            kv_usage: Gauge::new(KV_USAGE, "Fraction of KV-cache blocks in use (0 to 1).")
                .expect("gauge"),
            kv_blocks: IntGauge::new(KV_BLOCKS, "KV-cache blocks in total.").expect("gauge"),
            prompt_tokens: IntCounter::new(PROMPT_TOKENS, "Prompt tokens of finished requests.")
                .expect("counter"),
            generation_tokens: IntCounter::new(GENERATION_TOKENS, "Generated tokens.")
                .expect("counter"),
            prefix_hits: IntCounter::new(
                PREFIX_HITS,
                "Prompt blocks served from the prefix cache.",
            )
            .expect("counter"),
            prefix_queries: IntCounter::new(
                PREFIX_QUERIES,
                "Prompt blocks looked up in the prefix cache.",
            )
            .expect("counter"),
            preemptions: IntCounter::new(
                PREEMPTIONS,
                "Sequences preempted (KV blocks freed, recomputed later).",
            )
            .expect("counter"),
            success: IntCounterVec::new(
                Opts::new(SUCCESS, "Requests that ended normally, by finish reason."),
                &["finished_reason"],
            )
            .expect("counter vec"),
            failure: IntCounterVec::new(
                Opts::new(FAILURE, "Requests answered with an error, by reason."),
                &["reason"],
            )
            .expect("counter vec"),
            load_seconds: Gauge::new(LOAD_SECONDS, "Seconds the last model load took.")
                .expect("gauge"),
            load_bytes: IntGauge::new(LOAD_BYTES, "Weight bytes the last model load brought in.")
                .expect("gauge"),
            state: GaugeVec::new(
                Opts::new(STATE, "1 for the worker's current lifecycle state, else 0."),
                &["state"],
            )
            .expect("gauge vec"),
            cold_start_phase: GaugeVec::new(
                Opts::new(
                    COLD_START_PHASE,
                    "Seconds of each phase of the last cold start.",
                ),
                &["phase"],
            )
            .expect("gauge vec"),
            webhook_failures: IntCounter::new(
                WEBHOOK_FAILURES,
                "Failed autoscaler-webhook delivery attempts.",
            )
            .expect("counter"),
            webhook_events: IntCounterVec::new(
                Opts::new(WEBHOOK_EVENTS, "Autoscaler-webhook events, by outcome."),
                &["outcome"],
            )
            .expect("counter vec"),
            sync: Mutex::new(()),
        };
        let r = &m.registry;
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.queue.clone()),
            Box::new(m.params_n.clone()),
            Box::new(m.params_max_tokens.clone()),
            Box::new(m.running.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.kv_blocks.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.prefix_hits.clone()),
            Box::new(m.prefix_queries.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.success.clone()),
            Box::new(m.failure.clone()),
            Box::new(m.load_seconds.clone()),
            Box::new(m.load_bytes.clone()),
            Box::new(m.state.clone()),
            Box::new(m.cold_start_phase.clone()),
            Box::new(m.webhook_failures.clone()),
            Box::new(m.webhook_events.clone()),
        ];
        for c in all {
            r.register(c).expect("metric names are unique");
        }
        for s in STATES {
            m.state.with_label_values(&[s]).set(0.0);
        }
        m
    }

    pub fn set_state(&self, state: &str) {
        for s in STATES {
            self.state
                .with_label_values(&[s])
                .set(if s == state { 1.0 } else { 0.0 });
        }
    }

    /// Brings the engine-side figures up to date (called on scrape).
    pub fn observe_engine(&self, s: &EngineStats) {
        let _g = self.sync.lock().unwrap_or_else(|e| e.into_inner());
        self.running.set(s.running as i64);
        self.waiting.set(s.waiting as i64);
        self.kv_blocks.set(s.blocks_total as i64);
        self.kv_usage.set(if s.blocks_total > 0 {
            s.blocks_used as f64 / s.blocks_total as f64
        } else {
            0.0
        });
        for (c, v) in [
            (&self.prefix_hits, s.prefix_hits),
            (&self.prefix_queries, s.prefix_queries),
            (&self.preemptions, s.preemptions),
        ] {
            c.inc_by(v.saturating_sub(c.get()));
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The process's metrics.
pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);
