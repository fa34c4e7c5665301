//! The Board's rules: operator names, board sessions and their expiry, the CSRF token a session
//! carries, and the throttle on failed logins. The HTTP shell (`relay_server::board`) moves the
//! bytes; every decision about who may open the Board, and for how long, is here.
//!
//! Secrets: a session's cookie value and an operator token reach this module only to be hashed
//! or derived from; nothing here keeps or prints one.

use std::collections::{BTreeMap, VecDeque};

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::ledger::TokenHash;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
