//! The Board's rules: operator names, board sessions and their expiry, the CSRF token a session
//! carries, the throttle on failed logins, and what the overview counts (the store only adds
//! rows up: [`queue_counts`] and [`chart`] say what the sums mean). The HTTP shell (`relay_server::board`) moves the
//! bytes; every decision about who may open the Board, and for how long, is here.
//!
//! Secrets: a session's cookie value and an operator token reach this module only to be hashed
//! or derived from; nothing here keeps or prints one.

use std::collections::{BTreeMap, VecDeque};

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::ledger::{DeadLetterReason, Outcome, Todo, TodoState, TokenHash, dead_letter_of};
use crate::time::{MINUTE, Millis};

/// How long a Board session lasts after login (it is not extended by use: log in again).
pub const SESSION_TTL: Millis = 12 * 60 * MINUTE;
/// Failed logins one client may make within [`LOGIN_WINDOW`] before it is refused for the rest
/// of the window.
pub const LOGIN_FAILURES_MAX: usize = 5;
pub const LOGIN_WINDOW: Millis = MINUTE;
/// Clients the throttle remembers at once; the oldest is forgotten first past it, so a flood of
/// addresses cannot grow the server's memory.
pub const LOGIN_CLIENTS_MAX: usize = 4096;

/// Operator names: like endpoint names, 1 to 64 letters, digits, `_`, `-` or `.`, starting with
/// a letter or digit (they appear in the timeline as who closed an attempt).
pub fn check_operator_name(op: &str, name: &str) -> Result<(), Error> {
    if crate::ledger::valid_queue_name(name) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{op}: operator name {name:?} must start with a letter or digit and hold at most 64 \
             letters, digits, '_', '-' or '.'"
        )))
    }
}

/// A session is live strictly before it expires, and only while its operator is not revoked.
pub fn session_live(now: Millis, expires_at: Millis, operator_revoked: bool) -> bool {
    now < expires_at && !operator_revoked
}

/// How long a CSRF token is, in characters (hex of a SHA-256).
pub const CSRF_FIELD_LEN: usize = 64;

