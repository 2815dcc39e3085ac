//! Loading from a real S3-compatible server (moto's, started per test as its own process), also
//! through a TCP proxy that cuts connections or dies: every byte arrives or the load fails with
//! an error naming the object — never a hang, never a half-loaded checkpoint reported as loaded.

#[allow(dead_code)] // the fake-device helpers are for the other test files
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thaw_loader::s3::{self, S3Config, S3Url};
use thaw_loader::{Checkpoint, HostWeights, LoadOptions, Strategy, Verify};

/// moto's server: `$THAW_MOTO_SERVER`, the test venv's (scripts/setup-test-deps.sh), or PATH.
fn moto_bin() -> PathBuf {
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A moto S3 server on its own port, killed on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    fn start() -> Moto {
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

    fn config(&self, port: u16) -> S3Config {
        let _ = self;
        S3Config {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            region: "us-east-1".into(),
            path_style: true,
            credentials: Some(s3::sign::Credentials {
                access_key: "test".into(),
                secret_key: "test".into(),
                session_token: None,
            }),
            attempts: 4,
        }
    }

    fn create_bucket(&self, bucket: &str) {
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
struct Proxy {
    port: u16,
    dead: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
}

impl Proxy {
    fn start(upstream: u16, cut_every: usize, cut_after: usize) -> Proxy {
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
                        let budget = (cut_every > 0 && n.is_multiple_of(cut_every)).then_some(cut_after);
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

    fn kill(&self) {
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
    let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
    let dead2 = dead.clone();
    // Requests: client → server, unchanged.
    std::thread::spawn(move || {
        let mut buf = [0u8; 64 << 10];
        while !dead2.load(Ordering::SeqCst) {
            match d2.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    if u2.write_all(&buf[..k]).is_err() {
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
        let _ = u2.shutdown(Shutdown::Both);
    });
    // Responses: server → client, cut after the budget.
    let (mut up, mut down) = (up, down);
    let mut left = budget.unwrap_or(usize::MAX);
    let mut buf = [0u8; 64 << 10];
    while !dead.load(Ordering::SeqCst) {
        match up.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => {
                let k2 = k.min(left);
                if down.write_all(&buf[..k2]).is_err() {
                    break;
                }
                left -= k2;
                if left == 0 {
                    cuts.fetch_add(1, Ordering::SeqCst);
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
    let _ = down.shutdown(Shutdown::Both);
    let _ = up.shutdown(Shutdown::Both);
}

fn opts(cfg: S3Config) -> LoadOptions {
    LoadOptions {
        chunk_size: 64 << 10,
        queue_depth: 6,
        threads: 2,
        verify: Verify::Required,
        s3: Some(cfg),
        ..LoadOptions::default()
    }
}

/// Every tensor's bytes, by name, from a loaded checkpoint.
fn tensors(w: &HostWeights) -> Vec<(String, Vec<u8>)> {
    let mut names: Vec<String> = w.checkpoint.tensor_names().map(String::from).collect();
    names.sort();
    names
        .into_iter()
        .map(|n| (n.clone(), w.tensor(&n).unwrap().bytes.to_vec()))
        .collect()
}

/// The two-shard fixture pushed to a fresh bucket: (moto, local dir, url).
fn pushed(bucket: &str) -> (Moto, tempfile::TempDir, S3Url) {
    let moto = Moto::start();
    moto.create_bucket(bucket);
    let local = tempfile::tempdir().unwrap();
    common::two_shards(local.path());
    let url = S3Url::parse(&format!("s3://{bucket}/models/two")).unwrap();
    let (n, _) = s3::push(moto.config(moto.port), local.path(), &url).unwrap();
    assert_eq!(n, 4, "two shards, the index and the manifest");
    (moto, local, url)
}

#[test]
fn a_checkpoint_in_s3_loads_byte_identical_to_its_local_copy() {
    let (moto, local, url) = pushed("same");
    let stub = tempfile::tempdir().unwrap();
    let dir = stub.path().join("two");
    let st = s3::materialize(moto.config(moto.port), &url, &dir).unwrap();
    assert_eq!((st.files, st.shards), (2, 2), "{st:?}");
    // The weights stayed remote; the small files came down.
    assert!(!dir.join("model-00001-of-00002.safetensors").exists());
    assert!(dir.join("model.safetensors.index.json").exists());
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(ck.remote.is_some());
    let mut layers = Vec::new();
    let remote = HostWeights::load_with(ck, &opts(moto.config(moto.port)), &mut |p| {
        layers.push(p.layers_ready)
    })
    .unwrap();
    assert_eq!(remote.stats.strategy, "s3");
    assert!(remote.stats.verified);
    assert!(
        layers.windows(2).all(|w| w[0] <= w[1]),
        "layers land in order: {layers:?}"
    );
    let here = HostWeights::load_with(
        Checkpoint::open(local.path()).unwrap(),
        &LoadOptions {
            strategy: Strategy::Pread,
            ..LoadOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(tensors(&remote), tensors(&here));

    // The streaming load reads the same bytes, layer by layer.
    let s = thaw_loader::load_streaming(
        Checkpoint::open(&dir).unwrap(),
        &opts(moto.config(moto.port)),
    )
    .unwrap();
    s.gate.wait(usize::MAX).unwrap();
    assert_eq!(s.done.join().unwrap().unwrap().strategy, "s3");
    assert_eq!(tensors(&s.weights), tensors(&here));
}

#[test]
fn cut_connections_are_resumed_and_every_byte_still_arrives() {
    let (moto, local, url) = pushed("cuts");
    // Every other connection dies 20 KiB into its responses (64 KiB chunks: mid-body).
    let proxy = Proxy::start(moto.port, 2, 20 << 10);
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(moto.config(proxy.port), &url, &dir).unwrap();
    let mut o = opts(moto.config(proxy.port));
    if let Some(c) = o.s3.as_mut() {
        c.attempts = 8;
    }
    let w = HostWeights::load_with(Checkpoint::open(&dir).unwrap(), &o, &mut |_| {}).unwrap();
    assert!(
        proxy.cuts.load(Ordering::SeqCst) > 0,
        "the proxy cut nothing"
    );
    let here = HostWeights::load_with(
        Checkpoint::open(local.path()).unwrap(),
        &LoadOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(tensors(&w), tensors(&here));
}

#[test]
fn a_server_that_dies_fails_the_load_with_the_object_named() {
    let (moto, _local, url) = pushed("dies");
    let proxy = Proxy::start(moto.port, 0, 0);
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(moto.config(proxy.port), &url, &dir).unwrap();
    proxy.kill();
    let t = Instant::now();
    let e = HostWeights::load_with(
        Checkpoint::open(&dir).unwrap(),
        &opts(moto.config(proxy.port)),
        &mut |_| {},
    )
    .err()
    .expect("a load from a dead server must fail");
    let msg = e.to_string();
    assert!(msg.contains("s3://dies/models/two/model-0000"), "{msg}");
    assert!(msg.contains("gave up after 4 tries"), "{msg}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    // The streaming load fails its waiters with the same error.
    let s = thaw_loader::load_streaming(
        Checkpoint::open(&dir).unwrap(),
        &opts(moto.config(proxy.port)),
    )
    .unwrap();
    let w = s.gate.wait(usize::MAX).unwrap_err();
    assert!(w.contains("gave up"), "{w}");
    assert!(s.done.join().unwrap().is_err());
}

#[test]
fn corrupt_replaced_or_missing_objects_are_clear_errors() {
    let (moto, local, url) = pushed("bad");
    let cfg = moto.config(moto.port);
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(cfg.clone(), &url, &dir).unwrap();

    // Replaced after the listing: the ETag no longer matches, so nothing of the new version is
    // mixed into the old plan.
    let shard = "model-00002-of-00002.safetensors";
    let mut bytes = std::fs::read(local.path().join(shard)).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x40;
    let rt = s3::runtime(1).unwrap();
    let client = s3::Client::new(cfg.clone()).unwrap();
    rt.block_on(client.put("bad", &url.key(shard), bytes))
        .unwrap();
    let e = HostWeights::load_with(
        Checkpoint::open(&dir).unwrap(),
        &opts(cfg.clone()),
        &mut |_| {},
    )
    .err()
    .expect("a replaced object must fail the load");
    assert!(e.to_string().contains(shard), "{e}");
    assert!(e.to_string().contains("changed since it was listed"), "{e}");

    // Listed afresh, the corrupt bytes meet the manifest's hashes.
    s3::materialize(cfg.clone(), &url, &dir).unwrap();
    let e = HostWeights::load_with(
        Checkpoint::open(&dir).unwrap(),
        &opts(cfg.clone()),
        &mut |_| {},
    )
    .err()
    .expect("corrupt bytes must fail the load");
    assert!(e.to_string().contains("integrity check failed"), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("s3://bad/models/two/{shard}")),
        "{e}"
    );

    // An empty prefix and a missing bucket.
    let none = S3Url::parse("s3://bad/nothing/here").unwrap();
    let e = s3::materialize(cfg.clone(), &none, &dir.with_file_name("none")).unwrap_err();
    assert!(
        e.to_string().contains("no objects under this prefix"),
        "{e}"
    );
    let nob = S3Url::parse("s3://no-such-bucket/x").unwrap();
    let e = s3::materialize(cfg, &nob, &dir.with_file_name("nob")).unwrap_err();
    assert!(e.to_string().contains("s3://no-such-bucket/"), "{e}");
    // A stub directory survives a failed refresh untouched.
    assert!(Checkpoint::open(&dir).unwrap().remote.is_some());
}
