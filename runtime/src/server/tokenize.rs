//! `POST /tokenize` and `POST /detokenize` (vLLM's and llama.cpp's server offer them): what a
//! client needs to count tokens against the context or the price before it sends a request —
//! the worker's own tokenizer and chat template, so the count is the one a generation will see.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::api::{chat_messages, parse, Message};
use super::error::ApiError;
use super::routes::{body_bytes, check_auth, AppState, Body};
use super::state::App;
use crate::chat::render_chat;

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    /// With `messages`: end with the assistant's turn opening (as a chat request does).
    add_generation_prompt: Option<bool>,
    /// Special-token strings in `prompt` become their ids (as in a completions request).
    add_special_tokens: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// A `model` other than this worker's is a 404, as on the generation routes.
fn check_model(app: &App, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &app.served_name && m != &app.opts.model_arg => {
            Err(ApiError::model_not_found(m, &app.served_name))
        }
        _ => Ok(()),
    }
}

/// The tokenizer work of both routes, off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
}

async fn tokenize_inner(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    check_auth(app, headers)?;
    let req: TokenizeRequest = parse(&body_bytes(body)?)?;
    check_model(app, &req.model)?;
    let _slot = app.admit()?;
    let (w, _) = app.worker().await?;
    let wt = w.clone();
    let ids = blocking(move || {
        let enc = |s: &str, special: bool| {
            wt.tok
                .encode(s, special)
                .map_err(|e| ApiError::bad_request(e.to_string()))
        };
        match (req.prompt, req.messages) {
            (Some(p), None) => enc(&p, req.add_special_tokens.unwrap_or(true)),
            (None, Some(m)) => {
                let msgs = chat_messages(&m)?;
                let text = render_chat(&wt.tok, &msgs, req.add_generation_prompt.unwrap_or(true))
                    .map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?;
                enc(&text, true)
            }
            _ => Err(ApiError::bad_request(
                "give exactly one of 'prompt' or 'messages'",
            )),
        }
    })
    .await?;
    Ok(
        Json(json!({"count": ids.len(), "max_model_len": w.max_seq, "tokens": ids}))
            .into_response(),
    )
}

async fn detokenize_inner(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    check_auth(app, headers)?;
    let req: DetokenizeRequest = parse(&body_bytes(body)?)?;
    check_model(app, &req.model)?;
    let _slot = app.admit()?;
    let (w, _) = app.worker().await?;
    let vocab = w.model_cfg.vocab_size;
    if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {t} is outside the vocabulary ({vocab})"
        ))
        .param("tokens"));
    }
    let wt = w.clone();
    let text = blocking(move || {
        wt.tok
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    })
    .await?;
    Ok(Json(json!({ "prompt": text })).into_response())
}

pub async fn tokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    tokenize_inner(&app, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn detokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    detokenize_inner(&app, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
