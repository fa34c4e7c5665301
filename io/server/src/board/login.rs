//! Logging in and out of the Board: the session cookie, the CSRF check every POST makes, the
//! login form with its failed-login throttle, and the one-time login link.

use std::sync::Mutex;

use axum::extract::{Form, FromRequest, FromRequestParts, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use relay_core::board::{SESSION_TTL, csrf_matches, csrf_token};
use relay_core::ledger::TokenHash;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{Board, COOKIE, failure, html, see_other};

/// The throttle's one client name: handlers do not see the peer address, so failed logins share
/// one budget (a flood of guesses slows every login for a minute, never opens one).
const THROTTLE_CLIENT: &str = "board";

/// A logged-in operator's request.
pub(super) struct LoggedIn {
    pub(super) operator: String,
    pub(super) secret: String,
    pub(super) csrf: String,
}

fn cookie_secret(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
        .filter(|v| !v.is_empty())
}

/// The request's live session, or the response to give instead: a page request goes to the
/// login, anything else is refused. Host and Origin are checked first, as on the MCP side.
pub(super) async fn session(
    b: &Board,
    headers: &HeaderMap,
    page: bool,
) -> Result<LoggedIn, Response> {
    crate::server::host_check(&b.server, "board", headers)?;
    let refuse = || {
        if page {
            see_other("/board/login")
        } else {
            html(
                StatusCode::UNAUTHORIZED,
                html::login(Some("Your session has ended; log in again.")),
            )
        }
    };
    let Some(secret) = cookie_secret(headers) else {
        return Err(refuse());
    };
    let now = b.server.now();
    match b.store().session_get(now, TokenHash::of(&secret)).await {
        Ok(Some(s)) => Ok(LoggedIn {
            operator: s.operator,
            csrf: csrf_token(&secret),
            secret,
        }),
        Ok(None) => Err(refuse()),
        Err(e) => Err(html(
            StatusCode::SERVICE_UNAVAILABLE,
            html::login(Some(&b.server.internal_message("board session", &e))),
        )),
    }
}

/// A POST's CSRF check: the form's `csrf` must be the session's.
fn csrf_ok(s: &LoggedIn, presented: &str) -> Result<(), Response> {
    if csrf_matches(&s.secret, presented) {
        Ok(())
    } else {
        tracing::warn!(operator = %s.operator, "board: refused a POST without the session's CSRF token");
        Err(html(
            StatusCode::FORBIDDEN,
            html::page(
                "Refused",
                Some(&s.csrf),
                &html::error_banner(
                    "This form is stale or came from another site (CSRF token missing or wrong); \
                     reload the page and try again.",
                ),
            ),
        ))
    }
}

/// A page request's live session ([`session`]), as a handler's argument: without one, the
/// login page is the response.
impl FromRequestParts<Board> for LoggedIn {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, b: &Board) -> Result<LoggedIn, Response> {
        session(b, &parts.headers, true).await
    }
}

/// A form a state-changing POST sends: it carries the session's CSRF token.
pub(super) trait Posting: DeserializeOwned + Send {
    fn csrf(&self) -> &str;
}

/// A POST's session and form, past the session and CSRF checks together: what every
/// state-changing handler takes, so that none runs without them.
pub(super) struct Posted<F>(pub(super) LoggedIn, pub(super) F);

impl<F: Posting> FromRequest<Board> for Posted<F> {
    type Rejection = Response;

    async fn from_request(req: Request, b: &Board) -> Result<Posted<F>, Response> {
        let headers = req.headers().clone();
        let Form(f) = Form::<F>::from_request(req, b)
            .await
            .map_err(IntoResponse::into_response)?;
        let s = session(b, &headers, false).await?;
        csrf_ok(&s, f.csrf())?;
        Ok(Posted(s, f))
    }
}

pub(super) async fn login_page(State(b): State<Board>, headers: HeaderMap) -> Response {
    if let Err(r) = crate::server::host_check(&b.server, "board", &headers) {
        return r;
    }
    html(StatusCode::OK, html::login(None))
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    #[serde(default)]
    token: String,
}

