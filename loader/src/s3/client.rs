//! A small S3 client: ranged GETs into caller memory, whole-object GETs, LIST, PUT — each
//! signed with SigV4 when credentials are set, retried with backoff when the failure is
//! transient, and resumed where a broken body left off.
//!
//! Configuration comes from the variables the AWS tools read, so a pod's existing S3 settings
//! work unchanged: `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (an S3-compatible server: MinIO,
//! Ceph, R2, moto; path-style addressing then, unless `THAW_S3_ADDRESSING=virtual`),
//! `AWS_REGION` / `AWS_DEFAULT_REGION` (default `us-east-1`), `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, or a web identity to exchange with STS
//! ([`super::credentials`]: `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`); none of these:
//! anonymous, unsigned requests for public buckets. `THAW_S3_ATTEMPTS` (default 6) bounds the
//! tries per request; `THAW_S3_PART_SIZE` (default 256 MiB) the parts of large uploads.
//!
//! What is retried: connection failures, timeouts, bodies cut short, 429 and 5xx answers.
//! What is not: 4xx answers (a missing key, a refused signature), and 412 — the object's ETag no
//! longer matches the one listed, so the checkpoint changed under the load: mixing two
//! versions' bytes would be worse than failing.

use std::time::Duration;

use super::credentials::WebIdentity;
use super::sign::{self, Credentials, EMPTY_SHA256, UNSIGNED_PAYLOAD};
use crate::LoadError;

/// Default [`S3Config::part_size`].
pub const DEFAULT_PART_SIZE: u64 = 256 << 20;
/// The smallest part S3 accepts (all but the last).
pub const MIN_PART_SIZE: u64 = 5 << 20;

#[derive(Debug, Clone)]
pub struct S3Config {
    /// `scheme://host[:port]` of an S3-compatible server; `None` is AWS S3 itself.
    pub endpoint: Option<String>,
    pub region: String,
    pub path_style: bool,
    pub credentials: Option<Credentials>,
    /// Without static credentials: a role to assume with a web identity token.
    pub web_identity: Option<WebIdentity>,
    /// Tries per request (at least 1).
    pub attempts: u32,
    /// Files larger than this are uploaded in parts of this size, four at a time (S3's
    /// minimum part is 5 MiB).
    pub part_size: u64,
}

impl S3Config {
    pub fn from_env() -> S3Config {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let endpoint = var("AWS_ENDPOINT_URL_S3")
            .or_else(|| var("AWS_ENDPOINT_URL"))
            .map(|e| e.trim_end_matches('/').to_string());
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".into());
        let path_style = match var("THAW_S3_ADDRESSING").as_deref() {
            Some("path") => true,
            Some("virtual") => false,
            _ => endpoint.is_some(),
        };
        let credentials = match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(access_key), Some(secret_key)) => Some(Credentials {
                access_key,
                secret_key,
                session_token: var("AWS_SESSION_TOKEN"),
            }),
            _ => None,
        };
        let web_identity = match credentials {
            Some(_) => None,
            None => WebIdentity::from_env(&region),
        };
        let attempts = var("THAW_S3_ATTEMPTS")
            .and_then(|v| v.parse().ok())
            .unwrap_or(6u32)
            .max(1);
        S3Config {
            endpoint,
            region,
            path_style,
            credentials,
            web_identity,
            attempts,
            part_size: var("THAW_S3_PART_SIZE")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_PART_SIZE)
                .max(MIN_PART_SIZE),
        }
    }
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Object {
    pub key: String,
    pub size: u64,
    pub etag: String,
}

pub struct Client {
    http: reqwest::Client,
    cfg: S3Config,
    /// The credentials requests are signed with, resolved on first use (a web identity costs an
    /// STS round trip).
    creds: tokio::sync::OnceCell<Option<Credentials>>,
}

/// Why a request was not sent or got no answer.
pub(super) enum SendError {
    Http(reqwest::Error),
    Credentials(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Http(e) => write!(f, "{e}"),
            SendError::Credentials(m) => write!(f, "{m}"),
        }
    }
}

/// How one try ended, when it did not succeed.
pub(super) enum Fail {
    /// Try again (after a pause), resuming where the body stopped.
    Transient(String),
    /// Give up now.
    Fatal(String),
    NotFound,
}

