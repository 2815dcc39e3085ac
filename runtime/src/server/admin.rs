//! The autoscaler's side of the worker: admin routes a platform calls (`/admin/prewarm`,
//! `/admin/drain`, Bearer `--admin-token`), the JSON a KEDA `metrics-api` trigger reads
//! (`/autoscaler/metrics`), and the monitor task that parks or exits an idle worker and sends
//! scale hints to the webhook.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::ApiError;
use super::state::{AfterDrain, App, State as Life};

fn check_admin(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(want) = app.opts.admin_token.as_deref() else {
        return Err(ApiError::forbidden(
            "admin routes are disabled: start the worker with --admin-token",
        ));
    };
    if App::key_matches(Some(want), super::routes::bearer(headers)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// `POST /admin/prewarm`: start loading now (idempotent). 202 with the state.
pub async fn prewarm(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_admin(&app, &headers) {
        return e.into_response();
    }
    let s = app.prewarm();
    (StatusCode::ACCEPTED, Json(json!({"state": s.as_str()}))).into_response()
}

#[derive(serde::Deserialize)]
pub struct DrainQuery {
    /// `park` or `exit` (default: `--on-idle`).
    then: Option<String>,
}

/// `POST /admin/drain[?then=park|exit]`: stop admitting, finish in-flight requests, then park
/// or exit. 202 at once; the drain runs in the background.
pub async fn drain(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    q: Query<DrainQuery>,
) -> Response {
    if let Err(e) = check_admin(&app, &headers) {
        return e.into_response();
    }
    let then = match q.then.as_deref() {
        None => app.opts.on_idle,
        Some("park") => AfterDrain::Park,
        Some("exit") => AfterDrain::Exit,
        Some(x) => {
            return ApiError::bad_request(format!("then must be park or exit, got '{x}'"))
                .into_response()
        }
    };
    let a = app.clone();
    tokio::spawn(async move { a.drain(then).await });
    let then_s = if then == AfterDrain::Park {
        "park"
    } else {
        "exit"
    };
    (
        StatusCode::ACCEPTED,
        Json(json!({"state": "draining", "inflight": app.inflight(), "then": then_s})),
    )
        .into_response()
}

/// Replicas this worker's load asks for: in-flight requests over the per-replica target.
fn desired_replicas(app: &App) -> usize {
    app.inflight().div_ceil(app.opts.target_concurrency.max(1))
}

/// `GET /autoscaler/metrics`: one JSON document for a KEDA `metrics-api` trigger.
pub async fn autoscaler_metrics(State(app): State<Arc<App>>) -> Response {
    let stats = app.loaded().map(|w| w.engine.stats()).unwrap_or_default();
    let usage = if stats.blocks_total > 0 {
        stats.blocks_used as f64 / stats.blocks_total as f64
    } else {
        0.0
    };
    Json(json!({
        "state": app.state().as_str(),
        "inflight": app.inflight(),
        "running": stats.running,
        "waiting": stats.waiting,
        "queue_depth": app.inflight().saturating_sub(stats.running),
        "kv_cache_usage": usage,
        "target_concurrency": app.opts.target_concurrency,
        "desired_replicas": desired_replicas(&app),
        "idle_seconds": app.idle_for(),
    }))
    .into_response()
}

/// Every 100 ms: park or exit after `--idle-timeout` without requests; send a scale-up hint when
/// in-flight requests stay above the target for 2 s, a scale-down hint when idle.
pub async fn monitor(app: Arc<App>) {
    let mut above_since: Option<Instant> = None;
    let mut last_up: Option<Instant> = None;
    let mut down_sent = false;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let inflight = app.inflight();
        if let Some(t) = app.opts.idle_timeout {
            if app.state() == Life::Ready && inflight == 0 && app.idle_for() >= t.as_secs_f64() {
                let done = match app.opts.on_idle {
                    AfterDrain::Park => app.park_if_idle(),
                    AfterDrain::Exit => app.exit_if_idle(),
                };
                if done && app.opts.on_idle == AfterDrain::Exit {
                    return;
                }
            }
        }
        let Some(hook) = &app.webhook else {
            continue;
        };
        let target = app.opts.target_concurrency.max(1);
        if inflight > target {
            let since = *above_since.get_or_insert_with(Instant::now);
            let recent = last_up.is_some_and(|t| t.elapsed() < Duration::from_secs(10));
            if since.elapsed() >= Duration::from_secs(2) && !recent {
                hook.send(
                    json!({"event": "scale_up", "inflight": inflight, "target_concurrency": target,
                                 "desired_replicas": desired_replicas(&app)}),
                );
                last_up = Some(Instant::now());
            }
        } else {
            above_since = None;
        }
        let idle_hint = app
            .opts
            .idle_timeout
            .map(|t| t.as_secs_f64() / 2.0)
            .unwrap_or(30.0);
        if inflight == 0 && app.idle_for() >= idle_hint {
            if !down_sent && app.state() == Life::Ready {
                hook.send(
                    json!({"event": "scale_down", "idle_seconds": app.idle_for(),
                                 "desired_replicas": 0}),
                );
                down_sent = true;
            }
        } else if inflight > 0 {
            down_sent = false;
        }
    }
}
