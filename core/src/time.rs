//! Time as a value: instants on a host's two clocks, durations, and their text.
//!
//! Core never reads a clock; every input carries `now`. Three types of milliseconds:
//!
//! - [`Mono`]: an instant on a host's monotonic clock, from an origin of the clock's own. Every
//!   deadline and timer of the relay side runs on it (the relay machine, its [`Monitor`], the
//!   fleet's wake-ups, the daemon, both simulators).
//! - [`Wall`]: an instant on a host's wall clock, since the Unix epoch. It stamps text (run
//!   records, context files, `describe`) and places wall-clock schedules and operating hours.
//! - [`Millis`]: a span (a ttl, an interval, a backoff, a timeout).
//!
//! `Mono` and `Wall` are distinct types so that a deadline computed on one clock and compared on
//! the other does not compile: a span moves an instant along its own clock, the span between two
//! instants of one clock is a `Millis`, and [`Now::wall_at`] is the one bridge (for text). Each
//! goes in and out as a number only at an edge ([`Mono::from_ms`], [`Wall::ms`]: the wire's
//! text, [`rfc3339`], a clock's reading).
//!
//! The queue server's side — the [`Ledger`](crate::ledger), its stores, the server — keeps its
//! instants as bare `Millis` since the epoch: it reads one clock only ([`WallClock`]), so there is
//! nothing to mix them up with, and its stamps are stored as SQL integers and compared with the
//! same arithmetic as its spans.
//!
//! This module also converts between those numbers and the RFC 3339 strings the wire and the
//! records show, and defines [`Now`], the pair of readings that the relay machine takes.
//!
//! [`Monitor`]: crate::relay::invariants::Monitor

use std::ops::Add;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// A span of time in milliseconds: a ttl, an interval, a backoff, the time between two
/// instants of one clock. Also the queue server's instants, in milliseconds since
/// 1970-01-01T00:00:00Z (see the module doc).
pub type Millis = u64;

/// Defines an instant type on one clock: its number of milliseconds goes in and out only
/// through `from_ms` and `ms`, a span moves it (saturating), and the span between two of its
/// instants is `since`.
macro_rules! instant {
    ($(#[$doc:meta])* $name:ident, $origin:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(Millis);

        impl $name {
            #[doc = concat!("The instant `ms` milliseconds after ", $origin, ".")]
            pub const fn from_ms(ms: Millis) -> $name {
                $name(ms)
            }

            #[doc = concat!("Milliseconds after ", $origin, ".")]
            pub const fn ms(self) -> Millis {
                self.0
            }

            /// The span from `earlier` to this instant; 0 when `earlier` is not earlier.
            pub const fn since(self, earlier: $name) -> Millis {
                self.0.saturating_sub(earlier.0)
            }
        }

        /// The instant a span later (saturating: no clock runs that long).
        impl Add<Millis> for $name {
            type Output = $name;
            fn add(self, span: Millis) -> $name {
                $name(self.0.saturating_add(span))
            }
        }
    };
}

instant!(
    /// An instant on a host's monotonic clock: milliseconds from an origin of the clock's own
    /// (a boot, a process start), meaningless on any other host. It never steps; every deadline
    /// and timer of the relay side runs on it (see the [module doc](self)).
    ///
    /// It does not mix with a [`Wall`]: neither adds to, subtracts from nor compares with the
    /// other, and neither converts into the other.
    ///
    /// ```compile_fail,E0308
    /// use relay_core::time::Now;
    /// let now = Now::agreeing(1_000);
    /// let deadline = now.mono + 60_000;
    /// let late = now.wall > deadline; // a wall reading against a monotonic deadline
    /// ```
    ///
    /// ```compile_fail,E0308
    /// use relay_core::time::Now;
    /// let now = Now::agreeing(1_000);
    /// let sum = now.mono + now.wall;
    /// ```
    ///
    /// ```compile_fail,E0308
    /// use relay_core::time::Now;
    /// let now = Now::agreeing(1_000);
    /// let span = now.mono.since(now.wall);
    /// ```
    ///
    /// ```compile_fail,E0308
    /// use relay_core::time::{Mono, Wall};
    /// let wall: Wall = Mono::from_ms(1_000); // no conversion either way
    /// ```
    ///
    /// A span moves an instant along its own clock, and saturates rather than overflow:
    ///
    /// ```
    /// use relay_core::time::{Mono, SECOND};
    /// let start = Mono::from_ms(5 * SECOND);
    /// let deadline = start + 30 * SECOND;
    /// assert_eq!(deadline.since(start), 30 * SECOND);
    /// assert_eq!(start.since(deadline), 0);
    /// assert_eq!(Mono::from_ms(u64::MAX) + 1, Mono::from_ms(u64::MAX));
    /// ```
    Mono,
    "the clock's own origin"
);

instant!(
    /// An instant on a host's wall clock: milliseconds since 1970-01-01T00:00:00Z (UTC). It may
    /// step either way; on the relay side it stamps text and places schedules, never a deadline
    /// (see the [module doc](self)).
    Wall,
    "1970-01-01T00:00:00Z"
);

/// One reading of a host's two clocks, taken together, as every input of the relay machine
/// carries it.
///
/// Deadlines and timers run on `mono`: a clock that never steps (the shell reads one that also
/// counts time suspended, so that a lease does not outlive a laptop lid). `wall` only stamps
/// text (run records, context files, summaries, `describe`) and places schedules. A wall clock
/// stepped back or forward (an NTP correction, a VM restore, an operator's `date -s`) therefore
/// moves no deadline: a worker whose wall clock went back an hour still stops its agent when its
/// lease runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Now {
    pub mono: Mono,
    pub wall: Wall,
}

