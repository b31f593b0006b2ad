//! The HTTP provider adapter: POSTs a job's payload to the route its kind
//! selects, with tollgate's headers, and reports what happened as a
//! [`ProviderResponse`] for `tollgate-core` to classify.
//!
//! Routes come only from operator config: a job chooses a kind, never a URL
//! or a header.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue, LOCATION, RETRY_AFTER};
use tollgate_core::outcome::ProviderResponse;
use tollgate_core::ports::{Provider, ProviderCall, ThrottleScope};
use tollgate_core::{Eligibility, Job};
use url::Url;

/// How much of a provider's answer is read (and thrown away) so that its
/// connection can be reused; past it the connection is dropped instead.
const MAX_DRAINED_BODY: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("route {kind:?}: {url} is not an http(s) URL")]
    Scheme { kind: String, url: String },
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Where jobs of one kind go.
#[derive(Clone, Debug)]
pub struct Route {
    pub kind: String,
    pub url: Url,
    /// Asked before each permit: 200 = send, 410 = skip (no quota used).
    pub eligibility_url: Option<Url>,
    /// Whom a 429 from this route pauses.
    pub throttle_scope: ThrottleScope,
}

impl Route {
    pub fn new(
        kind: impl Into<String>,
        url: Url,
        eligibility_url: Option<Url>,
        throttle_scope: ThrottleScope,
    ) -> Result<Self, ProviderError> {
        let kind = kind.into();
        for u in std::iter::once(&url).chain(eligibility_url.as_ref()) {
            if !matches!(u.scheme(), "http" | "https") {
                return Err(ProviderError::Scheme {
                    kind,
                    url: redact(u),
                });
            }
        }
        Ok(Self {
            kind,
            url,
            eligibility_url,
            throttle_scope,
        })
    }
}

/// A URL safe to log: any password is replaced.
fn redact(url: &Url) -> String {
    tollgate_core::redact_url(url.as_str())
}

pub struct HttpProvider {
    client: reqwest::Client,
    routes: HashMap<String, Route>,
}

impl HttpProvider {
    /// `timeout` bounds the whole call (connect, send, response). Redirects
    /// are never followed: a 3xx is an answer, which the core rejects.
    pub fn new(routes: Vec<Route>, timeout: Duration) -> Result<Self, ProviderError> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .pool_max_idle_per_host(64)
            .build()?;
        Ok(Self {
            client,
            routes: routes.into_iter().map(|r| (r.kind.clone(), r)).collect(),
        })
    }
}

/// Header values from validated ids: they contain no control characters, so
/// `from_bytes` accepts them; the percent-encoded form is a belt and braces.
fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_bytes(s.as_bytes()).unwrap_or_else(|_| {
        let encoded: String = url::form_urlencoded::byte_serialize(s.as_bytes()).collect();
        HeaderValue::from_str(&encoded).expect("percent-encoding is visible ASCII")
    })
}

/// The contract headers of a call about `job`.
fn job_headers(job: &Job, attempt: u32) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(5);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        "idempotency-key",
        header_value(job.idempotency_key.as_str()),
    );
    headers.insert("x-tollgate-tenant", header_value(job.tenant.as_str()));
    headers.insert("x-tollgate-job-id", header_value(job.id.as_str()));
    headers.insert("x-tollgate-attempt", HeaderValue::from(attempt));
    headers
}

impl Provider for HttpProvider {
    fn route(&self, job: &Job) -> Option<&str> {
        self.routes.get(job.kind.as_str()).map(|r| r.kind.as_str())
    }

    fn throttle_scope(&self, job: &Job) -> ThrottleScope {
        self.routes
            .get(job.kind.as_str())
            .map(|r| r.throttle_scope)
            .unwrap_or_default()
    }

    /// POSTs the same headers and body as the provider call would.
    async fn eligibility(&self, job: &Job) -> Eligibility {
        let Some(url) = self
            .routes
            .get(job.kind.as_str())
            .and_then(|r| r.eligibility_url.as_ref())
        else {
            return Eligibility::Eligible;
        };
        let answer = self
            .client
            .post(url.clone())
            .headers(job_headers(job, 0))
            .body(job.payload.get().to_owned())
            .send()
            .await;
        match answer.map(|r| r.status().as_u16()) {
            Ok(200) => Eligibility::Eligible,
            Ok(410) => Eligibility::Skip,
            Ok(status) => {
                tracing::warn!(status, kind = %job.kind, "eligibility webhook answered neither 200 nor 410");
                Eligibility::Unavailable
            }
            Err(e) => {
                tracing::warn!(error = %e.without_url(), kind = %job.kind, "eligibility webhook unreachable");
                Eligibility::Unavailable
            }
        }
    }

