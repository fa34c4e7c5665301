//! The production transport: reqwest with rustls on the ring provider, behind the `reqwest`
//! feature so that a build for a simulated runtime, where reqwest cannot run, leaves both out.

use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::StreamExt;

use super::{
    Answer, HttpRequest, HttpResponse, MAX_RESPONSE_BYTES, StreamResponse, Transport,
    TransportError, chain, within,
};

/// How long an idle pooled connection to a lease source is kept.
const POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(3);

/// The production transport: reqwest with rustls on the ring provider. Redirects are not
/// followed (a redirect would carry the credential headers somewhere the config never named);
/// a 3xx is an answer like any other.
#[derive(Clone, Debug)]
pub struct ReqwestTransport {
    client: reqwest::Client,
}

impl ReqwestTransport {
    /// Installs the ring crypto provider for rustls (once per process; an already installed
    /// provider is kept) and builds the client.
    pub fn new() -> Result<ReqwestTransport, TransportError> {
        // Err means a provider is already installed, which is all we need.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            // Below `relay serve`'s 5 s idle timeout (and most proxies'), so that a heartbeat is
            // never written to a pooled connection the server is closing at that moment.
            .pool_idle_timeout(POOL_IDLE)
            .build()
            .map_err(|e| TransportError::Request(chain(&e.without_url())))?;
        Ok(ReqwestTransport { client })
    }

    fn build(
        &self,
        method: reqwest::Method,
        req: &HttpRequest,
    ) -> Result<reqwest::RequestBuilder, TransportError> {
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &req.headers {
            let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                TransportError::Request(format!("header name {name:?} is not a valid HTTP name"))
            })?;
            let mut value = reqwest::header::HeaderValue::from_str(value).map_err(|_| {
                TransportError::Request(format!(
                    "the value of header {name} is not a valid HTTP header value"
                ))
            })?;
            value.set_sensitive(true);
            headers.append(name, value);
        }
        let url = reqwest::Url::parse(&req.url)
            .map_err(|e| TransportError::Request(format!("the URL is not valid ({e})")))?;
        Ok(self.client.request(method, url).headers(headers))
    }
}

fn reqwest_error(e: reqwest::Error, timeout: Duration) -> TransportError {
    if e.is_timeout() {
        return TransportError::Timeout(timeout);
    }
    let connect = e.is_connect();
    let text = chain(&e.without_url());
    if connect {
        TransportError::Connect(text)
    } else {
        TransportError::Io(text)
    }
}

fn reqwest_headers(h: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter_map(|(n, v)| Some((n.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect()
}

impl Transport for ReqwestTransport {
    fn post(&self, req: HttpRequest) -> Answer<HttpResponse> {
        let built = self.build(reqwest::Method::POST, &req);
        let timeout = req.timeout;
        Box::pin(async move {
            let builder = built?.body(req.body);
            let work = async {
                let mut resp = builder
                    .send()
                    .await
                    .map_err(|e| reqwest_error(e, timeout))?;
                let status = resp.status().as_u16();
                let headers = reqwest_headers(resp.headers());
                let mut body = Vec::new();
                while let Some(chunk) = resp.chunk().await.map_err(|e| reqwest_error(e, timeout))? {
                    if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                        return Err(TransportError::TooLarge(MAX_RESPONSE_BYTES));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(HttpResponse {
                    status,
                    headers,
                    body: Bytes::from(body),
                })
            };
            within(timeout, work).await?
        })
    }

    fn post_stream(&self, req: HttpRequest) -> Answer<StreamResponse> {
        self.stream(reqwest::Method::POST, req)
    }

    fn get_stream(&self, req: HttpRequest) -> Answer<StreamResponse> {
        self.stream(reqwest::Method::GET, req)
    }
}

impl ReqwestTransport {
    fn stream(&self, method: reqwest::Method, req: HttpRequest) -> Answer<StreamResponse> {
        let post = method == reqwest::Method::POST;
        let built = self.build(method, &req);
        let timeout = req.timeout;
        Box::pin(async move {
            let mut builder = built?;
            if post {
                builder = builder.body(req.body);
            }
            let resp = within(timeout, builder.send())
                .await?
                .map_err(|e| reqwest_error(e, timeout))?;
            let status = resp.status().as_u16();
            let headers = reqwest_headers(resp.headers());
            let body = futures_util::stream::unfold(Some(resp), move |resp| async move {
                let mut resp = resp?;
                match resp.chunk().await {
                    Ok(Some(chunk)) => Some((Ok(chunk), Some(resp))),
                    Ok(None) => None,
                    Err(e) => Some((Err(reqwest_error(e, timeout)), None)),
                }
            })
            .boxed();
            Ok(StreamResponse {
                status,
                headers,
                body,
            })
        })
    }
}
