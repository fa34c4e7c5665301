//! The Board in a real browser: headless Chromium from Debian, driven over WebDriver
//! (chromedriver) with fantoccini. One server, one browser session: log in, read a queue's
//! counts, open a dead letter and read its attempt timeline (a `<script>` summary shows as text
//! and never runs), press Retry and see it pending, watch an open page update live when a
//! worker completes its todo over MCP, and recover a stuck claim with Release (the timeline
//! then shows the attempt closed `released` by that operator).
//!
//! Skips with a message when chromium or chromedriver is missing, unless
//! `RELAY_REQUIRE_BROWSER=1` (CI sets it), where it fails instead. With
//! `RELAY_BOARD_SCREENSHOTS=DIR` it saves the overview and the todo page as PNGs there (the
//! screenshots under docs/ are made so).

#[path = "support/harness.rs"]
mod harness;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use harness::{Harness, T0};
use relay_core::ledger::{Actor, LedgerConfig, Op, TodoState, TokenHash};
use relay_core::time::WallClock as _;
use relay_server::store::Store;
use serde_json::json;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// A failure bound on every wait in the browser, never a sleep.
const WAIT: Duration = Duration::from_secs(15);

/// chromedriver, ended when dropped.
struct Driver(Child, u16);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts chromedriver on a free loopback port and waits for the line saying it is up.
fn chromedriver() -> Driver {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        let line = lines
            .next()
            .expect("chromedriver ended before it was ready")
            .unwrap();
        if line.contains("started successfully") {
            break;
        }
    }
    // Keep draining its stdout so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Driver(child, port)
}

fn browser_present() -> bool {
    let present =
        std::path::Path::new(CHROMIUM).exists() && std::path::Path::new(CHROMEDRIVER).exists();
    if !present {
        assert!(
            std::env::var("RELAY_REQUIRE_BROWSER").as_deref() != Ok("1"),
            "RELAY_REQUIRE_BROWSER=1 but {CHROMIUM} or {CHROMEDRIVER} is missing; \
             apt-get install -y chromium chromium-driver"
        );
        eprintln!(
            "board_browser: skipped ({CHROMIUM} or {CHROMEDRIVER} missing; \
             apt-get install -y chromium chromium-driver)"
        );
    }
    present
}

async fn browser(driver: &Driver, profile: &std::path::Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--window-size=1100,1500",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await
        .expect("a WebDriver session with headless Chromium")
}

async fn text(c: &Client, css: &str) -> String {
    match c.wait().at_most(WAIT).for_element(Locator::Css(css)).await {
        Ok(e) => e.text().await.unwrap(),
        Err(e) => {
            let url = c.current_url().await.map(|u| u.to_string());
            let page = c.source().await.unwrap_or_default();
            panic!("{css}: {e}; at {url:?}:\n{page}")
        }
    }
}

