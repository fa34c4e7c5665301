//! The queue server over real HTTP (127.0.0.1:0): every tool, every error code, scoping,
//! authentication, the JSON-RPC and transport edges, the doorbell, graceful shutdown, the
//! Host/Origin checks, metrics and healthz.
//!
//! The store is SQLite in memory, or Postgres with `RELAY_SERVER_TEST_DB=postgres` (see
//! `open_store`). Time is a `ManualClock`; nothing sleeps to synchronise. Waits on streams and watches carry a
//! timeout only as a failure bound.

#[path = "support/harness.rs"]
mod harness;

use harness::{ALL_VERBS, BOUND, Harness, Mcp, T0, start_with};
use relay_core::ledger::{Actor, Answer, Op, TodoFilter, TodoView};
use serde_json::{Value, json};

/// Serves only the router (no background loops): tests drive the sweeps by hand.
async fn start() -> Harness {
    start_with(|_| {}, false).await
}

/// Every todo with its whole attempt timeline: what "nothing changed" compares.
async fn snapshot(h: &Harness) -> Vec<TodoView> {
    let all = h
        .store
        .apply(Op::ListTodos {
            actor: Actor::cli(),
            filter: TodoFilter {
                queues: None,
                state: None,
                after: None,
                limit: 10_000,
            },
        })
        .await
        .and_then(Answer::todos)
        .unwrap();
    let mut out = Vec::new();
    for t in all {
        out.push(
            h.store
                .apply(Op::GetTodo {
                    actor: Actor::cli(),
                    id: t.id,
                    attempts_limit: 1000,
                })
                .await
                .and_then(Answer::view)
                .unwrap(),
        );
    }
    out
}

