//! The Board: the operator's pages under `/board/`, served by `relay serve` on its listener.
//!
//! A shell, like the MCP side: it renders pages ([`html`]) and turns a button press into the
//! same [`Op`] the CLI sends, as [`Actor::Operator`] under the session's operator name, applied through [`Store::apply`]. Who may
//! open the Board, for how long, and the CSRF token a page carries are `relay_core::board`'s
//! rules; every lifecycle rule is the ledger's.
//!
//! Security, in one place:
//! - Login takes an operator token (form field `token`); only its SHA-256 is looked up. It sets
//!   a cookie holding a fresh random session secret (HttpOnly, SameSite=Strict, Path=/board,
//!   Secure under TLS); the store keeps only the secret's SHA-256 and the expiry. Logout deletes
//!   the row; revoking the operator deletes all of its rows.
//! - Every state change is a POST carrying the session's CSRF token (derived from the secret, so
//!   a cross-site page cannot make it), besides SameSite and the Host/Origin checks the MCP side
//!   makes. An endpoint's bearer token opens nothing here.
//! - Failed logins are throttled ([`LoginThrottle`]) and logged without the token.
//! - Every response carries a strict CSP: no inline script or style, nothing from elsewhere.

// The refusal *is* the response to send (as in server::http); boxing it would only add an
// allocation per refusal.
#![allow(clippy::result_large_err)]

mod bulk;
pub mod html;
mod login;

pub(crate) use bulk::resume_bulks;
use bulk::{bulk_confirm, bulk_create, bulk_page};
use login::{CsrfForm, LoggedIn, Posted, Posting, login, login_link, login_page, logout, session};

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use relay_core::board::LoginThrottle;
use relay_core::ledger::{Actor, NewTodo, Op, Report, Todo, TodoFilter, TodoState, finished};
use relay_core::{Error, ErrorCode};
use serde::Deserialize;

use crate::server::Server;
use crate::store::{Endpoint, Store};

/// The session cookie's name.
pub const COOKIE: &str = "relay_board";
/// The Content-Security-Policy of every Board response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
                       base-uri 'none'";
/// Todos a list on the Board shows at most per page.
pub const PAGE: usize = 50;

const CSS: &str = include_str!("assets/board.css");
const JS: &str = include_str!("assets/board.js");

#[derive(Clone)]
struct Board {
    server: Server,
    throttle: Arc<Mutex<LoginThrottle>>,
}

impl Board {
    fn store(&self) -> &Store {
        self.server.store()
    }
}

/// The Board's routes, to merge into the server's router.
pub fn router(server: Server) -> Router {
    let board = Board {
        server,
        throttle: Arc::new(Mutex::new(LoginThrottle::default())),
    };
    Router::new()
        .route("/board", get(|| async { see_other("/board/") }))
        .route("/board/", get(overview))
        .route("/board/login", get(login_page).post(login))
        .route("/board/login/link", get(login_link))
        .route("/board/logout", post(logout))
        .route(
            "/board/assets/board.css",
            get(|| async { asset("text/css", CSS) }),
        )
        .route(
            "/board/assets/board.js",
            get(|| async { asset("text/javascript", JS) }),
        )
        .route("/board/queues/{queue}", get(queue_page))
        .route("/board/bulk", post(bulk_create))
        .route("/board/bulk/{id}", get(bulk_page).post(bulk_confirm))
        .route("/board/queues/{queue}/{action}", post(queue_action))
        .route("/board/todos/{id}", get(todo_page).post(todo_action))
        .route("/board/events", get(events))
        .route("/board/add", get(add_page).post(add_todo))
        .route("/board/endpoints", get(endpoints_page))
        .route("/board/endpoints/{name}/revoke", post(endpoint_revoke))
        .layer(axum::middleware::from_fn_with_state(board.clone(), bounded))
        .layer(axum::middleware::from_fn(fragment))
        .layer(axum::middleware::map_response(secure_headers))
        .with_state(board)
}

/// Every Board request waits on the store at most the server's `answer_timeout`, as an MCP
/// request does: a page or action the database does not answer in time is a 503 page saying
/// the action may or may not have taken effect, instead of a page that never loads.
async fn bounded(
    State(b): State<Board>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let timeout = b.server.config().answer_timeout;
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!(
                timeout_ms = timeout.as_millis() as u64,
                "board: the store did not answer within the answer timeout"
            );
            let message = format!(
                "{} Reload the page to see what the database holds before repeating an action.",
                b.server.no_answer()
            );
            let body = html::page("No answer", None, &html::error_banner(&message));
            html(StatusCode::SERVICE_UNAVAILABLE, body)
        }
    }
}

