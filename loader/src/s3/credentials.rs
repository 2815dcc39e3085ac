//! Where the client's credentials come from, in the order the AWS tools look:
//! 1. `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`): used as given;
//! 2. a web identity — `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, what EKS (IRSA) and
//!    other OIDC-federated platforms mount into a pod: the token is exchanged for temporary
//!    credentials with STS `AssumeRoleWithWebIdentity` (an unsigned form POST; the endpoint is
//!    `AWS_ENDPOINT_URL_STS`, else `AWS_ENDPOINT_URL`, else `https://sts.<region>.amazonaws.com`),
//!    once per client, i.e. once per load — far inside the credentials' hour;
//! 3. none: anonymous, unsigned requests (public buckets).

use super::sign::Credentials;

/// A role to assume with a web identity token.
#[derive(Debug, Clone)]
pub struct WebIdentity {
    pub role_arn: String,
    pub token_file: std::path::PathBuf,
    pub session_name: String,
    /// `scheme://host[:port]` of STS.
    pub sts_endpoint: String,
}

impl WebIdentity {
    /// From `AWS_WEB_IDENTITY_TOKEN_FILE`, `AWS_ROLE_ARN` (both needed) and
    /// `AWS_ROLE_SESSION_NAME`.
    pub fn from_env(region: &str) -> Option<WebIdentity> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let token_file = var("AWS_WEB_IDENTITY_TOKEN_FILE")?;
        let role_arn = var("AWS_ROLE_ARN")?;
        let sts_endpoint = var("AWS_ENDPOINT_URL_STS")
            .or_else(|| var("AWS_ENDPOINT_URL"))
            .map(|e| e.trim_end_matches('/').to_string())
            .unwrap_or_else(|| format!("https://sts.{region}.amazonaws.com"));
        Some(WebIdentity {
            role_arn,
            token_file: token_file.into(),
            session_name: var("AWS_ROLE_SESSION_NAME")
                .unwrap_or_else(|| format!("thaw-{}", std::process::id())),
            sts_endpoint,
        })
    }

    /// Exchanges the token (read now: platforms rotate the file) for temporary credentials.
    pub async fn assume(&self, http: &reqwest::Client) -> Result<Credentials, String> {
        let token = std::fs::read_to_string(&self.token_file)
            .map_err(|e| format!("web identity token {}: {e}", self.token_file.display()))?;
        let form = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", "2011-06-15"),
            ("RoleArn", self.role_arn.as_str()),
            ("RoleSessionName", self.session_name.as_str()),
            ("WebIdentityToken", token.trim()),
            ("DurationSeconds", "3600"),
        ];
        let body: String = form
            .iter()
            .map(|(k, v)| format!("{k}={}", super::sign::uri_encode(v, false)))
            .collect::<Vec<_>>()
            .join("&");
        let url = format!("{}/", self.sts_endpoint);
        let resp = http
            .post(&url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("STS {url}: {e}"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| format!("STS {url}: body cut off: {e}"))?;
        if !status.is_success() {
            let code = super::xml::tag(&text, "Code").unwrap_or_default();
            let msg = super::xml::tag(&text, "Message").unwrap_or_default();
            return Err(format!(
                "STS AssumeRoleWithWebIdentity for {}: HTTP {status} {code}: {msg}",
                self.role_arn
            ));
        }
        let tag = |t: &str| {
            super::xml::tag(&text, t)
                .ok_or_else(|| format!("STS answer without <{t}> for {}", self.role_arn))
        };
        Ok(Credentials {
            access_key: tag("AccessKeyId")?,
            secret_key: tag("SecretAccessKey")?,
            session_token: Some(tag("SessionToken")?),
        })
    }
}
