//! A todo as an MCP task (the 2026-07-28 Tasks extension) over real HTTP, in raw JSON-RPC built
//! from the extension's schema: `add_todo` answered with a task, `tasks/get` through every
//! status, `tasks/update` answering a worker's question, `tasks/cancel` of a pending and of a
//! claimed task, a dead letter's `isError`, the refusals, and two servers on one database
//! (create on one, poll and cancel on the other).
//!
//! SQLite in memory, or Postgres with `RELAY_SERVER_TEST_DB=postgres` (CI runs both); on
//! Postgres the second server has a connection pool of its own. Time is a `ManualClock`.

#[path = "support/harness.rs"]
mod harness;

use std::time::Duration;

use harness::{BOUND, Harness, Mcp, next_event, open_store};
use relay_core::ledger::LedgerConfig;
use relay_core::mcp::era::{self, MODERN};
use relay_core::task::EXTENSION;
use relay_server::store::Store;
use serde_json::{Value, json};

/// Every verb a task's client and its workers use.
const VERBS: &[&str] = &[
    "add_todo",
    "claim_next",
    "heartbeat",
    "complete",
    "fail",
    "request_input",
    "list_todos",
    "answer_todo",
];

/// Two servers over one database, polling tasks every `poll`: the first owns the harness's store; the second opens its own
/// (a pool of its own on Postgres, the same in-memory SQLite otherwise).
async fn two_servers(poll: Duration) -> (Harness, Harness) {
    let (store, pg) = open_store().await;
    let second = match &pg {
        Some((url, schema)) => Store::Postgres(
            relay_server::store::PgStore::open_in_schema(url, schema, LedgerConfig::default())
                .await
                .unwrap()
                .with_clock(relay_server::store::PgClock::Caller),
        ),
        None => store.clone(),
    };
    let mut a = Harness::start_on(store, 7, |c| c.task_poll_interval = poll, false).await;
    a.pg_schema = pg;
    let b = Harness::start_on(second, 8, |c| c.task_poll_interval = poll, false).await;
    (a, b)
}

/// Two servers, an endpoint `ci`, and its clients: the task's client on the first server,
/// another task client on the second, and a modern worker on the first.
struct Cluster {
    a: Harness,
    b: Harness,
    token: String,
    client: Mcp,
    other: Mcp,
    worker: Mcp,
}

async fn cluster(poll: Duration) -> Cluster {
    let (a, b) = two_servers(poll).await;
    let token = a.endpoint("ci", VERBS, None).await;
    Cluster {
        client: a.mcp_tasks("ci", &token),
        other: b.mcp_tasks("ci", &token),
        worker: a.mcp_modern("ci", &token),
        a,
        b,
        token,
    }
}

/// A task method's result (asserting HTTP 200 and no error).
async fn task(c: &mut Mcp, method: &str, params: Value) -> Value {
    let (status, v) = c.rpc(method, params).await;
    assert_eq!(status, 200, "{method}: {v}");
    assert!(v["error"].is_null(), "{method}: {v}");
    assert_eq!(v["result"]["resultType"], "complete", "{v}");
    v["result"].clone()
}

async fn get(c: &mut Mcp, id: &str) -> Value {
    task(c, "tasks/get", json!({"taskId": id})).await
}

/// `add_todo` answered with a task: its CreateTaskResult.
async fn create(c: &mut Mcp, args: Value) -> Value {
    let (status, v) = c
        .rpc("tools/call", json!({"name": "add_todo", "arguments": args}))
        .await;
    assert_eq!(status, 200, "{v}");
    let r = v["result"].clone();
    assert_eq!(r["resultType"], "task", "{v}");
    r
}

/// `add_todo` answered with a task: its id.
async fn create_id(c: &mut Mcp, args: Value) -> String {
    let made = create(c, args).await;
    made["taskId"].as_str().expect("a task id").to_string()
}

/// A fenced claim by a worker: (todo id, lease token, the claim's answer).
async fn claim(w: &mut Mcp) -> (String, String, Value) {
    let c = w.ok("claim_next", json!({"require_fence": true})).await;
    let id = c["todo"]["id"].as_str().unwrap().to_string();
    (id, c["lease_token"].as_str().unwrap().to_string(), c)
}

