//! The server's hygiene rules against hostile clients: caps on sessions and doorbell streams, a
//! log throttle, and the escaping of untrusted text for logs and terminals.
//!
//! The shell counts and reads the clock; these functions decide. Nothing here reads time: every
//! `now` is a [`Millis`] passed in.

use std::borrow::Cow;

use crate::time::Millis;

/// The caps on what clients may hold open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Live MCP sessions across all endpoints.
    pub sessions_total: usize,
    /// Live MCP sessions of one endpoint.
    pub sessions_per_endpoint: usize,
    /// Open doorbell streams (legacy GET streams and modern listen streams) at once.
    pub streams: usize,
}

/// How long a server's note that a session holds a doorbell stream lasts: three of its
/// keep-alive touches (one a minute), so a stream that ended without a word (its server killed)
/// stops protecting its session from being ended for room within three minutes.
pub const STREAM_HOLD: Millis = 180_000;

/// How an MCP session's use is recorded in the store, so that checking a session is a read and
/// a request never fails because its use could not be written (a full disk, a read-only
/// replica): the store's record of a session's last use is written only when it is
/// [`session_touch_due`], at most once per [`session_touch_every`] (a tenth of the idle timeout:
/// 3 minutes of the default 30), and a failed write is logged, not answered. The record so lags
/// the session's true last use by less than that interval, so the store keeps a session for
/// [`session_kept`] (the idle timeout plus that interval) after its recorded use: a session used
/// within the idle timeout is never swept, and an unused one is forgotten between the idle
/// timeout and the idle timeout plus the interval after its last use.
pub fn session_touch_every(idle: Millis) -> Millis {
    idle / 10
}

/// Whether a request to a session whose recorded last use is `age` old writes a new one (see
/// [`session_touch_every`]).
pub fn session_touch_due(age: Millis, idle: Millis) -> bool {
    age >= session_touch_every(idle)
}

/// How long after its recorded last use the store keeps a session of idle timeout `idle` (see
/// [`session_touch_every`]): sessions whose record is this old are gone.
pub fn session_kept(idle: Millis) -> Millis {
    idle.saturating_add(session_touch_every(idle))
}

/// Whether one more session may open, given the live sessions: `Ok(n)` to open it after ending
/// the endpoint's `n` least recently used sessions that hold no doorbell stream (`streamless` of
/// them exist), `Err` with the message for the client. At the per-endpoint cap the oldest idle
/// session makes room, so clients that never end their sessions (a common SDK habit) cannot lock
/// an endpoint out; the cap still holds, and a session with an open stream is never ended for
/// room. The total cap ends nobody: one endpoint must not push another's sessions out.
pub fn admit_session(
    caps: &Caps,
    total: usize,
    for_endpoint: usize,
    streamless: usize,
) -> Result<usize, String> {
    let end = (for_endpoint + 1).saturating_sub(caps.sessions_per_endpoint);
    if end > streamless {
        return Err(format!(
            "too many sessions for this endpoint ({for_endpoint} open, at most {}, each holding a \
             doorbell stream); close a stream or end a session with DELETE, then initialize again",
            caps.sessions_per_endpoint
        ));
    }
    if total - end >= caps.sessions_total {
        return Err(format!(
            "the server holds its maximum of {} sessions; try again once idle sessions expire",
            caps.sessions_total
        ));
    }
    Ok(end)
}

/// Whether one more doorbell stream may open, given the open ones; `Err` is the message.
pub fn admit_stream(caps: &Caps, open: usize) -> Result<(), String> {
    if open >= caps.streams {
        return Err(format!(
            "the server holds its maximum of {} open doorbell streams; poll claim_next instead, \
             or try again later",
            caps.streams
        ));
    }
    Ok(())
}

/// At most one log line per window for one kind of event; the rest are counted and reported
/// with the next line that is let through, so a flood costs one line per window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogThrottle {
    window: Millis,
    last: Option<Millis>,
    suppressed: u64,
}

