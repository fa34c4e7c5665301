//! Operating hours: the weekly windows in which a harness may start a run.
//!
//! A window is written `[DAYS] HH:MM-HH:MM [OFFSET]`:
//! - `DAYS`: comma list of day names or ranges (`mon-fri`, `sat,sun`, `fri-mon` wraps); omitted
//!   means every day. The days name the day a window *starts* on.
//! - `HH:MM-HH:MM`: start inclusive, end exclusive, minute precision; `24:00` may end a window.
//!   A window whose end is before its start crosses midnight (`fri 22:00-02:00` runs into Saturday).
//! - `OFFSET`: `UTC`, `Z`, or a fixed `+HH:MM` / `-HH:MM` offset from UTC; omitted means UTC.
//!   Fixed offsets do not follow daylight saving time.

use crate::time::{DAY, MINUTE, Millis, Wall};
use std::fmt;

const DAY_NAMES: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];
const MINUTES_PER_DAY: u32 = 24 * 60;

/// The union of one or more windows; a time inside any window is inside the hours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatingHours {
    windows: Vec<Window>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Window {
    text: String,
    /// Bit `d` set: the window starts on weekday `d` (0 = Sunday), in the window's own offset.
    days: u8,
    start: u32,
    end: u32,
    offset_minutes: i32,
}

impl OperatingHours {
    /// Parses each window (format in the module doc); the error carries the index of
    /// the window that failed.
    pub fn parse<S: AsRef<str>>(windows: &[S]) -> Result<OperatingHours, (usize, String)> {
        let mut out = Vec::with_capacity(windows.len());
        for (i, w) in windows.iter().enumerate() {
            out.push(Self::parse_window(w.as_ref()).map_err(|e| (i, e))?);
        }
        Ok(OperatingHours { windows: out })
    }

    fn parse_window(text: &str) -> Result<Window, String> {
        let mut tokens: Vec<&str> = text.split_whitespace().collect();
        let mut offset_minutes = 0;
        if let Some(last) = tokens.last()
            && let Some(off) = parse_offset(last)?
        {
            offset_minutes = off;
            tokens.pop();
        }
        let (days, range) = match tokens.as_slice() {
            [range] => (0x7f, *range),
            [days, range] => (parse_days(days)?, *range),
            _ => {
                return Err("is not a window: write [DAYS] HH:MM-HH:MM [OFFSET], e.g. \
                     \"mon-fri 09:00-18:00 +02:00\""
                    .to_string());
            }
        };
        let Some((a, b)) = range.split_once('-') else {
            return Err(format!("has {range:?} where HH:MM-HH:MM was expected"));
        };
        let (start, end) = (parse_clock(a)?, parse_clock(b)?);
        if start == MINUTES_PER_DAY {
            return Err("starts at 24:00: start the window at 00:00 instead".to_string());
        }
        if start == end {
            return Err(
                "starts and ends at the same time: for the whole day write 00:00-24:00".to_string(),
            );
        }
        Ok(Window {
            text: text.to_string(),
            days,
            start,
            end,
            offset_minutes,
        })
    }

    /// True when `now` falls inside any window.
    pub fn contains(&self, now: Wall) -> bool {
        self.windows.iter().any(|w| w.contains(now.ms()))
    }
}

/// Whether a firing at wall time `now` may start a run under `hours` (`None`: no restriction).
/// The daemon and the simulator both ask this; the machine skips or holds a firing outside.
pub fn within_hours(hours: Option<&OperatingHours>, now: Wall) -> bool {
    hours.is_none_or(|h| h.contains(now))
}

impl fmt::Display for OperatingHours {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let texts: Vec<&str> = self.windows.iter().map(|w| w.text.as_str()).collect();
        f.write_str(&texts.join(", "))
    }
}

impl Window {
    fn contains(&self, now: Millis) -> bool {
        let local = i128::from(now) + i128::from(self.offset_minutes) * i128::from(MINUTE);
        let day = local.div_euclid(i128::from(DAY));
        let minute = (local.rem_euclid(i128::from(DAY)) / i128::from(MINUTE)) as u32;
        let weekday = (day + 4).rem_euclid(7) as u32; // 1970-01-01 was a Thursday
        let yesterday = (weekday + 6) % 7;
        let starts = |d: u32| self.days & (1 << d) != 0;
        if self.start < self.end {
            starts(weekday) && self.start <= minute && minute < self.end
        } else {
            (starts(weekday) && minute >= self.start) || (starts(yesterday) && minute < self.end)
        }
    }
}

fn parse_offset(tok: &str) -> Result<Option<i32>, String> {
    if tok.eq_ignore_ascii_case("utc") || tok == "Z" {
        return Ok(Some(0));
    }
    let sign = match tok.as_bytes().first() {
        Some(b'+') => 1,
        Some(b'-') => -1,
        _ => return Ok(None),
    };
    let bad = || format!("has the offset {tok:?}: write it as +HH:MM or -HH:MM, e.g. +02:00");
    let (h, m) = tok[1..].split_once(':').ok_or_else(bad)?;
    let two_digits = |s: &str| s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit());
    if !two_digits(h) || !two_digits(m) {
        return Err(bad());
    }
    let (h, m): (i32, i32) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
    if h > 14 || m > 59 {
        return Err(bad());
    }
    Ok(Some(sign * (h * 60 + m)))
}