#[tokio::test]
async fn a_task_is_created_polled_worked_and_completed_across_two_servers() {
    let Cluster {
        a: _a,
        b,
        token,
        mut client,
        mut other,
        worker: _,
    } = cluster(Duration::from_secs(5)).await;
    // This worker speaks the legacy era, through the second server.
    let mut worker = b.mcp("ci", &token);
    worker.init().await;

    // discover offers the extension.
    let (_, d) = client.rpc("server/discover", json!({})).await;
    assert_eq!(
        d["result"]["capabilities"]["extensions"][EXTENSION],
        json!({})
    );

    let made = create(
        &mut client,
        json!({"queue": "q", "title": "fix it", "max_attempts": 3, "idempotency_key": "k1"}),
    )
    .await;
    let id = made["taskId"].as_str().unwrap().to_string();
    assert_eq!(made["status"], "working");
    assert_eq!(made["pollIntervalMs"], 5000);
    assert_eq!(made["ttlMs"], Value::Null);
    assert!(made["createdAt"].is_string() && made["lastUpdatedAt"].is_string());
    // The CreateTaskResult was lost: the same add, on the other server, answers the same task.
    let again = create(
        &mut other,
        json!({"queue": "q", "title": "fix it", "max_attempts": 3, "idempotency_key": "k1"}),
    )
    .await;
    assert_eq!(again["taskId"], made["taskId"]);

    // Durable before the answer: the other server answers for it at once.
    let t = get(&mut other, &id).await;
    assert_eq!(
        (t["taskId"].as_str(), t["status"].as_str()),
        (Some(id.as_str()), Some("working"))
    );
    assert_eq!(t["statusMessage"], "waiting for a worker");

    let (todo, lease, _) = claim(&mut worker).await;
    assert_eq!(
        get(&mut client, &id).await["statusMessage"],
        "attempt 1/3 running"
    );
    // get_todo answers the task id to its client.
    let view = client.ok("get_todo", json!({"id": todo})).await;
    assert_eq!(
        (&view["todo"]["task_id"], &view["todo"]["task"]),
        (&json!(id), &json!(true))
    );

    worker
        .ok(
            "complete",
            json!({"id": todo, "lease_token": lease, "summary": "fixed", "result": {"pr": 12}}),
        )
        .await;
    for c in [&mut client, &mut other] {
        let t = get(c, &id).await;
        assert_eq!(t["status"], "completed", "{t}");
        assert_eq!(t["result"]["isError"], false);
        assert_eq!(t["result"]["resultType"], "complete", "{t}");
        assert_eq!(
            t["result"]["structuredContent"]["result"],
            json!({"pr": 12})
        );
        assert_eq!(t["result"]["structuredContent"]["state"], "done");
    }
    // A cancel after the end is acknowledged and changes nothing.
    assert_eq!(
        task(&mut other, "tasks/cancel", json!({"taskId": id})).await["resultType"],
        "complete"
    );
    assert_eq!(get(&mut client, &id).await["status"], "completed");
}

#[tokio::test]
async fn a_question_is_answered_through_the_task_and_the_next_attempt_reads_it() {
    let mut c = cluster(Duration::from_secs(5)).await;
    let id = create_id(&mut c.client, json!({"queue": "q", "title": "deploy"})).await;
    let (todo, lease, _) = claim(&mut c.worker).await;
    c.worker
        .ok(
            "request_input",
            json!({"id": todo, "lease_token": lease, "question": "Which region?"}),
        )
        .await;
    let t = get(&mut c.other, &id).await;
    assert_eq!(t["status"], "input_required", "{t}");
    let requests = t["inputRequests"].as_object().unwrap();
    assert_eq!(requests.len(), 1);
    let (key, asked) = requests.iter().next().unwrap();
    assert_eq!(asked["method"], "elicitation/create");
    assert_eq!(asked["params"]["message"], "Which region?");

    let answer = json!({key.as_str(): {"action": "accept", "content": {"answer": "eu-west"}}});
    let ack = task(
        &mut c.other,
        "tasks/update",
        json!({"taskId": id, "inputResponses": answer}),
    )
    .await;
    assert_eq!(
        ack.as_object().unwrap().len(),
        2,
        "only resultType and _meta: {ack}"
    );
    // The repeat (its ack lost) is ignored.
    task(
        &mut c.client,
        "tasks/update",
        json!({"taskId": id, "inputResponses": answer}),
    )
    .await;
    assert_eq!(get(&mut c.client, &id).await["status"], "working");
    // The next attempt sees the question and its answer, by the task's c.client.
    let (_, _, c) = claim(&mut c.worker).await;
    let prior = &c["prior_attempts"][0];
    assert_eq!(prior["question"], "Which region?", "{c}");
    assert_eq!(prior["answer"], "eu-west", "{c}");
    assert_eq!(prior["answered_by"], "endpoint:ci", "{c}");
}