impl Now {
    /// Both clocks read `ms`: for tests and models in which the wall clock never steps.
    pub const fn agreeing(ms: Millis) -> Now {
        Now {
            mono: Mono(ms),
            wall: Wall(ms),
        }
    }

    /// The wall time at which the monotonic instant `mono` falls, judged from this reading (for
    /// text only: a later step of the wall clock makes it wrong, never the deadline itself).
    pub fn wall_at(self, mono: Mono) -> Wall {
        if mono >= self.mono {
            self.wall + mono.since(self.mono)
        } else {
            Wall(self.wall.0.saturating_sub(self.mono.since(mono)))
        }
    }
}

/// A span read from a clock, in whole milliseconds (saturating: no clock runs that long).
pub fn millis(span: std::time::Duration) -> Millis {
    u64::try_from(span.as_millis()).unwrap_or(Millis::MAX)
}

/// A source of wall time, as the shells read it: core takes `now` as a value, the shells get
/// it from a clock, so that tests drive the server and the daemon on a clock they move by hand
/// instead of sleeping. The queue server needs only this reading (lease times, every stamp), and
/// keeps it as the bare `Millis` its ledger stores (see the module doc).
pub trait WallClock: Send + Sync + 'static {
    /// Wall time, milliseconds since the Unix epoch. It may step either way.
    fn now(&self) -> Millis;
}

/// A wall and a monotonic reading: what the daemon needs. Its deadlines run on [`Clock::mono`],
/// which never steps, so a wall clock stepped back cannot keep an agent running past its lease.
pub trait Clock: WallClock {
    /// Monotonic time, from an origin of the clock's own. It never decreases.
    fn mono(&self) -> Mono;
    /// The wall reading ([`WallClock::now`]) as the relay side takes it.
    fn wall(&self) -> Wall {
        Wall(self.now())
    }
    /// Both readings, as the relay machine takes them.
    fn reading(&self) -> Now {
        Now {
            mono: self.mono(),
            wall: self.wall(),
        }
    }
}

/// A clock that moves only when a test moves it. Both readings start at `start` and move
/// together; [`ManualClock::step_wall`] steps the wall reading alone. Clones share one reading.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    mono: Arc<AtomicU64>,
    wall_offset: Arc<AtomicI64>,
}

