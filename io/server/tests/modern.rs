//! The queue server in the MCP 2026-07-28 era over real HTTP, beside the legacy era on the same
//! URL: `server/discover`, stateless tool calls whose answers and error codes equal the legacy
//! era's, the envelope and header checks, the doorbell on `subscriptions/listen` and the queue
//! resources, and what the era has not (GET, DELETE, `initialize` with an envelope).
//!
//! SQLite in memory, or Postgres with `RELAY_SERVER_TEST_DB=postgres` (as server.rs). Time is a
//! `ManualClock`; nothing sleeps to synchronise.

#[path = "support/harness.rs"]
mod harness;

use harness::{ALL_VERBS as VERBS, BOUND, Harness, Mcp, next_event, start_with};
use relay_core::mcp::era::{self, MODERN};
use serde_json::{Value, json};

async fn start() -> Harness {
    start_with(|_| {}, false).await
}

/// A raw POST with the given headers and body: (status, JSON answer).
async fn raw(c: &Mcp, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
    let mut r = c
        .request(reqwest::Method::POST)
        .header("content-type", "application/json");
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.body(body.to_string()).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn envelope() -> Value {
    json!({era::META_VERSION: MODERN, era::META_CAPABILITIES: {}})
}

#[tokio::test]
async fn discover_then_the_same_tools_and_answers_as_the_legacy_era() {
    let h = start().await;
    let token = h.endpoint("ci", VERBS, Some(&["q1", "q2"])).await;
    let mut modern = h.mcp_modern("ci", &token);
    let mut legacy = h.mcp("ci", &token);
    legacy.init().await;

    let (status, d) = modern.rpc("server/discover", json!({})).await;
    assert_eq!(status, 200, "{d}");
    let d = &d["result"];
    assert_eq!(d["supportedVersions"], json!([MODERN]));
    assert_eq!(d["resultType"], "complete");
    assert!(d["ttlMs"].is_u64() && d["cacheScope"] == "private", "{d}");
    assert_eq!(d["_meta"][era::META_SERVER_INFO]["name"], "relay");
    assert_eq!(d["capabilities"]["resources"]["subscribe"], true);
    assert!(d["capabilities"]["tools"].is_object());
    // No session is made or named.
    let r = modern.send("tools/list", json!({})).await;
    assert!(r.headers().get("mcp-session-id").is_none());

    // tools/list: the same tools and schemas in both eras.
    let (_, m) = modern.rpc("tools/list", json!({})).await;
    let (_, l) = legacy.rpc("tools/list", json!({})).await;
    assert_eq!(m["result"]["tools"], l["result"]["tools"]);
    assert_eq!(m["result"]["resultType"], "complete");

    // A fenced claim, heartbeat and completion, modern; the same calls' shapes legacy.
    for c in [&mut modern, &mut legacy] {
        let added = c.ok("add_todo", json!({"queue": "q1", "title": "t"})).await;
        let id = added["id"].as_str().unwrap().to_string();
        let claim = c
            .ok("claim_next", json!({"queue": "q1", "require_fence": true}))
            .await;
        assert_eq!(claim["todo"]["id"], id.as_str());
        let lease = claim["lease_token"].as_str().unwrap().to_string();
        let hb = c
            .ok("heartbeat", json!({"id": id, "lease_token": lease}))
            .await;
        assert_eq!(hb["state"], "claimed");
        // Error codes are the same tool errors: a wrong fence, an unknown id, a bad argument.
        c.fails(
            "complete",
            json!({"id": id, "lease_token": "x".repeat(22)}),
            "conflict",
        )
        .await;
        c.fails("get_todo", json!({"id": "td_nope"}), "not_found")
            .await;
        c.fails("claim_next", json!({"queue": "q1", "bogus": 1}), "invalid")
            .await;
        c.fails("claim_next", json!({"queue": "q9"}), "forbidden")
            .await;
        let done = c
            .ok(
                "complete",
                json!({"id": id, "lease_token": lease, "summary": "ok"}),
            )
            .await;
        assert_eq!(done["state"], "done");
        let view = c.ok("get_todo", json!({"id": id})).await;
        assert_eq!(view["attempts"][0]["outcome"], "completed");
        // A modern attempt belongs to no session; a legacy one is recorded with its session.
    }
    // An unknown tool is invalid params in both eras (HTTP 200: the method answered).
    for c in [&mut modern, &mut legacy] {
        let (status, v) = c
            .rpc("tools/call", json!({"name": "nope", "arguments": {}}))
            .await;
        assert_eq!(
            (status, v["error"]["code"].as_i64()),
            (200, Some(-32602)),
            "{v}"
        );
    }
}

#[tokio::test]
async fn envelopes_and_headers_are_checked_and_a_refusal_changes_nothing() {
    let h = start().await;
    let token = h.endpoint("ci", VERBS, None).await;
    let c = h.mcp_modern("ci", &token);
    let call = |meta: Value| {
        json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
               "params": {"name": "add_todo", "arguments": {"queue": "q", "title": "t"}, "_meta": meta}})
    };
    let good = [
        ("mcp-protocol-version", MODERN),
        ("mcp-method", "tools/call"),
        ("mcp-name", "add_todo"),
    ];
    // (what, headers, body, HTTP status, JSON-RPC code)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Value, u16, i64);
    let cases: Vec<Case> = vec![
        // The envelope is malformed: no capabilities, _meta not an object, a version not a string.
        (
            "no capabilities",
            good.to_vec(),
            call(json!({era::META_VERSION: MODERN})),
            400,
            -32602,
        ),
        (
            "meta not an object",
            good.to_vec(),
            call(json!(7)),
            400,
            -32602,
        ),
        (
            "version not a string",
            good.to_vec(),
            call(json!({era::META_VERSION: 2026, era::META_CAPABILITIES: {}})),
            400,
            -32602,
        ),
        // A modern header with no envelope at all.
        (
            "header without envelope",
            good.to_vec(),
            json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"}),
            400,
            -32602,
        ),
        // Headers that disagree with the body, or are missing.
        (
            "header version differs",
            vec![
                ("mcp-protocol-version", "2025-06-18"),
                ("mcp-method", "tools/call"),
                ("mcp-name", "add_todo"),
            ],
            call(envelope()),
            400,
            -32020,
        ),
        (
            "method header differs",
            vec![
                ("mcp-protocol-version", MODERN),
                ("mcp-method", "tools/list"),
                ("mcp-name", "add_todo"),
            ],
            call(envelope()),
            400,
            -32020,
        ),
        (
            "name header differs",
            vec![
                ("mcp-protocol-version", MODERN),
                ("mcp-method", "tools/call"),
                ("mcp-name", "claim_next"),
            ],
            call(envelope()),
            400,
            -32020,
        ),
        (
            "name header missing",
            vec![
                ("mcp-protocol-version", MODERN),
                ("mcp-method", "tools/call"),
            ],
            call(envelope()),
            400,
            -32020,
        ),
        // An unsupported version, named in header and body alike.
        (
            "unsupported version",
            vec![
                ("mcp-protocol-version", "2099-01-01"),
                ("mcp-method", "tools/call"),
                ("mcp-name", "add_todo"),
            ],
            call(json!({era::META_VERSION: "2099-01-01", era::META_CAPABILITIES: {}})),
            400,
            -32022,
        ),
        // A legacy session id beside a modern envelope.
        (
            "session with envelope",
            [good.as_slice(), &[("mcp-session-id", "0123456789abcdef")]].concat(),
            call(envelope()),
            400,
            -32600,
        ),
    ];
    for (what, headers, body, status, code) in cases {
        let (s, v) = raw(&c, &headers, body).await;
        assert_eq!(
            (s, v["error"]["code"].as_i64()),
            (status, Some(code)),
            "{what}: {v}"
        );
        assert_eq!(v["id"], 5, "{what}: the id is echoed");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(!message.contains(&token), "{what}: no token in {message}");
        if code == -32022 {
            assert_eq!(v["error"]["data"]["supported"], json!([MODERN]), "{what}");
            assert_eq!(v["error"]["data"]["requested"], "2099-01-01", "{what}");
        }
    }
    // Nothing was added by any of them.
    let mut ok = h.mcp_modern("ci", &token);
    let listed = ok.ok("list_todos", json!({})).await;
    assert_eq!(listed["todos"], json!([]));

    // Methods the era does not have: 404 with -32601, even with a valid envelope.
    for method in [
        "initialize",
        "ping",
        "resources/subscribe",
        "unknown/method",
    ] {
        let (s, v) = ok.rpc(method, json!({})).await;
        assert_eq!(
            (s, v["error"]["code"].as_i64()),
            (404, Some(-32601)),
            "{method}: {v}"
        );
    }
    // A modern notification is accepted without a session.
    let r = ok
        .request(reqwest::Method::POST)
        .header("content-type", "application/json")
        .header("mcp-protocol-version", MODERN)
        .body(json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // No GET stream and no DELETE in the modern era.
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let r = ok
            .request(method.clone())
            .header("mcp-protocol-version", MODERN)
            .header("accept", "text/event-stream")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405, "{method}");
    }
    // A request with neither an envelope nor a session is still the legacy era's refusal.
    let (s, v) = raw(
        &ok,
        &[],
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server/discover"),
        "{v}"
    );
}