fn tool_names(list: &Value) -> Vec<String> {
    list["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn every_tool_works_over_http() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    let init = c.init().await;
    assert_eq!(init["result"]["protocolVersion"], "2025-06-18");
    assert_eq!(init["result"]["serverInfo"]["name"], "relay");

    let (_, list) = c.rpc("tools/list", json!({})).await;
    let names = tool_names(&list);
    for t in ALL_VERBS.iter().chain(&["get_todo"]) {
        assert!(names.contains(&t.to_string()), "{names:?}");
    }
    for t in list["result"]["tools"].as_array().unwrap() {
        assert_eq!(t["inputSchema"]["additionalProperties"], false, "{t}");
    }
    let (_, pong) = c.rpc("ping", json!({})).await;
    assert_eq!(pong["result"], json!({}));

    let added = c
        .ok(
            "add_todo",
            json!({"queue": "ci", "title": "fix the build", "payload": {"pr": 7}, "max_attempts": 2}),
        )
        .await;
    let id = added["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("td_"));
    assert_eq!(added["state"], "pending");

    let listed = c.ok("list_todos", json!({"queue": "ci"})).await;
    assert_eq!(listed["todos"].as_array().unwrap().len(), 1);

    // A fenced claim: 16 random bytes, base64url without padding; only its hash is stored.
    let claim = c
        .ok(
            "claim_next",
            json!({"require_fence": true, "claimant": "t/1", "lease_ttl_seconds": 60}),
        )
        .await;
    assert_eq!(claim["empty"], false);
    assert_eq!(claim["todo"]["id"], id.as_str());
    assert_eq!(claim["attempt_seq"], 1);
    assert_eq!(claim["prior_attempts"], json!([]));
    let lease = claim["lease_token"].as_str().unwrap().to_string();
    assert_eq!(lease.len(), 22, "{lease}");
    assert!(
        lease
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    );

    h.clock.advance(10_000);
    let hb = c
        .ok(
            "heartbeat",
            json!({"id": id, "lease_token": lease, "lease_ttl_seconds": 120}),
        )
        .await;
    assert_eq!(hb["state"], "claimed");

    let failed = c
        .ok(
            "fail",
            json!({"id": id, "lease_token": lease, "summary": "tests red", "result": {"exit": 1}}),
        )
        .await;
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["dead_letter"], false);
    assert!(failed["next_retry_at"].is_string(), "{failed}");

    // The retry is due within the backoff; claim by id answers the earlier attempt.
    h.clock.advance(60_000);
    let again = c.ok("claim", json!({"id": id})).await;
    assert_eq!(again["attempt_seq"], 2);
    assert!(again.get("lease_token").is_none());
    let prior = again["prior_attempts"].as_array().unwrap();
    assert_eq!(prior.len(), 1);
    assert_eq!(prior[0]["outcome"], "failed");
    assert_eq!(prior[0]["disposition"], "retry_scheduled");
    assert_eq!(prior[0]["summary"], "tests red");

    // The second failure reaches max_attempts: a dead letter.
    let dead = c
        .ok("fail", json!({"id": id, "summary": "still red"}))
        .await;
    assert_eq!(dead["dead_letter"], true);
    assert!(dead["next_retry_at"].is_null());

    let view = c
        .ok("get_todo", json!({"id": id, "attempts_limit": 10}))
        .await;
    assert_eq!(view["attempts_total"], 2);
    assert_eq!(view["attempts_pruned"], 0);
    assert_eq!(view["todo"]["dead_letter"], true);
    assert_eq!(view["todo"]["result"], Value::Null);
    let attempts = view["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["seq"], 2, "newest first");
    assert_eq!(attempts[0]["disposition"], "dead_lettered");

    // complete and release on a second todo.
    let t2 = c
        .ok("add_todo", json!({"queue": "ci", "title": "second"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let c2 = c.ok("claim_next", json!({"queue": "ci"})).await;
    assert_eq!(c2["todo"]["id"], t2.as_str());
    let rel = c
        .ok("release", json!({"id": t2, "summary": "shutting down"}))
        .await;
    assert_eq!(rel["state"], "pending");
    c.ok("claim_next", json!({})).await;
    let done = c
        .ok(
            "complete",
            json!({"id": t2, "result": {"ok": true}, "artifact": "https://ci.example/7"}),
        )
        .await;
    assert_eq!(done["state"], "done");
    let empty = c.ok("claim_next", json!({})).await;
    assert_eq!(empty, json!({"empty": true}));
}

/// The recovery rules, each through the real server and an MCP client: a non-retryable
/// failure, repeated failures, a deadline, an idempotent add and a late report kept.
#[tokio::test]
async fn every_recovery_rule_works_over_http() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    let add = |title: &str, extra: Value| {
        let mut args = json!({"queue": "ci", "title": title, "max_attempts": 5});
        args.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        args
    };
    let fenced = json!({"queue": "ci", "require_fence": true, "lease_ttl_seconds": 60});

    // Non-retryable: a dead letter on attempt 1 of 5, with its reason and an attention text.
    let id = c.ok("add_todo", add("auth", json!({}))).await["id"].clone();
    let claim = c.ok("claim_next", fenced.clone()).await;
    let lease = claim["lease_token"].clone();
    let failed = c
        .ok(
            "fail",
            json!({"id": id, "lease_token": lease, "summary": "401 from the API", "retryable": false}),
        )
        .await;
    assert_eq!(failed["dead_letter"], true, "{failed}");
    assert_eq!(failed["dead_letter_reason"], "non_retryable");
    assert_eq!(failed["attempt"], 1);
    let view = c.ok("get_todo", json!({"id": id})).await;
    assert!(
        view["attention"].as_str().is_some_and(|a| !a.is_empty()),
        "{view}"
    );

    // Repeated failures: the same signature twice in a row (max_same_failures defaults to 2).
    let id = c.ok("add_todo", add("flaky", json!({}))).await["id"].clone();
    let mut last = Value::Null;
    for _ in 0..2 {
        let claim = c
            .ok("claim", json!({"id": id, "require_fence": true}))
            .await;
        last = c
            .ok(
                "fail",
                json!({"id": id, "lease_token": claim["lease_token"], "failure_signature": "E42"}),
            )
            .await;
        h.clock.advance(10 * 60_000);
    }
    assert_eq!(last["dead_letter_reason"], "repeated_failure", "{last}");
    assert_eq!(last["attempt"], 2);

    // A deadline: once passed, no new attempt starts and the retry sweep dead-letters it.
    let id = c
        .ok("add_todo", add("timed", json!({"deadline_seconds": 60})))
        .await["id"]
        .clone();
    h.clock.advance(61_000);
    c.fails("claim", json!({"id": id}), "conflict").await;
    let swept = h.server.requeue_once(h.now()).await.unwrap();
    assert!(
        swept.iter().any(|t| t.id == id.as_str().unwrap()),
        "{swept:?}"
    );
    let view = c.ok("get_todo", json!({"id": id})).await;
    assert_eq!(view["todo"]["dead_letter_reason"], "deadline", "{view}");

    // An idempotent add: the second answers the first todo, created: false, and adds nothing.
    let first = c
        .ok(
            "add_todo",
            add("hook", json!({"idempotency_key": "delivery-7"})),
        )
        .await;
    assert_eq!(first["created"], true, "{first}");
    let again = c
        .ok(
            "add_todo",
            add("hook again", json!({"idempotency_key": "delivery-7"})),
        )
        .await;
    assert_eq!(
        (&again["id"], &again["created"]),
        (&first["id"], &json!(false))
    );
    assert_eq!(again["title"], "hook");

    // A late report: the first lease lapses, another claim takes over, and the first worker's
    // complete is refused, kept on its closed attempt, and changes nothing.
    let id = first["id"].clone();
    let old = c
        .ok(
            "claim",
            json!({"id": id, "require_fence": true, "lease_ttl_seconds": 60}),
        )
        .await;
    h.clock.advance(61_000);
    let new = c
        .ok("claim", json!({"id": id, "require_fence": true}))
        .await;
    assert_eq!(new["attempt_seq"], 2, "{new}");
    c.fails(
        "complete",
        json!({"id": id, "lease_token": old["lease_token"], "summary": "done after all"}),
        "conflict",
    )
    .await;
    let view = c.ok("get_todo", json!({"id": id})).await;
    assert_eq!(view["todo"]["state"], "claimed", "{view}");
    let lapsed = &view["attempts"][1];
    assert_eq!(lapsed["outcome"], "lease_expired", "{view}");
    assert_eq!(lapsed["late_reports"][0]["outcome"], "completed", "{view}");
    assert_eq!(lapsed["late_reports"][0]["summary"], "done after all");
}

#[tokio::test]
async fn every_error_code_is_a_tool_error_and_changes_nothing() {
    let h = start().await;
    let a = h.endpoint("a", ALL_VERBS, Some(&["qa"])).await;
    let b = h.endpoint("b", ALL_VERBS, None).await;
    let mut ca = h.mcp("a", &a);
    let mut cb = h.mcp("b", &b);
    ca.init().await;
    cb.init().await;
    let mine = ca
        .ok("add_todo", json!({"queue": "qa", "title": "a's"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let theirs = cb
        .ok("add_todo", json!({"queue": "qb", "title": "b's"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let claim = ca
        .ok("claim", json!({"id": mine, "require_fence": true}))
        .await;
    assert!(claim["lease_token"].is_string());
    let before = snapshot(&h).await;

    // conflict: a wrong lease token (the same answer as "not the owner").
    let m = ca
        .fails(
            "heartbeat",
            json!({"id": mine, "lease_token": "AAAAAAAAAAAAAAAAAAAAAA"}),
            "conflict",
        )
        .await;
    assert!(
        !m.contains("AAAAAAAAAAAAAAAAAAAAAA"),
        "no token in errors: {m}"
    );
    ca.fails("complete", json!({"id": mine}), "conflict").await;
    // not_found: a foreign id looks exactly like an unknown one.
    for tool in ["claim", "get_todo"] {
        let foreign = ca.fails(tool, json!({"id": theirs}), "not_found").await;
        let unknown = ca.fails(tool, json!({"id": "td_nope"}), "not_found").await;
        assert_eq!(
            foreign.replace(&theirs, "X"),
            unknown.replace("td_nope", "X")
        );
    }
    ca.fails("fail", json!({"id": theirs}), "not_found").await;
    // forbidden: an ungranted queue.
    ca.fails(
        "add_todo",
        json!({"queue": "qb", "title": "x"}),
        "forbidden",
    )
    .await;
    ca.fails("claim_next", json!({"queue": "qb"}), "forbidden")
        .await;
    ca.fails("list_todos", json!({"queue": "qb"}), "forbidden")
        .await;
    // invalid: an undeclared argument is named; bounds are enforced; a bad title is refused.
    let m = ca
        .fails(
            "claim_next",
            json!({"queue": "qa", "colour": "red"}),
            "invalid",
        )
        .await;
    assert!(m.contains("colour"), "{m}");
    let m = ca
        .fails(
            "heartbeat",
            json!({"id": mine, "lease_ttl_seconds": 0}),
            "invalid",
        )
        .await;
    assert!(m.contains("lease_ttl_seconds"), "{m}");
    ca.fails(
        "heartbeat",
        json!({"id": mine, "lease_ttl_seconds": 86_401}),
        "invalid",
    )
    .await;
    let m = ca.fails("claim", json!({}), "invalid").await;
    assert!(m.contains("id"), "{m}");
    ca.fails("add_todo", json!({"queue": "qa", "title": ""}), "invalid")
        .await;
    ca.fails("list_todos", json!({"limit": 501}), "invalid")
        .await;
    ca.fails("complete", json!({"id": mine, "result": [1]}), "invalid")
        .await;

    assert_eq!(snapshot(&h).await, before, "nothing changed");
}

#[tokio::test]
async fn a_wrong_token_unknown_or_revoked_endpoint_is_401() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let other = h.endpoint("other", ALL_VERBS, None).await;
    let before = snapshot(&h).await;
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18"}})
    .to_string();
    for (name, tok) in [
        ("ci", "wrong"),
        ("ci", other.as_str()),
        ("ghost", token.as_str()),
        ("ci", ""),
    ] {
        let r = h.mcp(name, tok).post_raw(body.clone()).await;
        assert_eq!(r.status(), 401, "{name}");
        assert!(
            r.headers()["www-authenticate"]
                .to_str()
                .unwrap()
                .starts_with("Bearer")
        );
        let text = r.text().await.unwrap();
        assert!(!text.contains(&token) && !text.contains(&other), "{text}");
    }
    let r = h
        .http
        .post(format!("{}/mcp/ci", h.base))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no Authorization header");

    // A live session dies with its endpoint.
    let mut c = h.mcp("ci", &token);
    c.init().await;
    h.store.endpoint_revoke(T0, "ci").await.unwrap();
    let (status, _) = c.rpc("tools/list", json!({})).await;
    assert_eq!(status, 401);
    assert_eq!(h.server.session_count(), 1);
    h.server.doorbell_once(T0).await.unwrap();
    assert_eq!(
        h.server.session_count(),
        0,
        "the sweep ends a revoked endpoint's sessions"
    );
    assert_eq!(snapshot(&h).await, before);
}

#[tokio::test]
async fn an_ungranted_verb_is_neither_listed_nor_callable() {
    let h = start().await;
    let reader = h.endpoint("reader", &["list_todos"], None).await;
    let worker = h
        .endpoint("worker", &["claim_next", "complete", "add_todo"], None)
        .await;
    let mut r = h.mcp("reader", &reader);
    r.init().await;
    let (_, list) = r.rpc("tools/list", json!({})).await;
    assert_eq!(
        tool_names(&list),
        vec!["get_todo", "list_todos"],
        "get_todo comes with list_todos"
    );
    let before = snapshot(&h).await;
    let m = r
        .fails("add_todo", json!({"queue": "q", "title": "x"}), "forbidden")
        .await;
    assert!(m.contains("add_todo"), "{m}");
    r.fails("claim_next", json!({}), "forbidden").await;
    assert_eq!(snapshot(&h).await, before);

    let mut w = h.mcp("worker", &worker);
    w.init().await;
    let (_, list) = w.rpc("tools/list", json!({})).await;
    assert_eq!(
        tool_names(&list),
        vec!["claim_next", "complete", "add_todo"]
    );
    let id = w.ok("add_todo", json!({"queue": "q", "title": "x"})).await["id"].clone();
    w.ok("claim_next", json!({})).await;
    w.fails("release", json!({"id": id}), "forbidden").await;
    w.fails("get_todo", json!({"id": id}), "forbidden").await;
    // An unknown tool name is a protocol error, not a tool error.
    let (status, v) = w.rpc("tools/call", json!({"name": "frobnicate"})).await;
    assert_eq!(status, 200);
    assert_eq!(v["error"]["code"], -32602, "{v}");
}

#[tokio::test]
async fn malformed_requests_are_answered_cleanly_and_change_nothing() {
    let h = start_with(|c| c.body_limit = 4096, false).await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    c.ok("add_todo", json!({"queue": "q", "title": "x"})).await;
    let before = snapshot(&h).await;

    let expect = |status: u16, code: i64| {
        move |(s, v): (u16, Value)| {
            assert_eq!(s, status, "{v}");
            assert_eq!(v["jsonrpc"], "2.0");
            assert_eq!(v["error"]["code"], code, "{v}");
        }
    };
    async fn send(c: &Mcp, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = c.post_raw(body).await;
        let s = r.status().as_u16();
        (s, r.json().await.unwrap())
    }
    expect(400, -32700)(send(&c, "{not json").await);
    expect(400, -32700)(send(&c, vec![0xff_u8, 0xfe, b'{', b'}']).await);
    expect(400, -32600)(
        send(
            &c,
            json!([{"jsonrpc": "2.0", "id": 1, "method": "ping"}]).to_string(),
        )
        .await,
    );
    expect(400, -32600)(send(&c, json!({"id": 1, "method": "ping"}).to_string()).await);
    expect(400, -32600)(send(&c, json!({"jsonrpc": "2.0", "id": 1}).to_string()).await);
    expect(400, -32600)(send(&c, "42").await);
    expect(200, -32601)(c.rpc("prompts/list", json!({})).await);
    expect(200, -32602)(c.rpc("tools/call", json!({})).await);
    // The tool call whose arguments are not an object.
    let r = c.call("list_todos", json!("all")).await;
    assert_eq!(r["structuredContent"]["error"]["code"], "invalid");

    // An oversize body: 413 with a JSON-RPC error, nothing added.
    let big = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
        "name": "add_todo", "arguments": {"queue": "q", "title": "big", "payload": "x".repeat(8000)}}})
    .to_string();
    let (s, v) = send(&c, big).await;
    assert_eq!(s, 413);
    assert_eq!(v["error"]["code"], -32600);
    assert!(v["error"]["message"].as_str().unwrap().contains("4096"));

    assert_eq!(snapshot(&h).await, before);
}

#[tokio::test]
async fn sessions_are_required_bound_deletable_and_expire() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let other = h.endpoint("other", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);

    // Without a session: 400.
    let (s, v) = c.rpc("tools/list", json!({})).await;
    assert_eq!(s, 400, "{v}");
    // Version negotiation: a supported one is echoed, an unknown one gets our latest.
    let (_, v) = c
        .rpc("initialize", json!({"protocolVersion": "2025-03-26"}))
        .await;
    assert_eq!(v["result"]["protocolVersion"], "2025-03-26");
    let (_, v) = c
        .rpc("initialize", json!({"protocolVersion": "1999-01-01"}))
        .await;
    assert_eq!(
        v["result"]["protocolVersion"],
        relay_server::server::PROTOCOL_VERSIONS[0]
    );
    c.init().await;
    let session = c.session.clone().unwrap();
    assert_eq!(session.len(), 32, "128 random bits in hex");

    // A protocol version header we do not speak: 400.
    let r = c
        .request(reqwest::Method::POST)
        .header("mcp-protocol-version", "1999-01-01")
        .body(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // A session belongs to its endpoint: another endpoint's token cannot use it.
    let mut o = h.mcp("other", &other);
    o.session = Some(session.clone());
    assert_eq!(o.rpc("ping", json!({})).await.0, 404);
    // Unknown session: 404.
    let mut u = h.mcp("ci", &token);
    u.session = Some("0".repeat(32));
    assert_eq!(u.rpc("ping", json!({})).await.0, 404);

    // DELETE ends it.
    let r = c.request(reqwest::Method::DELETE).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(c.rpc("ping", json!({})).await.0, 404);

    // Idle expiry on the injected clock. The store's record of a session's use is written at
    // most once per `session_touch_every`, so a session is forgotten between the idle timeout
    // and `session_kept` after its last use, never before.
    let idle = 30 * 60 * 1000;
    let kept = relay_core::limits::session_kept(idle);
    c.init().await;
    h.clock.advance(idle - 1);
    assert_eq!(c.rpc("ping", json!({})).await.0, 200, "used: kept alive");
    // Used again before its record fell due: the sweep at the last moment keeps it.
    h.clock
        .advance(relay_core::limits::session_touch_every(idle) - 1);
    assert_eq!(c.rpc("ping", json!({})).await.0, 200, "used again");
    h.clock.advance(idle - 1);
    h.server.doorbell_once(h.now()).await.unwrap();
    assert_eq!(
        c.rpc("ping", json!({})).await.0,
        200,
        "used within the idle timeout"
    );
    h.clock.advance(kept);
    assert_eq!(c.rpc("ping", json!({})).await.0, 404, "idle too long");
    // The sweep forgets idle sessions too.
    c.init().await;
    assert!(h.server.session_count() >= 1);
    h.clock.advance(kept);
    h.server.doorbell_once(h.now()).await.unwrap();
    assert_eq!(h.server.session_count(), 0);
}

/// The next `data:` message of an SSE response, within the bound.
async fn next_event(resp: &mut reqwest::Response, buf: &mut String) -> Value {
    harness::next_event(resp, buf, BOUND)
        .await
        .expect("an event within the bound")
}

#[tokio::test]
async fn the_doorbell_rings_gated_and_a_requeued_todo_is_not_swallowed() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    let mut stream = c.stream().await;
    // One stream per session.
    let second = c.get_stream().await;
    assert_eq!(second.status(), 409);
    let mut buf = String::new();

    // A new todo rings.
    let a = c.ok("add_todo", json!({"queue": "q1", "title": "a"})).await["id"].clone();
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["method"], "notifications/todo_ready");
    assert_eq!(ring["params"]["queues"], json!(["q1"]));

    // Inside the window another new todo is owed, not rung now.
    c.ok("add_todo", json!({"queue": "q2", "title": "b"})).await;
    // a is claimed, fails, and its retry is re-queued inside the same minute: it rings at once
    // (the next event is q1's, not the owed q2's).
    c.ok("claim", json!({"id": a})).await;
    let failed = c.ok("fail", json!({"id": a})).await;
    assert!(failed["next_retry_at"].is_string());
    h.clock.advance(31_000);
    let requeued = h.server.requeue_once(h.now()).await.unwrap();
    assert_eq!(requeued.len(), 1);
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(
        ring["params"]["queues"],
        json!(["q1"]),
        "the requeued todo rings"
    );

    // When the window has passed, the owed ring goes out.
    h.clock.advance(30_000);
    h.server.doorbell_once(h.now()).await.unwrap();
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["q2"]));

    // A reaped lease rings again too.
    h.clock.advance(61_000);
    let b = c
        .ok("claim_next", json!({"queue": "q2", "lease_ttl_seconds": 5}))
        .await;
    h.clock.advance(6_000);
    let reaped = h.server.reap_once(h.now()).await.unwrap();
    assert_eq!(reaped.len(), 1);
    assert_eq!(reaped[0].id, b["todo"]["id"].as_str().unwrap());
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["q2"]));
    let view = c.ok("get_todo", json!({"id": b["todo"]["id"]})).await;
    assert_eq!(view["attempts"][0]["outcome"], "reaped");
    assert_eq!(view["attempts"][0]["died"], true);

    // A todo added outside the server (the CLI writes the store) rings via the sweep.
    h.clock.advance(61_000);
    h.server.doorbell_once(h.now()).await.unwrap();
    h.store
        .apply(Op::AddTodo {
            now: h.now(),
            endpoint: "ci".into(),
            new: relay_core::ledger::NewTodo {
                id: "td_cli".into(),
                queue: "q3".into(),
                title: "from the cli".into(),
                ..Default::default()
            },
        })
        .await
        .unwrap();
    h.server.doorbell_once(h.now()).await.unwrap();
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["q3"]));

    // Claimed and given back outside too, after the window: the scan rings it again (the scan's
    // own earlier ring of it must not make the next scan skip it).
    h.clock.advance(61_000);
    let (now, actor) = (h.now(), Actor::cli());
    let claim = Op::Claim {
        now,
        actor: actor.clone(),
        id: "td_cli".into(),
        opts: relay_core::ledger::ClaimOpts {
            ttl: 60_000,
            ..Default::default()
        },
    };
    h.store.apply(claim).await.unwrap();
    let release = Op::Release {
        usage: None,
        now,
        actor,
        id: "td_cli".into(),
        summary: None,
        token_hash: None,
    };
    h.store.apply(release).await.unwrap();
    h.server.doorbell_once(h.now()).await.unwrap();
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["q3"]), "rung again");

    // DELETE ends the session, and with it the stream.
    let r = c.request(reqwest::Method::DELETE).send().await.unwrap();
    assert_eq!(r.status(), 204);
    let end = tokio::time::timeout(BOUND, async {
        while let Ok(Some(_)) = stream.chunk().await {}
    })
    .await;
    assert!(end.is_ok(), "the stream ends with its session");
}