/// Clicks the button labelled `label`.
async fn click(c: &Client, label: &str) {
    c.find(Locator::XPath(&format!("//button[text()='{label}']")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Waits (at most `WAIT`) for the todo page to show `state`; `what` says what failed if not.
async fn shows_state(c: &Client, state: &str, what: &str) {
    let at = format!("//dd[@class='state' and text()='{state}']");
    c.wait()
        .at_most(WAIT)
        .for_element(Locator::XPath(&at))
        .await
        .expect(what);
}

async fn screenshot(c: &Client, name: &str) {
    if let Ok(dir) = std::env::var("RELAY_BOARD_SCREENSHOTS") {
        let png = c.screenshot().await.unwrap();
        std::fs::write(std::path::Path::new(&dir).join(name), png).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_works_the_board_in_headless_chromium() {
    if !browser_present() {
        return;
    }
    let store = Store::open("sqlite::memory:", LedgerConfig::default())
        .await
        .unwrap();
    let h = Harness::start_on(store, 7, |_| {}, false).await;
    let token = relay_server::server::new_bearer_token().unwrap();
    h.store
        .operator_create(T0, "alice", TokenHash::of(&token))
        .await
        .unwrap();
    let bearer = h
        .endpoint(
            "ci",
            &[
                "claim_next",
                "claim",
                "add_todo",
                "fail",
                "complete",
                "request_input",
            ],
            None,
        )
        .await;
    let mut mcp = h.mcp("ci", &bearer);
    mcp.init().await;
    // A dead letter whose summary is hostile markup.
    let dead = mcp
        .ok(
            "add_todo",
            json!({"queue": "ci", "title": "Fix the flaky test", "max_attempts": 1,
                   "payload": {"branch": "main", "test": "ledger::claim"}}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let hostile = "<script>window.pwned=1</script> still failing";
    mcp.ok(
        "claim_next",
        json!({"queue": "ci", "claimant": "harness/box/fixer/run-1"}),
    )
    .await;
    mcp.ok("fail", json!({"id": dead, "summary": hostile}))
        .await;
    let live = mcp
        .ok(
            "add_todo",
            json!({"queue": "ci", "title": "Bump the lockfile"}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();

    // Half an hour of a second queue's history, so that the chart has something to draw: a
    // few attempts closed each minute, now and then a failure or a release.
    for minute in 0..30u64 {
        for k in 0..(minute * 7 % 4 + 1) {
            mcp.ok(
                "add_todo",
                json!({"queue": "nightly", "title": format!("nightly build {minute}.{k}")}),
            )
            .await;
            // Whichever is due first: a new one, or a failed one's retry.
            let c = mcp.ok("claim_next", json!({"queue": "nightly"})).await;
            let tool = if (minute + k) % 9 == 4 {
                "fail"
            } else {
                "complete"
            };
            mcp.ok(tool, json!({"id": c["todo"]["id"], "summary": "done"}))
                .await;
        }
        h.clock.advance(60_000);
    }

    let driver = chromedriver();
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, profile.path()).await;
    let base = h.base.clone();

    // Log in.
    c.goto(&format!("{base}/board/login")).await.unwrap();
    let field = c.find(Locator::Css("input[name='token']")).await.unwrap();
    field.send_keys(&token).await.unwrap();
    click(&c, "Log in").await;

    // The overview's counts.
    assert_eq!(text(&c, "tr[data-queue='ci'] .n-dead").await, "1");
    assert_eq!(text(&c, "tr[data-queue='ci'] .n-pending").await, "1");
    // The chart of the hour's closed attempts is drawn (inline SVG), with its legend.
    let failed = text(&c, ".legend [data-outcome='failed']").await;
    assert!(failed.parse::<u32>().unwrap() > 1, "{failed}");
    let bars = c
        .find_all(Locator::Css("figure.chart svg g.minute"))
        .await
        .unwrap();
    assert_eq!(bars.len(), relay_core::board::CHART_MINUTES);
    screenshot(&c, "board-overview.png").await;

    // The dead letter's timeline; the summary is text, and its script never ran.
    c.goto(&format!("{base}/board/todos/{dead}")).await.unwrap();
    assert_eq!(text(&c, ".attempt[data-seq='1'] .outcome").await, "failed");
    assert_eq!(text(&c, ".attempt[data-seq='1'] .summary").await, hostile);
    let pwned = c
        .execute("return typeof window.pwned;", vec![])
        .await
        .unwrap();
    assert_eq!(pwned, json!("undefined"));
    assert_eq!(text(&c, "dd.state").await, "dead letter");
    screenshot(&c, "board-todo.png").await;

    // Retry it, and see it pending.
    click(&c, "Retry").await;
    shows_state(&c, "pending", "the retried todo shows pending").await;

    // An open page updates live, without a reload, when a worker claims and completes its todo
    // over MCP; the summary the operator is typing meanwhile stays in its field, focused.
    c.goto(&format!("{base}/board/todos/{live}")).await.unwrap();
    c.wait()
        .at_most(WAIT)
        .for_element(Locator::Css("body[data-live='on']"))
        .await
        .expect("the page's live stream opens");
    assert_eq!(text(&c, "dd.state").await, "pending");
    // A mark only this page holds: a reload would drop it.
    c.execute("window.relayMark = 'this page';", vec![])
        .await
        .unwrap();
    let typing = c
        .find(Locator::Css(
            "input[name='summary'][aria-label='summary for fail']",
        ))
        .await
        .unwrap();
    typing.send_keys("the lockfile is half").await.unwrap();
    mcp.ok("claim", json!({"id": live})).await;
    shows_state(&c, "claimed", "the page shows the claim without a reload").await;
    mcp.ok("complete", json!({"id": live, "summary": "bumped"}))
        .await;
    shows_state(&c, "done", "the page shows the todo done without a reload").await;
    let mark = c.execute("return window.relayMark;", vec![]).await.unwrap();
    assert_eq!(mark, json!("this page"), "the page was reloaded");
    let field = c
        .find(Locator::Css(
            "input[name='summary'][aria-label='summary for fail']",
        ))
        .await
        .unwrap();
    assert_eq!(
        field.prop("value").await.unwrap().as_deref(),
        Some("the lockfile is half"),
        "the typed text was thrown away"
    );
    let focused = c
        .execute(
            "return document.activeElement.getAttribute('aria-label');",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        focused,
        json!("summary for fail"),
        "the field lost its focus"
    );
    // The timeline was patched in: the completed attempt shows.
    assert_eq!(
        text(&c, ".attempt[data-seq='1'] .outcome").await,
        "completed"
    );

    // A stuck claim (its worker is gone): Release recovers it without the fence, and the
    // timeline shows the attempt closed `released` by this operator.
    let stuck = mcp
        .ok(
            "add_todo",
            json!({"queue": "ci", "title": "Stuck on a dead box"}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    mcp.ok(
        "claim",
        json!({"id": stuck, "claimant": "harness/box/gone", "require_fence": true}),
    )
    .await;
    c.goto(&format!("{base}/board/todos/{stuck}"))
        .await
        .unwrap();
    assert_eq!(text(&c, "dd.state").await, "claimed");
    click(&c, "Release").await;
    shows_state(&c, "pending", "the released todo shows pending").await;
    assert_eq!(
        text(&c, ".attempt[data-seq='1'] .outcome").await,
        "released"
    );
    assert_eq!(text(&c, ".attempt[data-seq='1'] .closed-by").await, "alice");

    // A worker asks a question (hostile markup, like any worker's text) and waits: the overview
    // counts it, its page shows the question first, and the operator answers it there.
    let asking = mcp
        .ok(
            "add_todo",
            json!({"queue": "ask", "title": "Which branch?"}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    mcp.ok("claim", json!({"id": asking})).await;
    let question = "<img src=x onerror=window.pwned=2> main or release?";
    mcp.ok(
        "request_input",
        json!({"id": asking, "question": question, "usage": {"cost_usd": 0.5}}),
    )
    .await;
    c.goto(&format!("{base}/board")).await.unwrap();
    assert!(
        text(&c, "tr[data-queue='ask'] .n-waiting")
            .await
            .starts_with("1 (longest"),
        "the overview counts the waiting todo"
    );
    c.goto(&format!("{base}/board/todos/{asking}"))
        .await
        .unwrap();
    assert_eq!(text(&c, ".question .asked").await, question);
    assert!(text(&c, ".spend").await.starts_with("spent $0.5"));
    let pwned = c
        .execute("return typeof window.pwned;", vec![])
        .await
        .unwrap();
    assert_eq!(pwned, json!("undefined"));
    c.find(Locator::Css("textarea[name='answer']"))
        .await
        .unwrap()
        .send_keys("release, please")
        .await
        .unwrap();
    click(&c, "Answer").await;
    shows_state(&c, "pending", "the answered todo shows pending").await;
    let answered = text(&c, ".attempt[data-seq='1'] .answered").await;
    assert!(
        answered.contains("by operator:alice") && answered.ends_with("release, please"),
        "{answered}"
    );
    let next = mcp.ok("claim", json!({"id": asking})).await;
    assert_eq!(next["prior_attempts"][0]["answer"], "release, please");

    // A bulk retry of the dead letters a filter matches: 51 whose attempts ran out, and one
    // dead-lettered as non-retryable that the filter leaves out.
    let mut exhausted = Vec::new();
    for n in 0..51 {
        let id = mcp
            .ok(
                "add_todo",
                json!({"queue": "bulk", "title": format!("Port module {n}"), "max_attempts": 1}),
            )
            .await["id"]
            .as_str()
            .unwrap()
            .to_string();
        mcp.ok("claim", json!({"id": id})).await;
        mcp.ok("fail", json!({"id": id, "summary": "no toolchain"}))
            .await;
        exhausted.push(id);
    }
    let other = mcp
        .ok("add_todo", json!({"queue": "bulk", "title": "Forbidden"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    mcp.ok("claim", json!({"id": other})).await;
    mcp.ok("fail", json!({"id": other, "retryable": false}))
        .await;
    c.goto(&format!(
        "{base}/board/queues/bulk?state=failed&reason=attempts_exhausted"
    ))
    .await
    .unwrap();
    assert_eq!(text(&c, ".n-matched").await, "51");
    click(&c, "Retry all").await;
    assert_eq!(text(&c, ".bulk-count").await, "51");
    // Between the listing and the confirmation a worker claims one of them (an operator retried
    // it from the CLI first): the bulk retry must leave that live claim alone.
    let victim = exhausted[17].clone();
    h.store
        .apply(Op::Retry {
            now: h.clock.now(),
            actor: Actor::cli(),
            id: victim.clone(),
        })
        .await
        .unwrap();
    let claimed = mcp
        .ok(
            "claim",
            json!({"id": victim, "claimant": "harness/box/worker", "require_fence": true}),
        )
        .await;
    let seq = claimed["attempt_seq"].as_u64().unwrap();
    click(&c, "Retry 51 todos").await;
    // The bulk retry finishes (the open page shows it).
    text(&c, "p.finished").await;
    assert_eq!(text(&c, ".n-applied").await, "50");
    assert_eq!(text(&c, ".n-skipped").await, "1");
    assert_eq!(text(&c, ".n-left").await, "0");
    assert_eq!(
        text(&c, &format!("tr[data-todo='{victim}'] .result")).await,
        "skipped"
    );
    let why = text(&c, &format!("tr[data-todo='{victim}'] .note")).await;
    assert!(why.contains("claimed"), "{why}");
    let get = |id: &str| {
        h.store.apply(Op::GetTodo {
            actor: Actor::cli(),
            id: id.to_string(),
            attempts_limit: 10,
        })
    };
    for id in &exhausted {
        let view = get(id).await.unwrap().view().unwrap();
        if *id == victim {
            // The worker's claim is untouched: still claimed, its attempt open.
            assert_eq!(view.todo.state, TodoState::Claimed, "{id}");
            let open = view
                .attempts
                .iter()
                .find(|a| u64::from(a.seq) == seq)
                .unwrap();
            assert!(open.is_open(), "{open:?}");
        } else {
            assert_eq!(view.todo.state, TodoState::Pending, "{id}");
        }
    }
    let left_out = get(&other).await.unwrap().view().unwrap();
    assert!(left_out.todo.dead_letter(), "{:?}", left_out.todo);
    c.close().await.unwrap();
}
