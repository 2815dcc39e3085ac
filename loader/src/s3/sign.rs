//! AWS Signature Version 4 for S3 requests, header form.
//!
//! Written out rather than pulled from the AWS SDK: the loader needs four request kinds (ranged
//! GET, GET, LIST, PUT), and the SDK's build cost (minutes of cold compile) buys nothing else
//! here. The rules followed are S3's: the canonical URI is encoded once (not twice, unlike other
//! services), query parameters are sorted by encoded name, and the payload hash is sent as
//! `x-amz-content-sha256`. The unit test is the worked example from S3's documentation.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// An access key pair, with the session token of temporary credentials.
#[derive(Clone)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    // The secret never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

/// SHA-256 of the empty payload (every GET).
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// Payload hash for bodies not hashed up front (allowed by S3 for PUT).
pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

/// One request to sign. `path` is the raw (unencoded) path, starting with `/`.
pub struct Request<'a> {
    pub method: &'a str,
    pub host: &'a str,
    pub path: &'a str,
    pub query: &'a [(&'a str, &'a str)],
    /// Headers to sign besides host and the x-amz ones (lower-case names), e.g. `range`.
    pub headers: &'a [(&'a str, &'a str)],
    pub payload_sha256: &'a str,
}

/// Percent-encoding per SigV4: unreserved characters stay, everything else is `%XX` (upper
/// case); `/` stays only when `keep_slash` (object keys in a path).
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The query string in canonical form (also what goes on the wire).
pub fn canonical_query(query: &[(&str, &str)]) -> String {
    let mut q: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (uri_encode(k, false), uri_encode(v, false)))
        .collect();
    q.sort();
    q.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// The headers to add to `req`: `x-amz-date`, `x-amz-content-sha256`, `x-amz-security-token`
/// (temporary credentials) and `authorization`. `amz_date` is `YYYYMMDDTHHMMSSZ`.
pub fn sign(
    req: &Request,
    creds: &Credentials,
    region: &str,
    amz_date: &str,
) -> Vec<(&'static str, String)> {
    let mut headers: Vec<(String, String)> = vec![
        ("host".into(), req.host.to_string()),
        ("x-amz-content-sha256".into(), req.payload_sha256.into()),
        ("x-amz-date".into(), amz_date.into()),
    ];
    if let Some(t) = &creds.session_token {
        headers.push(("x-amz-security-token".into(), t.clone()));
    }
    for (k, v) in req.headers {
        headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
    }
    headers.sort();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let canonical = format!(
        "{}\n{}\n{}\n{}\n{}\n{}",
        req.method,
        uri_encode(req.path, true),
        canonical_query(req.query),
        canonical_headers,
        signed,
        req.payload_sha256
    );
    let day = &amz_date[..8];
    let scope = format!("{day}/{region}/s3/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let k = hmac(
        format!("AWS4{}", creds.secret_key).as_bytes(),
        day.as_bytes(),
    );
    let k = hmac(&k, region.as_bytes());
    let k = hmac(&k, b"s3");
    let k = hmac(&k, b"aws4_request");
    let signature = hex::encode(hmac(&k, to_sign.as_bytes()));
    let mut out = vec![
        ("x-amz-date", amz_date.to_string()),
        ("x-amz-content-sha256", req.payload_sha256.to_string()),
        (
            "authorization",
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed},Signature={signature}",
                creds.access_key
            ),
        ),
    ];
    if let Some(t) = &creds.session_token {
        out.push(("x-amz-security-token", t.clone()));
    }
    out
}

/// `YYYYMMDDTHHMMSSZ` for a time in seconds since the Unix epoch (UTC).
pub fn amz_date(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// [`amz_date`] for now.
pub fn amz_date_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    amz_date(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// S3 documentation, "Signature calculations for the Authorization header", GET Object.
    #[test]
    fn documented_get_object_example() {
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        };
        let req = Request {
            method: "GET",
            host: "examplebucket.s3.amazonaws.com",
            path: "/test.txt",
            query: &[],
            headers: &[("range", "bytes=0-9")],
            payload_sha256: EMPTY_SHA256,
        };
        let h = sign(&req, &creds, "us-east-1", "20130524T000000Z");
        let auth = &h.iter().find(|(k, _)| *k == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,\
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    #[test]
    fn dates_and_encoding() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
        assert_eq!(amz_date(951_782_400 + 3661), "20000229T010101Z");
        assert_eq!(uri_encode("a b/c+d~", true), "a%20b/c%2Bd~");
        assert_eq!(uri_encode("a/b", false), "a%2Fb");
        assert_eq!(
            canonical_query(&[("prefix", "m/x"), ("list-type", "2")]),
            "list-type=2&prefix=m%2Fx"
        );
    }
}