#[tokio::test]
async fn graceful_shutdown_finishes_an_in_flight_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut h = start_with(|_| {}, true).await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    let session = c.session.clone().unwrap();
    // An open doorbell stream must not hold shutdown up.
    let mut stream = c.stream().await;

    // A request whose body is still arriving when shutdown begins.
    let body = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "add_todo", "arguments": {"queue": "q", "title": "in flight"}}})
    .to_string();
    let addr = h.base.trim_start_matches("http://").to_string();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /mcp/ci HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Mcp-Session-Id: {session}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let mut in_flight = h.server.in_flight();
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(&body.as_bytes()[..10]).await.unwrap();
    tokio::time::timeout(BOUND, in_flight.wait_for(|n| *n >= 1))
        .await
        .unwrap()
        .unwrap();

    h.stop.take().unwrap().send(()).unwrap();
    sock.write_all(&body.as_bytes()[10..]).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(BOUND, sock.read_to_end(&mut response))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8(response).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("in flight"), "{text}");
    tokio::time::timeout(BOUND, h.served.take().unwrap())
        .await
        .expect("serve returns after draining")
        .unwrap()
        .unwrap();
    assert_eq!(snapshot(&h).await.len(), 1, "the in-flight add committed");
    let ended = tokio::time::timeout(BOUND, async {
        while let Ok(Some(_)) = stream.chunk().await {}
    })
    .await;
    assert!(ended.is_ok(), "the doorbell stream ended with the server");
    // And nothing is accepted any more.
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err());
}

