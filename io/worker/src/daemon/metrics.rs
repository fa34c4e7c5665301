//! The daemon's Prometheus metrics: attempts by relay outcome, heartbeat failures.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use relay_core::relay::RunRecord;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    harness: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HarnessLabel {
    harness: String,
}

pub struct DaemonMetrics {
    registry: Registry,
    attempts: Family<Outcome, Counter>,
    heartbeat_failures: Family<HarnessLabel, Counter>,
}

impl std::fmt::Debug for DaemonMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DaemonMetrics")
    }
}

impl Default for DaemonMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let attempts = Family::<Outcome, Counter>::default();
        let heartbeat_failures = Family::<HarnessLabel, Counter>::default();
        registry.register(
            "harness_relay_attempts",
            "Attempts of leased harnesses by relay outcome",
            attempts.clone(),
        );
        registry.register(
            "harness_relay_heartbeat_failures",
            "Heartbeats that failed",
            heartbeat_failures.clone(),
        );
        DaemonMetrics {
            registry,
            attempts,
            heartbeat_failures,
        }
    }
}

impl DaemonMetrics {
    pub(crate) fn run_closed(&self, record: &RunRecord) {
        if let Some(outcome) = record.relay_outcome {
            self.attempts
                .get_or_create(&Outcome {
                    harness: record.harness.clone(),
                    outcome: outcome.as_str().to_string(),
                })
                .inc();
        }
    }

    /// Makes the harness's heartbeat-failure series exist at 0, so that a rate over it is
    /// defined before the first failure.
    pub(crate) fn harness(&self, harness: &str) {
        let _ = self.heartbeat_failures.get_or_create(&HarnessLabel {
            harness: harness.to_string(),
        });
    }

    pub(crate) fn heartbeat_failure(&self, harness: &str) {
        self.heartbeat_failures
            .get_or_create(&HarnessLabel {
                harness: harness.to_string(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics` on `addr` in a background task; returns once bound. Plain hyper, not
/// a router: one route does not justify linking the server's web framework into the worker.
pub async fn serve_metrics(
    addr: std::net::SocketAddr,
    metrics: std::sync::Arc<DaemonMetrics>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                // Out of descriptors, say: wait for some to close instead of spinning.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            let service = hyper::service::service_fn(move |req| {
                let answer = metrics_answer(&metrics, &req);
                async move { Ok::<_, std::convert::Infallible>(answer) }
            });
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(())
}

/// The answer to one request: the exposition at `/metrics` (GET, and HEAD, whose body hyper
/// drops), 405 for another method there, 404 elsewhere.
fn metrics_answer<B>(
    metrics: &DaemonMetrics,
    req: &http::Request<B>,
) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    use http::{Method, StatusCode, header};
    let mut answer = http::Response::new(http_body_util::Full::default());
    if req.uri().path() != "/metrics" {
        *answer.status_mut() = StatusCode::NOT_FOUND;
    } else if req.method() != Method::GET && req.method() != Method::HEAD {
        *answer.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        answer
            .headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET,HEAD"));
    } else {
        answer.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static(
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
        );
        *answer.body_mut() = metrics.encode().into();
    }
    answer
}