impl LogThrottle {
    pub fn new(window: Millis) -> LogThrottle {
        LogThrottle {
            window,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(n)`: log now, mentioning the `n` events suppressed since the last line. `None`:
    /// stay silent (the event is counted).
    pub fn allow(&mut self, now: Millis) -> Option<u64> {
        let due = self
            .last
            .is_none_or(|last| now >= last.saturating_add(self.window) || now < last);
        if due {
            self.last = Some(now);
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            None
        }
    }
}

/// Whether a character must not reach a log line or a terminal raw: C0/C1 controls (newline and
/// ESC included), DEL, the line and paragraph separators, and the bidirectional formatting
/// characters (which reorder what the operator sees).
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{061C}' | '\u{200E}' | '\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// Untrusted text made safe for a log line or a terminal: every [`is_unsafe_char`] becomes a
/// visible `\u{…}` escape (a backslash becomes `\\`, so the escaping is unambiguous). Text
/// without either comes back borrowed and unchanged.
pub fn escape_text(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c == '\\' || is_unsafe_char(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if is_unsafe_char(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Caps = Caps {
        sessions_total: 3,
        sessions_per_endpoint: 2,
        streams: 1,
    };

    /// A session used within the idle timeout outlives the sweep whatever the throttle skipped;
    /// one unused for the idle timeout plus the interval is gone.
    #[test]
    fn a_throttled_session_record_never_loses_a_session_in_use() {
        let idle = 1_800_000;
        let every = session_touch_every(idle);
        assert_eq!(every, 180_000);
        assert!(!session_touch_due(every - 1, idle));
        assert!(session_touch_due(every, idle));
        // The worst lag: a use just before the write fell due, then silence.
        let recorded = 0;
        let used = every - 1;
        let last_moment_in_use = used + idle - 1;
        assert!(
            last_moment_in_use - recorded < session_kept(idle),
            "swept while in use"
        );
        assert!(recorded + session_kept(idle) <= used + idle + every);
    }

    #[test]
    fn sessions_are_capped_per_endpoint_and_in_total() {
        assert_eq!(admit_session(&CAPS, 0, 0, 0), Ok(0));
        assert_eq!(admit_session(&CAPS, 2, 1, 0), Ok(0));
        // At the endpoint's cap: the oldest streamless session makes room; none, a refusal.
        assert_eq!(admit_session(&CAPS, 2, 2, 1), Ok(1));
        assert!(
            admit_session(&CAPS, 2, 2, 0)
                .unwrap_err()
                .contains("this endpoint")
        );
        // A lowered cap ends as many as it takes, if there are as many.
        assert_eq!(admit_session(&CAPS, 3, 3, 3), Ok(2));
        assert!(admit_session(&CAPS, 3, 3, 1).is_err());
        assert!(
            admit_session(&CAPS, 3, 0, 0)
                .unwrap_err()
                .contains("maximum of 3")
        );
        assert!(admit_stream(&CAPS, 0).is_ok());
        assert!(
            admit_stream(&CAPS, 1)
                .unwrap_err()
                .contains("doorbell streams")
        );
    }

    #[test]
    fn the_throttle_lets_one_line_through_per_window_and_counts_the_rest() {
        let mut t = LogThrottle::new(1000);
        assert_eq!(t.allow(0), Some(0));
        assert_eq!(t.allow(1), None);
        assert_eq!(t.allow(999), None);
        assert_eq!(t.allow(1000), Some(2));
        assert_eq!(t.allow(1500), None);
        // A clock that went backwards does not silence the log for good.
        assert_eq!(t.allow(10), Some(1));
    }

    #[test]
    fn escaping_makes_controls_and_bidi_visible_and_keeps_the_rest() {
        assert!(matches!(escape_text("plain ünïcode 🚀"), Cow::Borrowed(_)));
        assert_eq!(escape_text("a\nb"), "a\\u{a}b");
        assert_eq!(escape_text("\u{1b}[2J"), "\\u{1b}[2J");
        assert_eq!(escape_text("x\u{202E}y\u{2028}z"), "x\\u{202e}y\\u{2028}z");
        assert_eq!(escape_text("back\\slash"), "back\\\\slash");
        assert_eq!(escape_text("\u{0}\u{7f}\u{85}"), "\\u{0}\\u{7f}\\u{85}");
        for s in ["\u{2066}", "\u{200f}", "\t", "\r"] {
            assert!(!escape_text(s).chars().any(is_unsafe_char), "{s:?}");
        }
    }
}