/// Opens a listen stream on `queues`; answers the response (asserted 200).
async fn listen(c: &mut Mcp, queues: &[&str]) -> reqwest::Response {
    let uris: Vec<String> = queues
        .iter()
        .map(|q| format!("relay://queues/{q}"))
        .collect();
    let r = c
        .send(
            "subscriptions/listen",
            json!({"notifications": {"resourceSubscriptions": uris, "toolsListChanged": true}}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    r
}

#[tokio::test]
async fn the_doorbell_rings_a_listen_stream_through_the_gate() {
    let mut h = start_with(|c| c.max_streams = 2, true).await;
    let token = h.endpoint("ci", VERBS, Some(&["q1", "q2"])).await;
    let mut c = h.mcp_modern("ci", &token);
    let mut stream = listen(&mut c, &["q1"]).await;
    let mut buf = String::new();
    let ack = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(ack["method"], "notifications/subscriptions/acknowledged");
    let sub = ack["params"]["_meta"][era::META_SUBSCRIPTION].clone();
    assert!(sub.is_u64(), "{ack}");
    // Only what is honoured: the queue, not the list-changed kinds relay never sends.
    assert_eq!(
        ack["params"]["notifications"],
        json!({"resourceSubscriptions": ["relay://queues/q1"]})
    );

    // A todo in another queue does not ring this stream; one in q1 does.
    c.ok("add_todo", json!({"queue": "q2", "title": "other"}))
        .await;
    let id = c.ok("add_todo", json!({"queue": "q1", "title": "t"})).await["id"].clone();
    let ring = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(ring["method"], "notifications/resources/updated");
    assert_eq!(ring["params"]["uri"], "relay://queues/q1");
    assert_eq!(ring["params"]["_meta"][era::META_SUBSCRIPTION], sub);

    // Within the window a second ring is owed, then goes out with the doorbell sweep.
    let claimed = c.ok("claim", json!({"id": id})).await;
    assert_eq!(claimed["todo"]["id"], id);
    c.ok("add_todo", json!({"queue": "q1", "title": "t2"}))
        .await;
    assert!(
        next_event(&mut stream, &mut buf, std::time::Duration::from_millis(200))
            .await
            .is_none(),
        "gated"
    );
    h.clock.advance(61_000);
    h.server.doorbell_once(h.now()).await.unwrap();
    let ring = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(ring["params"]["uri"], "relay://queues/q1");

    // The queue resource reads the endpoint's counts.
    let (_, read) = c
        .rpc("resources/read", json!({"uri": "relay://queues/q1"}))
        .await;
    let text = read["result"]["contents"][0]["text"].as_str().unwrap();
    let counts: Value = serde_json::from_str(text).unwrap();
    assert_eq!(counts["counts"]["claimed"], 1, "{counts}");
    assert_eq!(counts["counts"]["pending"], 1, "{counts}");
    // resources/list offers the granted queues.
    let (_, list) = c.rpc("resources/list", json!({})).await;
    let uris: Vec<&str> = list["result"]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["uri"].as_str())
        .collect();
    assert!(
        uris.starts_with(&["relay://queues/q1", "relay://queues/q2"]),
        "{uris:?}"
    );

    // A listen on a queue not granted, or on something that is not a queue, changes nothing.
    for uri in ["relay://queues/q9", "relay://todos/td_x"] {
        let (s, v) = c
            .rpc(
                "subscriptions/listen",
                json!({"notifications": {"resourceSubscriptions": [uri]}}),
            )
            .await;
        assert_eq!(
            (s, v["error"]["code"].as_i64()),
            (200, Some(-32602)),
            "{uri}: {v}"
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("resourceSubscriptions")
        );
    }
    // A queue resource outside the grant reads as not found (-32602 with the uri, modern).
    let (_, v) = c
        .rpc("resources/read", json!({"uri": "relay://queues/q9"}))
        .await;
    assert_eq!(v["error"]["code"], -32602, "{v}");
    assert_eq!(v["error"]["data"]["uri"], "relay://queues/q9");

    // Streams are capped together with the legacy GET streams (2 here).
    let _second = listen(&mut c, &["q2"]).await;
    let (s, v) = c
        .rpc(
            "subscriptions/listen",
            json!({"notifications": {"resourceSubscriptions": ["relay://queues/q2"]}}),
        )
        .await;
    assert_eq!(s, 503, "{v}");

    // On shutdown the stream ends with the listen's answer.
    h.server.begin_shutdown();
    let last = loop {
        let e = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
        if e.get("id").is_some() {
            break e;
        }
    };
    assert_eq!(last["id"], sub);
    assert_eq!(last["result"]["resultType"], "complete");
    h.stop_and_wait().await.unwrap();
}
