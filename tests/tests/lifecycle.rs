//! The scale-to-zero lifecycle against the real binary: lazy start, prewarm, idle exit and park,
//! admin drain, the admin token, the autoscaler document and the signed, retried webhook.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use thaw_tests::{client, model_dir, Server};

fn invoke(s: &Server) -> reqwest::blocking::Response {
    client()
        .post(s.url("/invoke"))
        .json(&json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0}))
        .send()
        .expect("POST /invoke")
}

/// `POST path` with an optional Bearer token: status and JSON body.
fn admin(s: &Server, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut rq = client().post(s.url(path));
    if let Some(k) = token {
        rq = rq.bearer_auth(k);
    }
    let r = rq.send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn ready_state(s: &Server) -> (u16, String) {
    let r = client().get(s.url("/ready")).send().unwrap();
    let st = r.status().as_u16();
    let v: Value = r.json().unwrap();
    (st, v["state"].as_str().unwrap_or("").to_string())
}

#[test]
fn lazy_start_loads_on_the_first_request() {
    model_dir("default");
    // `--device auto` probes the GPU driver (none in this build, or none here: the CPU): the
    // probe is its own phase, not part of `exec`.
    let s = Server::spawn(&["--lazy", "--device", "auto"]);
    assert_eq!(ready_state(&s), (503, "cold".to_string()));
    assert_eq!(s.status("/health"), 200);
    let r = invoke(&s);
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-thaw-cold-start"], "true");
    assert!(r.headers().contains_key("x-thaw-load-ms"));
    let v: Value = r.json().unwrap();
    assert_eq!(v["cold_start"], true, "{v}");
    assert!(v["timings"]["load_ms"].as_f64().unwrap() > 0.0);
    for p in [
        "exec",
        "device_probe",
        "runtime_init",
        "plan",
        "read",
        "warmup",
        "first_token",
    ] {
        assert!(v["cold_start_phases"][p].is_number(), "{p} missing: {v}");
    }
    assert_eq!(ready_state(&s), (200, "ready".to_string()));
    let v: Value = invoke(&s).json().unwrap();
    assert_eq!(v["cold_start"], false);
    assert!(s.metric("thaw_cold_start_phase_seconds{phase=\"read\"}") > 0.0);
}

#[test]
fn prewarm_is_idempotent_and_admin_routes_need_the_token() {
    model_dir("default");
    let s = Server::spawn(&["--lazy", "--admin-token", "adm"]);
    for key in [None, Some("nope")] {
        let (st, v) = admin(&s, "/admin/prewarm", key);
        assert_eq!(st, 401);
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    assert_eq!(admin(&s, "/admin/drain", Some("x")).0, 401);
    assert_eq!(ready_state(&s).1, "cold", "a refused prewarm must not load");
    let url = s.url("/admin/prewarm");
    let hs: Vec<_> = (0..10)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let r = client().post(url).bearer_auth("adm").send().unwrap();
                let st = r.status().as_u16();
                let v: Value = r.json().unwrap();
                (st, v["state"].as_str().unwrap().to_string())
            })
        })
        .collect();
    for h in hs {
        let (st, state) = h.join().unwrap();
        assert_eq!(st, 202);
        assert!(state == "loading" || state == "ready", "{state}");
    }
    s.wait_ready();
    let loads = s.log().matches("-> loading").count();
    assert_eq!(loads, 1, "{}", s.log());
    // Without --admin-token the routes are off.
    let s2 = Server::spawn(&["--lazy"]);
    assert_eq!(admin(&s2, "/admin/prewarm", Some("adm")).0, 403);
}

#[test]
fn idle_exit_exits_zero_and_loses_no_request() {
    model_dir("default");
    let mut s = Server::ready(&["--idle-timeout", "1s", "--on-idle", "exit"]);
    let mut outcomes = std::collections::BTreeMap::new();
    let t = Instant::now();
    let mut i = 0u64;
    // Requests spaced around the idle timeout, so some race the timer.
    let gaps = [300u64, 700, 900, 960, 990, 1000, 1010, 1040, 1080, 1150];
    while t.elapsed() < Duration::from_secs(30) {
        // Gaps that grow past the timeout: the last requests race the timer.
        std::thread::sleep(Duration::from_millis(
            gaps[(i as usize).min(gaps.len() - 1)],
        ));
        i += 1;
        let r = client()
            .post(s.url("/v1/completions"))
            .json(&json!({"prompt": "Hi", "max_tokens": 2}))
            .send();
        let outcome = match r {
            Ok(r) => {
                let st = r.status().as_u16();
                let body = r.text().expect("a complete body");
                assert!(st == 200 || st == 503, "{st} {body}");
                st.to_string()
            }
            Err(e) if e.is_connect() => "refused (exited)".to_string(),
            Err(e) => panic!("request lost: {e:?}"),
        };
        let exited = outcome.starts_with("refused");
        *outcomes.entry(outcome).or_insert(0) += 1;
        if exited {
            break;
        }
    }
    eprintln!("outcomes: {outcomes:?}");
    let status = s
        .wait_exit(Duration::from_secs(30))
        .expect("exited after idling");
    assert_eq!(status.code(), Some(0), "{}", s.log());
    assert!(s.log().contains("ready -> draining (idle)"), "{}", s.log());
}

