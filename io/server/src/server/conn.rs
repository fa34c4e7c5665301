//! The connection shell around the router: accepting with a cap on open connections, hyper's
//! HTTP/1 with a header read timeout, a per-connection idle watchdog, optional TLS, and a
//! shutdown that waits at most a grace period before dropping what is still open.
//!
//! Why our own accept loop and not `axum::serve`: that one has no timeouts, no connection cap
//! and a graceful shutdown without a deadline, so one half-sent request held the process
//! forever.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use http_body_util::BodyExt as _;
use hyper_util::rt::TokioIo;
use relay_core::limits::LogThrottle;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

use super::{Server, lock};

/// What a connection did last, for the idle watchdog.
struct Activity {
    start: Instant,
    /// Milliseconds after `start` of the last byte read or request finished.
    last: AtomicU64,
    /// Requests whose response (body included: a doorbell stream) is not finished.
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }
    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }
    /// Resolves once the connection has had no request in flight and read no byte for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let deadline =
                self.start + Duration::from_millis(self.last.load(Ordering::Relaxed)) + idle;
            tokio::time::sleep_until(deadline).await;
            let still =
                self.start + Duration::from_millis(self.last.load(Ordering::Relaxed)) + idle;
            if self.in_flight.load(Ordering::Relaxed) == 0 && still <= Instant::now() {
                return;
            }
            if self.in_flight.load(Ordering::Relaxed) > 0 {
                // Busy: look again one idle period after now (the request's end touches).
                self.touch();
            }
        }
    }
}

/// Ends a request's share of the activity when its response body is dropped.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// The stream, noting every read in the activity.
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The answer to a connection over the cap: written without waiting, then the socket closes.
#[cfg(not(madsim))]
const BUSY_BODY: &str = "too many open connections; try again in a moment\n";

/// The address a request came from, as a request extension (the Board's one-time login link
/// opens only for loopback).
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub std::net::SocketAddr);

/// Serves one connection until it ends, its watchdog fires, or shutdown has it finish.
async fn serve_connection<S>(
    server: Server,
    router: axum::Router,
    peer: std::net::SocketAddr,
    stream: S,
    activity: Arc<Activity>,
    mut shutdown: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = server.config().clone();
    let act = activity.clone();
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            use tower::Service as _;
            req.extensions_mut().insert(Peer(peer));
            act.in_flight.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight(act.clone());
            let mut router = router.clone();
            async move {
                let response = match router.call(req).await {
                    Ok(r) => r,
                    Err(e) => match e {},
                };
                // The guard lives as long as the body: a doorbell stream is a request in flight.
                Ok::<_, Infallible>(response.map(|body| {
                    axum::body::Body::new(body.map_frame(move |f| {
                        let _ = &guard;
                        f
                    }))
                }))
            }
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(relay_rt::Timer)
        .header_read_timeout(config.header_read_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(
        TokioIo::new(Watched {
            inner: stream,
            activity: activity.clone(),
        }),
        service,
    );
    tokio::pin!(conn);
    let mut draining = *shutdown.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = shutdown.wait_for(|v| *v), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            () = activity.idle_for(config.idle_timeout) => {
                tracing::debug!("closing an idle connection");
                return;
            }
        }
    }
}

/// Something that turns an accepted TCP stream into the stream HTTP runs over.
pub(crate) type Tls = Option<tokio_rustls::TlsAcceptor>;

/// The accept loop, serving `router` on every connection: until `shutdown` resolves, then the
/// grace period, then whatever is still open is dropped. Never returns an error for one bad connection.
pub(crate) async fn accept_loop(
    server: Server,
    router: axum::Router,
    listener: tokio::net::TcpListener,
    tls: Tls,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let config = server.config().clone();
    let permits = Arc::new(Semaphore::new(config.max_connections));
    let (stop, stop_rx) = watch::channel(false);
    let refused = Mutex::new(LogThrottle::new(10_000));
    // The connections' tasks (not a `JoinSet`, which madsim's runtime lacks): reaped as they
    // end, aborted when the grace period is over.
    let mut tasks = FuturesUnordered::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.next(), if !tasks.is_empty() => continue,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: keep accepting what we can; do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refuse(&stream);
            server.inner.metrics.connections_refused.inc();
            if let Some(suppressed) = lock(&refused).allow(server.now()) {
                tracing::warn!(
                    %peer,
                    max_connections = config.max_connections,
                    suppressed,
                    "refused a connection: at the maximum of open connections (--max-connections)"
                );
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let server = server.clone();
        let stop_rx = stop_rx.clone();
        let tls = tls.clone();
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let activity = Arc::new(Activity::new());
            match tls {
                None => serve_connection(server, router, peer, stream, activity, stop_rx).await,
                Some(acceptor) => {
                    // The handshake is bounded like a header: a silent TLS client holds nothing.
                    let timeout = server.config().header_read_timeout;
                    match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                        Ok(Ok(s)) => {
                            serve_connection(server, router, peer, s, activity, stop_rx).await
                        }
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        }));
    }
    drop(listener);
    tracing::info!(
        open = tasks.len(),
        grace_ms = u64::try_from(config.shutdown_grace.as_millis()).unwrap_or(u64::MAX),
        "shutting down: no new connections; finishing in-flight requests"
    );
    stop.send_replace(true);
    server.begin_shutdown();
    let drained = tokio::time::timeout(config.shutdown_grace, async {
        while tasks.next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            dropped = tasks.len(),
            "shutdown grace over: dropping the connections still open (--shutdown-grace)"
        );
        for task in &tasks {
            task.abort();
        }
        while tasks.next().await.is_some() {}
    }
    Ok(())
}

#[cfg(not(madsim))]
fn refuse(stream: &TcpStream) {
    // Best effort and never waiting: a client that does not read its answer just sees a close.
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n\
         retry-after: 1\r\ncontent-length: {}\r\n\r\n{BUSY_BODY}",
        BUSY_BODY.len()
    );
    let _ = stream.try_write(answer.as_bytes());
}

/// madsim's simulated stream has no non-blocking write: a refused connection just closes.
#[cfg(madsim)]
fn refuse(_: &TcpStream) {}

/// A TLS acceptor from a PEM certificate chain and a PEM private key (rustls with ring).
/// Errors name the file and the fix.
pub fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, relay_core::Error> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |path: &std::path::Path, what: &str, e: &dyn std::fmt::Display| {
        relay_core::Error::invalid(format!(
            "--tls-{what} {}: {e}; give a PEM file ({})",
            path.display(),
            if what == "cert" {
                "the certificate chain, leaf first"
            } else {
                "the certificate's private key, PKCS#8, PKCS#1 or SEC1"
            }
        ))
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, "cert", &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(cert, "cert", &e))?;
    if chain.is_empty() {
        return Err(bad(cert, "cert", &"no CERTIFICATE block found"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, "key", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| relay_core::Error::internal(format!("TLS setup: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            relay_core::Error::invalid(format!(
                "--tls-cert {} and --tls-key {} do not make a usable pair: {e}",
                cert.display(),
                key.display()
            ))
        })?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
