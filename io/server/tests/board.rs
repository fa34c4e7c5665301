//! The Board over real HTTP (127.0.0.1:0): login, the cookie's flags, CSRF refusal, session
//! expiry (on the injected clock), logout, revoke, the CSP, endpoint bearer tokens refused,
//! escaping, and an operator recovering a stuck claimed todo with Release.

#[path = "support/harness.rs"]
mod harness;

use harness::{Harness, Mcp, T0, form};
use relay_core::board::{CSRF_FIELD_LEN, SESSION_TTL};
use relay_core::ledger::{LedgerConfig, TokenHash};
use relay_server::store::{BulkResult, Store};
use serde_json::json;

async fn start() -> Harness {
    let store = Store::open("sqlite::memory:", LedgerConfig::default())
        .await
        .unwrap();
    Harness::start_on(store, 7, |_| {}, false).await
}

fn no_redirects() -> reqwest::Client {
    let _ = harness::client();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

struct Board {
    http: reqwest::Client,
    base: String,
    cookie: Option<String>,
}

impl Board {
    fn new(h: &Harness) -> Board {
        Board {
            http: no_redirects(),
            base: h.base.clone(),
            cookie: None,
        }
    }

    /// A Board logged in with `token`.
    async fn logged_in(h: &Harness, token: &str) -> Board {
        let mut b = Board::new(h);
        b.login(token).await;
        b
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        let mut r = self.http.get(format!("{}{path}", self.base));
        if let Some(c) = &self.cookie {
            r = r.header("cookie", c);
        }
        r.send().await.unwrap()
    }

    async fn post(&self, path: &str, pairs: &[(&str, &str)]) -> reqwest::Response {
        let mut r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(pairs));
        if let Some(c) = &self.cookie {
            r = r.header("cookie", c);
        }
        r.send().await.unwrap()
    }

    /// Logs in; answers the Set-Cookie header as sent.
    async fn login(&mut self, token: &str) -> String {
        let r = self.post("/board/login", &[("token", token)]).await;
        assert_eq!(r.status(), 303, "login: {}", r.text().await.unwrap());
        let set = r.headers()["set-cookie"].to_str().unwrap().to_string();
        self.cookie = Some(set.split(';').next().unwrap().to_string());
        set
    }

    /// The page at `path`, as text.
    async fn page(&self, path: &str) -> String {
        self.get(path).await.text().await.unwrap()
    }

    /// The CSRF token the page at `path` carries in its forms.
    async fn csrf(&self, path: &str) -> String {
        let page = self.page(path).await;
        let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
        page[at..at + CSRF_FIELD_LEN].to_string()
    }
}

/// A server with operator `alice` (her token) and endpoint `ci` granted `verbs`, its MCP
/// session initialised.
async fn with_ci(verbs: &[&str]) -> (Harness, String, Mcp) {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let bearer = h.endpoint("ci", verbs, None).await;
    let mut mcp = h.mcp("ci", &bearer);
    mcp.init().await;
    (h, token, mcp)
}

/// Adds a todo through `mcp`; its id.
async fn add(mcp: &mut Mcp, args: serde_json::Value) -> String {
    mcp.ok("add_todo", args).await["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn operator(h: &Harness, name: &str) -> String {
    let token = relay_server::server::new_bearer_token().unwrap();
    h.store
        .operator_create(T0, name, TokenHash::of(&token))
        .await
        .unwrap();
    token
}

#[tokio::test]
async fn login_sets_a_strict_httponly_cookie_and_every_page_a_strict_csp() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let mut b = Board::new(&h);
    // Without a session, a page sends to the login.
    let r = b.get("/board/").await;
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/board/login");
    let r = b.get("/board/login").await;
    let csp = r.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
    assert!(!csp.contains("unsafe-inline"));
    let page = r.text().await.unwrap();
    assert!(page.contains("name=\"token\""));
    assert!(!page.contains("<script>") && !page.contains("style="));

    let set = b.login(&token).await;
    assert!(set.contains("HttpOnly"), "{set}");
    assert!(set.contains("SameSite=Strict"), "{set}");
    assert!(set.contains("Path=/board"), "{set}");
    // Plain HTTP: not Secure (the browser would drop it); TLS sets it (config.secure_cookies).
    assert!(!set.contains("Secure"), "{set}");
    // The cookie is not the operator token, and the store keeps only its hash.
    assert!(!set.contains(&token));
    let r = b.get("/board/").await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("content-security-policy"));
    for asset in ["/board/assets/board.css", "/board/assets/board.js"] {
        let r = b.get(asset).await;
        assert_eq!(r.status(), 200, "{asset}");
        assert!(r.headers().contains_key("content-security-policy"));
    }
}