impl ManualClock {
    pub fn new(start: Millis) -> ManualClock {
        ManualClock {
            mono: Arc::new(AtomicU64::new(start)),
            wall_offset: Arc::default(),
        }
    }
    pub fn advance(&self, by: Millis) {
        self.mono.fetch_add(by, Ordering::SeqCst);
    }
    /// Steps the wall clock by `by` ms, back or forward; the monotonic clock does not move.
    pub fn step_wall(&self, by: i64) {
        self.wall_offset.fetch_add(by, Ordering::SeqCst);
    }
}

impl WallClock for ManualClock {
    fn now(&self) -> Millis {
        self.mono
            .load(Ordering::SeqCst)
            .saturating_add_signed(self.wall_offset.load(Ordering::SeqCst))
    }
}

impl Clock for ManualClock {
    fn mono(&self) -> Mono {
        Mono(self.mono.load(Ordering::SeqCst))
    }
}

pub const SECOND: Millis = 1_000;
pub const MINUTE: Millis = 60 * SECOND;
pub const HOUR: Millis = 60 * MINUTE;
pub const DAY: Millis = 24 * HOUR;

/// Formats `ms` (milliseconds since the epoch) as RFC 3339 in UTC: `2026-09-22T15:32:00Z`, with
/// `.mmm` only when the milliseconds are not zero. It takes the number, as the ledger keeps its
/// stamps; a [`Wall`] comes as [`Wall::ms`].
pub fn rfc3339(ms: Millis) -> String {
    let secs = ms / SECOND;
    let millis = ms % SECOND;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days as i64);
    let (hh, mm, ss) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    let year = u64::try_from(y).ok().filter(|y| *y <= 9_999);
    let Some(year) = year else {
        return match millis {
            0 => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z"),
            _ => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{millis:03}Z"),
        };
    };
    // Digit by digit: every answer and record carries times, and `format!`'s padding machinery
    // was a twentieth of the simulator's time.
    let mut out = String::with_capacity(24);
    let parts = [
        (year, 4, '-'),
        (u64::from(m), 2, '-'),
        (u64::from(d), 2, 'T'),
        (hh, 2, ':'),
        (mm, 2, ':'),
        (ss, 2, if millis == 0 { 'Z' } else { '.' }),
    ];
    for (n, width, after) in parts {
        push_digits(&mut out, n, width);
        out.push(after);
    }
    if millis != 0 {
        push_digits(&mut out, millis, 3);
        out.push('Z');
    }
    out
}

/// Writes the last `width` decimal digits of `n`, zero-padded.
fn push_digits(out: &mut String, n: u64, width: u32) {
    for k in (0..width).rev() {
        out.push(char::from(b'0' + (n / 10u64.pow(k) % 10) as u8));
    }
}

/// Parses the RFC 3339 forms [`rfc3339`] writes (UTC `Z`, optional fraction of up to 9 digits,
/// truncated to milliseconds). Offsets other than `Z` are accepted as `+HH:MM` / `-HH:MM`.
pub fn parse_rfc3339(s: &str) -> Option<Millis> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b't') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> {
        let part = s.get(r)?;
        if part.bytes().all(|c| c.is_ascii_digit()) {
            part.parse().ok()
        } else {
            None
        }
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mi, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || d == 0 || d > days_in_month(y as i64, mo as u32) as u64 {
        return None;
    }
    if hh > 23 || mi > 59 || ss > 59 {
        return None;
    }
    let mut rest = &s[19..];
    let mut millis = 0u64;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 9 {
            return None;
        }
        let mut ms_digits: String = frac[..digits.min(3)].to_string();
        while ms_digits.len() < 3 {
            ms_digits.push('0');
        }
        millis = ms_digits.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset_secs: i64 = match rest {
        "Z" | "z" => 0,
        _ => {
            let ob = rest.as_bytes();
            if ob.len() != 6 || ob[3] != b':' || !(ob[0] == b'+' || ob[0] == b'-') {
                return None;
            }
            let oh: i64 = rest[1..3].parse().ok()?;
            let om: i64 = rest[4..6].parse().ok()?;
            if oh > 23 || om > 59 {
                return None;
            }
            let v = oh * 3600 + om * 60;
            if ob[0] == b'+' { v } else { -v }
        }
    };
    let days = days_from_civil(y as i64, mo as u32, d as u32);
    let secs = days * 86_400 + (hh * 3600 + mi * 60 + ss) as i64 - offset_secs;
    if secs < 0 {
        return None;
    }
    Some(secs as u64 * SECOND + millis)
}