pub(super) async fn login(
    State(b): State<Board>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    if let Err(r) = crate::server::host_check(&b.server, "board", &headers) {
        return r;
    }
    let now = b.server.now();
    if !lock(&b.throttle).allows(now, THROTTLE_CLIENT) {
        tracing::warn!("board: login refused, too many failed logins in the last minute");
        return html(
            StatusCode::TOO_MANY_REQUESTS,
            html::login(Some("Too many failed logins; wait a minute and try again.")),
        );
    }
    let found = b
        .store()
        .operator_by_token(TokenHash::of(f.token.trim()))
        .await;
    let operator = match found {
        Ok(Some(o)) => o,
        Ok(None) => {
            lock(&b.throttle).failed(now, THROTTLE_CLIENT);
            // Never the token: only that one was refused.
            tracing::warn!("board: failed login (unknown or revoked operator token)");
            return html(
                StatusCode::UNAUTHORIZED,
                html::login(Some(
                    "That token opens no Board: it is unknown or revoked (endpoint tokens never \
                     do). Create one with `relay operator create NAME`.",
                )),
            );
        }
        Err(e) => {
            return html(
                StatusCode::SERVICE_UNAVAILABLE,
                html::login(Some(&b.server.internal_message("board login", &e))),
            );
        }
    };
    lock(&b.throttle).succeeded(THROTTLE_CLIENT);
    open_session(&b, &operator.name).await
}

/// Opens a Board session for `operator`: a fresh random secret in the cookie, only its hash in
/// the store; then on to the overview.
async fn open_session(b: &Board, operator: &str) -> Response {
    let now = b.server.now();
    let mut raw = [0u8; 32];
    if let Err(e) = b.server.fill_random(&mut raw) {
        return html(
            StatusCode::SERVICE_UNAVAILABLE,
            html::login(Some(&e.message)),
        );
    }
    use base64::Engine as _;
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
    if let Err(e) = b
        .store()
        .session_create(now, TokenHash::of(&secret), operator)
        .await
    {
        return html(
            StatusCode::SERVICE_UNAVAILABLE,
            html::login(Some(&b.server.internal_message("board login", &e))),
        );
    }
    tracing::info!(operator = %operator, "board: logged in");
    let cookie = format!(
        "{COOKIE}={secret}; Path=/board; HttpOnly; SameSite=Strict; Max-Age={}{}",
        SESSION_TTL / 1000,
        if b.server.config().secure_cookies {
            "; Secure"
        } else {
            ""
        }
    );
    let mut r = see_other("/board/");
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

#[derive(Deserialize)]
pub(super) struct LinkQuery {
    #[serde(default)]
    secret: String,
}

/// The one-time login link `relay up` prints: a GET (it is clicked from a terminal) that opens
/// a session once, from loopback, within ten minutes (`relay_core::board::LoginLink`). Failed
/// tries count against the same throttle as failed logins; the secret is never logged.
pub(super) async fn login_link(
    State(b): State<Board>,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    Query(q): Query<LinkQuery>,
) -> Response {
    if let Err(r) = crate::server::host_check(&b.server, "board", &headers) {
        return r;
    }
    let now = b.server.now();
    if !lock(&b.throttle).allows(now, THROTTLE_CLIENT) {
        return html(
            StatusCode::TOO_MANY_REQUESTS,
            html::login(Some("Too many failed logins; wait a minute and try again.")),
        );
    }
    // A request that did not come over a socket (a test's in-process router) is not loopback.
    let loopback = extensions
        .get::<crate::server::Peer>()
        .is_some_and(|p| p.0.ip().is_loopback());
    match b.server.redeem_login_link(q.secret.trim(), loopback) {
        Ok(operator) => open_session(&b, &operator).await,
        Err(e) => {
            lock(&b.throttle).failed(now, THROTTLE_CLIENT);
            tracing::warn!(code = %e.code.as_str(), "board: refused a one-time login link");
            html(StatusCode::FORBIDDEN, html::login(Some(&e.message)))
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A form with nothing but the CSRF token (a button).
#[derive(Deserialize)]
pub(super) struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

impl Posting for CsrfForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

pub(super) async fn logout(State(b): State<Board>, Posted(s, _): Posted<CsrfForm>) -> Response {
    if let Err(e) = b.store().session_delete(TokenHash::of(&s.secret)).await {
        return failure(&b, &s, &e);
    }
    let mut r = see_other("/board/login");
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("relay_board=; Path=/board; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    r
}