/// The request header with which the Board's script asks for a page's `<main>` alone, to patch
/// the open page with what changed instead of reloading it.
pub const FRAGMENT: &str = "x-relay-fragment";

/// A page asked for with `X-Relay-Fragment: main` is answered with the inner HTML of its
/// `<main>` only (and the same header back, so the script knows it got one). Every page has
/// exactly one `<main>`, and every stored string in it is escaped, so `</main>` cannot appear
/// inside it.
async fn fragment(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let wanted = req
        .headers()
        .get(FRAGMENT)
        .is_some_and(|v| v.as_bytes() == b"main");
    let r = next.run(req).await;
    let is_html = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/html"));
    if !wanted || !is_html {
        return r;
    }
    let (mut parts, body) = r.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let text = String::from_utf8_lossy(&bytes);
    let inner = text
        .split_once("<main>")
        .and_then(|(_, rest)| rest.rsplit_once("</main>"))
        .map_or_else(String::new, |(inner, _)| inner.to_string());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(FRAGMENT, HeaderValue::from_static("main"));
    Response::from_parts(parts, axum::body::Body::from(inner))
}

async fn secure_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Not `no-referrer`: under it a browser sends `Origin: null` on the Board's own form posts,
    // which the Origin check (rightly) refuses.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    r
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