/// `s3://bucket/key`, for messages.
pub fn s3_url(bucket: &str, key: &str) -> String {
    format!("s3://{bucket}/{key}")
}

pub(super) fn remote(bucket: &str, key: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Remote {
        url: s3_url(bucket, key),
        msg: msg.into(),
    }
}

/// The `<Code>` and `<Message>` of an S3 error document, or the body's start.
fn error_text(status: reqwest::StatusCode, body: &str) -> String {
    let code = super::xml::tag(body, "Code");
    let message = super::xml::tag(body, "Message");
    match (code, message) {
        (Some(c), Some(m)) => format!("HTTP {status}: {c}: {m}"),
        (Some(c), None) => format!("HTTP {status}: {c}"),
        _ if body.trim().is_empty() => format!("HTTP {status}"),
        _ => format!(
            "HTTP {status}: {}",
            body.chars().take(200).collect::<String>()
        ),
    }
}

/// Pause before try `n + 1`: 100 ms doubling to a 3.2 s cap, with jitter so that many
/// parallel GETs failing together do not come back together.
fn backoff(n: u32) -> Duration {
    let base = 100u64 << n.min(5);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    Duration::from_millis(base / 2 + nanos % (base / 2 + 1))
}

impl Client {
    pub fn new(cfg: S3Config) -> Result<Client, LoadError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // Idle time between body reads: a server that stops sending is a failure to retry.
            .read_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| LoadError::Remote {
                url: cfg.endpoint.clone().unwrap_or_else(|| "s3".into()),
                msg: format!("cannot build an HTTP client: {e}"),
            })?;
        Ok(Client {
            http,
            cfg,
            creds: tokio::sync::OnceCell::new(),
        })
    }

    /// The credentials in use: static, assumed from a web identity (once), or none.
    pub async fn credentials(&self) -> Result<Option<Credentials>, String> {
        self.creds().await.cloned()
    }

    async fn creds(&self) -> Result<&Option<Credentials>, String> {
        self.creds
            .get_or_try_init(|| async {
                match (&self.cfg.credentials, &self.cfg.web_identity) {
                    (Some(c), _) => Ok(Some(c.clone())),
                    (None, Some(w)) => w.assume(&self.http).await.map(Some),
                    (None, None) => Ok(None),
                }
            })
            .await
    }

    pub fn config(&self) -> &S3Config {
        &self.cfg
    }

    /// (URL on the wire, Host header, path that is signed) for `key` in `bucket`.
    fn address(&self, bucket: &str, key: &str) -> (String, String, String) {
        let (scheme, authority) = match &self.cfg.endpoint {
            Some(e) => match e.split_once("://") {
                Some((s, a)) => (s.to_string(), a.split('/').next().unwrap_or(a).to_string()),
                None => ("https".to_string(), e.clone()),
            },
            None => (
                "https".to_string(),
                format!("s3.{}.amazonaws.com", self.cfg.region),
            ),
        };
        let (host, path) = if self.cfg.path_style {
            (authority, format!("/{bucket}/{key}"))
        } else {
            (format!("{bucket}.{authority}"), format!("/{key}"))
        };
        let url = format!("{scheme}://{host}{}", sign::uri_encode(&path, true));
        (url, host, path)
    }

    /// Builds and sends one signed request.
    pub(super) async fn send(
        &self,
        method: reqwest::Method,
        bucket: &str,
        key: &str,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        body: Option<reqwest::Body>,
    ) -> Result<reqwest::Response, SendError> {
        let creds = self.creds().await.map_err(SendError::Credentials)?;
        let (mut url, host, path) = self.address(bucket, key);
        if !query.is_empty() {
            url.push('?');
            url.push_str(&sign::canonical_query(query));
        }
        let mut rb = self.http.request(method.clone(), &url);
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        if let Some(creds) = creds {
            let payload = if body.is_some() {
                UNSIGNED_PAYLOAD
            } else {
                EMPTY_SHA256
            };
            let req = sign::Request {
                method: method.as_str(),
                host: &host,
                path: &path,
                query,
                headers,
                payload_sha256: payload,
            };
            for (k, v) in sign::sign(&req, creds, &self.cfg.region, &sign::amz_date_now()) {
                rb = rb.header(k, v);
            }
        }
        if let Some(b) = body {
            rb = rb.body(b);
        }
        rb.send().await.map_err(SendError::Http)
    }

    /// Classifies a non-success answer.
    pub(super) async fn refusal(resp: reqwest::Response) -> Fail {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        let text = error_text(status, &body);
        if status == reqwest::StatusCode::NOT_FOUND {
            Fail::NotFound
        } else if status == reqwest::StatusCode::PRECONDITION_FAILED {
            Fail::Fatal(format!(
                "{text} (the object changed since it was listed: its ETag no longer matches)"
            ))
        } else if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            Fail::Transient(text)
        } else {
            Fail::Fatal(text)
        }
    }

    /// Runs `try_once` until it succeeds, fails fatally, or runs out of attempts.
    pub(super) async fn retrying<T, F, Fut>(
        &self,
        bucket: &str,
        key: &str,
        mut try_once: F,
    ) -> Result<Option<T>, LoadError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, Fail>>,
    {
        let mut last = String::new();
        for n in 0..self.cfg.attempts {
            if n > 0 {
                tokio::time::sleep(backoff(n - 1)).await;
            }
            match try_once().await {
                Ok(v) => return Ok(Some(v)),
                Err(Fail::NotFound) => return Ok(None),
                Err(Fail::Fatal(m)) => return Err(remote(bucket, key, m)),
                Err(Fail::Transient(m)) => last = m,
            }
        }
        Err(remote(
            bucket,
            key,
            format!("{last} (gave up after {} tries)", self.cfg.attempts),
        ))
    }

    /// Fills `out` with the object's bytes `start .. start + out.len()`. `if_match` pins the
    /// ETag the caller planned with. A body cut short is resumed from its last byte.
    pub async fn get_into(
        &self,
        bucket: &str,
        key: &str,
        start: u64,
        out: &mut [u8],
        if_match: Option<&str>,
    ) -> Result<(), LoadError> {
        // Shared with each try (uncontended): a try advances `got`, the next resumes from it.
        use std::sync::atomic::{AtomicUsize, Ordering};
        let total = out.len();
        let got = AtomicUsize::new(0);
        let out = tokio::sync::Mutex::new(out);
        let r = self
            .retrying(bucket, key, || async {
                let mut n = got.load(Ordering::Relaxed);
                if n == total {
                    return Ok(());
                }
                let mut out = out.lock().await;
                let r = self
                    .try_range(bucket, key, start, &mut out, &mut n, if_match)
                    .await;
                got.store(n, Ordering::Relaxed);
                r
            })
            .await?;
        r.ok_or_else(|| remote(bucket, key, "no such object (HTTP 404)"))
    }

    /// One GET of what `out` still lacks (bytes from `start + *got`), advancing `*got` as the
    /// body arrives so that a retry resumes rather than restarts.
    async fn try_range(
        &self,
        bucket: &str,
        key: &str,
        start: u64,
        out: &mut [u8],
        got: &mut usize,
        if_match: Option<&str>,
    ) -> Result<(), Fail> {
        let total = out.len();
        let from = start + *got as u64;
        let to = start + total as u64 - 1;
        let range = format!("bytes={from}-{to}");
        let mut headers = vec![("range", range.as_str())];
        if let Some(e) = if_match {
            headers.push(("if-match", e));
        }
        let mut resp = self
            .send(reqwest::Method::GET, bucket, key, &[], &headers, None)
            .await
            .map_err(|e| Fail::Transient(format!("GET {range}: {e}")))?;
        let status = resp.status();
        let whole = status == reqwest::StatusCode::OK
            && from == 0
            && resp.content_length() == Some(total as u64);
        if status != reqwest::StatusCode::PARTIAL_CONTENT && !whole {
            if status.is_success() {
                return Err(Fail::Fatal(format!(
                    "GET {range} answered {status}, not a byte range (the server ignored Range)"
                )));
            }
            return Err(Self::refusal(resp).await);
        }
        loop {
            match resp.chunk().await {
                Ok(Some(b)) => {
                    if b.len() > total - *got {
                        return Err(Fail::Fatal(format!(
                            "GET {range} sent more bytes than asked for"
                        )));
                    }
                    out[*got..*got + b.len()].copy_from_slice(&b);
                    *got += b.len();
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(Fail::Transient(format!(
                        "GET {range}: body cut off after {} bytes: {e}",
                        start + *got as u64 - from
                    )))
                }
            }
        }
        if *got < total {
            return Err(Fail::Transient(format!(
                "GET {range}: body ended {} bytes short",
                total - *got
            )));
        }
        Ok(())
    }

    /// The whole object, or `None` when there is no such key.
    pub async fn get(&self, bucket: &str, key: &str) -> Result<Option<Vec<u8>>, LoadError> {
        self.retrying(bucket, key, || async move {
            let resp = self
                .send(reqwest::Method::GET, bucket, key, &[], &[], None)
                .await
                .map_err(|e| Fail::Transient(format!("GET: {e}")))?;
            if !resp.status().is_success() {
                return Err(Self::refusal(resp).await);
            }
            let want = resp.content_length();
            let body = resp
                .bytes()
                .await
                .map_err(|e| Fail::Transient(format!("GET: body cut off: {e}")))?;
            if want.is_some_and(|w| w != body.len() as u64) {
                return Err(Fail::Transient("GET: body ended short".into()));
            }
            Ok(body.to_vec())
        })
        .await
    }

    /// The first `n` bytes of an object (fewer if it is shorter), with the object's size.
    pub async fn get_head_bytes(
        &self,
        bucket: &str,
        key: &str,
        n: u64,
        if_match: Option<&str>,
    ) -> Result<(Vec<u8>, u64), LoadError> {
        let r = self
            .retrying(bucket, key, || async move {
                let range = format!("bytes=0-{}", n.max(1) - 1);
                let mut headers = vec![("range", range.as_str())];
                if let Some(e) = if_match {
                    headers.push(("if-match", e));
                }
                let resp = self
                    .send(reqwest::Method::GET, bucket, key, &[], &headers, None)
                    .await
                    .map_err(|e| Fail::Transient(format!("GET {range}: {e}")))?;
                let status = resp.status();
                let size = match status {
                    reqwest::StatusCode::PARTIAL_CONTENT => resp
                        .headers()
                        .get("content-range")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.rsplit('/').next())
                        .and_then(|v| v.parse::<u64>().ok())
                        .ok_or_else(|| {
                            Fail::Fatal(format!("GET {range}: no object size in Content-Range"))
                        })?,
                    reqwest::StatusCode::OK => resp.content_length().unwrap_or(0),
                    // An empty object has no byte 0.
                    reqwest::StatusCode::RANGE_NOT_SATISFIABLE => return Ok((Vec::new(), 0)),
                    _ => return Err(Self::refusal(resp).await),
                };
                let body = resp
                    .bytes()
                    .await
                    .map_err(|e| Fail::Transient(format!("GET {range}: body cut off: {e}")))?;
                let mut body = body.to_vec();
                body.truncate(n as usize);
                if (body.len() as u64) < n.min(size) {
                    return Err(Fail::Transient(format!("GET {range}: body ended short")));
                }
                Ok((body, size))
            })
            .await?;
        r.ok_or_else(|| remote(bucket, key, "no such object (HTTP 404)"))
    }

    /// Every object whose key starts with `prefix` (ListObjectsV2, all pages).
    pub async fn list(&self, bucket: &str, prefix: &str) -> Result<Vec<Object>, LoadError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retrying(bucket, prefix, || {
                    let token = token.clone();
                    async move {
                        let mut q = vec![("list-type", "2"), ("prefix", prefix)];
                        if let Some(t) = token.as_deref() {
                            q.push(("continuation-token", t));
                        }
                        let resp = self
                            .send(reqwest::Method::GET, bucket, "", &q, &[], None)
                            .await
                            .map_err(|e| Fail::Transient(format!("LIST: {e}")))?;
                        if !resp.status().is_success() {
                            return Err(match Self::refusal(resp).await {
                                Fail::NotFound => Fail::Fatal("no such bucket (HTTP 404)".into()),
                                f => f,
                            });
                        }
                        resp.text()
                            .await
                            .map_err(|e| Fail::Transient(format!("LIST: body cut off: {e}")))
                    }
                })
                .await?
                .unwrap_or_default();
            let (objects, next) = super::xml::list_page(&page)
                .map_err(|m| remote(bucket, prefix, format!("LIST: {m}")))?;
            out.extend(objects);
            match next {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
    }
}
