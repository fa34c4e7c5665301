//! [`ReceiptClient`]: the attempt receipt upload to a `[cairn.<name>]` source.
//!
//! # The upload
//!
//! One Markdown artifact per receipt, through Cairn's artifact API as every Cairn accepts it
//! today (no probe for receipt metadata, no fallback):
//!
//! ```text
//! POST {url}/artifacts
//! <the source's resolved headers>
//! Content-Type: application/json
//!
//! {"content": "<markdown>", "content_type": "text/markdown",
//!  "tags": ["receipt", "harness", "relay"], "ttl_seconds": <the source's ttl>}
//!
//! 200 or 201  {"handle": "mcp://cairn/<id>"}
//! ```
//!
//! The handle must be an `mcp://cairn/<id>` handle or an https URL of at most 512 bytes (the
//! same check the queue applies to artifacts); anything else is a failed upload. The upload is
//! bounded by the command's timeout (30 s); a failure is an `Input::ReceiptFailed` whose text
//! names the source and never a header value.

use std::sync::Arc;
use std::time::Duration;

use relay_core::bounds::check_artifact;
use relay_core::config::{ResolvedConfig, Secret, SourceKind, SourceRef};
use relay_core::relay::summary::receipt_log_section;
use relay_core::relay::{Command, Input, Redactor};
use serde_json::{Value, json};

use super::mcp::Endpoint;
use super::transport::Transport;

/// The receipt as uploaded: the machine's Markdown plus the last `lines` lines of the run log
/// (`run_log_tail`: the end of the run log as bytes; a few hundred KiB is plenty), ANSI-folded
/// and redacted.
pub fn compose_receipt(
    markdown: &str,
    run_log_tail: &[u8],
    lines: usize,
    redactor: &Redactor,
) -> String {
    format!(
        "{markdown}{}",
        receipt_log_section(run_log_tail, lines, redactor)
    )
}

/// Why a receipt upload failed; the text names the source and never a header value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: receipt upload failed: {detail}; {hint}")]
pub struct ReceiptError {
    /// `cairn.main`.
    pub source_name: String,
    pub detail: String,
    pub hint: String,
}

/// The receipt client of one Cairn source.
#[derive(Debug)]
pub struct ReceiptClient {
    ep: Endpoint,
    ttl_seconds: u64,
}

impl ReceiptClient {
    /// `url` is Cairn's base URL; `ttl_seconds` is the artifact's time to live.
    pub fn new(
        source: impl Into<String>,
        url: impl Into<String>,
        headers: impl IntoIterator<Item = (String, Secret)>,
        ttl_seconds: u64,
        transport: Arc<dyn Transport>,
    ) -> ReceiptClient {
        let url = format!("{}/artifacts", url.into().trim_end_matches('/'));
        ReceiptClient {
            ep: Endpoint::new(source, url, headers, transport),
            ttl_seconds,
        }
    }

    /// The client of `[cairn.<name>]` in a resolved config.
    pub fn from_config(
        config: &ResolvedConfig,
        name: &str,
        transport: Arc<dyn Transport>,
    ) -> Option<ReceiptClient> {
        let source = config.config.cairns.get(name)?;
        let r = SourceRef {
            kind: SourceKind::Cairn,
            name: name.to_string(),
        };
        let headers = config.headers(&r).cloned().unwrap_or_default();
        Some(ReceiptClient::new(
            r.to_string(),
            source.endpoint.url.as_str(),
            headers,
            source.ttl / 1000,
            transport,
        ))
    }

    pub fn source_name(&self) -> &str {
        &self.ep.source
    }

    /// Carries out a `Command::UploadReceipt`: composes the receipt from its Markdown and
    /// `run_log_tail`, uploads it within the command's timeout, and answers `ReceiptUploaded`
    /// or `ReceiptFailed`. `None` for any other command.
    pub async fn execute(&self, command: &Command, run_log_tail: &[u8]) -> Option<Input> {
        let Command::UploadReceipt {
            request,
            markdown,
            run_log_lines,
            redactor,
            tags,
            timeout,
            ..
        } = command
        else {
            return None;
        };
        let content = compose_receipt(markdown, run_log_tail, *run_log_lines, redactor);
        let timeout = Duration::from_millis(*timeout);
        Some(match self.upload(&content, tags, timeout).await {
            Ok(handle) => Input::ReceiptUploaded {
                request: *request,
                handle,
            },
            Err(e) => {
                tracing::warn!(source = %self.ep.source, "{e}");
                Input::ReceiptFailed {
                    request: *request,
                    error: e.to_string(),
                }
            }
        })
    }

    /// Uploads one Markdown artifact; its handle.
    pub async fn upload(
        &self,
        markdown: &str,
        tags: &[String],
        timeout: Duration,
    ) -> Result<String, ReceiptError> {
        let fail = |detail: String, hint: &str| ReceiptError {
            source_name: self.ep.source.clone(),
            detail,
            hint: hint.to_string(),
        };
        let body = json!({
            "content": markdown,
            "content_type": "text/markdown",
            "tags": tags,
            "ttl_seconds": self.ttl_seconds,
        });
        let mut req = self
            .ep
            .request(None, "application/json", body.to_string().into_bytes());
        req.timeout = timeout;
        let resp = self.ep.transport.post(req).await.map_err(|e| {
            fail(
                e.to_string(),
                "check that Cairn is running and reachable at the source's url; the report goes \
                 out without a receipt",
            )
        })?;
        match resp.status {
            200 | 201 => {}
            401 | 403 => {
                return Err(fail(
                    format!("Cairn answered HTTP {}", resp.status),
                    "check the source's Authorization header and the token in its env_file",
                ));
            }
            s => {
                return Err(fail(
                    format!("Cairn answered HTTP {s}"),
                    "check the source's url (Cairn's base URL, without /artifacts) and Cairn's log",
                ));
            }
        }
        let answer: Value = serde_json::from_slice(&resp.body)
            .map_err(|e| fail(format!("the answer is not JSON ({e})"), "check Cairn's log"))?;
        let Some(handle) = answer.get("handle").and_then(Value::as_str) else {
            return Err(fail(
                "the answer has no handle".into(),
                "check that the source's url points at Cairn",
            ));
        };
        check_artifact(handle).map_err(|why| {
            fail(
                format!("the answered handle {why}"),
                "check that the source's url points at Cairn",
            )
        })?;
        Ok(handle.to_string())
    }
}
