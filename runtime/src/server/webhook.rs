//! The outgoing autoscaler webhook: a JSON event on every state change and on scale hints,
//! POSTed to `--autoscaler-webhook URL` with `x-thaw-signature: sha256=<hex HMAC of the body>`
//! keyed by `--webhook-secret`.
//!
//! Serving never waits for it: events go through an unbounded channel to one sender task, which
//! delivers them in order and retries each with exponential backoff (100 ms, 200 ms, …, 5
//! attempts). Failed attempts are counted in `thaw_webhook_failures_total`; deliveries and
//! events given up on in `thaw_webhook_events_total{outcome}`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use super::log;
use super::metrics::METRICS;

const ATTEMPTS: u32 = 5;

/// Hex HMAC-SHA256 of `body` under `secret`.
pub fn sign(secret: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

pub struct Webhook {
    tx: UnboundedSender<Value>,
}

impl Webhook {
    /// Starts the sender task (call inside the tokio runtime).
    pub fn start(url: String, secret: Option<String>, worker: String) -> Webhook {
        let (tx, mut rx) = unbounded_channel::<Value>();
        tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("HTTP client");
            while let Some(mut ev) = rx.recv().await {
                ev["worker"] = json!(worker);
                let body = ev.to_string();
                let kind = ev["event"].as_str().unwrap_or("event").to_string();
                let mut delivered = false;
                for attempt in 0..ATTEMPTS {
                    let mut rq = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .header("x-thaw-event", &kind)
                        .header("x-thaw-attempt", attempt + 1)
                        .body(body.clone());
                    if let Some(s) = &secret {
                        rq = rq.header(
                            "x-thaw-signature",
                            format!("sha256={}", sign(s, body.as_bytes())),
                        );
                    }
                    match rq.send().await {
                        Ok(r) if r.status().is_success() => {
                            delivered = true;
                            break;
                        }
                        _ => {
                            METRICS.webhook_failures.inc();
                            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                        }
                    }
                }
                let outcome = if delivered { "delivered" } else { "dropped" };
                METRICS.webhook_events.with_label_values(&[outcome]).inc();
                if !delivered {
                    log(format_args!(
                        "webhook: gave up on a '{kind}' event after {ATTEMPTS} attempts"
                    ));
                }
            }
        });
        Webhook { tx }
    }

    pub fn send(&self, mut event: Value) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        event["timestamp"] = json!(ts);
        let _ = self.tx.send(event);
    }

    pub fn send_state(&self, from: &str, to: &str, inflight: usize) {
        self.send(json!({"event": "state", "from": from, "state": to, "inflight": inflight}));
    }
}