/// A wall time that comes in as text (a peer's answer, a file): read once, at the edge, by
/// [`parse_rfc3339`] (any offset, `t`/`z` in either case, any fraction, surrounding blanks);
/// `None` when it is no such time.
pub fn read_wall_text(text: &str) -> Option<Wall> {
    parse_rfc3339(text.trim()).map(Wall)
}

/// Serde for an optional wall time carried as text: written strictly as [`rfc3339`] writes it
/// (or `null`), read as [`read_wall_text`] reads it (anything else, a non-string included, is
/// `None`). Use with `#[serde(with = "crate::time::wall_text")]`.
pub mod wall_text {
    use super::{Wall, read_wall_text, rfc3339};

    pub fn serialize<S: serde::Serializer>(t: &Option<Wall>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(wall) => s.serialize_str(&rfc3339(wall.ms())),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Wall>, D::Error> {
        let v: serde_json::Value = serde::Deserialize::deserialize(d)?;
        Ok(v.as_str().and_then(read_wall_text))
    }
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

pub(crate) fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if is_leap(y) => 29,
        _ => 28,
    }
}

// Howard Hinnant's civil-calendar algorithms (public domain), proleptic Gregorian.
pub(crate) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_790_000_000_000), "2026-09-21T14:13:20Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
    }

    #[test]
    fn parses_offsets_and_fractions() {
        assert_eq!(
            parse_rfc3339("2026-09-21T14:13:20Z"),
            Some(1_790_000_000_000)
        );
        assert_eq!(
            parse_rfc3339("2026-09-21T16:13:20+02:00"),
            Some(1_790_000_000_000)
        );
        assert_eq!(
            parse_rfc3339("2000-02-29T00:00:00.1239Z"),
            Some(951_782_400_123)
        );
        assert_eq!(parse_rfc3339("2001-02-29T00:00:00Z"), None);
        assert_eq!(parse_rfc3339("2026-09-22 14:13:20Z"), None);
        assert_eq!(parse_rfc3339("2026-09-22T14:13:20"), None);
    }

    #[test]
    fn instants_move_by_spans_and_saturate() {
        let now = Now::agreeing(10 * SECOND);
        let deadline = now.mono + MINUTE;
        assert_eq!(deadline.since(now.mono), MINUTE);
        assert_eq!(now.mono.since(deadline), 0, "a span is never negative");
        assert_eq!(Wall::from_ms(Millis::MAX) + 1, Wall::from_ms(Millis::MAX));
        assert_eq!(now.wall_at(deadline), now.wall + MINUTE);
        assert_eq!(now.wall_at(Mono::from_ms(4 * SECOND)).ms(), 4 * SECOND);
        let stepped = Now {
            wall: Wall::from_ms(SECOND),
            ..now
        };
        assert_eq!(
            stepped.wall_at(Mono::default()),
            Wall::default(),
            "saturates at the epoch"
        );
    }

    /// The digit writer answers what `format!` with padding answers, past year 9999 too.
    fn by_format(ms: Millis) -> String {
        let (secs, millis) = (ms / SECOND, ms % SECOND);
        let (y, m, d) = civil_from_days((secs / 86_400) as i64);
        let rem = secs % 86_400;
        let (hh, mm, ss) = (rem / 3600, (rem % 3600) / 60, rem % 60);
        match millis {
            0 => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z"),
            _ => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{millis:03}Z"),
        }
    }

    proptest! {
        #[test]
        fn round_trips(ms in 0u64..253_402_300_799_999) {
            prop_assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms));
        }

        #[test]
        fn writes_what_format_writes(ms in 0u64..400_000_000_000_000) {
            prop_assert_eq!(rfc3339(ms), by_format(ms));
        }
    }
}
