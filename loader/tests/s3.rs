//! Loading from a real S3-compatible server (moto's, started per test as its own process), also
//! through a TCP proxy that cuts connections or dies: every byte arrives or the load fails with
//! an error naming the object — never a hang, never a half-loaded checkpoint reported as loaded.

#[allow(dead_code)] // the fake-device helpers are for the other test files
mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use thaw_tests::s3::{Moto, Proxy};

use thaw_loader::s3::{self, S3Config, S3Url};
use thaw_loader::{Checkpoint, HostWeights, LoadOptions, Strategy, Verify};

/// Test credentials (moto accepts any; they are still signed with).
fn config(port: u16) -> S3Config {
    S3Config {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: "us-east-1".into(),
        path_style: true,
        credentials: Some(s3::sign::Credentials {
            access_key: "test".into(),
            secret_key: "test".into(),
            session_token: None,
        }),
        web_identity: None,
        attempts: 4,
        part_size: s3::client::DEFAULT_PART_SIZE,
    }
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

/// Every tensor's bytes of the local checkpoint in `dir` (read with buffered preads).
fn local_tensors(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let opts = LoadOptions {
        strategy: Strategy::Pread,
        ..LoadOptions::default()
    };
    tensors(&HostWeights::load_with(Checkpoint::open(dir).unwrap(), &opts, &mut |_| {}).unwrap())
}

/// The two-shard fixture pushed to a fresh bucket: (moto, local dir, url).
fn pushed(bucket: &str) -> (Moto, tempfile::TempDir, S3Url) {
    let moto = Moto::start();
    moto.create_bucket(bucket);
    let local = tempfile::tempdir().unwrap();
    common::two_shards(local.path());
    let url = S3Url::parse(&format!("s3://{bucket}/models/two")).unwrap();
    let (n, _) = s3::push(config(moto.port), local.path(), &url).unwrap();
    assert_eq!(n, 4, "two shards, the index and the manifest");
    (moto, local, url)
}

#[test]
fn a_checkpoint_in_s3_loads_byte_identical_to_its_local_copy() {
    let (moto, local, url) = pushed("same");
    let stub = tempfile::tempdir().unwrap();
    let dir = stub.path().join("two");
    let st = s3::materialize(config(moto.port), &url, &dir).unwrap();
    assert_eq!((st.files, st.shards), (2, 2), "{st:?}");
    // The weights stayed remote; the small files came down.
    assert!(!dir.join("model-00001-of-00002.safetensors").exists());
    assert!(dir.join("model.safetensors.index.json").exists());
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(ck.remote.is_some());
    let mut layers = Vec::new();
    let remote = HostWeights::load_with(ck, &opts(config(moto.port)), &mut |p| {
        layers.push(p.layers_ready)
    })
    .unwrap();
    assert_eq!(remote.stats.strategy, "s3");
    assert!(remote.stats.verified);
    assert!(
        layers.windows(2).all(|w| w[0] <= w[1]),
        "layers land in order: {layers:?}"
    );
    let here = local_tensors(local.path());
    assert_eq!(tensors(&remote), here);

    // The streaming load reads the same bytes, layer by layer.
    let s = thaw_loader::load_streaming(Checkpoint::open(&dir).unwrap(), &opts(config(moto.port)))
        .unwrap();
    s.gate.wait(usize::MAX).unwrap();
    assert_eq!(s.done.join().unwrap().unwrap().strategy, "s3");
    assert_eq!(tensors(&s.weights), here);
}

#[test]
fn cut_connections_are_resumed_and_every_byte_still_arrives() {
    let (moto, local, url) = pushed("cuts");
    // Every other connection dies 20 KiB into its responses (64 KiB chunks: mid-body).
    let proxy = Proxy::start(moto.port, 2, 20 << 10);
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(config(proxy.port), &url, &dir).unwrap();
    let mut o = opts(config(proxy.port));
    if let Some(c) = o.s3.as_mut() {
        c.attempts = 8;
    }
    let w = HostWeights::load_with(Checkpoint::open(&dir).unwrap(), &o, &mut |_| {}).unwrap();
    assert!(
        proxy.cuts.load(Ordering::SeqCst) > 0,
        "the proxy cut nothing"
    );
    assert_eq!(tensors(&w), local_tensors(local.path()));
}

#[test]
fn a_server_that_dies_fails_the_load_with_the_object_named() {
    let (moto, _local, url) = pushed("dies");
    let proxy = Proxy::start(moto.port, 0, 0);
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(config(proxy.port), &url, &dir).unwrap();
    proxy.kill();
    let t = Instant::now();
    let e = HostWeights::load_with(
        Checkpoint::open(&dir).unwrap(),
        &opts(config(proxy.port)),
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
    let s = thaw_loader::load_streaming(Checkpoint::open(&dir).unwrap(), &opts(config(proxy.port)))
        .unwrap();
    let w = s.gate.wait(usize::MAX).unwrap_err();
    assert!(w.contains("gave up"), "{w}");
    assert!(s.done.join().unwrap().is_err());
}

#[test]
fn corrupt_replaced_or_missing_objects_are_clear_errors() {
    let (moto, local, url) = pushed("bad");
    let cfg = config(moto.port);
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

#[test]
fn a_checkpoint_in_s3_streams_through_the_staging_ring_to_the_device() {
    use common::fake_gpu::FakeGpu;
    // The CUDA load's path from S3, with the fake copy engine: ranged GETs fill two staging
    // buffers, each copied to the "device" once landed and refilled only after its copy.
    let (moto, _local, url) = pushed("ring");
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(config(moto.port), &url, &dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let bufs = vec![
        thaw_loader::AlignedBuf::zeroed(64 << 10),
        thaw_loader::AlignedBuf::zeroed(64 << 10),
    ];
    let mut ring = thaw_loader::StagingRing::new(bufs, FakeGpu::new());
    let (plan, stats) =
        thaw_loader::read::load_into(&ck, &opts(config(moto.port)), &mut ring, &mut |_| {})
            .unwrap();
    ring.finish().unwrap();
    assert_eq!(stats.strategy, "s3");
    assert!(stats.verified);
    let gpu = ring.into_engine();
    assert_eq!(gpu.copies.load(Ordering::SeqCst), plan.chunks.len());
    assert_eq!(
        gpu.overwritten.load(Ordering::SeqCst),
        0,
        "a buffer was refilled mid-copy"
    );
    // Every shard's data section arrived whole at its place on the device.
    let local = tempfile::tempdir().unwrap();
    common::two_shards(local.path());
    let device = gpu.device.lock().unwrap();
    for (si, s) in plan.shards.iter().enumerate() {
        let name = s.path.file_name().unwrap();
        let file = std::fs::read(local.path().join(name)).unwrap();
        let data = &file[s.data_start as usize..(s.data_start + s.data_len) as usize];
        let off = s.device_data_offset() as usize;
        assert_eq!(&device[si][off..off + data.len()], data, "shard {si}");
    }
}

#[test]
fn a_web_identity_is_exchanged_with_sts_for_the_credentials_that_sign() {
    // moto's server answers STS too: AssumeRoleWithWebIdentity returns temporary credentials
    // (an ASIA… key and a session token), which then sign the S3 requests of the load.
    let (moto, local, url) = pushed("irsa");
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        token.path(),
        "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0aGF3In0.c2ln\n",
    )
    .unwrap();
    let mut cfg = config(moto.port);
    cfg.credentials = None;
    cfg.web_identity = Some(s3::credentials::WebIdentity {
        role_arn: "arn:aws:iam::123456789012:role/thaw-reader".into(),
        token_file: token.path().to_path_buf(),
        session_name: "thaw-test".into(),
        sts_endpoint: format!("http://127.0.0.1:{}", moto.port),
    });
    let rt = s3::runtime(1).unwrap();
    let client = s3::Client::new(cfg.clone()).unwrap();
    let creds = rt.block_on(client.credentials()).unwrap().expect("assumed");
    assert!(creds.access_key.starts_with("ASIA"), "{creds:?}");
    assert!(creds
        .session_token
        .as_deref()
        .is_some_and(|t| !t.is_empty()));
    let dir = tempfile::tempdir().unwrap().keep().join("two");
    s3::materialize(cfg.clone(), &url, &dir).unwrap();
    let w = HostWeights::load_with(
        Checkpoint::open(&dir).unwrap(),
        &opts(cfg.clone()),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(tensors(&w), local_tensors(local.path()));

    // A token file that is not there: the error says which, after the retries.
    cfg.web_identity.as_mut().unwrap().token_file = "/nonexistent/thaw-token".into();
    let e = s3::materialize(cfg, &url, &dir.with_file_name("none"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("web identity token /nonexistent/thaw-token"),
        "{e}"
    );
}

#[test]
fn files_over_the_part_size_are_pushed_in_parts_and_read_back_whole() {
    let moto = Moto::start();
    moto.create_bucket("parts");
    let dir = tempfile::tempdir().unwrap();
    // 12 MiB + 4321 bytes: two whole 5 MiB parts and a short third.
    let big: Vec<u8> = (0..(12 << 20) + 4321u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(dir.path().join("model.safetensors"), &big).unwrap();
    std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
    let mut cfg = config(moto.port);
    cfg.part_size = s3::client::MIN_PART_SIZE;
    let url = S3Url::parse("s3://parts/m").unwrap();
    let (n, bytes) = s3::push(cfg.clone(), dir.path(), &url).unwrap();
    assert_eq!((n, bytes), (2, big.len() as u64 + 2));
    let rt = s3::runtime(1).unwrap();
    let client = s3::Client::new(cfg).unwrap();
    let back = rt
        .block_on(client.get("parts", "m/model.safetensors"))
        .unwrap()
        .unwrap();
    assert!(back == big, "the object differs from the file");
    // A multipart object's ETag names its part count; the small file went in one PUT.
    let listed = rt.block_on(client.list("parts", "m/")).unwrap();
    let etag = |k: &str| listed.iter().find(|o| o.key == k).unwrap().etag.clone();
    assert!(
        etag("m/model.safetensors").ends_with("-3\""),
        "{}",
        etag("m/model.safetensors")
    );
    assert!(
        !etag("m/config.json").contains('-'),
        "{}",
        etag("m/config.json")
    );
}
