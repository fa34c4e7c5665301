//! The lease clients against a small fake MCP server (axum on 127.0.0.1:0), and once over a
//! simulated network (turmoil). No test sleeps to synchronise: they wait on the fake's
//! counters, and the only timeouts are the clients' own, made short.

use std::collections::{BTreeMap, VecDeque};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use relay_core::config::{Secret, parse_env_file};
use relay_core::error::ErrorCode;
use relay_core::relay::{
    Capabilities, Command, Input, LeaseError, LeaseToken, Redactor, ReportVerb, RequestId,
};
use relay_core::wire::{Tool, call_result, tools_list};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::*;

/// Planted where they must never come back out.
const TOKEN: &str = "tok-SECRET-123";
const HEADER: &str = "Bearer hdr-SECRET-456";

fn secret(value: &str) -> Secret {
    let vars = parse_env_file(&format!("V={value}")).expect("env line");
    vars.iter().next().expect("one var").1.clone()
}

fn auth() -> Vec<(String, Secret)> {
    vec![("Authorization".to_string(), secret(HEADER))]
}

// ---------------------------------------------------------------------------------------------
// The fake server
// ---------------------------------------------------------------------------------------------

/// How the fake answers the next `tools/call`.
#[derive(Clone, Debug)]
enum Reply {
    /// A tool result whose answer is this object.
    Ok(Value),
    /// The same, framed as an SSE stream.
    OkSse(Value),
    /// This tool result as it is (a text-only result, say).
    Raw(Value),
    /// An `isError` result with this code and message.
    ToolError(&'static str, String),
    Http(u16),
    /// A 200 whose body is not JSON.
    Broken,
    /// Never answers.
    Hang,
    /// Forgets every session, then answers 404 as for an unknown session.
    Expire,
}

#[derive(Debug)]
struct Seen {
    method: String,
    /// Reached a live session, or a modern request on a modern fake.
    live: bool,
    session: Option<String>,
    mcp_method: Option<String>,
    mcp_name: Option<String>,
    authorization: Option<String>,
    protocol: Option<String>,
    params: Value,
}

struct FakeState {
    /// Speaks 2026-07-28 beside the legacy era (a legacy-only fake answers discover 404).
    modern: bool,
    /// How `server/discover` is answered instead, when set.
    discover_status: Option<u16>,
    /// The params of every `subscriptions/listen`.
    listens: Vec<Value>,
    sessions: Vec<String>,
    next_session: u64,
    tools: Value,
    page_size: Option<usize>,
    replies: VecDeque<Reply>,
    posts: Vec<Seen>,
    gets: u32,
    /// The session of every GET.
    get_sessions: Vec<Option<String>>,
    streams: Vec<mpsc::UnboundedSender<Bytes>>,
    opened: watch::Sender<u32>,
    artifacts: Vec<(Option<String>, Value)>,
    artifact_reply: Reply,
}

#[derive(Clone)]
struct Fake(Arc<Mutex<FakeState>>);

impl Fake {
    fn new() -> Fake {
        Fake(Arc::new(Mutex::new(FakeState {
            modern: false,
            discover_status: None,
            listens: Vec::new(),
            sessions: Vec::new(),
            next_session: 1,
            tools: tools_list(&Tool::ALL),
            page_size: None,
            replies: VecDeque::new(),
            posts: Vec::new(),
            gets: 0,
            get_sessions: Vec::new(),
            streams: Vec::new(),
            opened: watch::channel(0).0,
            artifacts: Vec::new(),
            artifact_reply: Reply::Ok(json!({"handle": "mcp://cairn/Rc1"})),
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.0.lock().expect("fake state")
    }

    /// Sends `b` on the newest open GET or listen stream.
    fn send(&self, b: Bytes) {
        let s = self.lock();
        let stream = s.streams.last().expect("a stream");
        stream.send(b).expect("stream open");
    }

    fn reply(&self, r: Reply) -> &Fake {
        self.lock().replies.push_back(r);
        self
    }

    fn methods(&self) -> Vec<String> {
        self.lock().posts.iter().map(|p| p.method.clone()).collect()
    }

    fn count(&self, method: &str) -> usize {
        self.methods().iter().filter(|m| *m == method).count()
    }

    /// The arguments of every `tools/call` that reached a live session.
    fn calls(&self) -> Vec<(String, Value)> {
        let s = self.lock();
        s.posts
            .iter()
            .filter(|p| p.method == "tools/call" && p.live)
            .filter(|p| p.params.get("executed").is_some())
            .map(|p| {
                (
                    p.params["name"].as_str().unwrap_or_default().to_string(),
                    p.params["arguments"].clone(),
                )
            })
            .collect()
    }

    fn router(&self) -> Router {
        Router::new()
            .route("/mcp/e1", post(mcp_post).get(mcp_get))
            .route("/artifacts", post(artifact_post))
            .with_state(self.clone())
    }

    /// Serves on 127.0.0.1:0; the MCP URL.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = self.router();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}/mcp/e1")
    }

    fn client(&self, url: &str) -> LeaseClient {
        LeaseClient::new(
            "queue.ci",
            url,
            auth(),
            Arc::new(ReqwestTransport::new().unwrap()),
        )
        .with_timeout(Duration::from_millis(500))
    }
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn rpc_answer(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

async fn mcp_post(State(fake): State<Fake>, headers: HeaderMap, body: Bytes) -> Response {
    let msg: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let method = msg["method"].as_str().unwrap_or_default().to_string();
    let id = msg["id"].clone();
    let session = header(&headers, "mcp-session-id");
    let mut params = msg.get("params").cloned().unwrap_or(Value::Null);
    let stamped = params["_meta"]
        .get("io.modelcontextprotocol/protocolVersion")
        .is_some();
    let reply = {
        let mut s = fake.lock();
        let known = session.as_ref().is_some_and(|id| s.sessions.contains(id))
            || (stamped && s.modern && session.is_none());
        let reply = if method == "tools/call" && known {
            let r = s
                .replies
                .pop_front()
                .unwrap_or(Reply::Ok(json!({"empty": true})));
            if !matches!(r, Reply::Expire) {
                params["executed"] = json!(true);
            }
            Some(r)
        } else {
            None
        };
        s.posts.push(Seen {
            method: method.clone(),
            live: known,
            session: session.clone(),
            mcp_method: header(&headers, "mcp-method"),
            mcp_name: header(&headers, "mcp-name"),
            authorization: header(&headers, "authorization"),
            protocol: header(&headers, "mcp-protocol-version"),
            params: params.clone(),
        });
        if method == "server/discover"
            && let Some(status) = s.discover_status
        {
            return StatusCode::from_u16(status)
                .expect("status")
                .into_response();
        }
        if method != "initialize" && !known {
            return StatusCode::NOT_FOUND.into_response();
        }
        reply
    };
    match method.as_str() {
        "server/discover" => axum::Json(rpc_answer(
            &id,
            json!({"resultType": "complete", "supportedVersions": ["2026-07-28"],
                   "capabilities": {"tools": {}, "resources": {"subscribe": true}},
                   "ttlMs": 0, "cacheScope": "private"}),
        ))
        .into_response(),
        "resources/list" => axum::Json(rpc_answer(
            &id,
            json!({"resources": [{"uri": "relay://queues/ci-failures"},
                                 {"uri": "relay://todos/td_1"}]}),
        ))
        .into_response(),
        "subscriptions/listen" => {
            let mut s = fake.lock();
            s.listens.push(params.clone());
            let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
            let uris = params["notifications"]["resourceSubscriptions"].clone();
            let ack = json!({"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
                             "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": id},
                                        "notifications": {"resourceSubscriptions": uris}}});
            tx.send(Bytes::from(format!("data: {ack}\n\n")))
                .expect("open");
            s.streams.push(tx);
            s.opened.send_modify(|n| *n += 1);
            event_stream(rx)
        }
        "initialize" => {
            let mut s = fake.lock();
            let sid = format!("sess-{}", s.next_session);
            s.next_session += 1;
            s.sessions.push(sid.clone());
            let answer = rpc_answer(
                &id,
                json!({"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                       "serverInfo": {"name": "fake", "version": "0"}}),
            );
            ([("mcp-session-id", sid)], axum::Json(answer)).into_response()
        }
        "notifications/initialized" => StatusCode::ACCEPTED.into_response(),
        "tools/list" => {
            let s = fake.lock();
            let all = s.tools["tools"].as_array().cloned().unwrap_or_default();
            let start: usize = params["cursor"]
                .as_str()
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let size = s.page_size.unwrap_or(all.len().max(1));
            let page: Vec<Value> = all.iter().skip(start).take(size).cloned().collect();
            let mut result = json!({ "tools": page });
            if start + size < all.len() {
                result["nextCursor"] = json!((start + size).to_string());
            }
            axum::Json(rpc_answer(&id, result)).into_response()
        }
        "tools/call" => match reply.expect("a reply for a call on a live session") {
            Reply::Ok(answer) => {
                axum::Json(rpc_answer(&id, call_result(answer, false))).into_response()
            }
            Reply::Raw(result) => axum::Json(rpc_answer(&id, result)).into_response(),
            Reply::OkSse(answer) => {
                // A notification first, then the answer, and the stream is never closed: the
                // client must stop reading at its answer.
                use futures_util::StreamExt as _;
                let note = json!({"jsonrpc": "2.0", "method": "notifications/progress"});
                let data = rpc_answer(&id, call_result(answer, false));
                let events = vec![
                    Ok::<_, std::convert::Infallible>(Bytes::from(format!(
                        ": note\ndata: {note}\n\n"
                    ))),
                    Ok(Bytes::from(format!("event: message\ndata: {data}\n\n"))),
                ];
                let body =
                    futures_util::stream::iter(events).chain(futures_util::stream::pending());
                (
                    [("content-type", "text/event-stream")],
                    Body::from_stream(body),
                )
                    .into_response()
            }
            Reply::ToolError(code, message) => {
                let answer = json!({"error": {"code": code, "message": message}});
                axum::Json(rpc_answer(&id, call_result(answer, true))).into_response()
            }
            Reply::Http(status) => StatusCode::from_u16(status)
                .expect("status")
                .into_response(),
            Reply::Broken => "{\"jsonrpc\": \"2.0\", \"id\": ".into_response(),
            Reply::Hang => std::future::pending::<Response>().await,
            Reply::Expire => {
                fake.lock().sessions.clear();
                StatusCode::NOT_FOUND.into_response()
            }
        },
        _ => StatusCode::BAD_REQUEST.into_response(),
    }
}

async fn mcp_get(State(fake): State<Fake>, headers: HeaderMap) -> Response {
    let session = header(&headers, "mcp-session-id");
    let mut s = fake.lock();
    s.gets += 1;
    s.get_sessions.push(session.clone());
    if !session.is_some_and(|id| s.sessions.contains(&id)) {
        return StatusCode::NOT_FOUND.into_response();
    }
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    s.streams.push(tx);
    s.opened.send_modify(|n| *n += 1);
    event_stream(rx)
}

/// An SSE stream answering what the test sends down `rx`, open until its sender is dropped.
fn event_stream(rx: mpsc::UnboundedReceiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn artifact_post(State(fake): State<Fake>, headers: HeaderMap, body: Bytes) -> Response {
    let reply = {
        let mut s = fake.lock();
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        s.artifacts.push((header(&headers, "authorization"), v));
        s.artifact_reply.clone()
    };
    match reply {
        Reply::Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Reply::Http(status) => StatusCode::from_u16(status)
            .expect("status")
            .into_response(),
        Reply::Hang => std::future::pending::<Response>().await,
        _ => "not json".into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Commands and answers
// ---------------------------------------------------------------------------------------------

fn claim_cmd(n: u64) -> Command {
    Command::SendClaimNext {
        request: RequestId(n),
        run_id: 1,
        queue: Some("ci-failures".into()),
        lease_ttl_seconds: 300,
        require_fence: true,
        claimant: "harness/buildbox/fixer/run-1".into(),
    }
}

fn heartbeat_cmd(n: u64) -> Command {
    Command::SendHeartbeat {
        request: RequestId(n),
        run_id: 1,
        todo_id: "td_1".into(),
        lease_ttl_seconds: 300,
        lease_token: LeaseToken::new(TOKEN),
    }
}

/// What our server's schemas declare: the contract's arguments, `fail`'s failure class,
/// `usage` on the heartbeat and every report, and `request_input`.
fn ours() -> Capabilities {
    relay_core::testing::relay::our_server_capabilities()
}

fn report_cmd(n: u64, verb: ReportVerb) -> Command {
    relay_core::testing::relay::report_command(n, verb, TOKEN)
}

fn todo_out(id: &str) -> Value {
    json!({
        "id": id, "queue": "ci-failures", "title": "CI red", "state": "claimed",
        "attempt": 2, "max_attempts": 5, "attempts_total": 2,
        "created_at": "2026-09-22T11:58:00Z", "updated_at": "2026-09-22T12:00:00Z",
        "claimed_at": "2026-09-22T12:00:00Z", "dead_letter": false,
    })
}

fn claim_answer(token: Option<&str>) -> Value {
    let mut a = json!({
        "empty": false, "todo": todo_out("td_1"), "attempt_seq": 7, "attempts_total": 2,
        "prior_attempts": [{
            "seq": 6, "attempt": 1, "claimer_kind": "endpoint",
            "claimant": "harness/buildbox/fixer/run-0", "claimed_at": "2026-09-22T11:59:00Z",
            "lease_expires_at": "2026-09-22T12:04:00Z", "ended_at": "2026-09-22T11:59:30Z",
            "outcome": "failed", "disposition": "retry_scheduled", "died": false,
            "summary": "first try", "summary_truncated": false, "artifact": null,
        }],
    });
    if let Some(t) = token {
        a["lease_token"] = json!(t);
    }
    a
}

async fn run(client: &LeaseClient, cmd: Command) -> LeaseOutcome {
    client.execute(&cmd).await.expect("a lease call")
}

/// Heartbeat `n`, which finds its session gone: it succeeds, carried by a new session (the
/// machine hears the expiry, then the server's capabilities again).
async fn heartbeat_on_a_new_session(client: &LeaseClient, n: u64) -> LeaseOutcome {
    let out = run(client, heartbeat_cmd(n)).await;
    let ok = Input::HeartbeatOk {
        request: RequestId(n),
    };
    assert_eq!(out.input, ok);
    assert_eq!(
        out.session,
        [SessionNews::Expired, SessionNews::Known(ours())]
    );
    out
}

fn failed_with(o: &LeaseOutcome) -> LeaseError {
    match &o.input {
        Input::ClaimFailed { error, .. }
        | Input::HeartbeatFailed { error, .. }
        | Input::ReportFailed { error, .. } => error.clone(),
        other => panic!("expected a failure, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn initialize_handshakes_and_sends_the_headers_on_every_request() {
    let fake = Fake::new();
    fake.lock().page_size = Some(4);
    let url = fake.start().await;
    let client = fake.client(&url);
    let caps = client.initialize().await.expect("initialize");
    assert_eq!(caps, ours());
    assert_eq!(client.capabilities(), Some(caps));
    let heartbeat = run(&client, heartbeat_cmd(1)).await;
    assert_eq!(
        heartbeat.input,
        Input::HeartbeatOk {
            request: RequestId(1)
        }
    );
    assert!(heartbeat.session.is_empty());

    // The probe (a legacy-only server: 404), initialize, initialized, tools/list over 3 pages
    // (11 tools), then the call.
    assert_eq!(
        fake.methods(),
        [
            "server/discover",
            "initialize",
            "notifications/initialized",
            "tools/list",
            "tools/list",
            "tools/list",
            "tools/call"
        ]
    );
    let s = fake.lock();
    for p in &s.posts {
        assert_eq!(p.authorization.as_deref(), Some(HEADER), "{}", p.method);
        if p.method != "initialize" && p.method != "server/discover" {
            assert_eq!(p.session.as_deref(), Some("sess-1"), "{}", p.method);
            assert_eq!(p.protocol.as_deref(), Some("2025-06-18"));
        }
    }
    // No capability advertised: above all not claude/channel.
    assert_eq!(s.posts[1].params["capabilities"], json!({}));
    assert_eq!(s.posts[4].params["cursor"], json!("4"));
    assert_eq!(s.gets, 0, "the lease client never opens a GET stream");
}

#[tokio::test]
async fn a_modern_server_is_spoken_without_a_session_every_request_stamped() {
    let fake = Fake::new();
    fake.lock().modern = true;
    fake.reply(Reply::Ok(claim_answer(Some(TOKEN))));
    let url = fake.start().await;
    let client = fake.client(&url);
    let caps = client.initialize().await.expect("initialize");
    assert_eq!(caps, ours(), "the same capability check from tools/list");
    assert_eq!(
        client.era().as_deref(),
        Some("MCP 2026-07-28 (modern era, no session)")
    );
    let claim = run(&client, claim_cmd(1)).await;
    assert!(
        matches!(claim.input, Input::ClaimAnswered { .. }),
        "{claim:?}"
    );
    let heartbeat = run(&client, heartbeat_cmd(2)).await;
    assert_eq!(
        heartbeat.input,
        Input::HeartbeatOk {
            request: RequestId(2)
        }
    );
    assert_eq!(
        fake.methods(),
        ["server/discover", "tools/list", "tools/call", "tools/call"],
        "no initialize, no listen"
    );
    let s = fake.lock();
    for p in &s.posts {
        assert!(p.live, "{}", p.method);
        assert_eq!(p.session, None, "no session in the modern era");
        assert_eq!(p.authorization.as_deref(), Some(HEADER));
        assert_eq!(p.protocol.as_deref(), Some("2026-07-28"));
        assert_eq!(p.mcp_method.as_deref(), Some(p.method.as_str()));
        let meta = &p.params["_meta"];
        assert_eq!(
            meta["io.modelcontextprotocol/protocolVersion"],
            json!("2026-07-28")
        );
        assert_eq!(
            meta["io.modelcontextprotocol/clientCapabilities"],
            json!({})
        );
        assert_eq!(
            meta["io.modelcontextprotocol/clientInfo"]["name"],
            json!("relay")
        );
    }
    assert_eq!(s.posts[2].mcp_name.as_deref(), Some("claim_next"));
    assert_eq!(s.posts[3].mcp_name.as_deref(), Some("heartbeat"));
    assert_eq!(s.posts[3].params["arguments"]["lease_token"], json!(TOKEN));
    assert_eq!(s.gets, 0);
    assert!(s.listens.is_empty(), "the lease client never listens");
}

#[tokio::test]
async fn credentials_and_crashes_at_the_probe_are_errors_not_the_legacy_era() {
    for (status, want) in [
        (401, LeaseError::Other(UNAUTHORIZED.into())),
        (403, LeaseError::Other(UNAUTHORIZED.into())),
        (500, LeaseError::Transport),
        (503, LeaseError::Transport),
    ] {
        let fake = Fake::new();
        fake.lock().discover_status = Some(status);
        let url = fake.start().await;
        let client = fake.client(&url);
        let e = client.initialize().await.expect_err("no era decided");
        assert_eq!(e.kind, want, "{status}");
        assert!(
            e.to_string().contains(&format!("HTTP {status}")),
            "{status}: {e}"
        );
        assert_eq!(fake.count("initialize"), 0, "{status}: no fallback");
        assert_eq!(client.era(), None);
    }
    // Any other 4xx is a legacy-only server: initialize, as before.
    for status in [400, 404, 405] {
        let fake = Fake::new();
        fake.lock().discover_status = Some(status);
        let url = fake.start().await;
        let client = fake.client(&url);
        client.initialize().await.expect("the legacy era");
        assert_eq!(fake.count("initialize"), 1, "{status}");
        assert_eq!(
            client.era().as_deref(),
            Some("MCP 2025-06-18 (legacy era, initialize and a session)")
        );
    }
}

#[tokio::test]
async fn mcp_era_forces_an_era_without_a_probe() {
    use relay_core::mcp::client::EraChoice;
    let fake = Fake::new();
    fake.lock().modern = true;
    let url = fake.start().await;
    let legacy = fake.client(&url).with_era(EraChoice::Legacy);
    legacy.initialize().await.expect("legacy");
    assert_eq!(
        fake.methods()[..2],
        ["initialize", "notifications/initialized"]
    );
    let modern = fake.client(&url).with_era(EraChoice::Modern);
    modern.initialize().await.expect("modern");
    assert_eq!(fake.count("server/discover"), 0);
    assert!(modern.era().is_some_and(|e| e.contains("modern")));
}

#[tokio::test]
async fn a_server_upgraded_or_downgraded_under_the_client_is_followed() {
    let fake = Fake::new();
    let url = fake.start().await;
    let client = fake.client(&url);
    client.initialize().await.expect("legacy");
    assert!(client.era().is_some_and(|e| e.contains("legacy")));

    // Upgraded (a restart forgets the sessions): the 404 re-opens, the probe finds the modern
    // era, and the call goes once more, without a session.
    {
        let mut s = fake.lock();
        s.modern = true;
        s.sessions.clear();
    }
    heartbeat_on_a_new_session(&client, 1).await;
    assert!(client.era().is_some_and(|e| e.contains("modern")));
    assert_eq!(fake.count("initialize"), 1);

    // Downgraded: the modern call is refused (404, no session), the probe falls back, a new
    // session carries the call.
    fake.lock().modern = false;
    heartbeat_on_a_new_session(&client, 2).await;
    assert!(client.era().is_some_and(|e| e.contains("legacy")));
    assert_eq!(fake.count("initialize"), 2);
    assert_eq!(fake.count("server/discover"), 3);
    assert_eq!(fake.calls().len(), 2, "each heartbeat ran once");
}

#[tokio::test]
async fn a_server_without_the_fence_is_unsupported_and_never_claimed_on() {
    let fake = Fake::new();
    fake.lock().tools = relay_core::testing::relay::tools_list(&[
        ("claim_next", &["queue", "lease_ttl_seconds"]),
        ("heartbeat", &["id", "lease_ttl_seconds"]),
        ("complete", &["id", "result"]),
        ("fail", &["id", "result"]),
    ]);
    let url = fake.start().await;
    let client = fake.client(&url);
    let caps = client.initialize().await.expect("initialize");
    assert!(!caps.supported());
    assert!(
        caps.missing
            .contains(&"claim_next.require_fence".to_string())
    );
    let out = run(&client, claim_cmd(1)).await;
    assert_eq!(failed_with(&out), LeaseError::Other(UNSUPPORTED.into()));
    let text = out.error.expect("error").to_string();
    assert!(text.starts_with("queue.ci: claim_next failed"), "{text}");
    assert!(text.contains("claim_next.require_fence"), "{text}");
    assert_eq!(fake.count("tools/call"), 0);

    // doctor reads the raw list.
    let list = client.tools_list().await.expect("tools/list");
    assert_eq!(list.tools["tools"].as_array().map(Vec::len), Some(4));
    assert!(list.session.is_empty());
}

#[tokio::test]
async fn claims_decode_fenced_unfenced_and_empty() {
    let fake = Fake::new();
    fake.reply(Reply::Ok(claim_answer(Some(TOKEN))))
        .reply(Reply::OkSse(claim_answer(None)))
        .reply(Reply::Ok(json!({"empty": true})));
    let url = fake.start().await;
    let client = fake.client(&url);

    // No initialize first: the first call opens the session and reports the check.
    let first = run(&client, claim_cmd(1)).await;
    assert_eq!(first.session, [SessionNews::Known(ours())]);
    let Input::ClaimAnswered { request, claim } = &first.input else {
        panic!("{:?}", first.input)
    };
    assert_eq!(*request, RequestId(1));
    assert_eq!(claim.todo_id, "td_1");
    assert_eq!(
        (claim.attempt, claim.max_attempts, claim.attempt_seq),
        (2, 5, 7)
    );
    assert_eq!(claim.lease_token, Some(LeaseToken::new(TOKEN)));
    assert_eq!(claim.prior_attempts.len(), 1);
    assert_eq!(
        claim.prior_attempts[0].summary.as_deref(),
        Some("first try")
    );
    assert_eq!(first.inputs().len(), 2);

    let unfenced = run(&client, claim_cmd(2)).await;
    let Input::ClaimAnswered { claim, .. } = &unfenced.input else {
        panic!("{:?}", unfenced.input)
    };
    assert_eq!(
        claim.lease_token, None,
        "the machine refuses it as no_fence"
    );

    let empty = run(&client, claim_cmd(3)).await;
    assert_eq!(
        empty.input,
        Input::ClaimEmpty {
            request: RequestId(3)
        }
    );

    let calls = fake.calls();
    assert_eq!(calls[0].0, "claim_next");
    assert_eq!(
        calls[0].1,
        json!({"queue": "ci-failures", "lease_ttl_seconds": 300, "require_fence": true,
               "claimant": "harness/buildbox/fixer/run-1"})
    );
    assert_eq!(fake.lock().gets, 0);
}

/// A claim answer with the relay-design contract table's fields and nothing more.
fn contract_claim_answer() -> Value {
    json!({
        "empty": false,
        "todo": {"id": "td_1", "queue": "ci-failures", "title": "CI red", "kind": null,
                 "source": null, "payload": {"sha": "abc"}, "work_order": null,
                 "attempt": 1, "max_attempts": 3, "created_at": "2026-09-22T11:58:00Z"},
        "attempt_seq": 1,
        "lease_token": TOKEN,
        "prior_attempts": [],
    })
}

#[tokio::test]
async fn a_contract_only_claim_is_claimed_and_one_missing_a_needed_field_is_claim_failed() {
    let fake = Fake::new();
    fake.reply(Reply::OkSse(contract_claim_answer()));
    let needed = [
        "todo.id",
        "todo.attempt",
        "todo.max_attempts",
        "attempt_seq",
    ];
    for field in needed {
        let mut answer = contract_claim_answer();
        match field.split_once('.') {
            Some((_, key)) => answer["todo"].as_object_mut().map(|t| t.remove(key)),
            None => answer.as_object_mut().map(|a| a.remove(field)),
        };
        fake.reply(Reply::Ok(answer));
    }
    let mut bad_token = contract_claim_answer();
    bad_token["lease_token"] = json!(42);
    fake.reply(Reply::Ok(bad_token));
    // A text-only result that is not JSON: no todo.
    fake.reply(Reply::Raw(
        json!({"content": [{"type": "text", "text": "claimed!"}]}),
    ));
    let url = fake.start().await;
    let client = fake.client(&url);

    let ok = run(&client, claim_cmd(1)).await;
    let Input::ClaimAnswered { claim, .. } = &ok.input else {
        panic!("{:?}", ok.input)
    };
    assert_eq!(
        (claim.todo_id.as_str(), claim.attempt, claim.max_attempts),
        ("td_1", 1, 3)
    );
    assert_eq!(claim.todo["payload"], json!({"sha": "abc"}));
    assert_eq!(claim.lease_token, Some(LeaseToken::new(TOKEN)));

    for (n, field) in needed.iter().chain(&["lease_token", "todo"]).enumerate() {
        let out = run(&client, claim_cmd(n as u64 + 2)).await;
        let LeaseError::Malformed(e) = failed_with(&out) else {
            panic!("{field}: {:?}", out.input)
        };
        assert_eq!(e.field, *field);
        assert_eq!(LeaseError::Malformed(e).code(), "malformed_answer");
        // The daemon's log line is this error's text: it names the field, never the token.
        let text = out.error.expect("error").to_string();
        assert!(text.starts_with("queue.ci: claim_next failed: "), "{text}");
        assert!(text.contains(&format!(" {field}")), "{text}");
        assert!(text.contains("the lease will lapse"), "{text}");
        assert!(!text.contains(TOKEN), "{text}");
    }
}

#[tokio::test]
async fn answers_that_only_say_success_need_no_json() {
    let fake = Fake::new();
    let text_only = || Reply::Raw(json!({"content": [{"type": "text", "text": "ok"}]}));
    fake.reply(text_only()).reply(text_only()).reply(Reply::Ok(
        json!({"state": "failed", "attempt": 3, "max_attempts": 3}),
    ));
    let url = fake.start().await;
    let client = fake.client(&url);
    assert_eq!(
        run(&client, heartbeat_cmd(1)).await.input,
        Input::HeartbeatOk {
            request: RequestId(1)
        }
    );
    let accepted = |n| Input::ReportAnswered {
        request: RequestId(n),
        dead_letter: false,
        next_retry_at: None,
    };
    assert_eq!(
        run(&client, report_cmd(2, ReportVerb::Complete))
            .await
            .input,
        accepted(2)
    );
    // A fail answer without dead_letter is accepted and is not a dead letter, whatever the
    // attempt counts say.
    assert_eq!(
        run(&client, report_cmd(3, ReportVerb::Fail)).await.input,
        accepted(3)
    );
}

#[tokio::test]
async fn reports_send_their_arguments_and_read_the_dead_letter() {
    let fake = Fake::new();
    let mut failed = todo_out("td_1");
    failed["state"] = json!("failed");
    failed["dead_letter"] = json!(true);
    let mut retry = todo_out("td_1");
    retry["next_retry_at"] = json!("2026-09-22T12:30:00Z");
    fake.reply(Reply::Ok(failed))
        .reply(Reply::Ok(retry))
        .reply(Reply::Ok(todo_out("td_1")));
    let url = fake.start().await;
    let client = fake.client(&url);
    client.initialize().await.expect("initialize");

    let dead = run(&client, report_cmd(1, ReportVerb::Fail)).await;
    assert_eq!(
        dead.input,
        Input::ReportAnswered {
            request: RequestId(1),
            dead_letter: true,
            next_retry_at: None
        }
    );
    let retried = run(&client, report_cmd(2, ReportVerb::Fail)).await;
    assert_eq!(
        retried.input,
        Input::ReportAnswered {
            request: RequestId(2),
            dead_letter: false,
            next_retry_at: Some("2026-09-22T12:30:00Z".into())
        }
    );
    run(&client, report_cmd(3, ReportVerb::Release)).await;

    let calls = fake.calls();
    assert_eq!(calls[0].0, "fail");
    assert_eq!(
        calls[0].1,
        json!({"id": "td_1", "summary": "attempt 1/5 · agent failed",
               "artifact": "mcp://cairn/Ab12", "result": {"harness": {"run_id": 1}},
               "lease_token": TOKEN, "retryable": false, "failure_signature": "0123abcd"})
    );
    assert_eq!(calls[2].0, "release");
    assert_eq!(
        calls[2].1,
        json!({"id": "td_1", "summary": "attempt 1/5 · agent failed", "lease_token": TOKEN})
    );
}

#[tokio::test]
async fn a_question_and_the_usage_go_out_as_our_server_declares_them() {
    let fake = Fake::new();
    let mut waiting = todo_out("td_1");
    waiting["state"] = json!("input_required");
    let mut exhausted = todo_out("td_1");
    exhausted["dead_letter"] = json!(true);
    fake.reply(Reply::Ok(json!({})))
        .reply(Reply::Ok(waiting))
        .reply(Reply::Ok(exhausted))
        .reply(Reply::ToolError(
            "conflict",
            "spend reached its budget".into(),
        ));
    let url = fake.start().await;
    let client = fake.client(&url);
    client.initialize().await.expect("initialize");
    let usage = relay_core::wire::UsageArg {
        cost_usd: Some(0.25),
        input_tokens: Some(1000),
        output_tokens: Some(20),
    };
    let beat = client
        .execute_with_usage(&heartbeat_cmd(1), Some(&usage))
        .await
        .expect("a lease call");
    assert!(matches!(beat.input, Input::HeartbeatOk { .. }));
    for (n, dead_letter) in [(2, false), (3, true)] {
        let asked = client
            .execute_with_usage(&report_cmd(n, ReportVerb::RequestInput), Some(&usage))
            .await
            .expect("a lease call");
        assert_eq!(
            asked.input,
            Input::ReportAnswered {
                request: RequestId(n),
                dead_letter,
                next_retry_at: None
            }
        );
    }
    // At the budget the heartbeat is refused as a cancel is: lease loss.
    let over = client
        .execute_with_usage(&heartbeat_cmd(4), Some(&usage))
        .await
        .expect("a lease call");
    assert_eq!(failed_with(&over), LeaseError::Code(ErrorCode::Conflict));
    let calls = fake.calls();
    let sent = json!({"cost_usd": 0.25, "input_tokens": 1000, "output_tokens": 20});
    assert_eq!(
        calls[0],
        (
            "heartbeat".to_string(),
            json!({"id": "td_1", "lease_ttl_seconds": 300, "lease_token": TOKEN, "usage": sent})
        )
    );
    assert_eq!(
        calls[1],
        (
            "request_input".to_string(),
            json!({"id": "td_1", "question": "which branch?",
                   "summary": "attempt 1/5 · agent failed", "artifact": "mcp://cairn/Ab12",
                   "usage": sent, "lease_token": TOKEN})
        )
    );
}

#[tokio::test]
async fn error_codes_map_to_distinct_lease_errors() {
    let fake = Fake::new();
    let cases = [
        (
            Reply::ToolError("conflict", "fence mismatch".into()),
            LeaseError::Code(ErrorCode::Conflict),
        ),
        (
            Reply::ToolError("not_found", "no such todo".into()),
            LeaseError::Code(ErrorCode::NotFound),
        ),
        (
            Reply::ToolError("forbidden", "verb not granted".into()),
            LeaseError::Code(ErrorCode::Forbidden),
        ),
        (
            Reply::ToolError("invalid", "bad ttl".into()),
            LeaseError::Code(ErrorCode::Invalid),
        ),
        (
            Reply::ToolError("quota", "new code".into()),
            LeaseError::Other("quota".into()),
        ),
        (Reply::Http(500), LeaseError::Transport),
        (Reply::Http(503), LeaseError::Transport),
        (Reply::Broken, LeaseError::Transport),
        (Reply::Http(401), LeaseError::Other(UNAUTHORIZED.into())),
        (Reply::Http(403), LeaseError::Other(UNAUTHORIZED.into())),
        (Reply::Http(400), LeaseError::Other("http_400".into())),
        (Reply::Hang, LeaseError::Transport),
    ];
    for (reply, _) in &cases {
        fake.reply(reply.clone());
    }
    let url = fake.start().await;
    let client = fake.client(&url).with_timeout(Duration::from_millis(300));
    client.initialize().await.expect("initialize");
    for (i, (reply, want)) in cases.iter().enumerate() {
        let out = run(&client, heartbeat_cmd(i as u64)).await;
        assert_eq!(failed_with(&out), *want, "{reply:?}");
        let e = out.error.expect("error");
        assert_eq!(e.source_name, "queue.ci");
        assert_eq!(e.operation, "heartbeat for todo td_1");
        assert!(out.session.is_empty(), "{reply:?}");
    }
    let conflict = LeaseError::Code(ErrorCode::Conflict);
    assert!(conflict.is_lease_loss() && !LeaseError::Transport.is_lease_loss());
    assert_eq!(fake.lock().gets, 0);
}

#[tokio::test]
async fn refused_connections_and_timeouts_are_transport_errors() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    for transport in [
        Arc::new(ReqwestTransport::new().unwrap()) as Arc<dyn Transport>,
        Arc::new(HyperTransport::new()),
    ] {
        let client = LeaseClient::new(
            "queue.ci",
            format!("http://127.0.0.1:{port}/mcp/e1"),
            auth(),
            transport,
        );
        let e = client.initialize().await.expect_err("refused");
        assert_eq!(e.kind, LeaseError::Transport);
        assert!(
            e.to_string()
                .starts_with("queue.ci: initialize failed: could not connect"),
            "{e}"
        );
        let out = run(&client, claim_cmd(1)).await;
        assert_eq!(failed_with(&out), LeaseError::Transport);
        assert!(out.session.is_empty());
        let text = out.error.expect("error").to_string();
        assert!(
            text.starts_with("queue.ci: claim_next failed: initialize: could not connect"),
            "{text}"
        );
    }

    // A server that never answers, and a short timeout.
    let fake = Fake::new();
    fake.reply(Reply::Hang);
    let url = fake.start().await;
    let client = LeaseClient::new("queue.ci", url, auth(), Arc::new(HyperTransport::new()))
        .with_timeout(Duration::from_millis(200));
    client.initialize().await.expect("initialize");
    let out = run(&client, report_cmd(1, ReportVerb::Complete)).await;
    assert_eq!(failed_with(&out), LeaseError::Transport);
    assert!(
        out.error
            .expect("error")
            .detail
            .contains("no answer within")
    );
}

#[tokio::test]
async fn an_expired_session_is_reinitialized_and_the_call_retried_once() {
    let fake = Fake::new();
    let url = fake.start().await;
    let client = fake.client(&url);
    client.initialize().await.expect("initialize");
    fake.lock().sessions.clear();

    let out = heartbeat_on_a_new_session(&client, 1).await;
    assert_eq!(
        out.inputs(),
        [
            Input::SessionExpired,
            Input::CapabilitiesKnown(ours()),
            Input::HeartbeatOk {
                request: RequestId(1)
            }
        ]
    );
    assert_eq!(fake.count("initialize"), 2);
    assert_eq!(fake.count("tools/call"), 2, "the refused one and the retry");
    assert_eq!(fake.calls().len(), 1, "run once");
    // The retry carries the new session.
    assert_eq!(
        fake.lock()
            .posts
            .last()
            .and_then(|p| p.session.clone())
            .as_deref(),
        Some("sess-2")
    );

    // Expired again right after re-initializing: retried exactly once, then transport.
    fake.reply(Reply::Expire).reply(Reply::Expire);
    let out = run(&client, heartbeat_cmd(2)).await;
    assert_eq!(failed_with(&out), LeaseError::Transport);
    assert_eq!(fake.count("tools/call"), 4);
    assert_eq!(fake.calls().len(), 1);
    assert_eq!(
        out.session,
        [
            SessionNews::Expired,
            SessionNews::Known(ours()),
            SessionNews::Expired
        ]
    );
    // The next call starts a new session.
    let out = run(&client, heartbeat_cmd(3)).await;
    assert_eq!(
        out.input,
        Input::HeartbeatOk {
            request: RequestId(3)
        }
    );
    assert_eq!(out.session, [SessionNews::Known(ours())]);
    assert_eq!(fake.lock().gets, 0);
}

#[tokio::test]
async fn a_reinitialize_that_finds_the_source_unsupported_does_not_retry() {
    let fake = Fake::new();
    let url = fake.start().await;
    let client = fake.client(&url);
    client.initialize().await.expect("initialize");
    {
        let mut s = fake.lock();
        s.sessions.clear();
        s.tools = relay_core::testing::relay::tools_list(&[("claim_next", &["queue"])]);
    }
    let out = run(&client, report_cmd(1, ReportVerb::Complete)).await;
    assert_eq!(failed_with(&out), LeaseError::Other(UNSUPPORTED.into()));
    assert_eq!(out.session.len(), 2);
    assert!(matches!(&out.session[1], SessionNews::Known(c) if !c.supported()));
    assert_eq!(
        fake.count("tools/call"),
        1,
        "only the call the server refused with 404"
    );
    assert!(fake.calls().is_empty());
}

#[tokio::test]
async fn concurrent_calls_on_an_expired_session_reinitialize_once() {
    let fake = Fake::new();
    let url = fake.start().await;
    let client = Arc::new(fake.client(&url));
    client.initialize().await.expect("initialize");
    fake.lock().sessions.clear();
    let (a, b) = tokio::join!(
        run(&client, heartbeat_cmd(1)),
        run(&client, heartbeat_cmd(2))
    );
    assert_eq!(
        a.input,
        Input::HeartbeatOk {
            request: RequestId(1)
        }
    );
    assert_eq!(
        b.input,
        Input::HeartbeatOk {
            request: RequestId(2)
        }
    );
    assert_eq!(fake.count("initialize"), 2);
    let news = a.session.len() + b.session.len();
    assert_eq!(news, 2, "one Expired and one Known between them");
}

#[tokio::test]
async fn secrets_never_reach_errors_or_debug_output() {
    let fake = Fake::new();
    let echo = format!("you sent {TOKEN} with {HEADER} (hdr-SECRET-456)");
    fake.reply(Reply::ToolError("conflict", echo.clone()))
        .reply(Reply::ToolError("weird", echo.clone()))
        .reply(Reply::Http(500))
        .reply(Reply::Broken)
        .reply(Reply::Http(401))
        .reply(Reply::Hang);
    let url = fake.start().await;
    let client = fake.client(&url).with_timeout(Duration::from_millis(200));
    client.initialize().await.expect("initialize");
    let mut texts = vec![format!("{client:?}")];
    for i in 0..6 {
        let cmd = if i % 2 == 0 {
            heartbeat_cmd(i)
        } else {
            report_cmd(i, ReportVerb::Fail)
        };
        texts.push(format!("{cmd:?}"));
        let out = run(&client, cmd).await;
        let e = out.error.clone().expect("error");
        texts.push(e.to_string());
        texts.push(format!("{e:?}"));
        texts.push(format!("{out:?}"));
    }
    // A refused connection and a transport-level request.
    let dead = LeaseClient::new(
        "queue.ci",
        "http://127.0.0.1:1/mcp/e1",
        auth(),
        Arc::new(HyperTransport::new()),
    );
    let out = run(&dead, heartbeat_cmd(9)).await;
    texts.push(format!("{out:?}"));
    texts.push(out.error.expect("error").to_string());
    let ep = super::mcp::SourceLink::new(
        "queue.ci",
        "http://x/",
        auth(),
        Arc::new(HyperTransport::new()),
    );
    let req = ep.request(
        None,
        "application/json",
        json!({"lease_token": TOKEN}).to_string().into_bytes(),
    );
    texts.push(format!("{req:?}"));
    for text in &texts {
        assert!(!text.contains(TOKEN), "token in {text}");
        assert!(!text.contains("hdr-SECRET-456"), "header value in {text}");
    }
    // The server's words still come through, masked.
    assert!(
        texts.iter().any(|t| t.contains("you sent [REDACTED]")),
        "{texts:#?}"
    );
}

#[tokio::test]
async fn execute_refuses_commands_that_are_not_lease_calls() {
    let client = LeaseClient::new(
        "queue.ci",
        "http://127.0.0.1:1/mcp/e1",
        auth(),
        Arc::new(HyperTransport::new()),
    );
    let cmd = Command::KillCheck { run_id: 1 };
    let e = client.execute(&cmd).await.expect_err("not a lease call");
    assert_eq!(e, NotALeaseCall("KillCheck".into()));
}

// ---------------------------------------------------------------------------------------------
// Doorbell
// ---------------------------------------------------------------------------------------------

fn bell(n: u32) -> Bytes {
    let data = json!({"jsonrpc": "2.0", "method": "notifications/todo_ready",
                      "params": {"queue": "ci-failures", "n": n}});
    Bytes::from(format!("id: {n}\r\nevent: message\r\ndata: {data}\r\n\r\n"))
}

async fn opened(rx: &mut watch::Receiver<u32>, n: u32) {
    rx.wait_for(|v| *v >= n).await.expect("fake alive");
}

#[tokio::test]
async fn the_doorbell_forwards_notifications_and_reconnects() {
    doorbell_over(Arc::new(ReqwestTransport::new().unwrap())).await;
    doorbell_over(Arc::new(HyperTransport::new())).await;
}

async fn doorbell_over(transport: Arc<dyn Transport>) {
    let fake = Fake::new();
    let url = fake.start().await;
    let mut streams = fake.lock().opened.subscribe();
    let (tx, mut rx) = mpsc::channel(8);
    let (stop_tx, stop) = watch::channel(false);
    let listener = DoorbellListener::new("channel.bell", &url, auth(), transport).with_backoff(
        ReconnectBackoff {
            initial: Duration::from_millis(5),
            max: Duration::from_millis(20),
        },
    );
    let task = listener.spawn(tx, stop);

    opened(&mut streams, 1).await;
    fake.send(Bytes::from_static(b": keep-alive\n\n"));
    fake.send(bell(1));
    let got = rx.recv().await.expect("doorbell");
    assert_eq!(got.source, "channel.bell");
    assert_eq!(got.method, "notifications/todo_ready");
    assert_eq!(got.params["n"], json!(1));

    // The server drops the stream: the listener comes back on the same session.
    fake.lock().streams.clear();
    opened(&mut streams, 2).await;
    fake.send(bell(2));
    assert_eq!(rx.recv().await.expect("doorbell").params["n"], json!(2));
    assert_eq!(fake.count("initialize"), 1);

    // The server forgets the session: 404 on the GET, a new session, a new stream.
    {
        let mut s = fake.lock();
        s.sessions.clear();
        s.streams.clear();
    }
    opened(&mut streams, 3).await;
    fake.send(bell(3));
    assert_eq!(rx.recv().await.expect("doorbell").params["n"], json!(3));
    assert_eq!(fake.count("initialize"), 2);
    assert_eq!(fake.count("tools/call"), 0, "the listener calls no tools");
    assert_eq!(fake.count("tools/list"), 0);

    stop_tx.send(true).expect("listener alive");
    task.await.expect("listener ends cleanly");
}

fn update(queue: &str, subscription: &Value) -> Bytes {
    let frame = relay_core::mcp::listen::updated(subscription, queue);
    Bytes::from(format!("event: message\ndata: {frame}\n\n"))
}

#[tokio::test]
async fn a_modern_doorbell_listens_to_its_queues_and_follows_a_downgrade() {
    use relay_core::mcp::client::Subscriptions;
    let fake = Fake::new();
    fake.lock().modern = true;
    let url = fake.start().await;
    let mut streams = fake.lock().opened.subscribe();
    let (tx, mut rx) = mpsc::channel(8);
    let (stop_tx, stop) = watch::channel(false);
    let listener = DoorbellListener::new(
        "channel.bell",
        &url,
        auth(),
        Arc::new(ReqwestTransport::new().unwrap()),
    )
    .with_subscriptions(Subscriptions::Queues(
        ["ci-failures".to_string()].into_iter().collect(),
    ))
    .with_backoff(ReconnectBackoff {
        initial: Duration::from_millis(5),
        max: Duration::from_millis(20),
    });
    let task = listener.spawn(tx, stop);
    opened(&mut streams, 1).await;
    let (subscription, sent) = {
        let s = fake.lock();
        let listen = s.posts.last().expect("the listen");
        assert_eq!(listen.method, "subscriptions/listen");
        assert_eq!(listen.session, None);
        assert_eq!(listen.mcp_method.as_deref(), Some("subscriptions/listen"));
        (
            s.listens[0]["_meta"].clone(),
            s.listens[0]["notifications"].clone(),
        )
    };
    assert_eq!(
        subscription["io.modelcontextprotocol/protocolVersion"],
        json!("2026-07-28")
    );
    assert_eq!(
        sent,
        json!({"resourceSubscriptions": ["relay://queues/ci-failures"]})
    );
    let id = json!(fake.lock().posts.len() as u64);
    // Another subscription's ring and a keep-alive are passed over; ours is forwarded.
    fake.send(Bytes::from_static(b": keepalive\n\n"));
    fake.send(update("elsewhere", &json!("other-listen")));
    fake.send(update("ci-failures", &id));
    let got = rx.recv().await.expect("doorbell");
    assert_eq!(got.source, "channel.bell");
    assert_eq!(got.method, "notifications/resources/updated");
    assert_eq!(got.params["uri"], json!("relay://queues/ci-failures"));

    // Downgraded: the next listen is refused (404, no session), the probe falls back, and the
    // legacy GET stream carries the ring.
    {
        let mut s = fake.lock();
        s.modern = false;
        s.streams.clear();
    }
    opened(&mut streams, 2).await;
    assert_eq!(fake.lock().gets, 1);
    fake.send(bell(9));
    let got = rx.recv().await.expect("doorbell");
    assert_eq!(got.method, "notifications/todo_ready");
    assert_eq!(fake.count("initialize"), 1);
    assert_eq!(fake.count("tools/call") + fake.count("tools/list"), 0);

    stop_tx.send(true).expect("listener alive");
    task.await.expect("listener ends cleanly");
}

#[tokio::test]
async fn a_modern_doorbell_without_named_queues_subscribes_to_every_listed_queue() {
    let fake = Fake::new();
    fake.lock().modern = true;
    let url = fake.start().await;
    let mut streams = fake.lock().opened.subscribe();
    let (tx, _rx) = mpsc::channel(8);
    let (stop_tx, stop) = watch::channel(false);
    let task = DoorbellListener::new(
        "channel.bell",
        &url,
        auth(),
        Arc::new(ReqwestTransport::new().unwrap()),
    )
    .spawn(tx, stop);
    opened(&mut streams, 1).await;
    assert_eq!(
        fake.methods(),
        ["server/discover", "resources/list", "subscriptions/listen"]
    );
    assert_eq!(
        fake.lock().listens[0]["notifications"],
        json!({"resourceSubscriptions": ["relay://queues/ci-failures"]})
    );
    stop_tx.send(true).expect("listener alive");
    task.await.expect("listener ends cleanly");
}

// ---------------------------------------------------------------------------------------------
// Receipts
// ---------------------------------------------------------------------------------------------

fn receipt_cmd(timeout_ms: u64) -> Command {
    Command::UploadReceipt {
        request: RequestId(5),
        run_id: 1,
        source: "cairn.main".into(),
        markdown: "# Attempt receipt: fixer run 1\n".into(),
        run_log_lines: 2,
        redactor: Redactor::new(["log-SECRET-789"]),
        tags: vec!["receipt".into(), "harness".into(), "relay".into()],
        timeout: timeout_ms,
    }
}

async fn cairn(fake: &Fake) -> ReceiptClient {
    let url = fake.start().await;
    let base = url.trim_end_matches("/mcp/e1").to_string() + "/";
    ReceiptClient::new(
        "cairn.main",
        base,
        auth(),
        604_800,
        Arc::new(ReqwestTransport::new().unwrap()),
    )
}

#[tokio::test]
async fn a_receipt_is_uploaded_with_the_log_tail() {
    let fake = Fake::new();
    let client = cairn(&fake).await;
    let log = b"line 1\nline 2 \x1b[31mred\x1b[0m\nline 3 log-SECRET-789\n";
    let input = client
        .execute(&receipt_cmd(30_000), log)
        .await
        .expect("a receipt command");
    assert_eq!(
        input,
        Input::ReceiptUploaded {
            request: RequestId(5),
            handle: "mcp://cairn/Rc1".into()
        }
    );
    let s = fake.lock();
    let (authorization, body) = &s.artifacts[0];
    assert_eq!(authorization.as_deref(), Some(HEADER));
    assert_eq!(body["content_type"], json!("text/markdown"));
    assert_eq!(body["tags"], json!(["receipt", "harness", "relay"]));
    assert_eq!(body["ttl_seconds"], json!(604_800));
    let content = body["content"].as_str().expect("content");
    assert!(content.starts_with("# Attempt receipt: fixer run 1\n"));
    assert!(
        content.contains("line 2 red\nline 3 [REDACTED]"),
        "{content}"
    );
    assert!(
        !content.contains("line 1"),
        "only the last 2 lines: {content}"
    );
}

#[tokio::test]
async fn receipt_failures_answer_receipt_failed_without_secrets() {
    for (reply, timeout, want) in [
        (Reply::Http(500), 30_000, "Cairn answered HTTP 500"),
        (Reply::Http(401), 30_000, "Authorization header"),
        (
            Reply::Ok(json!({"handle": "file:///etc/passwd"})),
            30_000,
            "mcp://cairn/<id>",
        ),
        (Reply::Ok(json!({"id": "x"})), 30_000, "no handle"),
        (Reply::Broken, 30_000, "not JSON"),
        (Reply::Hang, 200, "no answer within"),
    ] {
        let fake = Fake::new();
        fake.lock().artifact_reply = reply.clone();
        let client = cairn(&fake).await;
        let input = client
            .execute(&receipt_cmd(timeout), b"log")
            .await
            .expect("a receipt command");
        let Input::ReceiptFailed { request, error } = &input else {
            panic!("{reply:?}: {input:?}")
        };
        assert_eq!(*request, RequestId(5));
        assert!(
            error.starts_with("cairn.main: receipt upload failed"),
            "{error}"
        );
        assert!(error.contains(want), "{reply:?}: {error}");
        assert!(!error.contains("hdr-SECRET-456") && !format!("{client:?}").contains("hdr-SECRET"));
    }
    // Not a receipt command.
    let fake = Fake::new();
    let client = cairn(&fake).await;
    assert_eq!(client.execute(&heartbeat_cmd(1), b"").await, None);
}

#[test]
fn compose_receipt_appends_the_redacted_log_section() {
    let r = Redactor::new(["s3cret-value"]);
    let text = compose_receipt("# R\n", b"a\nb s3cret-value\nc\n", 2, &r);
    assert!(
        text.starts_with("# R\n\n## Run log (last 2 lines)"),
        "{text}"
    );
    assert!(text.contains("b [REDACTED]\nc"), "{text}");
    assert!(!text.contains("\na\n"));
}

// ---------------------------------------------------------------------------------------------
// turmoil
// ---------------------------------------------------------------------------------------------

#[path = "../../tests/support/sim_listener.rs"]
mod sim_listener;
use sim_listener::SimListener;

#[test]
fn the_hyper_transport_runs_the_lease_client_and_the_doorbell_over_turmoil() {
    let fake = Fake::new();
    fake.reply(Reply::Ok(claim_answer(Some(TOKEN))));
    let mut sim = turmoil::Builder::new().build();
    let server = fake.clone();
    sim.host("server", move || {
        let router = server.router();
        async move {
            let listener = turmoil::net::TcpListener::bind("0.0.0.0:8080").await?;
            axum::serve(SimListener(listener), router).await?;
            Ok(())
        }
    });
    sim.client("daemon", async move {
        let transport = HyperTransport::with_dialer(|host, port| {
            turmoil::net::TcpStream::connect((host, port))
        });
        let client = LeaseClient::new(
            "queue.ci",
            "http://server:8080/mcp/e1",
            auth(),
            Arc::new(transport),
        );
        let caps = client.initialize().await.map_err(|e| e.to_string())?;
        assert!(caps.supported());
        let out = client
            .execute(&claim_cmd(1))
            .await
            .map_err(|e| e.to_string())?;
        assert!(
            matches!(out.input, Input::ClaimAnswered { .. }),
            "{:?}",
            out.input
        );
        Ok(())
    });
    let bells = fake.clone();
    sim.client("listener", async move {
        let transport = HyperTransport::with_dialer(|host, port| {
            turmoil::net::TcpStream::connect((host, port))
        });
        let mut streams = bells.lock().opened.subscribe();
        let (tx, mut rx) = mpsc::channel(8);
        let (stop_tx, stop) = watch::channel(false);
        let task = DoorbellListener::new(
            "channel.bell",
            "http://server:8080/mcp/e1",
            auth(),
            Arc::new(transport),
        )
        .spawn(tx, stop);
        opened(&mut streams, 1).await;
        let stream = bells.lock().streams.last().cloned().expect("a stream");
        stream.send(bell(1)).map_err(|e| e.to_string())?;
        let got = rx.recv().await.ok_or("no doorbell")?;
        assert_eq!(got.method, "notifications/todo_ready");
        stop_tx.send(true).map_err(|e| e.to_string())?;
        task.await.map_err(|e| e.to_string())?;
        Ok(())
    });
    sim.run().expect("the simulation runs clean");
    assert_eq!(fake.count("tools/call"), 1);
    assert_eq!(fake.lock().gets, 1, "the listener's stream only");
}

// ---------------------------------------------------------------------------------------------
// From the config
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_clients_are_built_from_a_resolved_config() {
    use relay_core::config::resolve;
    let fake = Fake::new();
    let url = fake.start().await;
    let base = url.trim_end_matches("/mcp/e1");
    let text = format!(
        "[queue.ci]\nurl = \"{url}\"\nenv_file = \"ci.env\"\n\
         headers = {{ Authorization = \"Bearer ${{TOKEN}}\" }}\n\n\
         [channel.bell]\nurl = \"{url}\"\nenv_file = \"ci.env\"\n\
         headers = {{ Authorization = \"Bearer ${{TOKEN}}\" }}\n\n\
         [cairn.main]\nurl = \"{base}\"\nenv_file = \"ci.env\"\n\
         headers = {{ Authorization = \"Bearer ${{TOKEN}}\" }}\nttl = \"1h\"\n"
    );
    let config = relay_core::testing::config::config(&text);
    let env = BTreeMap::from([("ci.env".to_string(), "TOKEN=hdr-SECRET-456\n".to_string())]);
    let resolved = resolve(&config, &env).expect("the headers resolve");
    let transport: Arc<dyn Transport> = Arc::new(ReqwestTransport::new().unwrap());

    let lease = LeaseClient::from_config(&resolved, "ci", transport.clone()).expect("queue.ci");
    assert_eq!(lease.source_name(), "queue.ci");
    lease.initialize().await.expect("initialize");
    assert_eq!(fake.lock().posts[0].authorization.as_deref(), Some(HEADER));
    assert!(!format!("{lease:?}").contains("hdr-SECRET"));

    let receipts = ReceiptClient::from_config(&resolved, "main", transport.clone()).expect("cairn");
    assert_eq!(receipts.source_name(), "cairn.main");
    let input = receipts
        .execute(&receipt_cmd(30_000), b"")
        .await
        .expect("a receipt command");
    assert!(matches!(input, Input::ReceiptUploaded { .. }), "{input:?}");
    assert_eq!(fake.lock().artifacts[0].1["ttl_seconds"], json!(3600));

    assert!(DoorbellListener::from_config(&resolved, "bell", transport.clone()).is_some());
    assert!(LeaseClient::from_config(&resolved, "nope", transport).is_none());
}

#[tokio::test]
async fn sharing_a_url_the_only_get_stream_is_the_doorbells() {
    let fake = Fake::new();
    fake.reply(Reply::Ok(claim_answer(Some(TOKEN))));
    let url = fake.start().await;
    let transport: Arc<dyn Transport> = Arc::new(ReqwestTransport::new().unwrap());
    let lease = LeaseClient::new("queue.ci", &url, auth(), transport.clone());
    lease.initialize().await.expect("initialize");

    let mut streams = fake.lock().opened.subscribe();
    let (tx, _rx) = mpsc::channel(8);
    let (stop_tx, stop) = watch::channel(false);
    let task = DoorbellListener::new("channel.bell", &url, auth(), transport).spawn(tx, stop);
    opened(&mut streams, 1).await;

    let out = run(&lease, claim_cmd(1)).await;
    assert!(matches!(out.input, Input::ClaimAnswered { .. }));
    run(&lease, heartbeat_cmd(2)).await;
    {
        let s = fake.lock();
        assert_eq!(s.gets, 1);
        assert_eq!(
            s.get_sessions,
            [Some("sess-2".to_string())],
            "the listener's session"
        );
        let lease_sessions: Vec<_> = s
            .posts
            .iter()
            .filter(|p| p.method == "tools/call")
            .map(|p| p.session.clone())
            .collect();
        assert_eq!(
            lease_sessions,
            [Some("sess-1".to_string()), Some("sess-1".to_string())]
        );
    }
    stop_tx.send(true).expect("listener alive");
    task.await.expect("listener ends cleanly");
}