#[tokio::test]
async fn foreign_host_and_origin_are_refused() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let c = h.mcp("ci", &token);
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18"}})
    .to_string();
    for (header, value, status) in [
        ("host", "evil.example", 403),
        ("origin", "https://evil.example", 403),
        ("origin", "http://localhost:3000", 200),
    ] {
        let r = c
            .request(reqwest::Method::POST)
            .header(header, value)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{header}: {value}");
    }
    assert_eq!(
        h.server.session_count(),
        1,
        "only the allowed one opened a session"
    );
}

#[tokio::test]
async fn metrics_and_healthz() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    let a = c.ok("add_todo", json!({"queue": "q", "title": "a"})).await["id"].clone();
    c.ok("add_todo", json!({"queue": "q", "title": "b"})).await;
    let claim = c.ok("claim", json!({"id": a, "require_fence": true})).await;
    let lease = claim["lease_token"].as_str().unwrap().to_string();
    c.ok("heartbeat", json!({"id": a, "lease_token": lease}))
        .await;
    c.ok("complete", json!({"id": a, "lease_token": lease}))
        .await;

    let r = h
        .http
        .get(format!("{}/healthz", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = h
        .http
        .get(format!("{}/metrics", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    for line in [
        "relay_todos{state=\"pending\"} 1",
        "relay_todos{state=\"done\"} 1",
        "relay_todos{state=\"claimed\"} 0",
        "relay_attempts_closed_total{outcome=\"completed\",disposition=\"done\"} 1",
        "relay_heartbeats_total 1",
        "relay_claim_latency_seconds_count 1",
        "relay_tool_calls_total{tool=\"complete\",result=\"ok\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    assert!(!text.contains(&lease) && !text.contains(&token));
}

#[tokio::test]
async fn a_seeded_server_issues_replayable_session_ids() {
    let mut ids = Vec::new();
    for _ in 0..2 {
        let h = start().await;
        let token = h.endpoint("ci", ALL_VERBS, None).await;
        let mut c = h.mcp("ci", &token);
        c.init().await;
        ids.push(c.session.clone().unwrap());
    }
    assert_eq!(ids[0], ids[1], "same seed, same session ids");
}

/// Pages through `resources/list` to the end: every URI, and how many pages it took.
async fn all_resources(m: &mut Mcp) -> (Vec<String>, usize) {
    let (mut uris, mut cursor, mut pages) = (Vec::new(), None::<Value>, 0);
    loop {
        let params = cursor.map_or(json!({}), |c| json!({ "cursor": c }));
        let (status, v) = m.rpc("resources/list", params).await;
        assert_eq!(status, 200, "{v}");
        pages += 1;
        for r in v["result"]["resources"].as_array().expect("resources") {
            assert_eq!(r["mimeType"], "application/json", "{r}");
            assert!(r["name"].is_string(), "{r}");
            uris.push(r["uri"].as_str().unwrap().to_string());
        }
        match v["result"].get("nextCursor") {
            Some(c) => cursor = Some(c.clone()),
            None => return (uris, pages),
        }
    }
}

#[tokio::test]
async fn todo_resources_page_every_todo_once_and_are_scoped_like_get_todo() {
    let h = start().await;
    let verbs = ["add_todo", "list_todos", "claim_next", "complete"];
    let a = h.endpoint("a", &verbs, None).await;
    let b = h.endpoint("b", &verbs, None).await;
    let plain = h.endpoint("plain", &["claim_next", "get_todo"], None).await;
    let mut a = h.mcp("a", &a);
    let init = a.init().await;
    assert_eq!(
        init["result"]["capabilities"]["resources"],
        json!({"subscribe": false, "listChanged": false})
    );
    // The clock stands still: every todo ties on created_at, so the id orders the pages.
    let page = relay_core::resources::PAGE;
    let mut ids = Vec::new();
    for i in 0..(2 * page + 7) {
        let q = if i % 3 == 0 { "q2" } else { "q1" };
        let t = a
            .ok(
                "add_todo",
                json!({"queue": q, "title": format!("todo <{i}>")}),
            )
            .await;
        ids.push(t["id"].as_str().unwrap().to_string());
    }
    let mut b = h.mcp("b", &b);
    b.init().await;
    let foreign = b
        .ok("add_todo", json!({"queue": "q1", "title": "b's"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();

    let (uris, pages) = all_resources(&mut a).await;
    assert_eq!(pages, 3);
    // a may claim: the queues it has todos in come first, on the first page, then its todos.
    assert_eq!(uris[..2], ["relay://queues/q1", "relay://queues/q2"]);
    let uris: Vec<String> = uris
        .into_iter()
        .filter(|u| u.starts_with("relay://todos/"))
        .collect();
    let mut want: Vec<String> = ids.iter().map(|id| format!("relay://todos/{id}")).collect();
    want.sort();
    let mut got = uris.clone();
    got.sort();
    got.dedup();
    assert_eq!(got.len(), uris.len(), "a todo listed twice");
    assert_eq!(got, want, "every todo of a, and only a's");

    // A todo added between pages shows on a later page, and nothing repeats.
    let (_, first) = a.rpc("resources/list", json!({})).await;
    let cursor = first["result"]["nextCursor"].clone();
    h.clock.advance(1);
    let late = a
        .ok("add_todo", json!({"queue": "q1", "title": "late"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut rest = Vec::new();
    let mut c = cursor;
    while !c.is_null() {
        let (_, v) = a.rpc("resources/list", json!({ "cursor": c })).await;
        for r in v["result"]["resources"].as_array().unwrap() {
            rest.push(r["uri"].as_str().unwrap().to_string());
        }
        c = v["result"]["nextCursor"].clone();
    }
    assert_eq!(rest.len(), ids.len() + 1 - page);
    assert_eq!(rest.last(), Some(&format!("relay://todos/{late}")));

    // A read is the get_todo answer as JSON, and a short text.
    a.ok("claim_next", json!({"queue": "q1"})).await;
    let id = &ids[1];
    let (_, v) = a
        .rpc(
            "resources/read",
            json!({"uri": format!("relay://todos/{id}")}),
        )
        .await;
    let contents = v["result"]["contents"]
        .as_array()
        .expect("contents")
        .clone();
    assert_eq!(contents[0]["mimeType"], "application/json");
    let json: Value = serde_json::from_str(contents[0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(json, a.ok("get_todo", json!({"id": id})).await);
    let text = contents[1]["text"].as_str().unwrap();
    assert_eq!(contents[1]["mimeType"], "text/plain");
    assert!(
        text.contains("todo <1>") && text.contains("#1 attempt 1: open"),
        "{text}"
    );

    // A foreign and an unknown id answer the same not-found error.
    let before = snapshot(&h).await;
    let not_found = |v: &Value, id: &str| {
        assert_eq!(v["error"]["code"], -32002, "{v}");
        v["error"]["message"].as_str().unwrap().replace(id, "ID")
    };
    let (_, v) = a
        .rpc(
            "resources/read",
            json!({"uri": format!("relay://todos/{foreign}")}),
        )
        .await;
    let (_, w) = a
        .rpc("resources/read", json!({"uri": "relay://todos/td_nosuch"}))
        .await;
    assert_eq!(not_found(&v, &foreign), not_found(&w, "td_nosuch"));

    // Bad input: invalid params naming the field and the fix.
    for (method, params, field) in [
        (
            "resources/list",
            json!({"cursor": "nonsense"}),
            "params.cursor",
        ),
        ("resources/list", json!({"cursor": 3}), "params.cursor"),
        ("resources/read", json!({}), "params.uri"),
        (
            "resources/read",
            json!({"uri": "https://elsewhere/td_1"}),
            "params.uri",
        ),
        (
            "resources/read",
            json!({"uri": "relay://todos/../x"}),
            "params.uri",
        ),
    ] {
        let (status, v) = a.rpc(method, params).await;
        assert_eq!(status, 200);
        assert_eq!(v["error"]["code"], -32602, "{method}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(field) && m.contains("resources/list"), "{m}");
    }

    // Without list_todos: only the queue resources (plain may claim), and no todo is read.
    let mut p = h.mcp("plain", &plain);
    let init = p.init().await;
    assert_eq!(
        init["result"]["capabilities"]["resources"]["subscribe"], false,
        "{init}"
    );
    let (_, v) = p.rpc("resources/list", json!({})).await;
    let listed = v["result"]["resources"].as_array().expect("a list").clone();
    assert!(
        listed
            .iter()
            .all(|r| r["uri"].as_str().unwrap().starts_with("relay://queues/")),
        "{v}"
    );
    let (_, v) = p
        .rpc(
            "resources/read",
            json!({"uri": format!("relay://todos/{id}")}),
        )
        .await;
    assert_eq!(v["error"]["code"], -32003, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("list_todos")
    );
    // An endpoint that can neither list nor claim is offered no resources at all.
    let reader = h.endpoint("reader", &["add_todo"], None).await;
    let mut r = h.mcp("reader", &reader);
    let init = r.init().await;
    assert!(
        init["result"]["capabilities"].get("resources").is_none(),
        "{init}"
    );
    let (_, v) = r.rpc("resources/list", json!({})).await;
    assert_eq!(v["error"]["code"], -32003, "{v}");
    assert_eq!(snapshot(&h).await, before);
}

/// Priorities and delayed todos (CONTRACT "Flow control"), the same in both MCP eras: a higher
/// priority is claimed first and FIFO holds within one; `run_at` and `delay_seconds` hold a
/// todo back until their instant; bad values (and a bad `concurrency_key`) are refused naming
/// the argument, alike in both eras, and add nothing.
#[tokio::test]
async fn priorities_and_delays_order_claims_in_both_eras() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut legacy = h.mcp("ci", &token);
    legacy.init().await;
    let mut modern = h.mcp_modern("ci", &token);
    for (era, c) in [("legacy", &mut legacy), ("modern", &mut modern)] {
        let q = format!("q-{era}");
        let in_a_minute = relay_core::time::rfc3339(h.now() + 60_000);
        let add = |title: &str, extra: Value| {
            let mut args = json!({"queue": q, "title": title});
            args.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            args
        };
        let low = c.ok("add_todo", add("low", json!({"priority": -3}))).await;
        assert_eq!(low["priority"], -3, "{low}");
        c.ok("add_todo", add("plain", json!({}))).await;
        let later = c
            .ok("add_todo", add("later", json!({"run_at": in_a_minute})))
            .await;
        assert_eq!(later["run_at"], in_a_minute.as_str(), "{later}");
        c.ok("add_todo", add("delayed", json!({"delay_seconds": 30})))
            .await;
        c.ok("add_todo", add("urgent", json!({"priority": 100})))
            .await;
        let mut order = Vec::new();
        loop {
            let next = c.ok("claim_next", json!({"queue": q})).await;
            match next["todo"]["title"].as_str() {
                Some(t) => order.push(t.to_string()),
                None => break,
            }
        }
        assert_eq!(order, ["urgent", "plain", "low"], "{era}");
        h.clock.advance(30_000);
        let next = c.ok("claim_next", json!({"queue": q})).await;
        assert_eq!(next["todo"]["title"], "delayed", "{era}: {next}");
        h.clock.advance(30_000);
        let next = c.ok("claim_next", json!({"queue": q})).await;
        assert_eq!(next["todo"]["title"], "later", "{era}: {next}");
    }

    let before = snapshot(&h).await;
    let in_a_minute = relay_core::time::rfc3339(h.now() + 60_000);
    let far = relay_core::time::rfc3339(h.now() + 366 * 86_400_000);
    let bad = [
        (json!({"priority": 101}), "priority"),
        (json!({"priority": -101}), "priority"),
        (json!({"priority": "high"}), "priority"),
        (json!({"run_at": "tomorrow"}), "run_at"),
        (json!({"run_at": far}), "run_at"),
        (json!({"delay_seconds": -1}), "delay_seconds"),
        (json!({"delay_seconds": 31_536_001}), "delay_seconds"),
        (
            json!({"run_at": in_a_minute, "delay_seconds": 5}),
            "delay_seconds",
        ),
        (
            json!({"concurrency_key": "k".repeat(129)}),
            "concurrency_key",
        ),
        (json!({"concurrency_key": ""}), "concurrency_key"),
        (json!({"concurrency_key": "a\u{7}b"}), "concurrency_key"),
        (json!({"concurrency_key": 7}), "concurrency_key"),
    ];
    for (extra, field) in bad {
        let mut args = json!({"queue": "q-bad", "title": "bad"});
        args.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let l = legacy.fails("add_todo", args.clone(), "invalid").await;
        let m = modern.fails("add_todo", args, "invalid").await;
        assert!(l.contains(field), "{extra}: {l}");
        assert_eq!(l, m, "both eras answer {extra} alike");
    }
    assert_eq!(snapshot(&h).await, before, "nothing changed");
}

/// A delayed todo rings twice: when it is added (a client that drains then finds nothing) and
/// when its time comes (the retry sweep clears `run_at`), even inside the doorbell's window, so
/// a client that waits for rings is told as soon as it can claim it.
#[tokio::test]
async fn a_delayed_todo_rings_again_when_its_time_comes() {
    let h = start().await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;
    let mut stream = c.stream().await;
    let mut buf = String::new();
    let id = c
        .ok(
            "add_todo",
            json!({"queue": "later", "title": "t", "delay_seconds": 20}),
        )
        .await["id"]
        .clone();
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["later"]));
    let next = c.ok("claim_next", json!({"queue": "later"})).await;
    assert!(next["todo"].is_null(), "not before its time: {next}");
    h.clock.advance(19_999);
    assert!(h.server.requeue_once(h.now()).await.unwrap().is_empty());
    h.clock.advance(1);
    let came = h.server.requeue_once(h.now()).await.unwrap();
    assert_eq!(came.len(), 1, "{came:?}");
    let ring = next_event(&mut stream, &mut buf).await;
    assert_eq!(ring["params"]["queues"], json!(["later"]), "its time rings");
    let view = c.ok("get_todo", json!({"id": id})).await;
    assert_eq!(view["todo"]["run_at"], Value::Null, "{view}");
    let next = c.ok("claim_next", json!({"queue": "later"})).await;
    assert_eq!(next["todo"]["id"], id, "{next}");
}
