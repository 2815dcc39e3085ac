//! Uploads (`thaw model push`): one streamed PUT per file up to the part size, a multipart
//! upload beyond it (S3 takes at most 5 GiB in one PUT, and parts in parallel are faster), every
//! body read from the file as it is sent — never a whole shard in memory.

use std::path::Path;

use futures_util::StreamExt;

use super::client::{remote, Client, Fail};
use crate::LoadError;

impl Client {
    /// Uploads `body` as one object (S3 takes up to 5 GiB in one PUT).
    pub async fn put(&self, bucket: &str, key: &str, body: Vec<u8>) -> Result<(), LoadError> {
        let body = bytes::Bytes::from(body);
        let len = body.len() as u64;
        self.put_with(bucket, key, &[], len, || {
            Ok(reqwest::Body::from(body.clone()))
        })
        .await
        .map(|_| ())
    }

    /// Uploads the file at `path`, streamed from the file (never held in memory whole): one PUT
    /// up to [`S3Config::part_size`](super::S3Config::part_size), a multipart upload beyond.
    pub async fn put_file(&self, bucket: &str, key: &str, path: &Path) -> Result<(), LoadError> {
        let len = std::fs::metadata(path)
            .map_err(|e| LoadError::io(path, e))?
            .len();
        if len > self.config().part_size {
            return self.put_multipart(bucket, key, path, len).await;
        }
        self.put_with(bucket, key, &[], len, || file_body(path, 0, len))
            .await
            .map(|_| ())
    }

    /// Parts of `part_size` (the last shorter), four in flight, each retried on its own; a
    /// failed upload is aborted so that no parts linger (and bill) in the bucket.
    async fn put_multipart(
        &self,
        bucket: &str,
        key: &str,
        path: &Path,
        len: u64,
    ) -> Result<(), LoadError> {
        let created = self
            .retrying(bucket, key, || async {
                let resp = self
                    .send(
                        reqwest::Method::POST,
                        bucket,
                        key,
                        &[("uploads", "")],
                        &[],
                        None,
                    )
                    .await
                    .map_err(|e| Fail::Transient(format!("create multipart upload: {e}")))?;
                if !resp.status().is_success() {
                    return Err(Self::refusal(resp).await);
                }
                let text = resp
                    .text()
                    .await
                    .map_err(|e| Fail::Transient(format!("create multipart upload: {e}")))?;
                super::xml::tag(&text, "UploadId")
                    .ok_or_else(|| Fail::Fatal("create multipart upload: no <UploadId>".into()))
            })
            .await?;
        let id = created.ok_or_else(|| remote(bucket, key, "no such bucket (HTTP 404)"))?;
        let part = self.config().part_size;
        let parts: Vec<(u64, u64, u64)> = (0..len.div_ceil(part))
            .map(|i| (i + 1, i * part, part.min(len - i * part)))
            .collect();
        let puts: Vec<_> = parts
            .into_iter()
            .map(|(n, off, plen)| self.put_part(bucket, key, &id, path, n, off, plen))
            .collect();
        let uploaded: Result<Vec<(u64, String)>, LoadError> = futures_util::stream::iter(puts)
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect();
        let done = match uploaded {
            Ok(mut etags) => {
                etags.sort();
                self.complete_multipart(bucket, key, &id, &etags).await
            }
            Err(e) => Err(e),
        };
        if done.is_err() {
            let _ = self
                .send(
                    reqwest::Method::DELETE,
                    bucket,
                    key,
                    &[("uploadId", id.as_str())],
                    &[],
                    None,
                )
                .await;
        }
        done
    }

    /// Part `n`: `plen` bytes of the file from `off`. Returns (n, its ETag).
    #[allow(clippy::too_many_arguments)]
    async fn put_part(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        path: &Path,
        n: u64,
        off: u64,
        plen: u64,
    ) -> Result<(u64, String), LoadError> {
        let number = n.to_string();
        let q = [("partNumber", number.as_str()), ("uploadId", id)];
        let etag = self
            .put_with(bucket, key, &q, plen, || file_body(path, off, plen))
            .await?;
        Ok((n, etag))
    }

    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        etags: &[(u64, String)],
    ) -> Result<(), LoadError> {
        let mut xml = String::from("<CompleteMultipartUpload>");
        for (n, e) in etags {
            let e = e.replace('&', "&amp;").replace('"', "&quot;");
            xml.push_str(&format!(
                "<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>"
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let body = bytes::Bytes::from(xml);
        let len = body.len().to_string();
        let r = self
            .retrying(bucket, key, || async {
                let resp = self
                    .send(
                        reqwest::Method::POST,
                        bucket,
                        key,
                        &[("uploadId", id)],
                        &[("content-length", len.as_str())],
                        Some(reqwest::Body::from(body.clone())),
                    )
                    .await
                    .map_err(|e| Fail::Transient(format!("complete multipart upload: {e}")))?;
                if !resp.status().is_success() {
                    return Err(Self::refusal(resp).await);
                }
                // S3 may answer 200 and report the failure in the body.
                let text = resp.text().await.unwrap_or_default();
                match super::xml::tag(&text, "Code") {
                    Some(code) if text.contains("<Error>") => Err(Fail::Transient(format!(
                        "complete multipart upload: {code}"
                    ))),
                    _ => Ok(()),
                }
            })
            .await?;
        r.ok_or_else(|| remote(bucket, key, "complete multipart upload: HTTP 404"))
    }

    /// One PUT of `len` bytes (with `query`: a part), its body made afresh by `body` for each
    /// try. Returns the ETag the store gave it.
    async fn put_with(
        &self,
        bucket: &str,
        key: &str,
        query: &[(&str, &str)],
        len: u64,
        body: impl Fn() -> Result<reqwest::Body, LoadError>,
    ) -> Result<String, LoadError> {
        let len = len.to_string();
        let r = self
            .retrying(bucket, key, || {
                let b = body();
                let len = len.as_str();
                async move {
                    let b = b.map_err(|e| Fail::Fatal(e.to_string()))?;
                    let resp = self
                        .send(
                            reqwest::Method::PUT,
                            bucket,
                            key,
                            query,
                            // S3 refuses a chunked upload without its length.
                            &[("content-length", len)],
                            Some(b),
                        )
                        .await
                        .map_err(|e| Fail::Transient(format!("PUT: {e}")))?;
                    if !resp.status().is_success() {
                        return Err(match Self::refusal(resp).await {
                            Fail::NotFound => Fail::Fatal("no such bucket (HTTP 404)".into()),
                            f => f,
                        });
                    }
                    Ok(resp
                        .headers()
                        .get("etag")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string())
                }
            })
            .await?;
        r.ok_or_else(|| remote(bucket, key, "PUT: HTTP 404"))
    }
}

/// `len` bytes of the file at `path` from `off`, as a streamed body (opened anew per try).
fn file_body(path: &Path, off: u64, len: u64) -> Result<reqwest::Body, LoadError> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    file.seek(SeekFrom::Start(off))
        .map_err(|e| LoadError::io(path, e))?;
    let file = tokio::fs::File::from_std(file);
    let chunks = futures_util::stream::unfold((file, len), |(mut f, left)| async move {
        use tokio::io::AsyncReadExt;
        if left == 0 {
            return None;
        }
        let mut buf = vec![0u8; left.min(1 << 20) as usize];
        match f.read(&mut buf).await {
            Ok(0) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "file shrank during the upload",
                )),
                (f, 0),
            )),
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), (f, left - n as u64)))
            }
            Err(e) => Some((Err(e), (f, 0))),
        }
    });
    Ok(reqwest::Body::wrap_stream(chunks))
}