fn parse_clock(s: &str) -> Result<u32, String> {
    let bad = || format!("has the time {s:?}: write HH:MM from 00:00 to 24:00");
    let (h, m) = s.split_once(':').ok_or_else(bad)?;
    let digits = |t: &str, n: std::ops::RangeInclusive<usize>| {
        n.contains(&t.len()) && t.bytes().all(|b| b.is_ascii_digit())
    };
    if !digits(h, 1..=2) || !digits(m, 2..=2) {
        return Err(bad());
    }
    let (h, m): (u32, u32) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
    if m > 59 || h > 24 || (h == 24 && m != 0) {
        return Err(bad());
    }
    Ok(h * 60 + m)
}

fn parse_days(s: &str) -> Result<u8, String> {
    let day = |t: &str| {
        let lower = t.to_ascii_lowercase();
        DAY_NAMES
            .iter()
            .position(|n| *n == lower)
            .map(|i| i as u32)
            .ok_or_else(|| format!("has the day {t:?}: use sun, mon, tue, wed, thu, fri or sat"))
    };
    let mut bits = 0u8;
    for item in s.split(',') {
        match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (day(a)?, day(b)?);
                // A range may wrap past Saturday: fri-mon is fri, sat, sun, mon.
                let mut d = a;
                loop {
                    bits |= 1 << d;
                    if d == b {
                        break;
                    }
                    d = (d + 1) % 7;
                }
            }
            None => bits |= 1 << day(item)?,
        }
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::read_wall_text;

    fn hours(ws: &[&str]) -> OperatingHours {
        OperatingHours::parse(ws).unwrap()
    }

    fn inside(h: &OperatingHours, t: &str) -> bool {
        h.contains(read_wall_text(t).unwrap())
    }

    #[test]
    fn operating_hours_weekdays() {
        // 2026-09-22 is a Tuesday; 2026-09-26 a Saturday.
        let h = hours(&["mon-fri 09:00-18:00"]);
        assert!(inside(&h, "2026-09-22T09:00:00Z"));
        assert!(inside(&h, "2026-09-22T17:59:59.999Z"));
        assert!(!inside(&h, "2026-09-22T18:00:00Z"));
        assert!(!inside(&h, "2026-09-22T08:59:59Z"));
        assert!(!inside(&h, "2026-09-26T12:00:00Z"));
    }

    #[test]
    fn operating_hours_crossing_midnight() {
        let h = hours(&["fri 22:00-02:00"]);
        assert!(inside(&h, "2026-09-25T22:00:00Z")); // Friday night
        assert!(inside(&h, "2026-09-26T01:59:00Z")); // Saturday small hours
        assert!(!inside(&h, "2026-09-26T02:00:00Z"));
        assert!(!inside(&h, "2026-09-26T23:00:00Z")); // Saturday night: not a start day
        assert!(!inside(&h, "2026-09-25T01:00:00Z")); // Friday small hours belong to Thursday
    }

    #[test]
    fn operating_hours_offsets_and_unions() {
        // 09:00-18:00 at +02:00 is 07:00-16:00 UTC.
        let h = hours(&["mon-fri 09:00-18:00 +02:00"]);
        assert!(inside(&h, "2026-09-22T07:00:00Z"));
        assert!(!inside(&h, "2026-09-22T16:00:00Z"));
        // Monday 00:30 at +02:00 is Sunday 22:30 UTC.
        let h = hours(&["mon 00:00-01:00 +02:00"]);
        assert!(inside(&h, "2026-09-27T22:30:00Z"));
        let h = hours(&["sat,sun 10:00-12:00", "mon-fri 20:00-24:00 UTC"]);
        assert!(inside(&h, "2026-09-26T11:00:00Z"));
        assert!(inside(&h, "2026-09-22T23:59:00Z"));
        assert!(!inside(&h, "2026-09-22T11:00:00Z"));
        let h = hours(&["fri-mon 00:00-24:00 -05:00"]);
        assert!(inside(&h, "2026-09-22T04:59:00Z")); // still Monday at -05:00
        assert!(!inside(&h, "2026-09-22T05:00:00Z"));
        assert!(hours(&["00:00-24:00"]).contains(Wall::default()));
        assert!(hours(&["23:00-01:00 -01:00"]).contains(Wall::default()));
    }

    #[test]
    fn operating_hours_rejects_garbage() {
        for bad in [
            "",
            "mon-fri",
            "9-5",
            "mon-fri 09:00-09:00",
            "mon-fry 09:00-18:00",
            "09:00-25:00",
            "24:00-02:00",
            "09:0-10:00",
            "mon 09:00-18:00 +2",
            "09:00-18:00 +15:00",
            "mon fri 09:00-18:00",
            "09:00-18:00 CEST",
        ] {
            assert!(OperatingHours::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