fn see_other(to: &str) -> Response {
    let to = HeaderValue::from_str(to).unwrap_or(HeaderValue::from_static("/board/"));
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

fn status_of(e: &Error) -> StatusCode {
    match e.code {
        ErrorCode::Conflict => StatusCode::CONFLICT,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::Invalid => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A page that could not be served: the message (errors never hold a secret), escaped.
fn failure(b: &Board, s: &LoggedIn, e: &Error) -> Response {
    let message = if status_of(e) == StatusCode::INTERNAL_SERVER_ERROR {
        b.server.internal_message("board", e)
    } else {
        e.message.clone()
    };
    html(
        status_of(e),
        html::page("Error", Some(&s.csrf), &html::error_banner(&message)),
    )
}

async fn overview(State(b): State<Board>, s: LoggedIn) -> Response {
    let now = b.server.now();
    let read = async {
        let o = b.store().board_overview(now).await?;
        let paused = paused(&b).await?;
        let flow = b.store().queue_lines(now).await?;
        let chart = relay_core::board::chart(now, &o.closed)?;
        Ok::<_, Error>((o, paused, flow, chart))
    };
    let (o, paused, flow, chart) = match read.await {
        Ok(r) => r,
        Err(e) => return failure(&b, &s, &e),
    };
    let queues = relay_core::board::queue_counts(&o.groups, &paused);
    html(
        StatusCode::OK,
        html::overview(&html::Overview {
            now,
            csrf: &s.csrf,
            queues: &queues,
            flow: &flow,
            chart: &chart,
            dead_letters: &o.dead_letters,
            lapsing: &o.lapsing,
            died_again: &o.died_again,
        }),
    )
}

async fn paused(b: &Board) -> Result<Vec<String>, Error> {
    b.store().apply(Op::PausedQueues).await?.queues()
}

/// A queue page's filter fields, as its query string and its bulk form carry them.
#[derive(Deserialize, Default)]
struct Filter {
    #[serde(default)]
    state: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    q: String,
}

#[derive(Deserialize)]
struct QueueQuery {
    #[serde(flatten)]
    filter: Filter,
    #[serde(default)]
    page: usize,
}

/// Todos a queue page searches through at most (and a bulk action lists at most).
const QUEUE_SCAN: usize = relay_core::board::BULK_MAX;

impl Filter {
    /// The filter the fields say; a bad state or reason names the field and the values.
    fn todo_match(&self) -> Result<relay_core::board::TodoMatch, Error> {
        let state = match self.state.trim() {
            "" => None,
            s => Some(TodoState::parse(s).ok_or_else(|| {
                Error::invalid(format!(
                    "state {s:?} is not a todo state; use pending, claimed, failed, done or canceled"
                ))
            })?),
        };
        let reason = match self.reason.trim() {
            "" => None,
            r => Some(
                relay_core::ledger::DeadLetterReason::parse(r).ok_or_else(|| {
                    let all: Vec<&str> = relay_core::ledger::DeadLetterReason::ALL
                        .iter()
                        .map(|r| r.as_str())
                        .collect();
                    Error::invalid(format!(
                        "reason {r:?} is not a dead-letter reason; use one of {}",
                        all.join(", ")
                    ))
                })?,
            ),
        };
        Ok(relay_core::board::TodoMatch {
            state,
            reason,
            text: self.q.clone(),
        })
    }
}

/// The todos of `queue` that `m` matches, newest first: what a queue page lists and what a
/// bulk action acts on.
async fn matching(
    b: &Board,
    operator: &str,
    queue: &str,
    m: &relay_core::board::TodoMatch,
) -> Result<Vec<Todo>, Error> {
    let all = b
        .store()
        .apply(Op::ListTodos {
            actor: Actor::operator(operator),
            filter: TodoFilter {
                queues: Some(vec![queue.to_string()]),
                state: m.state,
                after: None,
                limit: QUEUE_SCAN,
            },
        })
        .await?
        .todos()?;
    // Newest first: what an operator looks for is usually recent.
    Ok(all.into_iter().rev().filter(|t| m.matches(t)).collect())
}

async fn queue_page(
    State(b): State<Board>,
    Path(queue): Path<String>,
    Query(query): Query<QueueQuery>,
    s: LoggedIn,
) -> Response {
    let m = match query.filter.todo_match() {
        Ok(m) => m,
        Err(e) => return failure(&b, &s, &e),
    };
    let (matching, flow) = match (
        matching(&b, &s.operator, &queue, &m).await,
        b.store().queue_lines(b.server.now()).await,
    ) {
        (Ok(a), Ok(f)) => (a, f),
        (Err(e), _) | (_, Err(e)) => return failure(&b, &s, &e),
    };
    let line = flow.into_iter().find(|l| l.queue == queue);
    let start = query.page.saturating_mul(PAGE).min(matching.len());
    let end = (start + PAGE).min(matching.len());
    html(
        StatusCode::OK,
        html::queue(&html::QueuePage {
            now: b.server.now(),
            csrf: &s.csrf,
            queue: &queue,
            flow: line.as_ref(),
            filter: &m,
            matched: matching.len(),
            todos: &matching[start..end],
            page: query.page,
            more: end < matching.len(),
        }),
    )
}

async fn queue_action(
    State(b): State<Board>,
    Path((queue, action)): Path<(String, String)>,
    Posted(s, _): Posted<CsrfForm>,
) -> Response {
    let paused = match action.as_str() {
        "pause" => true,
        "resume" => false,
        other => {
            let e = Error::invalid(format!("{other:?} is no queue action; use pause or resume"));
            return failure(&b, &s, &e);
        }
    };
    let op = Op::PauseQueue {
        now: b.server.now(),
        actor: Actor::operator(&s.operator),
        queue: queue.clone(),
        paused,
    };
    match b.store().apply(op).await {
        Ok(_) => {
            tracing::info!(operator = %s.operator, queue = %queue, action = %action, "board: queue action");
            see_other(&format!("/board/queues/{queue}"))
        }
        Err(e) => failure(&b, &s, &e),
    }
}

/// Attempts a todo page shows at most.
const TODO_ATTEMPTS: usize = 100;

async fn todo_view(b: &Board, s: &LoggedIn, id: &str, error: Option<&str>) -> Response {
    let op = Op::GetTodo {
        actor: Actor::operator(&s.operator),
        id: id.to_string(),
        attempts_limit: TODO_ATTEMPTS,
    };
    let now = b.server.now();
    let read = async {
        let view = b.store().apply(op).await?.view()?;
        let flow = b.store().apply(Op::QueueFlow { now }).await?.flow()?;
        Ok::<_, Error>((view, flow))
    };
    match read.await {
        Ok((view, flow)) => {
            let status = if error.is_some() {
                StatusCode::CONFLICT
            } else {
                StatusCode::OK
            };
            let held = relay_core::ledger::flow::why_held(&flow, now, &view.todo);
            html(status, html::todo(now, &s.csrf, &view, held, error))
        }
        Err(e) => failure(b, s, &e),
    }
}

async fn todo_page(State(b): State<Board>, Path(id): Path<String>, s: LoggedIn) -> Response {
    todo_view(&b, &s, &id, None).await
}

#[derive(Deserialize)]
struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    summary: String,
    /// The answer of the `answer` action.
    #[serde(default)]
    answer: String,
}

impl Posting for ActionForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

/// The operation a todo's button stands for: the very one the CLI sends, as the operator.
fn action_op(now: relay_core::Millis, s: &LoggedIn, id: &str, f: &ActionForm) -> Result<Op, Error> {
    let (actor, id) = (Actor::operator(&s.operator), id.to_string());
    let summary = Some(f.summary.trim().to_string()).filter(|s| !s.is_empty());
    let report = Report {
        summary: summary.clone(),
        ..Report::default()
    };
    Ok(match f.action.as_str() {
        "retry" => Op::Retry { now, actor, id },
        "cancel" => Op::Cancel { now, actor, id },
        "release" => Op::Release {
            now,
            actor,
            id,
            summary,
            token_hash: None,
            usage: None,
        },
        "answer" => Op::AnswerTodo {
            now,
            actor,
            id,
            answer: f.answer.clone(),
            key: None,
            seq: None,
        },
        "complete" => Op::Complete {
            now,
            actor,
            id,
            report,
        },
        "fail" => Op::Fail {
            now,
            actor,
            id,
            report,
        },
        other => {
            return Err(Error::invalid(format!(
                "action {other:?} is not one of retry, cancel, release, complete, fail, answer"
            )));
        }
    })
}

async fn todo_action(
    State(b): State<Board>,
    Path(id): Path<String>,
    Posted(s, f): Posted<ActionForm>,
) -> Response {
    let op = match action_op(b.server.now(), &s, &id, &f) {
        Ok(op) => op,
        Err(e) => return todo_view(&b, &s, &id, Some(&e.message)).await,
    };
    let answer = b.store().apply(op).await;
    match answer.and_then(|a| a.todo()) {
        Ok(t) => {
            // A todo the action made claimable (Retry, Release) rings the doorbell at once, as
            // a worker's release does; ring_todo tells the Board too.
            if t.state == TodoState::Pending {
                let offer = relay_core::doorbell::Offer::of_pending(t.attempts_total);
                b.server.ring_todo(&t, offer);
            } else {
                b.server
                    .notice(&Ok(relay_core::ledger::Answer::Todo(t.clone())));
            }
            tracing::info!(operator = %s.operator, todo = %t.id, action = %f.action, state = %t.state, finished = finished(&t), "board: todo action");
            see_other(&format!("/board/todos/{id}"))
        }
        Err(e) if status_of(&e) == StatusCode::INTERNAL_SERVER_ERROR => failure(&b, &s, &e),
        Err(e) => todo_view(&b, &s, &id, Some(&e.message)).await,
    }
}

/// The Board's live stream: an SSE event `todo`, data `{"id": ID}`, for each todo this server
/// changes, and for each todo the doorbell's out-of-process scan finds pending anew (added or
/// retried by the CLI, requeued by another server on the same database). A reader that fell
/// behind gets `{"id": null}`, which reloads any page.
async fn events(State(b): State<Board>, headers: HeaderMap) -> Response {
    if let Err(r) = session(&b, &headers, false).await {
        return r;
    }
    let rx = b.server.board_notices();
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let id = match rx.recv().await {
            Ok(id) => Some(id),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => None,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        let data = serde_json::json!({ "id": id }).to_string();
        Some((
            Ok::<_, Infallible>(Event::default().event("todo").data(data)),
            rx,
        ))
    });
    // Ends when shutdown begins, as the doorbell streams do: an open Board never holds up a
    // graceful stop (the browser's EventSource reconnects to whatever serves next).
    let mut stopping = b.server.shutting_down();
    let stream = futures_util::StreamExt::take_until(stream, async move {
        let _ = stopping.wait_for(|v| *v).await;
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[derive(Deserialize, Default)]
struct AddQuery {
    #[serde(default)]
    queue: String,
}

/// The endpoints an operator may pick as a new todo's owner: the live ones.
async fn owners(b: &Board) -> Result<Vec<Endpoint>, Error> {
    let all = b.store().endpoint_list().await?;
    Ok(all.into_iter().filter(|e| e.revoked_at.is_none()).collect())
}

async fn add_view(b: &Board, s: &LoggedIn, f: &AddForm, error: Option<&Error>) -> Response {
    let owners = match owners(b).await {
        Ok(o) => o,
        Err(e) => return failure(b, s, &e),
    };
    let status = error.map_or(StatusCode::OK, status_of);
    let message = error.map(|e| e.message.as_str());
    html(
        status,
        html::add_todo(&s.csrf, &owners, &f.values(), message),
    )
}

async fn add_page(State(b): State<Board>, Query(q): Query<AddQuery>, s: LoggedIn) -> Response {
    let f = AddForm {
        queue: q.queue,
        ..AddForm::default()
    };
    add_view(&b, &s, &f, None).await
}

#[derive(Deserialize, Default)]
struct AddForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    queue: String,
    #[serde(default)]
    id: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    payload: String,
}

impl Posting for AddForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

impl AddForm {
    fn values(&self) -> html::AddValues<'_> {
        html::AddValues {
            endpoint: &self.endpoint,
            queue: &self.queue,
            id: &self.id,
            title: &self.title,
            payload: &self.payload,
        }
    }
}

/// The Board's add: what `relay todo add` does (the owner checked by the same rule, the same
/// `Op::AddTodo`), with the owner the operator picks.
async fn add_op(b: &Board, f: &AddForm) -> Result<Op, Error> {
    let (endpoint, queue) = (f.endpoint.trim(), f.queue.trim());
    let found = b.store().endpoint_get(endpoint).await?;
    relay_core::grant::check_owner(
        endpoint,
        found
            .as_ref()
            .map(|e| (e.revoked_at.is_some(), e.queues.as_deref())),
        queue,
        ["endpoint", "queue"],
    )?;
    let payload = match f.payload.trim() {
        "" => None,
        p => Some(serde_json::from_str(p).map_err(|e| {
            Error::invalid(format!(
                "payload: not valid JSON ({e}); write e.g. {{\"key\": \"value\"}}, or leave it empty"
            ))
        })?),
    };
    let id = match f.id.trim() {
        "" => crate::server::new_todo_id()?,
        id => id.to_string(),
    };
    Ok(Op::AddTodo {
        now: b.server.now(),
        endpoint: endpoint.to_string(),
        new: NewTodo {
            id,
            queue: queue.to_string(),
            title: f.title.trim().to_string(),
            payload,
            ..NewTodo::default()
        },
    })
}

async fn add_todo(State(b): State<Board>, Posted(s, f): Posted<AddForm>) -> Response {
    let answer = match add_op(&b, &f).await {
        Ok(op) => b.store().apply(op).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(relay_core::ledger::Answer::Todo(t)) => {
            tracing::info!(operator = %s.operator, todo = %t.id, endpoint = %t.endpoint, queue = %t.queue, "board: todo added");
            b.server.ring_todo(&t, relay_core::doorbell::Offer::Fresh);
            see_other(&format!("/board/todos/{}", t.id))
        }
        Ok(other) => match other.todo() {
            Ok(t) => see_other(&format!("/board/todos/{}", t.id)),
            Err(e) => failure(&b, &s, &e),
        },
        Err(e) if status_of(&e) == StatusCode::INTERNAL_SERVER_ERROR => failure(&b, &s, &e),
        Err(e) => add_view(&b, &s, &f, Some(&e)).await,
    }
}

async fn endpoints_page(State(b): State<Board>, s: LoggedIn) -> Response {
    match b.store().endpoint_list().await {
        Ok(all) => html(StatusCode::OK, html::endpoints(&s.csrf, &all, None)),
        Err(e) => failure(&b, &s, &e),
    }
}

/// Revoke: the same `Store::endpoint_revoke` as `relay endpoint revoke` (its token stops
/// working, its open attempts close as `revoked`, its claimed todos become dead letters).
async fn endpoint_revoke(
    State(b): State<Board>,
    Path(name): Path<String>,
    Posted(s, _): Posted<CsrfForm>,
) -> Response {
    match b.store().endpoint_revoke(b.server.now(), &name).await {
        Ok((_, todos)) => {
            tracing::info!(operator = %s.operator, endpoint = %name, dead_lettered = todos.len(), "board: endpoint revoked");
            b.server
                .notice(&Ok(relay_core::ledger::Answer::Todos(todos)));
            see_other("/board/endpoints")
        }
        Err(e) if status_of(&e) == StatusCode::INTERNAL_SERVER_ERROR => failure(&b, &s, &e),
        Err(e) => match b.store().endpoint_list().await {
            Ok(all) => html(
                status_of(&e),
                html::endpoints(&s.csrf, &all, Some(&e.message)),
            ),
            Err(e) => failure(&b, &s, &e),
        },
    }
}
