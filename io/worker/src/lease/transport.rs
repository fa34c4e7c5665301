//! The HTTP seam under the lease client, the doorbell listener and the receipt client.
//!
//! [`Transport`] is one POST (URL, headers, JSON body, timeout → status, headers, body), the
//! same POST with its answer read as it arrives (an MCP answer framed as SSE), and one
//! streaming GET (the doorbell's SSE stream). [`ReqwestTransport`] is the production one (rustls
//! with ring, https and http); [`HyperTransport`] is hyper-util's client over a pluggable dialer,
//! plain http only, so that the same clients run over `turmoil::net::TcpStream` in a simulated
//! network, where reqwest cannot run.
//!
//! Nothing here ever prints a header value or a body: requests and responses have hand-written
//! `Debug` forms showing header names and body lengths, and errors describe what failed, never
//! what was sent.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// A boxed, `Send` future: what the object-safe [`Transport`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Answers larger than this are refused: no tool answer, tools/list or receipt answer comes
/// near it, and a runaway body must not exhaust the daemon's memory.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// One HTTP request. `headers` may hold credentials and `body` a lease token, so `Debug` shows
/// header names and the body's length only.
#[derive(Clone)]
pub struct HttpRequest {
    pub url: String,
    pub headers: Vec<(String, String)>,
    /// The JSON body of a POST; ignored by [`Transport::get_stream`].
    pub body: Vec<u8>,
    /// Bounds the whole POST (connect, send, the whole answer); for a stream, until the
    /// answer's headers arrive.
    pub timeout: Duration,
}

impl std::fmt::Debug for HttpRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpRequest")
            .field("url", &self.url)
            .field("headers", &names)
            .field("body_bytes", &self.body.len())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// An HTTP answer: status, headers and a body of type `B`.
pub struct Response<B> {
    pub status: u16,
    /// Names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: B,
}

impl<B> Response<B> {
    /// The first value of a header, by case-insensitive name.
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }
}

/// A complete HTTP answer. The body may carry a lease token (a claim answer), so `Debug` shows
/// its length only.
pub type HttpResponse = Response<Bytes>;

impl Clone for HttpResponse {
    fn clone(&self) -> Self {
        Response {
            status: self.status,
            headers: self.headers.clone(),
            body: self.body.clone(),
        }
    }
}

impl std::fmt::Debug for HttpResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpResponse")
            .field("status", &self.status)
            .field("headers", &names)
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

/// The chunks of a streaming answer's body, as they arrive.
pub type BodyStream = BoxStream<'static, Result<Bytes, TransportError>>;

/// A streaming answer: status and headers now, the body as it comes.
pub type StreamResponse = Response<BodyStream>;

impl std::fmt::Debug for StreamResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamResponse")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Why a request got no HTTP answer. The texts describe the failure and never repeat a header
/// value or a body.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("could not connect ({0})")]
    Connect(String),
    #[error("the connection failed ({0})")]
    Io(String),
    #[error("the answer is larger than {0} bytes")]
    TooLarge(usize),
    /// The request itself cannot be sent (a malformed URL, a header value with a newline, an
    /// https URL on a plain-http transport); retrying will not help.
    #[error("the request cannot be sent: {0}")]
    Request(String),
}

/// What every call of the seam answers, later.
pub type Answer<T> = BoxFuture<'static, Result<T, TransportError>>;

/// `fut`, or `TransportError::Timeout` once `timeout` has passed.
async fn within<T>(timeout: Duration, fut: impl Future<Output = T>) -> Result<T, TransportError> {
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| TransportError::Timeout(timeout))
}

/// The HTTP seam: one POST, and one streaming GET for the doorbell. Object-safe; futures are
/// `'static` so a caller can race them against a cancellation signal.
pub trait Transport: Send + Sync + 'static {
    /// POSTs `req.body`, bounded by `req.timeout` end to end.
    fn post(&self, req: HttpRequest) -> Answer<HttpResponse>;

    /// POSTs `req.body` and hands back the answer once its headers are in (bounded by
    /// `req.timeout`); the caller reads the body as it arrives and bounds that itself. An MCP
    /// server may answer a POST with an SSE stream that it closes late (or never): the client
    /// stops reading once its answer is in.
    fn post_stream(&self, req: HttpRequest) -> Answer<StreamResponse>;

    /// GETs `req.url` and hands back the answer once its headers are in (bounded by
    /// `req.timeout`); the body is then read without a deadline, as long as the server keeps
    /// the stream open.
    fn get_stream(&self, req: HttpRequest) -> Answer<StreamResponse>;
}

/// An error and its sources, joined: the useful part ("Connection refused") is usually deep.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(feature = "reqwest")]
mod reqwest_transport;
#[cfg(feature = "reqwest")]
pub use reqwest_transport::ReqwestTransport;

// ---------------------------------------------------------------------------------------------
// hyper-util over a pluggable dialer
// ---------------------------------------------------------------------------------------------

/// What a dialer hands back: any tokio byte stream.
pub trait DialedIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> DialedIo for T {}

type DialFuture = BoxFuture<'static, io::Result<Box<dyn DialedIo>>>;
type DialFn = Arc<dyn Fn(String, u16) -> DialFuture + Send + Sync>;

/// A dialed connection as hyper-util's client wants it.
struct Dialed(TokioIo<Box<dyn DialedIo>>);