/// The CSRF token of a session: derived from the session's secret, so a page of that session can
/// carry it in its forms while a cross-site page, which cannot read the cookie, cannot make it.
/// Nothing is stored for it. Domain-separated from the session id's own hash.
pub fn csrf_token(session_secret: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"relay board csrf\0");
    h.update(session_secret.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a presented CSRF token is the session's, compared in constant time.
pub fn csrf_matches(session_secret: &str, presented: &str) -> bool {
    let want = csrf_token(session_secret);
    want.len() == presented.len()
        && want
            .bytes()
            .zip(presented.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Whether a presented token's hash equals a stored one, in constant time.
pub fn hash_matches(stored: &TokenHash, presented: &TokenHash) -> bool {
    stored
        .0
        .iter()
        .zip(presented.0.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// How long a one-time login link opens the Board: long enough to click it from the terminal
/// that printed it, short enough that a stale scrollback is worth nothing.
pub const LOGIN_LINK_TTL: Millis = 10 * MINUTE;

/// A one-time login link (issued by `relay up` for the operator it creates): it opens one Board
/// session, once, before [`LOGIN_LINK_TTL`] has passed, and only for a client on the same host.
/// Only the secret's hash is kept; a wrong secret, or a try from elsewhere, does not use it up.
#[derive(Clone, Debug)]
pub struct LoginLink {
    hash: TokenHash,
    operator: String,
    expires_at: Millis,
    used: bool,
}

impl LoginLink {
    /// A link for `operator` whose secret hashes to `hash`, issued at `now`.
    pub fn new(now: Millis, hash: TokenHash, operator: &str) -> LoginLink {
        LoginLink {
            hash,
            operator: operator.to_string(),
            expires_at: now.saturating_add(LOGIN_LINK_TTL),
            used: false,
        }
    }

    /// Redeems the link at `now` with the presented secret's hash, from a client that is
    /// (`loopback`) or is not on this host. `Ok` names the operator to open a session for;
    /// after it, the link opens nothing more.
    pub fn redeem(
        &mut self,
        now: Millis,
        presented: &TokenHash,
        loopback: bool,
    ) -> Result<String, Error> {
        let again = "run `relay up` again for a new link, or log in with an operator token \
                     (`relay operator create NAME`)";
        if !loopback {
            return Err(Error::forbidden(format!(
                "a login link opens the Board only from the machine it was printed on (loopback); \
                 {again}"
            )));
        }
        if !hash_matches(&self.hash, presented) {
            return Err(Error::forbidden(format!(
                "this login link is not the one `relay up` printed; {again}"
            )));
        }
        if self.used {
            return Err(Error::forbidden(format!(
                "this login link was used already (it opens the Board once); {again}"
            )));
        }
        if now >= self.expires_at {
            return Err(Error::forbidden(format!(
                "this login link has expired (it lasts 10 minutes); {again}"
            )));
        }
        self.used = true;
        Ok(self.operator.clone())
    }
}

/// The throttle on failed logins, per client (the shell names a client by its address). Sans-IO:
/// every call takes `now`.
#[derive(Clone, Debug, Default)]
pub struct LoginThrottle {
    failures: BTreeMap<String, VecDeque<Millis>>,
    /// Clients in the order they first failed, to forget the oldest first.
    order: VecDeque<String>,
}

impl LoginThrottle {
    /// Whether a login from `client` may be tried at `now`: fewer than [`LOGIN_FAILURES_MAX`]
    /// failures within the last [`LOGIN_WINDOW`]. A refused try is not counted again, so a
    /// client is let in once its window has passed.
    pub fn allows(&mut self, now: Millis, client: &str) -> bool {
        let Some(f) = self.failures.get_mut(client) else {
            return true;
        };
        while f
            .front()
            .is_some_and(|t| t.saturating_add(LOGIN_WINDOW) <= now)
        {
            f.pop_front();
        }
        f.len() < LOGIN_FAILURES_MAX
    }

    /// Records a failed login of `client` at `now`.
    pub fn failed(&mut self, now: Millis, client: &str) {
        if !self.failures.contains_key(client) {
            if self.order.len() >= LOGIN_CLIENTS_MAX
                && let Some(oldest) = self.order.pop_front()
            {
                self.failures.remove(&oldest);
            }
            self.order.push_back(client.to_string());
        }
        let f = self.failures.entry(client.to_string()).or_default();
        f.push_back(now);
        // Only the newest failures within a window matter.
        while f.len() > LOGIN_FAILURES_MAX {
            f.pop_front();
        }
    }

    /// A successful login forgets the client's failures.
    pub fn succeeded(&mut self, client: &str) {
        if self.failures.remove(client).is_some() {
            self.order.retain(|c| c != client);
        }
    }
}

// ---- the overview --------------------------------------------------------------------------

/// Claims about to lapse, and todos that died more than once, the overview lists at most.
pub const OVERVIEW_LIST: usize = 10;
/// Dead letters the overview lists at most (the newest).
pub const OVERVIEW_DEAD_LETTERS: usize = 50;
/// The chart's span: attempts closed per minute over the last hour (the last minute is the
/// current one, still running).
pub const CHART_MINUTES: usize = 60;

/// One group of todos as the store counts them: a queue's todos in one state, how many of them
/// have a retry scheduled, and the oldest one's creation time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateCount {
    pub queue: String,
    pub state: TodoState,
    pub todos: u64,
    pub retry_scheduled: u64,
    pub oldest_created_at: Option<Millis>,
    /// The earliest last change in the group: for todos waiting for an answer, when the
    /// longest-waiting one asked.
    pub oldest_updated_at: Option<Millis>,
}

/// One queue's line on the overview.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueCounts {
    pub queue: String,
    pub pending: u64,
    pub claimed: u64,
    pub retrying: u64,
    pub dead_letters: u64,
    pub done: u64,
    pub canceled: u64,
    pub oldest_pending: Option<Millis>,
    /// Todos waiting for an answer (`input_required`), and since when the longest has waited.
    pub waiting: u64,
    pub oldest_waiting: Option<Millis>,
    pub paused: bool,
}

/// The overview's lines, by queue name: the store's groups summed into states (a failed todo
/// is retrying or a dead letter by [`dead_letter_of`]), and every paused queue, also one with no
/// todos.
pub fn queue_counts(groups: &[StateCount], paused: &[String]) -> Vec<QueueCounts> {
    let mut out: BTreeMap<String, QueueCounts> = BTreeMap::new();
    fn line<'a>(out: &'a mut BTreeMap<String, QueueCounts>, q: &str) -> &'a mut QueueCounts {
        out.entry(q.to_string()).or_insert_with(|| QueueCounts {
            queue: q.to_string(),
            ..QueueCounts::default()
        })
    }
    for q in paused {
        line(&mut out, q).paused = true;
    }
    for g in groups {
        let c = line(&mut out, &g.queue);
        let scheduled = g.retry_scheduled.min(g.todos);
        match g.state {
            TodoState::Pending => {
                c.pending += g.todos;
                c.oldest_pending = match (c.oldest_pending, g.oldest_created_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            TodoState::Claimed => c.claimed += g.todos,
            TodoState::Failed => {
                for (retry, n) in [(true, scheduled), (false, g.todos - scheduled)] {
                    if dead_letter_of(TodoState::Failed, retry) {
                        c.dead_letters += n;
                    } else {
                        c.retrying += n;
                    }
                }
            }
            TodoState::Done => c.done += g.todos,
            TodoState::Canceled => c.canceled += g.todos,
            TodoState::InputRequired => {
                c.waiting += g.todos;
                c.oldest_waiting = match (c.oldest_waiting, g.oldest_updated_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
        }
    }
    out.into_values().collect()
}

/// The attempt outcomes that count as a death (the store counts attempts closed with them).
pub fn died_outcomes() -> Vec<&'static str> {
    Outcome::ALL
        .into_iter()
        .filter(|o| o.died())
        .map(Outcome::as_str)
        .collect()
}

/// When the chart's first minute starts, for a chart drawn at `now`.
pub fn chart_since(now: Millis) -> Millis {
    (now / MINUTE).saturating_sub(CHART_MINUTES as Millis - 1) * MINUTE
}

/// Attempts closed per minute over the last hour, by outcome: `minutes[0]` starts at `since`,
/// the last is the current minute.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chart {
    pub since: Millis,
    pub minutes: Vec<BTreeMap<Outcome, u64>>,
}

impl Chart {
    /// The most attempts closed in one minute (the chart's scale).
    pub fn peak(&self) -> u64 {
        self.minutes
            .iter()
            .map(|m| m.values().sum::<u64>())
            .max()
            .unwrap_or(0)
    }

    /// Every attempt the chart counts, by outcome.
    pub fn totals(&self) -> BTreeMap<Outcome, u64> {
        let mut t = BTreeMap::new();
        for m in &self.minutes {
            for (o, n) in m {
                *t.entry(*o).or_default() += n;
            }
        }
        t
    }
}

/// The chart at `now` from the store's counts: `(minute number, i.e. ended_at / MINUTE,
/// outcome name, attempts)`. Counts outside the hour are left out; an outcome this build does
/// not name is an error (the store holds only names the ledger wrote).
pub fn chart(now: Millis, counts: &[(u64, String, u64)]) -> Result<Chart, Error> {
    let since = chart_since(now);
    let first = since / MINUTE;
    let mut minutes = vec![BTreeMap::new(); CHART_MINUTES];
    for (minute, outcome, n) in counts {
        let Some(o) = Outcome::parse(outcome) else {
            return Err(Error::internal(format!(
                "the overview chart: outcome {outcome:?} is not one this build knows"
            )));
        };
        let Some(slot) = minute
            .checked_sub(first)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| minutes.get_mut(i))
        else {
            continue;
        };
        *slot.entry(o).or_default() += n;
    }
    Ok(Chart { since, minutes })
}

/// A queue page's filter: a state, a dead-letter reason, and a text searched (case-insensitive)
/// in the id and the title. The page lists what it matches, and a bulk action acts on the same.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TodoMatch {
    pub state: Option<TodoState>,
    pub reason: Option<DeadLetterReason>,
    pub text: String,
}

impl TodoMatch {
    pub fn matches(&self, t: &Todo) -> bool {
        let needle = self.text.trim().to_lowercase();
        self.state.is_none_or(|s| t.state == s)
            && self.reason.is_none_or(|r| t.dead_letter_reason == Some(r))
            && (needle.is_empty()
                || t.id.to_lowercase().contains(&needle)
                || t.title.to_lowercase().contains(&needle))
    }

    /// The filter in words, for the confirmation and the record ("state failed, dead-letter
    /// reason attempts_exhausted, text \"flaky\"", or "every todo").
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state {s}"));
        }
        if let Some(r) = self.reason {
            parts.push(format!("dead-letter reason {r}"));
        }
        if !self.text.trim().is_empty() {
            parts.push(format!("text {:?}", self.text.trim()));
        }
        if parts.is_empty() {
            "every todo".into()
        } else {
            parts.join(", ")
        }
    }
}