#[tokio::test]
async fn cancel_stops_a_pending_and_a_claimed_task_and_a_dead_letter_is_an_error_result() {
    let mut c = cluster(Duration::from_secs(5)).await;

    let pending = create_id(&mut c.client, json!({"queue": "p", "title": "t"})).await;
    task(&mut c.other, "tasks/cancel", json!({"taskId": pending})).await;
    assert_eq!(get(&mut c.client, &pending).await["status"], "cancelled");

    let claimed = create_id(&mut c.client, json!({"queue": "q", "title": "t"})).await;
    let (todo, lease, _) = claim(&mut c.worker).await;
    task(&mut c.other, "tasks/cancel", json!({"taskId": claimed})).await;
    assert_eq!(get(&mut c.client, &claimed).await["status"], "cancelled");
    // The c.worker is stopped at its next heartbeat; its late completion changes nothing.
    c.worker
        .fails(
            "heartbeat",
            json!({"id": todo, "lease_token": lease}),
            "conflict",
        )
        .await;
    c.worker
        .fails(
            "complete",
            json!({"id": todo, "lease_token": lease}),
            "conflict",
        )
        .await;
    assert_eq!(get(&mut c.other, &claimed).await["status"], "cancelled");

    let dead = create(
        &mut c.client,
        json!({"queue": "q", "title": "t", "max_attempts": 1}),
    )
    .await["taskId"]
        .as_str()
        .unwrap()
        .to_string();
    let (todo, lease, _) = claim(&mut c.worker).await;
    c.worker
        .ok(
            "fail",
            json!({"id": todo, "lease_token": lease, "summary": "tests still red"}),
        )
        .await;
    let t = get(&mut c.other, &dead).await;
    assert_eq!(
        (t["status"].as_str(), &t["result"]["isError"]),
        (Some("completed"), &json!(true))
    );
    assert!(
        t["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("tests still red"),
        "{t}"
    );
}

#[tokio::test]
async fn task_requests_are_checked_and_a_refusal_names_no_task_id() {
    let (a, _b) = two_servers(Duration::from_secs(5)).await;
    let token = a.endpoint("ci", VERBS, None).await;
    let other_token = a.endpoint("other", VERBS, None).await;
    let mut client = a.mcp_tasks("ci", &token);
    let id = create_id(&mut client, json!({"queue": "q", "title": "t"})).await;
    let secret = id.rsplit_once('.').unwrap().1.to_string();

    // Without the extension declared: a plain answer to add_todo, -32021 to a task method.
    let mut plain = a.mcp_modern("ci", &token);
    let added = plain
        .ok("add_todo", json!({"queue": "q", "title": "t"}))
        .await;
    assert!(added["id"].is_string());
    let (status, v) = plain.rpc("tasks/get", json!({"taskId": id})).await;
    assert_eq!(
        (status, v["error"]["code"].as_i64()),
        (400, Some(-32021)),
        "{v}"
    );
    assert_eq!(
        v["error"]["data"]["requiredCapabilities"]["extensions"][EXTENSION],
        json!({})
    );
    // The legacy era has no task methods; the extension removed tasks/list and tasks/result.
    let mut legacy = a.mcp("ci", &token);
    legacy.init().await;
    let (_, v) = legacy.rpc("tasks/get", json!({"taskId": id})).await;
    assert_eq!(v["error"]["code"], -32601, "{v}");
    for removed in ["tasks/list", "tasks/result"] {
        let (status, v) = client.rpc(removed, json!({"taskId": id})).await;
        assert_eq!(
            (status, v["error"]["code"].as_i64()),
            (404, Some(-32601)),
            "{v}"
        );
    }

    // Unknown, foreign and malformed ids are invalid params that never quote the id.
    let mut stranger = a.mcp_tasks("other", &other_token);
    let (todo, _) = id.rsplit_once('.').unwrap();
    let wrong = format!("{todo}.{}", "0".repeat(secret.len()));
    for (who, presented) in [
        ("other", id.as_str()),
        ("ci", wrong.as_str()),
        ("ci", "td_nope"),
    ] {
        let c = if who == "ci" {
            &mut client
        } else {
            &mut stranger
        };
        for method in ["tasks/get", "tasks/cancel"] {
            let (status, v) = c.rpc(method, json!({"taskId": presented})).await;
            assert_eq!(
                (status, v["error"]["code"].as_i64()),
                (200, Some(-32602)),
                "{v}"
            );
            let text = v.to_string();
            assert!(
                !text.contains(&secret) && !text.contains("td_nope"),
                "{text}"
            );
        }
    }
    // Bad params name the field; the task is untouched.
    for (method, params, says) in [
        (
            "tasks/get",
            json!({"taskId": id, "bogus": 1}),
            "unknown field \"bogus\"",
        ),
        (
            "tasks/update",
            json!({"taskId": id}),
            "inputResponses is required",
        ),
        (
            "tasks/update",
            json!({"taskId": id, "inputResponses": {"q1": {"action": "maybe"}}}),
            "action",
        ),
    ] {
        let (status, v) = client.rpc(method, params).await;
        assert_eq!(
            (status, v["error"]["code"].as_i64()),
            (200, Some(-32602)),
            "{v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{v}"
        );
    }
    // The routing header must carry the task id.
    let body = json!({"jsonrpc": "2.0", "id": 9, "method": "tasks/get", "params": {
        "taskId": id, "_meta": {era::META_VERSION: MODERN,
            era::META_CAPABILITIES: {"extensions": {EXTENSION: {}}}}}});
    let r = client
        .request(reqwest::Method::POST)
        .header("content-type", "application/json")
        .header(era::VERSION_HEADER, MODERN)
        .header(era::METHOD_HEADER, "tasks/get")
        .header(era::NAME_HEADER, "td_other.abc")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], -32020, "{v}");
    assert!(!v.to_string().contains(&secret), "{v}");
    assert_eq!(get(&mut client, &id).await["status"], "working");
}