#[tokio::test]
async fn a_wrong_token_or_an_endpoint_token_never_opens_the_board_and_failures_are_throttled() {
    let h = start().await;
    operator(&h, "alice").await;
    let bearer = h.endpoint("ci", &["claim_next", "list_todos"], None).await;
    let b = Board::new(&h);
    // An endpoint's bearer token, as a header or as the login token, opens nothing.
    let r = b
        .http
        .get(format!("{}/board/", h.base))
        .header("authorization", format!("Bearer {bearer}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    let r = b.post("/board/login", &[("token", &bearer)]).await;
    assert_eq!(r.status(), 401);
    assert!(!r.headers().contains_key("set-cookie"));
    let page = r.text().await.unwrap();
    assert!(!page.contains(&bearer), "the token is never echoed");
    // Past the failures allowed in a window, even a try is refused until it passes.
    for _ in 1..relay_core::board::LOGIN_FAILURES_MAX {
        let r = b.post("/board/login", &[("token", "guess")]).await;
        assert_eq!(r.status(), 401);
    }
    let r = b.post("/board/login", &[("token", "guess")]).await;
    assert_eq!(r.status(), 429);
    h.clock.advance(relay_core::board::LOGIN_WINDOW);
    let r = b.post("/board/login", &[("token", "guess")]).await;
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn a_post_without_the_sessions_csrf_token_is_refused_and_changes_nothing() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let b = Board::logged_in(&h, &token).await;
    let r = b
        .post("/board/queues/ci/pause", &[("csrf", "forged")])
        .await;
    assert_eq!(r.status(), 403);
    let r = b.post("/board/queues/ci/pause", &[]).await;
    assert_eq!(r.status(), 403);
    let paused = h.store.apply(relay_core::ledger::Op::PausedQueues).await;
    assert!(paused.unwrap().queues().unwrap().is_empty());
    // Another session's token is no better.
    let mut other = Board::new(&h);
    other.login(&token).await;
    let theirs = other.csrf("/board/").await;
    let r = b.post("/board/queues/ci/pause", &[("csrf", &theirs)]).await;
    assert_eq!(r.status(), 403);
    // The right one pauses the queue.
    let mine = b.csrf("/board/").await;
    let r = b.post("/board/queues/ci/pause", &[("csrf", &mine)]).await;
    assert_eq!(r.status(), 303);
    let paused = h.store.apply(relay_core::ledger::Op::PausedQueues).await;
    assert_eq!(paused.unwrap().queues().unwrap(), ["ci"]);
    let page = b.page("/board/queues/ci").await;
    assert!(page.contains(">Resume</button>"), "{page}");
}

#[tokio::test]
async fn a_session_ends_at_its_expiry_at_logout_and_when_its_operator_is_revoked() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let mut b = Board::logged_in(&h, &token).await;
    assert_eq!(b.get("/board/").await.status(), 200);
    h.clock.advance(SESSION_TTL);
    assert_eq!(b.get("/board/").await.status(), 303);

    b.login(&token).await;
    let csrf = b.csrf("/board/").await;
    let r = b.post("/board/logout", &[("csrf", &csrf)]).await;
    assert_eq!(r.status(), 303);
    assert!(
        r.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    assert_eq!(b.get("/board/").await.status(), 303);

    b.login(&token).await;
    h.store.operator_revoke(h.now(), "alice").await.unwrap();
    assert_eq!(b.get("/board/").await.status(), 303);
    let r = b.post("/board/login", &[("token", &token)]).await;
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn an_operator_recovers_a_stuck_claim_and_untrusted_text_stays_text() {
    let (h, token, mut mcp) = with_ci(&["claim_next", "add_todo", "fail", "get_todo"]).await;
    let title = "<script>alert(1)</script>";
    let id = add(
        &mut mcp,
        json!({"queue": "ci", "title": title, "max_attempts": 1}),
    )
    .await;
    mcp.ok(
        "claim_next",
        json!({"queue": "ci", "claimant": "<b>bold</b>"}),
    )
    .await;
    let b = Board::logged_in(&h, &token).await;
    let page = b.page(&format!("/board/todos/{id}")).await;
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!page.contains("<script>alert"));
    assert!(page.contains("&lt;b&gt;bold&lt;/b&gt;"));
    for label in ["Retry", "Cancel", "Release", "Complete", "Fail"] {
        assert!(page.contains(&format!(">{label}</button>")), "{label}");
    }
    // The claim is stuck (its worker is gone); Release recovers it without the fence.
    let csrf = b.csrf(&format!("/board/todos/{id}")).await;
    let r = b
        .post(
            &format!("/board/todos/{id}"),
            &[("csrf", &csrf), ("action", "release"), ("summary", "")],
        )
        .await;
    assert_eq!(r.status(), 303);
    let page = b.page(&format!("/board/todos/{id}")).await;
    assert!(
        page.contains("<span class=\"outcome\">released</span>"),
        "{page}"
    );
    // Closed by that operator, as the timeline says.
    assert!(
        page.contains("<dd class=\"closed-by\">alice</dd>"),
        "{page}"
    );
    // A refused action says why, on the page, and changes nothing.
    let r = b
        .post(
            &format!("/board/todos/{id}"),
            &[("csrf", &csrf), ("action", "complete"), ("summary", "x")],
        )
        .await;
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("not claimed"));
}

#[tokio::test]
async fn the_live_stream_tells_an_open_page_when_a_worker_completes_its_todo() {
    let (h, token, mut mcp) = with_ci(&["claim_next", "add_todo", "complete"]).await;
    let id = add(&mut mcp, json!({"queue": "ci", "title": "t"})).await;
    let mut b = Board::new(&h);
    // Without a session the stream does not open.
    assert_eq!(b.get("/board/events").await.status(), 401);
    b.login(&token).await;
    let mut stream = b.get("/board/events").await;
    assert_eq!(stream.status(), 200);
    mcp.ok("claim_next", json!({"queue": "ci"})).await;
    mcp.ok("complete", json!({"id": id, "summary": "ok"})).await;
    let mut buf = String::new();
    for _ in 0..2 {
        let ev = harness::next_event(&mut stream, &mut buf, harness::BOUND).await;
        assert_eq!(ev.expect("an event within the bound")["id"], id.as_str());
    }
    assert!(buf.is_empty() || !buf.contains("data:"));
}

#[tokio::test]
async fn the_overview_counts_charts_closes_and_lists_lapsing_claims_and_repeated_deaths() {
    let (h, token, mut mcp) = with_ci(&["claim_next", "add_todo", "complete", "fail"]).await;
    // One millisecond apart, so that claim_next takes them in this order.
    let mut ids = Vec::new();
    for (title, max) in [("done", 3), ("flaky <i>", 3), ("dead", 1), ("waiting", 3)] {
        let args = json!({"queue": "ci", "title": title, "max_attempts": max});
        ids.push(add(&mut mcp, args).await);
        h.clock.advance(1);
    }
    let (done, flaky) = (ids[0].clone(), ids[1].clone());
    mcp.ok("claim_next", json!({"queue": "ci"})).await;
    mcp.ok("complete", json!({"id": done})).await;
    // flaky's leases lapse twice: each takeover closes the lapsed attempt as lease_expired.
    for _ in 0..3 {
        let c = mcp
            .ok("claim_next", json!({"queue": "ci", "lease_ttl_seconds": 1}))
            .await;
        assert_eq!(c["todo"]["id"], flaky.as_str(), "{c}");
        h.clock.advance(2_000);
    }
    let c = mcp.ok("claim_next", json!({"queue": "ci"})).await;
    mcp.ok("fail", json!({"id": c["todo"]["id"]})).await;

    let b = Board::logged_in(&h, &token).await;
    let r = b.get("/board/").await;
    assert_eq!(r.status(), 200);
    let page = r.text().await.unwrap();
    let row = |class: &str| format!("<td class=\"{class}\">");
    for (class, n) in [
        ("n-pending", 1),
        ("n-claimed", 1),
        ("n-dead", 1),
        ("n-done", 1),
    ] {
        assert!(
            page.contains(&format!("{}{n}</td>", row(class))),
            "{class}: {page}"
        );
    }
    // The chart: one completed, two lease_expired, one failed, in the hour; no inline style.
    for (outcome, n) in [("completed", 1), ("lease_expired", 2), ("failed", 1)] {
        assert!(
            page.contains(&format!("data-outcome=\"{outcome}\">{n}</span>")),
            "{outcome}: {page}"
        );
    }
    assert!(page.contains("<svg viewBox=") && !page.contains("style="));
    // flaky is claimed (with a lease that lapses) and died twice; its title stays text.
    let lapsing = &page[page.find("Claims about to lapse").unwrap()..];
    assert!(
        lapsing.contains(&format!("data-todo=\"{flaky}\"")),
        "{page}"
    );
    let died = &page[page.find("Died more than once").unwrap()..];
    assert!(died.contains(&format!("data-todo=\"{flaky}\"")), "{page}");
    assert!(died.contains("<td class=\"deaths\">2×</td>"), "{died}");
    assert!(died.contains("flaky &lt;i&gt;"));
}

#[tokio::test]
async fn an_operator_adds_a_todo_for_an_endpoint_and_bad_input_changes_nothing() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    h.endpoint("ci", &["claim_next", "get_todo"], None).await;
    h.endpoint("narrow", &["claim_next"], Some(&["a"])).await;
    let b = Board::logged_in(&h, &token).await;
    let page = b.page("/board/add?queue=ci").await;
    assert!(page.contains("<option value=\"ci\""), "{page}");
    assert!(
        page.contains("name=\"queue\" required value=\"ci\""),
        "{page}"
    );
    let csrf = b.csrf("/board/add").await;
    let count = || async {
        h.store
            .count_by_state()
            .await
            .unwrap()
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    // Refused: no CSRF token, bad JSON, a queue the owner is not granted, an unknown owner.
    let r = b
        .post(
            "/board/add",
            &[("endpoint", "ci"), ("queue", "ci"), ("title", "t")],
        )
        .await;
    assert_eq!(r.status(), 403);
    for (pairs, status, says) in [
        (
            vec![
                ("endpoint", "ci"),
                ("queue", "ci"),
                ("title", "t"),
                ("payload", "{nope"),
            ],
            400,
            "payload: not valid JSON",
        ),
        (
            vec![("endpoint", "narrow"), ("queue", "b"), ("title", "t")],
            403,
            "queue b: endpoint narrow is not granted this queue",
        ),
        (
            vec![("endpoint", "ghost"), ("queue", "ci"), ("title", "t")],
            404,
            "endpoint ghost: no such endpoint",
        ),
        (
            vec![("endpoint", "ci"), ("queue", "ci"), ("title", "")],
            400,
            "title must be non-empty",
        ),
    ] {
        let mut pairs = pairs;
        pairs.push(("csrf", &csrf));
        let r = b.post("/board/add", &pairs).await;
        assert_eq!(r.status(), status, "{pairs:?}");
        let page = r.text().await.unwrap();
        assert!(page.contains(says), "{says}: {page}");
        // The form is shown again, with what was typed.
        assert!(page.contains("<form method=\"post\" action=\"/board/add\""));
    }
    assert_eq!(count().await, 0);

    // Added: owned by the endpoint picked, with the payload; an id given is kept.
    let r = b
        .post(
            "/board/add",
            &[
                ("csrf", &csrf),
                ("endpoint", "ci"),
                ("queue", "ci"),
                ("id", "td_from_board"),
                ("title", "<b>board</b>"),
                ("payload", "{\"k\": 1}"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/board/todos/td_from_board");
    let view = h
        .store
        .apply(relay_core::ledger::Op::GetTodo {
            actor: relay_core::ledger::Actor::cli(),
            id: "td_from_board".into(),
            attempts_limit: 1,
        })
        .await
        .unwrap()
        .view()
        .unwrap();
    assert_eq!(view.todo.endpoint, "ci");
    assert_eq!(view.todo.title, "<b>board</b>");
    assert_eq!(view.todo.payload, Some(json!({"k": 1})));
    let r = b
        .post(
            "/board/add",
            &[
                ("csrf", &csrf),
                ("endpoint", "ci"),
                ("queue", "ci"),
                ("title", "drawn"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303);
    let to = r.headers()["location"].to_str().unwrap().to_string();
    assert!(to.starts_with("/board/todos/td_"), "{to}");
    assert_eq!(count().await, 2);
}

#[tokio::test]
async fn an_operator_revokes_an_endpoint_from_the_board() {
    let (h, token, mut mcp) = with_ci(&["claim_next", "add_todo"]).await;
    let id = add(&mut mcp, json!({"queue": "ci", "title": "t"})).await;
    mcp.ok("claim_next", json!({"queue": "ci"})).await;
    let b = Board::logged_in(&h, &token).await;
    let page = b.page("/board/endpoints").await;
    assert!(page.contains("data-endpoint=\"ci\"") && page.contains(">Revoke</button>"));
    // Without the CSRF token: refused, nothing changes.
    let r = b.post("/board/endpoints/ci/revoke", &[]).await;
    assert_eq!(r.status(), 403);
    assert!(
        h.store
            .endpoint_get("ci")
            .await
            .unwrap()
            .unwrap()
            .revoked_at
            .is_none()
    );
    let csrf = b.csrf("/board/endpoints").await;
    let r = b
        .post("/board/endpoints/ci/revoke", &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), 303);
    let e = h.store.endpoint_get("ci").await.unwrap().unwrap();
    assert_eq!(e.revoked_at, Some(h.now()));
    // As `relay endpoint revoke`: the claim is a dead letter, the token opens nothing.
    let page = b.page(&format!("/board/todos/{id}")).await;
    assert!(
        page.contains("<span class=\"outcome\">revoked</span>"),
        "{page}"
    );
    let r = mcp
        .post_raw(json!({"jsonrpc": "2.0", "id": 9, "method": "ping"}).to_string())
        .await;
    assert_eq!(r.status(), 401);
    let page = b.page("/board/endpoints").await;
    assert!(!page.contains(">Revoke</button>"), "{page}");
    // Twice: the store's conflict, said on the page.
    let r = b
        .post("/board/endpoints/ci/revoke", &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("already revoked"));
}

#[tokio::test]
async fn a_change_made_outside_this_server_reaches_an_open_board_stream() {
    // The server on a SQLite file; a second store handle on the same file writes as
    // `relay todo add` and `relay todo retry` do, never through this server.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    let store = Store::open(&url, LedgerConfig::default()).await.unwrap();
    let h = Harness::start_on(store, 7, |_| {}, false).await;
    let token = operator(&h, "alice").await;
    h.endpoint("ci", &["claim_next"], None).await;
    let cli = Store::open(&url, LedgerConfig::default()).await.unwrap();
    let b = Board::logged_in(&h, &token).await;
    let mut stream = b.get("/board/events").await;
    assert_eq!(stream.status(), 200);
    // The first scan only takes the store's watermark.
    h.server.doorbell_once(h.now()).await.unwrap();
    let add = relay_core::ledger::Op::AddTodo {
        now: h.now(),
        endpoint: "ci".into(),
        new: relay_core::ledger::NewTodo {
            id: "td_cli".into(),
            queue: "ci".into(),
            title: "from the cli".into(),
            max_attempts: Some(1),
            ..Default::default()
        },
    };
    cli.apply(add).await.unwrap();
    let mut buf = String::new();
    // The scan's notice arrives.
    h.server.doorbell_once(h.now()).await.unwrap();
    let ev = harness::next_event(&mut stream, &mut buf, harness::BOUND).await;
    assert_eq!(ev.expect("an event")["id"], "td_cli");
    // A retry from outside (a dead letter made pending again) is heard the same way.
    let actor = relay_core::ledger::Actor::cli();
    let now = h.now();
    cli.apply(relay_core::ledger::Op::Cancel {
        now,
        actor: actor.clone(),
        id: "td_cli".into(),
    })
    .await
    .unwrap();
    cli.apply(relay_core::ledger::Op::Retry {
        now,
        actor,
        id: "td_cli".into(),
    })
    .await
    .unwrap();
    h.server.doorbell_once(h.now()).await.unwrap();
    let ev = harness::next_event(&mut stream, &mut buf, harness::BOUND).await;
    assert_eq!(ev.expect("an event")["id"], "td_cli");
}

#[tokio::test]
async fn a_retry_on_the_board_rings_the_doorbell_at_once() {
    let (h, token, mut mcp) = with_ci(&["claim_next", "add_todo", "fail"]).await;
    let id = add(
        &mut mcp,
        json!({"queue": "ci", "title": "t", "max_attempts": 1}),
    )
    .await;
    mcp.ok("claim_next", json!({"queue": "ci"})).await;
    mcp.ok("fail", json!({"id": id})).await;
    // The stream opens after the add's own ring; only the retry can ring it.
    let mut stream = mcp.stream().await;
    let b = Board::logged_in(&h, &token).await;
    let csrf = b.csrf(&format!("/board/todos/{id}")).await;
    let r = b
        .post(
            &format!("/board/todos/{id}"),
            &[("csrf", &csrf), ("action", "retry")],
        )
        .await;
    assert_eq!(r.status(), 303);
    let mut buf = String::new();
    let ring = harness::next_event(&mut stream, &mut buf, harness::BOUND)
        .await
        .expect("a ring within the bound");
    assert_eq!(ring["method"], "notifications/todo_ready", "{ring}");
    assert_eq!(ring["params"]["queues"], json!(["ci"]));
}

/// Dead letters of queue `q`: `n` todos with one attempt each, claimed and failed.
async fn dead_letters(h: &Harness, q: &str, n: usize) -> Vec<String> {
    let bearer = h.endpoint("w", &["add_todo", "claim", "fail"], None).await;
    let mut mcp = h.mcp("w", &bearer);
    mcp.init().await;
    let mut ids = Vec::new();
    for k in 0..n {
        let args = json!({"queue": q, "title": format!("dead {k}"), "max_attempts": 1});
        let id = add(&mut mcp, args).await;
        mcp.ok("claim", json!({"id": id})).await;
        mcp.ok("fail", json!({"id": id})).await;
        ids.push(id);
    }
    ids.sort();
    ids
}

/// The bulk action's id from the redirect that made it.
fn bulk_id(r: &reqwest::Response) -> String {
    let to = r.headers()["location"].to_str().unwrap();
    to.strip_prefix("/board/bulk/").expect(to).to_string()
}

async fn get(h: &Harness, id: &str) -> relay_core::ledger::TodoView {
    let op = relay_core::ledger::Op::GetTodo {
        actor: relay_core::ledger::Actor::cli(),
        id: id.to_string(),
        attempts_limit: 1,
    };
    h.store.apply(op).await.unwrap().view().unwrap()
}

async fn finished(h: &Harness, id: &str) -> relay_server::store::Bulk {
    // A failure bound on a wait for the server's own task, never a sleep to synchronise.
    for _ in 0..2_000 {
        let b = h.store.bulk_get(id).await.unwrap().unwrap();
        if b.finished_at.is_some() {
            return b;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!(
        "bulk action {id} did not finish: {:?}",
        h.store.bulk_get(id).await
    );
}

#[tokio::test]
async fn retry_all_lists_the_filter_confirms_the_count_and_records_each_todo() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let ids = dead_letters(&h, "q", 5).await;
    let b = Board::logged_in(&h, &token).await;
    let page = b
        .page("/board/queues/q?state=failed&reason=attempts_exhausted")
        .await;
    assert!(
        page.contains("<span class=\"n-matched\">5</span>"),
        "{page}"
    );
    let csrf = b.csrf("/board/queues/q").await;
    // A bad reason names the field and the values; nothing is made.
    let bad = b
        .post(
            "/board/bulk",
            &[
                ("csrf", &csrf),
                ("queue", "q"),
                ("action", "retry"),
                ("reason", "tired"),
            ],
        )
        .await;
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("attempts_exhausted"));
    let r = b
        .post(
            "/board/bulk",
            &[
                ("csrf", &csrf),
                ("queue", "q"),
                ("action", "retry"),
                ("state", "failed"),
                ("reason", "attempts_exhausted"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303);
    let id = bulk_id(&r);
    let confirm = b.page(&format!("/board/bulk/{id}")).await;
    assert!(
        confirm.contains("<span class=\"bulk-count\">5</span>"),
        "{confirm}"
    );
    assert!(confirm.contains("Retry 5 todos"), "{confirm}");
    // Listed, not applied: every todo is still a dead letter.
    let bulk = h.store.bulk_get(&id).await.unwrap().unwrap();
    assert!(bulk.confirmed_at.is_none());
    assert_eq!(
        bulk.items
            .iter()
            .map(|i| i.todo_id.clone())
            .collect::<Vec<_>>(),
        ids
    );
    // Another operator may not confirm it.
    let mallory = operator(&h, "mallory").await;
    let m = Board::logged_in(&h, &mallory).await;
    let mcsrf = m.csrf("/board/").await;
    let refused = m
        .post(&format!("/board/bulk/{id}"), &[("csrf", &mcsrf)])
        .await;
    assert_eq!(refused.status(), 403);

    let r = b
        .post(&format!("/board/bulk/{id}"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), 303);
    let done = finished(&h, &id).await;
    assert!(
        done.items.iter().all(|i| i.applied == Some(true)),
        "{done:?}"
    );
    for id in &ids {
        let t = get(&h, id).await;
        assert_eq!(t.todo.state, relay_core::ledger::TodoState::Pending, "{id}");
    }
}

#[tokio::test]
async fn a_confirmed_bulk_action_resumes_after_a_restart_from_the_todos_left() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let ids = dead_letters(&h, "q", 4).await;
    let b = Board::logged_in(&h, &token).await;
    let csrf = b.csrf("/board/queues/q").await;
    let r = b
        .post(
            "/board/bulk",
            &[
                ("csrf", &csrf),
                ("queue", "q"),
                ("action", "cancel"),
                ("state", "failed"),
            ],
        )
        .await;
    let id = bulk_id(&r);
    // The server "stopped" right after the confirmation and two results: confirmed in the
    // store, no task running it, the first two todos recorded (as skipped, so that the resume
    // can be told apart from a fresh run: it must not touch them).
    h.store.bulk_confirm(T0, &id, "alice").await.unwrap();
    for todo in &ids[..2] {
        let skipped = BulkResult {
            todo_id: todo.clone(),
            applied: false,
            note: Some("test".into()),
        };
        assert!(h.store.bulk_record(T0, &id, skipped).await.unwrap());
    }
    // A server starting on the same store (with its background loops) carries on.
    let again = Harness::start_on(h.store.clone(), 8, |_| {}, true).await;
    let done = finished(&again, &id).await;
    let results: Vec<Option<bool>> = done.items.iter().map(|i| i.applied).collect();
    assert_eq!(results, [Some(false), Some(false), Some(true), Some(true)]);
    for (k, id) in ids.iter().enumerate() {
        let t = get(&h, id).await;
        let want = if k < 2 {
            relay_core::ledger::TodoState::Failed
        } else {
            relay_core::ledger::TodoState::Canceled
        };
        assert_eq!(t.todo.state, want, "{id}");
    }
}

#[tokio::test]
async fn a_task_page_says_it_is_a_task_and_whose_but_never_its_id() {
    let h = start().await;
    let token = operator(&h, "alice").await;
    let ep = h.endpoint("ci", &["add_todo", "get_todo"], None).await;
    let mut client = h.mcp_tasks("ci", &ep);
    let (_, made) = client
        .rpc(
            "tools/call",
            json!({"name": "add_todo", "arguments": {"queue": "q", "title": "as a task"}}),
        )
        .await;
    let task_id = made["result"]["taskId"]
        .as_str()
        .expect("a task")
        .to_string();
    let (todo, secret) = task_id.rsplit_once('.').unwrap();
    let b = Board::logged_in(&h, &token).await;
    let page = b.page(&format!("/board/todos/{todo}")).await;
    assert!(page.contains("An MCP task"), "{page}");
    assert!(page.contains("endpoint ci"), "{page}");
    assert!(!page.contains(secret), "the page shows the task id");
    let list = b.page("/board/queues/q").await;
    assert!(!list.contains(secret), "the queue page shows the task id");
}

#[tokio::test]
async fn a_delayed_todo_page_says_until_when_it_waits_and_its_priority() {
    let (h, token, mut c) = with_ci(&["add_todo"]).await;
    let at = relay_core::time::rfc3339(h.now() + 3_600_000);
    let later = add(
        &mut c,
        json!({"queue": "q", "title": "later", "run_at": at, "priority": 7}),
    )
    .await;
    let b = Board::logged_in(&h, &token).await;
    let page = b.page(&format!("/board/todos/{later}")).await;
    assert!(
        page.contains(&format!("waits until {at}")) && page.contains("priority 7"),
        "{page}"
    );
}

/// A queue with limits (CONTRACT "Flow control"): the overview and the queue page show them,
/// what is claimed and how many waiting todos they hold back; a held-back todo's page says
/// which limit holds it; `/metrics` shows the same held-back count.
#[tokio::test]
async fn a_held_back_todo_says_which_limit_holds_it_and_the_board_counts_them() {
    let (h, token, mut c) = with_ci(&["add_todo", "claim_next"]).await;
    let op = relay_core::ledger::Op::SetQueueLimits {
        now: h.now(),
        actor: relay_core::ledger::Actor::cli(),
        queue: "q".into(),
        change: relay_core::ledger::LimitsChange {
            max_claimed_per_key: Some(Some(1)),
            ..Default::default()
        },
    };
    h.store.apply(op).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        let args = json!({"queue": "q", "title": format!("t{i}"), "concurrency_key": "repo-a"});
        ids.push(add(&mut c, args).await);
        h.clock.advance(1);
    }
    let first = c.ok("claim_next", json!({"queue": "q"})).await;
    assert_eq!(first["todo"]["id"], ids[0].as_str());
    let b = Board::logged_in(&h, &token).await;
    let overview = b.page("/board/").await;
    assert!(overview.contains("<h2>Flow limits</h2>"), "{overview}");
    assert!(
        overview.contains("<td class=\"n-held-back\">2</td>")
            && overview.contains("max_claimed_per_key 1")
            && overview.contains("keys at max_claimed_per_key: &quot;repo-a&quot;"),
        "{overview}"
    );
    let queue = b.page("/board/queues/q").await;
    assert!(
        queue.contains("<td class=\"n-held-back\">2</td>"),
        "{queue}"
    );
    let page = b.page(&format!("/board/todos/{}", ids[1])).await;
    assert!(
        page.contains("held back: its queue has max_claimed_per_key 1 todos with concurrency_key &quot;repo-a&quot; claimed")
            && page.contains("concurrency_key repo-a"),
        "{page}"
    );
    // The claimed one is not held back: it runs.
    let page = b.page(&format!("/board/todos/{}", ids[0])).await;
    assert!(!page.contains("held back"), "{page}");
    let metrics = h
        .http
        .get(format!("{}/metrics", h.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("relay_queue_held_back{queue=\"q\"} 2")
            && metrics.contains("relay_queue_limit{queue=\"q\",limit=\"max_claimed_per_key\"} 1"),
        "{metrics}"
    );
}