#[test]
fn park_then_request_is_served() {
    model_dir("default");
    let s = Server::ready(&["--idle-timeout", "500ms", "--on-idle", "park"]);
    s.wait_until("the worker to park", 10, || {
        ready_state(&s) == (503, "parked".to_string())
    });
    assert_eq!(s.metric("thaw_state{state=\"parked\"}"), 1.0);
    let r = invoke(&s);
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-thaw-cold-start"], "true");
    let v: Value = r.json().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // A return from parked has no process phases, only the load's.
    assert!(v["cold_start_phases"]["exec"].is_null(), "{v}");
    assert!(v["cold_start_phases"]["read"].is_number(), "{v}");
}

#[test]
fn admin_drain_finishes_streams_then_parks_or_exits() {
    model_dir("default");
    let mut s = Server::ready(&["--admin-token", "adm"]);
    let stream = |s: &Server| {
        let url = s.url("/v1/completions");
        std::thread::spawn(move || {
            let mut r = client()
                .post(url)
                .json(
                    &json!({"prompt": "Once", "max_tokens": 40, "ignore_eos": true,
                              "stream": true}),
                )
                .send()
                .unwrap();
            let mut body = String::new();
            r.read_to_string(&mut body).unwrap();
            body
        })
    };
    // Drain, then park: streams finish, new requests get 503 meanwhile, then the next request
    // reloads.
    let hs: Vec<_> = (0..2).map(|_| stream(&s)).collect();
    s.wait_until("two running requests", 30, || {
        s.metric("thaw_num_requests_running") >= 2.0
    });
    assert_eq!(admin(&s, "/admin/drain?then=park", Some("adm")).0, 202);
    let r = invoke(&s);
    assert_eq!(r.status().as_u16(), 503);
    for h in hs {
        let body = h.join().unwrap();
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        assert!(body.contains("\"finish_reason\":\"length\""));
    }
    s.wait_until("the drain to park the worker", 10, || {
        ready_state(&s).1 == "parked"
    });
    assert_eq!(invoke(&s).status().as_u16(), 200);
    // Drain, then exit.
    let h = stream(&s);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(admin(&s, "/admin/drain?then=exit", Some("adm")).0, 202);
    assert!(h.join().unwrap().contains("data: [DONE]"));
    let status = s.wait_exit(Duration::from_secs(30)).expect("exited");
    assert_eq!(status.code(), Some(0));
}

/// Requests a receiver got: headers (lower-cased names) and body.
type Received = Arc<Mutex<Vec<(Vec<(String, String)>, String)>>>;

/// A webhook receiver on 127.0.0.1 that answers 500 to the first `fail` requests.
fn receiver(fail: usize) -> (String, Received) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        let mut n = 0;
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let mut rd = BufReader::new(c.try_clone().unwrap());
            let mut headers = Vec::new();
            let mut line = String::new();
            rd.read_line(&mut line).unwrap();
            loop {
                line.clear();
                if rd.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.trim_end().split_once(": ") {
                    headers.push((k.to_ascii_lowercase(), v.to_string()));
                }
            }
            let len: usize = headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .map(|(_, v)| v.parse().unwrap())
                .unwrap_or(0);
            let mut body = vec![0u8; len];
            rd.read_exact(&mut body).unwrap();
            n += 1;
            let status = if n <= fail {
                "500 Internal Server Error"
            } else {
                "200 OK"
            };
            let _ = write!(
                c,
                "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            );
            g.lock()
                .unwrap()
                .push((headers, String::from_utf8(body).unwrap()));
        }
    });
    (url, got)
}