    async fn call(&self, call: ProviderCall<'_>) -> ProviderResponse {
        let job = call.job;
        let Some(route) = self.routes.get(job.kind.as_str()) else {
            // The runtime checks the route before asking for a permit.
            return ProviderResponse::Unreachable;
        };
        let sent = self
            .client
            .post(route.url.clone())
            .headers(job_headers(job, call.attempt))
            .body(job.payload.get().to_owned())
            .send()
            .await;
        match sent {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                // Every value of a repeated header, as one list (`5, 30`):
                // the classifier takes the longest wait.
                let header = |name| {
                    let values: Vec<String> = resp
                        .headers()
                        .get_all(name)
                        .iter()
                        .map(|v: &HeaderValue| String::from_utf8_lossy(v.as_bytes()).into_owned())
                        .collect();
                    (!values.is_empty()).then(|| values.join(", "))
                };
                let (retry_after, location) = (header(RETRY_AFTER), header(LOCATION));
                // Drain the body so the connection can be reused, but only so
                // far: the call is answered, and a provider's endless body
                // must not hold the pod's memory (or the job) meanwhile.
                let mut drained = 0;
                while drained <= MAX_DRAINED_BODY {
                    match resp.chunk().await {
                        Ok(Some(chunk)) => drained += chunk.len(),
                        _ => break,
                    }
                }
                ProviderResponse::Status {
                    status,
                    retry_after,
                    location,
                }
            }
            // A timeout once connected: the request may be with the provider.
            Err(e) if e.is_timeout() && !e.is_connect() => ProviderResponse::Timeout,
            Err(e) => {
                // Not connected: the request never left. Anything else (a
                // connection closed or reset once the request was written)
                // may have reached the provider.
                let unreachable = e.is_connect();
                tracing::debug!(error = %e.without_url(), route = %route.kind, "provider transport error");
                if unreachable {
                    ProviderResponse::Unreachable
                } else {
                    ProviderResponse::Broken
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_in_urls() {
        let url = Url::parse("https://user:s3cret@provider.example/send").unwrap();
        let shown = redact(&url);
        assert!(!shown.contains("s3cret"));
        assert!(shown.contains("user:REDACTED@provider.example"));
    }

    #[test]
    fn refuses_non_http_routes() {
        let url = Url::parse("file:///etc/passwd").unwrap();
        assert!(matches!(
            Route::new("default", url, None, ThrottleScope::Tenant),
            Err(ProviderError::Scheme { .. })
        ));
    }

    /// A 429 with two `Retry-After` headers, then a body that never ends:
    /// both values reach the classifier, and the call is answered after
    /// reading a bounded part of the body (the server counts what it could
    /// write before the client hung up; it stops by itself at 256 MiB).
    #[tokio::test]
    async fn a_repeated_retry_after_is_one_list_and_an_endless_body_is_not_read() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const SERVER_STOPS_AT: usize = 256 << 20;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 64 * 1024];
            let _ = socket.read(&mut request).await;
            socket
                .write_all(
                    b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 5\r\n\
                      Retry-After: 30\r\nTransfer-Encoding: chunked\r\n\r\n",
                )
                .await
                .unwrap();
            let chunk = format!("2000\r\n{}\r\n", "x".repeat(0x2000));
            let mut written = 0;
            while written < SERVER_STOPS_AT && socket.write_all(chunk.as_bytes()).await.is_ok() {
                written += 0x2000;
            }
            written
        });
        let url = Url::parse(&format!("http://{addr}/send")).unwrap();
        let route = Route::new("default", url, None, ThrottleScope::Tenant).unwrap();
        let provider = HttpProvider::new(vec![route], Duration::from_secs(600)).unwrap();
        let body = br#"{"id":"j-1","tenant":"acme","kind":"default","payload":{}}"#;
        let job = tollgate_core::job::decode(body, &tollgate_core::job::Limits::default()).unwrap();
        let response = provider
            .call(ProviderCall {
                job: &job,
                attempt: 1,
            })
            .await;
        assert_eq!(
            response,
            ProviderResponse::Status {
                status: 429,
                retry_after: Some("5, 30".into()),
                location: None,
            }
        );
        drop(provider);
        let written = server.await.unwrap();
        assert!(
            written < SERVER_STOPS_AT,
            "the client read the endless body until the server gave up ({written} bytes)"
        );
    }

    #[test]
    fn header_values_keep_unicode_ids() {
        assert_eq!(header_value("job-1").to_str().unwrap(), "job-1");
        assert_eq!(header_value("jöb").as_bytes(), "jöb".as_bytes());
    }
}