impl hyper::rt::Read for Dialed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Dialed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl Connection for Dialed {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// hyper-util's connector: a tower service from the URI to a dialed connection.
#[derive(Clone)]
struct DialConnector(DialFn);

impl tower::Service<http::Uri> for DialConnector {
    type Response = Dialed;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<Dialed>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let host = uri.host().unwrap_or_default();
        // An IPv6 literal comes bracketed in the URI; dialers want it bare.
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(80);
        let dial = self.0.clone();
        Box::pin(async move { Ok(Dialed(TokioIo::new(dial(host, port).await?))) })
    }
}

/// hyper-util's pooled HTTP/1 client over a dialer: `tokio::net::TcpStream` by default, or any
/// stream (a `turmoil::net::TcpStream` in the simulated network) via
/// [`HyperTransport::with_dialer`]. Plain http only: https sources use [`ReqwestTransport`].
#[derive(Clone)]
pub struct HyperTransport {
    client: Client<DialConnector, Full<Bytes>>,
}

impl std::fmt::Debug for HyperTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HyperTransport").finish_non_exhaustive()
    }
}

impl Default for HyperTransport {
    fn default() -> Self {
        HyperTransport::new()
    }
}

impl HyperTransport {
    /// Dials with `tokio::net::TcpStream`.
    pub fn new() -> HyperTransport {
        HyperTransport::with_dialer(|host, port| async move {
            tokio::net::TcpStream::connect((host.as_str(), port)).await
        })
    }

    /// Dials with `dial(host, port)`.
    pub fn with_dialer<F, Fut, S>(dial: F) -> HyperTransport
    where
        F: Fn(String, u16) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = io::Result<S>> + Send + 'static,
        S: DialedIo,
    {
        let dial: DialFn = Arc::new(move |host, port| {
            let fut = dial(host, port);
            Box::pin(async move { Ok(Box::new(fut.await?) as Box<dyn DialedIo>) })
        });
        // The timer lets the pool drop idle connections (after 90 s by default).
        let client = Client::builder(relay_rt::Exec)
            .pool_timer(relay_rt::Timer)
            .build(DialConnector(dial));
        HyperTransport { client }
    }

    fn build(
        method: http::Method,
        req: &HttpRequest,
        body: Vec<u8>,
    ) -> Result<http::Request<Full<Bytes>>, TransportError> {
        let uri: http::Uri = req
            .url
            .parse()
            .map_err(|e| TransportError::Request(format!("the URL is not valid ({e})")))?;
        if uri.scheme_str() != Some("http") {
            return Err(TransportError::Request(
                "HyperTransport speaks plain http only; use ReqwestTransport for https".into(),
            ));
        }
        let mut builder = http::Request::builder().method(method).uri(uri);
        for (name, value) in &req.headers {
            let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                TransportError::Request(format!("header name {name:?} is not a valid HTTP name"))
            })?;
            let mut value = http::HeaderValue::from_str(value).map_err(|_| {
                TransportError::Request(format!(
                    "the value of header {name} is not a valid HTTP header value"
                ))
            })?;
            value.set_sensitive(true);
            builder = builder.header(name, value);
        }
        builder
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| TransportError::Request(e.to_string()))
    }
}

fn hyper_error(e: hyper_util::client::legacy::Error) -> TransportError {
    if e.is_connect() {
        TransportError::Connect(chain(&e))
    } else {
        TransportError::Io(chain(&e))
    }
}

fn http_headers(h: &http::HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter_map(|(n, v)| Some((n.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect()
}

impl Transport for HyperTransport {
    fn post(&self, req: HttpRequest) -> Answer<HttpResponse> {
        let client = self.client.clone();
        let timeout = req.timeout;
        let built = HyperTransport::build(http::Method::POST, &req, req.body.clone());
        Box::pin(async move {
            let request = built?;
            let work = async {
                let resp = client.request(request).await.map_err(hyper_error)?;
                let status = resp.status().as_u16();
                let headers = http_headers(resp.headers());
                let body = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
                    .collect()
                    .await
                    .map_err(|e| {
                        if e.is::<http_body_util::LengthLimitError>() {
                            TransportError::TooLarge(MAX_RESPONSE_BYTES)
                        } else {
                            TransportError::Io(chain(e.as_ref()))
                        }
                    })?
                    .to_bytes();
                Ok(HttpResponse {
                    status,
                    headers,
                    body,
                })
            };
            within(timeout, work).await?
        })
    }

    fn post_stream(&self, req: HttpRequest) -> Answer<StreamResponse> {
        let body = req.body.clone();
        self.stream(http::Method::POST, req, body)
    }

    fn get_stream(&self, req: HttpRequest) -> Answer<StreamResponse> {
        self.stream(http::Method::GET, req, Vec::new())
    }
}

impl HyperTransport {
    fn stream(
        &self,
        method: http::Method,
        req: HttpRequest,
        body: Vec<u8>,
    ) -> Answer<StreamResponse> {
        let client = self.client.clone();
        let timeout = req.timeout;
        let built = HyperTransport::build(method, &req, body);
        Box::pin(async move {
            let resp = within(timeout, client.request(built?))
                .await?
                .map_err(hyper_error)?;
            let status = resp.status().as_u16();
            let headers = http_headers(resp.headers());
            let body = futures_util::stream::unfold(Some(resp.into_body()), |body| async move {
                let mut body = body?;
                loop {
                    match body.frame().await {
                        None => return None,
                        Some(Err(e)) => return Some((Err(TransportError::Io(chain(&e))), None)),
                        Some(Ok(frame)) => {
                            // Trailers carry nothing for us.
                            if let Ok(data) = frame.into_data() {
                                return Some((Ok(data), Some(body)));
                            }
                        }
                    }
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