#[test]
fn webhook_events_are_signed_and_retried() {
    model_dir("default");
    let (url, got) = receiver(2);
    let s = Server::ready(&["--autoscaler-webhook", &url, "--webhook-secret", "hush"]);
    let t = Instant::now();
    loop {
        let n = got
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, b)| b.contains("\"state\":\"ready\""))
            .count();
        if n > 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no ready event");
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = got.lock().unwrap().clone();
    // The first event failed twice and arrived on the third attempt, unchanged.
    let first: Vec<_> = got.iter().take(3).collect();
    assert_eq!(first[0].1, first[2].1);
    let attempt = |h: &Vec<(String, String)>| {
        h.iter()
            .find(|(k, _)| k == "x-thaw-attempt")
            .map(|(_, v)| v.clone())
    };
    assert_eq!(attempt(&first[2].0).as_deref(), Some("3"));
    for (headers, body) in &got {
        let sig = headers
            .iter()
            .find(|(k, _)| k == "x-thaw-signature")
            .map(|(_, v)| v.clone())
            .expect("signed");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"hush").unwrap();
        mac.update(body.as_bytes());
        assert_eq!(
            sig,
            format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
        );
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["event"], "state");
    }
    let states: Vec<String> = got
        .iter()
        .skip(2)
        .map(|(_, b)| {
            serde_json::from_str::<Value>(b).unwrap()["state"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(states, vec!["loading", "ready"]);
    assert!(s.metric("thaw_webhook_failures_total") >= 2.0);
}

#[test]
fn autoscaler_document_reports_load() {
    model_dir("default");
    let s = Server::ready(&["--target-concurrency", "2"]);
    let v: Value = client()
        .get(s.url("/autoscaler/metrics"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(v["state"], "ready");
    assert_eq!(v["desired_replicas"], 0);
    let url = s.url("/v1/completions");
    let hs: Vec<_> = (0..5)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                client()
                    .post(url)
                    .json(&json!({"prompt": "Hi", "max_tokens": 60, "ignore_eos": true}))
                    .send()
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    let t = Instant::now();
    let mut seen = 0;
    while t.elapsed() < Duration::from_secs(20) {
        let v: Value = client()
            .get(s.url("/autoscaler/metrics"))
            .send()
            .unwrap()
            .json()
            .unwrap();
        if v["inflight"] == 5 {
            seen = v["desired_replicas"].as_u64().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(seen, 3, "5 in flight over a target of 2");
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
}

#[test]
fn webhook_gets_scale_hints() {
    model_dir("default");
    let (url, got) = receiver(0);
    let s = Server::ready(&[
        "--autoscaler-webhook",
        &url,
        "--target-concurrency",
        "1",
        "--idle-timeout",
        "2s",
        "--on-idle",
        "park",
    ]);
    // Three requests held for a few seconds against a target of one: a scale-up hint.
    let hs: Vec<_> = (0..3)
        .map(|_| {
            let u = s.url("/v1/completions");
            std::thread::spawn(move || {
                client()
                    .post(u)
                    .json(&json!({"prompt": "Hi", "max_tokens": 200, "ignore_eos": true}))
                    .send()
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    let events = |kind: &str| {
        got.lock()
            .unwrap()
            .iter()
            .filter_map(|(_, b)| serde_json::from_str::<Value>(b).ok())
            .filter(|v| v["event"] == kind)
            .collect::<Vec<_>>()
    };
    let up = events("scale_up");
    assert!(
        !up.is_empty(),
        "no scale_up hint: {:?}",
        got.lock().unwrap()
    );
    assert!(
        up[0]["desired_replicas"].as_u64().unwrap() >= 2,
        "{}",
        up[0]
    );
    // Then idle: a scale-down hint (at half the idle timeout) and the park.
    s.wait_until("a scale-down hint and the park", 20, || {
        !events("scale_down").is_empty() && events("state").iter().any(|v| v["state"] == "parked")
    });
}

/// Evicts the model's weight files from the page cache, so the next load reads them from disk
/// (streamed) instead of mapping them in place.
fn evict_weights(dir: &std::path::Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let f = std::fs::File::open(&p).unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: advisory call on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

#[test]
fn serving_while_loading_gives_the_same_answer() {
    let dir = model_dir("default");
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true});
    let want: Value = {
        let s = Server::ready(&[]);
        client()
            .post(s.url("/invoke"))
            .json(&body)
            .send()
            .unwrap()
            .json()
            .unwrap()
    };
    evict_weights(&dir);
    let s = Server::spawn(&["--lazy", "--serve-while-loading"]);
    let r = client().post(s.url("/invoke")).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["text"], want["text"], "{v}");
    assert_eq!(v["cold_start"], true);
    assert!(s.log().contains("serving while loading"), "{}", s.log());
    s.wait_ready();
    let v: Value = client()
        .post(s.url("/invoke"))
        .json(&body)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(v["text"], want["text"]);
}
