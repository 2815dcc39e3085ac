//! # thaw-tests: black-box tests against the built binaries
//!
//! Nothing here links the project's crates: tests start `target/<profile>/thaw` and
//! `bench-coldstart` as real processes, exactly as a user or a platform would, and judge them by
//! exit codes, stdout and stderr. Build the binaries first (`scripts/test.sh` does).

pub mod s3;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Path of a workspace binary next to the running test executable's profile directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target profile directory");
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --release --bins` first (scripts/test.sh does)",
        p.display()
    );
    p
}

/// Runs `thaw` with `args`.
pub fn thaw(args: &[&str]) -> Output {
    Command::new(bin("thaw"))
        .args(args)
        .output()
        .expect("starting thaw")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The reference data copied from llama.cpp runs (tests/fixtures).
pub fn golden() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2-public.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("fixture JSON")
}

/// The default model's directory (fetched on first use) in `variant` (`default`, `default-f32`).
pub fn model_dir(variant: &str) -> PathBuf {
    let dtype = variant.strip_prefix("default-").unwrap_or("bf16");
    let o = thaw(&["model", "fetch", "--dtype", dtype]);
    assert!(
        o.status.success(),
        "thaw model fetch failed: {}",
        stderr(&o)
    );
    PathBuf::from(stdout(&o).trim())
}

/// A `thaw serve` process on 127.0.0.1 with a free port, killed when dropped (and when the test
/// process dies: it gets SIGKILL with its parent thread).
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `thaw serve --port 0 ARGS` and waits until it listens (not until it is ready).
    pub fn spawn(args: &[&str]) -> Server {
        Server::spawn_env(args, &[])
    }

    pub fn spawn_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(bin("thaw"));
        cmd.args(["serve", "--port", "0"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("starting thaw serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let url = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(url);
                }
                l.lock().unwrap().push(line);
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(u) => u,
            Err(_) => panic!(
                "thaw serve did not start listening: {}",
                log.lock().unwrap().join("\n")
            ),
        };
        Server { child, base, log }
    }

    /// Starts a server and waits for `/ready`.
    pub fn ready(args: &[&str]) -> Server {
        let s = Server::spawn(args);
        s.wait_ready();
        s
    }

    pub fn wait_ready(&self) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(120) {
            if let Ok(r) = client().get(self.url("/ready")).send() {
                if r.status().as_u16() == 200 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("thaw serve never became ready: {}", self.log());
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The status of `GET path`.
    pub fn status(&self, path: &str) -> u16 {
        client()
            .get(self.url(path))
            .send()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .status()
            .as_u16()
    }

    /// Polls `cond` every 10 ms until it holds; panics with `what` and the log after `secs`.
    pub fn wait_until(&self, what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
        let t = Instant::now();
        while !cond() {
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One metric's value from `/metrics` (first sample whose name and labels start with `key`).
    pub fn metric(&self, key: &str) -> f64 {
        let text = client()
            .get(self.url("/metrics"))
            .send()
            .and_then(|r| r.text())
            .expect("GET /metrics");
        text.lines()
            .find(|l| l.starts_with(key) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {key} not in /metrics:\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking HTTP client with a generous timeout.
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("HTTP client")
}