crate::names! {
    /// The Board's bulk actions: the operator's Retry and Cancel, on every todo a filter matches.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum BulkAction {
        Retry => "retry",
        Cancel => "cancel",
    }
}

/// Todos one bulk action lists at most (a queue page searches as many).
pub const BULK_MAX: usize = 10_000;

/// How a todo stood when a bulk action listed it: its state, and its attempts so far (every
/// claim adds one, so a todo claimed and closed again since reads as changed too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listed {
    pub state: TodoState,
    pub attempts_total: u32,
}

impl Listed {
    pub fn of(t: &Todo) -> Listed {
        Listed {
            state: t.state,
            attempts_total: t.attempts_total,
        }
    }
}

/// What a bulk action does with one todo it listed, given the todo as it is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkStep {
    /// Apply the action through the ledger's own transition (which may still refuse it).
    Apply,
    /// The action's effect is already there and nothing else happened since: it was applied
    /// before the server stopped midway, and only its record was missing.
    AlreadyApplied,
    /// The todo changed since it was listed (a worker claimed it, someone retried, canceled or
    /// completed it): the operator confirmed the todos as they were, so it is left alone.
    Skip(&'static str),
}

/// The bulk action's rule for one todo. A retry never touches a live claim: a claimed todo is
/// skipped, whatever was listed (and the ledger refuses to retry one anyway).
pub fn bulk_step(action: BulkAction, listed: Listed, now: &Todo) -> BulkStep {
    let result_state = match action {
        BulkAction::Retry => TodoState::Pending,
        BulkAction::Cancel => TodoState::Canceled,
    };
    if now.attempts_total == listed.attempts_total
        && listed.state != result_state
        && now.state == result_state
    {
        return BulkStep::AlreadyApplied;
    }
    if action == BulkAction::Retry && now.state == TodoState::Claimed {
        return BulkStep::Skip("claimed by a worker: a live claim is never retried");
    }
    if now.state != listed.state || now.attempts_total != listed.attempts_total {
        return BulkStep::Skip("changed since it was listed");
    }
    BulkStep::Apply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn todo_in(state: TodoState, attempts_total: u32) -> Todo {
        Todo {
            id: "td_1".into(),
            endpoint: "ci".into(),
            queue: "ci".into(),
            title: "Fix the Flaky test".into(),
            kind: None,
            source: None,
            payload: None,
            work_order: None,
            assignee: None,
            state,
            owner: None,
            attempt: 0,
            max_attempts: 3,
            attempts_total,
            attempts_pruned: 0,
            lease_expires_at: None,
            claimed_at: None,
            next_retry_at: None,
            result: None,
            created_at: 0,
            updated_at: 0,
            dead_letter_reason: None,
            idempotency_key: None,
            deadline_at: None,
            max_same_failures: 2,
            asking: crate::ledger::Asking {
                max_requests: 3,
                requests: 0,
                answer_within: None,
                answer_due_at: None,
            },
            budget: crate::ledger::Budget::default(),
            spent: crate::ledger::Usage::default(),
            task_id: None,
            priority: 0,
            run_at: None,
            concurrency_key: None,
        }
    }

    #[test]
    fn a_filter_matches_state_reason_and_text() {
        let mut dead = todo_in(TodoState::Failed, 2);
        dead.dead_letter_reason = Some(DeadLetterReason::AttemptsExhausted);
        let f = TodoMatch {
            state: Some(TodoState::Failed),
            reason: Some(DeadLetterReason::AttemptsExhausted),
            text: " flaky ".into(),
        };
        assert!(f.matches(&dead));
        assert!(!f.matches(&todo_in(TodoState::Failed, 2)), "no reason");
        let other = TodoMatch {
            reason: Some(DeadLetterReason::Deadline),
            ..TodoMatch::default()
        };
        assert!(!other.matches(&dead));
        assert!(TodoMatch::default().matches(&dead));
        assert_eq!(TodoMatch::default().describe(), "every todo");
    }

    #[test]
    fn a_bulk_step_skips_what_changed_and_never_retries_a_claim() {
        let listed = Listed::of(&todo_in(TodoState::Failed, 3));
        let retry = BulkAction::Retry;
        assert_eq!(
            bulk_step(retry, listed, &todo_in(TodoState::Failed, 3)),
            BulkStep::Apply
        );
        // Retried and claimed in between: a live claim, never touched.
        assert!(matches!(
            bulk_step(retry, listed, &todo_in(TodoState::Claimed, 4)),
            BulkStep::Skip(_)
        ));
        // Retried, claimed and failed again in between: changed, skipped.
        assert!(matches!(
            bulk_step(retry, listed, &todo_in(TodoState::Failed, 4)),
            BulkStep::Skip(_)
        ));
        // Pending with no claim since: the retry landed before a stop.
        assert_eq!(
            bulk_step(retry, listed, &todo_in(TodoState::Pending, 3)),
            BulkStep::AlreadyApplied
        );
        let cancel = BulkAction::Cancel;
        assert_eq!(
            bulk_step(cancel, listed, &todo_in(TodoState::Canceled, 3)),
            BulkStep::AlreadyApplied
        );
        assert!(matches!(
            bulk_step(cancel, listed, &todo_in(TodoState::Done, 4)),
            BulkStep::Skip(_)
        ));
    }

    #[test]
    fn a_login_link_opens_once_within_ten_minutes_and_only_from_loopback() {
        let secret = TokenHash::of("s3cret");
        let mut link = LoginLink::new(1_000, secret, "relay-up");
        // Refusals that do not use it up: from elsewhere, with another secret.
        assert!(link.redeem(2_000, &secret, false).is_err());
        assert!(link.redeem(2_000, &TokenHash::of("guess"), true).is_err());
        assert_eq!(link.redeem(2_000, &secret, true).unwrap(), "relay-up");
        let again = link.redeem(2_001, &secret, true).unwrap_err();
        assert!(again.message.contains("used already"), "{}", again.message);

        let mut late = LoginLink::new(1_000, secret, "relay-up");
        let e = late
            .redeem(1_000 + LOGIN_LINK_TTL, &secret, true)
            .unwrap_err();
        assert!(e.message.contains("expired"), "{}", e.message);
        assert_eq!(
            late.redeem(1_000 + LOGIN_LINK_TTL - 1, &secret, true)
                .unwrap(),
            "relay-up"
        );
    }

    const T0: Millis = 1_790_000_000_000;

    #[test]
    fn the_throttle_refuses_a_client_past_its_failures_until_the_window_passes() {
        let mut t = LoginThrottle::default();
        for i in 0..LOGIN_FAILURES_MAX as u64 {
            assert!(t.allows(T0 + i, "10.0.0.1"));
            t.failed(T0 + i, "10.0.0.1");
        }
        assert!(!t.allows(T0 + 10, "10.0.0.1"));
        // Another client is not affected.
        assert!(t.allows(T0 + 10, "10.0.0.2"));
        // The window is counted from the oldest failure kept.
        assert!(!t.allows(T0 + LOGIN_WINDOW - 1, "10.0.0.1"));
        assert!(t.allows(T0 + LOGIN_WINDOW, "10.0.0.1"));
        t.succeeded("10.0.0.1");
        assert!(t.failures.is_empty() && t.order.is_empty());
    }

    #[test]
    fn the_throttle_forgets_the_oldest_client_past_its_bound() {
        let mut t = LoginThrottle::default();
        for i in 0..=LOGIN_CLIENTS_MAX {
            t.failed(T0, &format!("c{i}"));
        }
        assert_eq!(t.failures.len(), LOGIN_CLIENTS_MAX);
        assert!(!t.failures.contains_key("c0"));
    }

    #[test]
    fn a_session_lives_strictly_before_it_expires_and_not_past_a_revoke() {
        assert!(session_live(T0, T0 + 1, false));
        assert!(!session_live(T0 + 1, T0 + 1, false));
        assert!(!session_live(T0, T0 + 1, true));
    }

    #[test]
    fn the_csrf_token_is_the_sessions_own() {
        let a = csrf_token("secret-a");
        assert_eq!(a.len(), 64);
        assert!(csrf_matches("secret-a", &a));
        assert!(!csrf_matches("secret-b", &a));
        assert!(!csrf_matches("secret-a", ""));
        // Not the session id's own hash (which is what the store keeps).
        let stored = TokenHash::of("secret-a");
        let hex: String = stored.0.iter().map(|b| format!("{b:02x}")).collect();
        assert_ne!(a, hex);
    }

    #[test]
    fn queue_counts_split_failed_into_retrying_and_dead_letters_and_keep_paused_queues() {
        let g = |queue: &str, state, todos, retry_scheduled, oldest| StateCount {
            queue: queue.into(),
            state,
            todos,
            retry_scheduled,
            oldest_created_at: oldest,
            oldest_updated_at: oldest,
        };
        let groups = [
            g("a", TodoState::Pending, 3, 0, Some(T0 + 5)),
            g("a", TodoState::Failed, 5, 2, Some(T0)),
            g("a", TodoState::Done, 1, 0, Some(T0)),
            g("b", TodoState::Claimed, 2, 0, Some(T0)),
        ];
        let c = queue_counts(&groups, &["b".into(), "idle".into()]);
        let names: Vec<&str> = c.iter().map(|q| q.queue.as_str()).collect();
        assert_eq!(names, ["a", "b", "idle"]);
        assert_eq!(
            (c[0].pending, c[0].retrying, c[0].dead_letters, c[0].done),
            (3, 2, 3, 1)
        );
        assert_eq!(c[0].oldest_pending, Some(T0 + 5));
        assert!(!c[0].paused && c[1].paused && c[2].paused);
        assert_eq!((c[1].claimed, c[2].pending), (2, 0));
    }

    #[test]
    fn the_chart_holds_the_last_hour_by_minute_and_refuses_unknown_outcomes() {
        let now = T0 + 30 * 1000;
        let this = now / MINUTE;
        let counts = [
            (this, "completed".to_string(), 4),
            (this, "reaped".to_string(), 1),
            (this - 59, "failed".to_string(), 2),
            (this - 60, "failed".to_string(), 9),
            (this + 1, "failed".to_string(), 9),
        ];
        let c = chart(now, &counts).unwrap();
        assert_eq!(c.minutes.len(), CHART_MINUTES);
        assert_eq!(c.since, (this - 59) * MINUTE);
        assert_eq!(c.minutes[59][&Outcome::Completed], 4);
        assert_eq!(c.minutes[0][&Outcome::Failed], 2);
        assert_eq!(c.peak(), 5);
        assert_eq!(c.totals().values().sum::<u64>(), 7);
        assert!(chart(now, &[(this, "exploded".into(), 1)]).is_err());
        assert_eq!(died_outcomes(), ["lease_expired", "reaped"]);
    }
}