#[tokio::test]
async fn a_listen_stream_hears_a_task_change_made_through_another_server() {
    let Cluster {
        a,
        b,
        token,
        mut client,
        other: mut watcher,
        mut worker,
    } = cluster(Duration::from_millis(20)).await;
    let adder = a.endpoint("adder", &["add_todo"], None).await;
    let id = create_id(&mut client, json!({"queue": "q", "title": "t"})).await;

    // Without the extension declared, task notifications are refused.
    let mut plain = b.mcp_modern("ci", &token);
    let (status, v) = plain
        .rpc(
            "subscriptions/listen",
            json!({"notifications": {"taskIds": [id]}}),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_i64()),
        (400, Some(-32021)),
        "{v}"
    );

    let mut stream = watcher
        .send(
            "subscriptions/listen",
            json!({"notifications": {"taskIds": [id]}}),
        )
        .await;
    assert_eq!(stream.status(), 200);
    let mut buf = String::new();
    let ack = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(
        ack["params"]["notifications"]["taskIds"],
        json!([id]),
        "{ack}"
    );
    let seen = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(seen["method"], "notifications/tasks", "{seen}");
    assert_eq!(
        (
            seen["params"]["taskId"].as_str(),
            seen["params"]["status"].as_str()
        ),
        (Some(id.as_str()), Some("working"))
    );
    assert!(seen["params"]["_meta"].is_object());

    // The worker claims and completes through the other server: each change is heard, the
    // last with the result, and then the stream has nothing more to say of the task.
    let (todo, lease, _) = claim(&mut worker).await;
    let running = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(
        running["params"]["statusMessage"], "attempt 1/5 running",
        "{running}"
    );
    worker
        .ok(
            "complete",
            json!({"id": todo, "lease_token": lease, "result": {"ok": true}}),
        )
        .await;
    let done = next_event(&mut stream, &mut buf, BOUND).await.unwrap();
    assert_eq!(done["params"]["status"], "completed", "{done}");
    assert_eq!(
        done["params"]["result"]["structuredContent"]["result"],
        json!({"ok": true})
    );

    // An endpoint that only adds may watch its tasks; another endpoint's task is never heard.
    let mut only_adds = b.mcp_tasks("adder", &adder);
    let mut s2 = only_adds
        .send(
            "subscriptions/listen",
            json!({"notifications": {"taskIds": [id]}}),
        )
        .await;
    assert_eq!(s2.status(), 200);
    let mut buf2 = String::new();
    next_event(&mut s2, &mut buf2, BOUND).await.unwrap();
    assert_eq!(
        next_event(&mut s2, &mut buf2, Duration::from_millis(200)).await,
        None
    );
}
