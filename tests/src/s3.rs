//! An S3-compatible server for tests: moto's (`moto[server]`, installed by
//! scripts/setup-test-deps.sh), started as its own process on a free port; and a TCP proxy that
//! cuts connections or dies, to put a real client through a failing network.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// moto's server: `$THAW_MOTO_SERVER`, the test venv's (scripts/setup-test-deps.sh), or PATH.
pub fn moto_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("THAW_MOTO_SERVER") {
        return p.into();
    }
    let home = std::env::var_os("THAW_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/thaw"));
    let venv = home.join("venv/bin/moto_server");
    if venv.exists() {
        venv
    } else {
        "moto_server".into()
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A moto S3 server on its own port, killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Moto {
    pub fn start() -> Moto {
        let port = free_port();
        let child = Command::new(moto_bin())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {}: {e} (install it with scripts/setup-test-deps.sh, or \
                     pip install 'moto[server]')",
                    moto_bin().display()
                )
            });
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(30), "moto did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Moto { child, port }
    }

    pub fn create_bucket(&self, bucket: &str) {
        let r = reqwest::blocking::Client::new()
            .put(format!("http://127.0.0.1:{}/{bucket}", self.port))
            .send()
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy in front of a server. Connection `n` (from 0) is cut after `cut_after` response
/// bytes when `n.is_multiple_of(cut_every)`; `kill()` closes every connection and the port.
pub struct Proxy {
    pub port: u16,
    dead: Arc<AtomicBool>,
    pub cuts: Arc<AtomicUsize>,
}

impl Proxy {
    pub fn start(upstream: u16, cut_every: usize, cut_after: usize) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let dead = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let (d, c) = (dead.clone(), cuts.clone());
        std::thread::spawn(move || {
            let mut n = 0usize;
            while !d.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let budget =
                            (cut_every > 0 && n.is_multiple_of(cut_every)).then_some(cut_after);
                        n += 1;
                        let (d, c) = (d.clone(), c.clone());
                        std::thread::spawn(move || relay(down, upstream, budget, d, c));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
            // The listener drops here: connecting is refused from now on.
        });
        Proxy { port, dead, cuts }
    }

    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn relay(
    down: TcpStream,
    upstream: u16,
    budget: Option<usize>,
    dead: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
) {
    let Ok(up) = TcpStream::connect(("127.0.0.1", upstream)) else {
        return;
    };
    for s in [&down, &up] {
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    }
    let (d2, u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
    let dead2 = dead.clone();
    // Requests: client → server, unchanged.
    std::thread::spawn(move || pump(d2, u2, usize::MAX, &dead2, None));
    // Responses: server → client, cut after the budget.
    pump(up, down, budget.unwrap_or(usize::MAX), &dead, Some(&cuts));
}

/// Copies `from` → `to` until either side closes, the proxy dies, or `budget` bytes have gone
/// (counted in `cuts`); then closes both.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    mut budget: usize,
    dead: &AtomicBool,
    cuts: Option<&AtomicUsize>,
) {
    let mut buf = [0u8; 64 << 10];
    while !dead.load(Ordering::SeqCst) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => {
                let k2 = k.min(budget);
                if to.write_all(&buf[..k2]).is_err() {
                    break;
                }
                budget -= k2;
                if budget == 0 {
                    if let Some(c) = cuts {
                        c.fetch_add(1, Ordering::SeqCst);
                    }
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
