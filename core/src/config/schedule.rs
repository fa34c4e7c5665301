//! When a scheduled harness fires: `@every <duration>` or a five-field cron expression, in UTC.

use super::duration::{format_duration, parse_duration};
use crate::time::{DAY, HOUR, MINUTE, Millis, SECOND, Wall, civil_from_days, days_from_civil};
use std::fmt;

/// A harness's `schedule`. Both forms are fixed grids in time, so a slot missed while the daemon
/// was down is simply a grid point in the past, and `catch_up` can find it the same way for both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schedule {
    /// Every multiple of the interval since the Unix epoch (so `@every 30m` fires at :00 and :30
    /// UTC, whenever the daemon started).
    Every(Millis),
    Cron(Cron),
}

impl Schedule {
    /// Parses `@every <duration>` (at least 1s), a cron macro (`@hourly`, `@daily`/`@midnight`,
    /// `@weekly`, `@monthly`, `@yearly`/`@annually`) or a five-field cron expression.
    pub fn parse(text: &str) -> Result<Schedule, String> {
        if let Some(rest) = text.strip_prefix("@every") {
            let d = rest.trim();
            if d.is_empty() || !rest.starts_with(char::is_whitespace) {
                return Err("needs a duration after @every, e.g. \"@every 30m\"".to_string());
            }
            let ms = parse_duration(d)
                .map_err(|e| format!("has the @every duration {d:?}, which {e}"))?;
            if ms < SECOND {
                return Err("has an @every interval below 1s: use at least 1s".to_string());
            }
            return Ok(Schedule::Every(ms));
        }
        let expanded = match text {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            t if t.starts_with('@') => {
                return Err(
                    "is not a known schedule: use \"@every <duration>\", @hourly, @daily, \
                            @weekly, @monthly, @yearly or a five-field cron expression"
                        .to_string(),
                );
            }
            t => t,
        };
        Cron::parse(expanded).map(|mut c| {
            c.text = text.to_string();
            Schedule::Cron(c)
        })
    }

    /// The first slot strictly after `last` (when the harness last ran) that is not after
    /// `now`: a firing owed while nothing ran. `None` when no slot fell in between.
    pub fn missed_since(&self, last: Wall, now: Wall) -> Option<Wall> {
        let slot = self.next_after(last);
        (slot <= now).then_some(slot)
    }

    /// The first firing time strictly after `now`. `Millis::MAX` ms after the epoch means
    /// "never", which parsing rules out, so callers may treat it as unreachable.
    pub fn next_after(&self, now: Wall) -> Wall {
        match self {
            Schedule::Every(every) => Wall::from_ms(
                now.ms()
                    .checked_div(*every)
                    .and_then(|n| n.checked_add(1))
                    .and_then(|n| n.checked_mul(*every))
                    .unwrap_or(Millis::MAX),
            ),
            Schedule::Cron(cron) => cron.next_after(now),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Every(ms) => write!(f, "@every {}", format_duration(*ms)),
            Schedule::Cron(c) => f.write_str(&c.text),
        }
    }
}

/// A parsed cron expression: one bit per allowed value of each field, evaluated in UTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    text: String,
    minutes: u64,
    hours: u32,
    days_of_month: u32,
    months: u16,
    days_of_week: u8,
    // A field written starting with `*` does not restrict the day for the OR rule (as Vixie cron).
    dom_star: bool,
    dow_star: bool,
}

struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const MONTH_NAMES: &[&str] = &[
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAY_NAMES: &[&str] = &["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

const FIELDS: [Field; 5] = [
    Field {
        name: "minute",
        min: 0,
        max: 59,
        names: &[],
    },
    Field {
        name: "hour",
        min: 0,
        max: 23,
        names: &[],
    },
    Field {
        name: "day-of-month",
        min: 1,
        max: 31,
        names: &[],
    },
    Field {
        name: "month",
        min: 1,
        max: 12,
        names: MONTH_NAMES,
    },
    // 7 is accepted as another Sunday, as most crons do.
    Field {
        name: "day-of-week",
        min: 0,
        max: 7,
        names: DAY_NAMES,
    },
];

impl Field {
    fn value(&self, s: &str) -> Result<u32, String> {
        let lower = s.to_ascii_lowercase();
        if let Some(i) = self.names.iter().position(|n| *n == lower) {
            // Month names count from 1, day names from 0 (sun).
            return Ok(i as u32 + self.min);
        }
        let n: u32 = s
            .parse()
            .ok()
            .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| {
                let names = if self.names.is_empty() {
                    ""
                } else {
                    " or a name such as "
                };
                let example = self.names.get(1).copied().unwrap_or("");
                format!(
                    "has {s:?} in the {} field: use a number from {} to {}{names}{example}",
                    self.name, self.min, self.max
                )
            })?;
        if n < self.min || n > self.max {
            return Err(format!(
                "has {n} in the {} field: use a number from {} to {}",
                self.name, self.min, self.max
            ));
        }
        Ok(n)
    }

    /// Returns the bit set of the field and whether it starts with `*`.
    fn parse(&self, text: &str) -> Result<(u64, bool), String> {
        let mut bits = 0u64;
        for item in text.split(',') {
            let (range, step) = match item.split_once('/') {
                Some((r, s)) => {
                    let step: u32 = s.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        format!(
                            "has the step {s:?} in the {} field: use a whole number above 0",
                            self.name
                        )
                    })?;
                    (r, step)
                }
                None => (item, 1),
            };
            let (lo, hi) = if range == "*" {
                (self.min, self.max)
            } else if let Some((a, b)) = range.split_once('-') {
                let (a, mut b) = (self.value(a)?, self.value(b)?);
                if self.max == 7 && b == 0 && a > 0 {
                    b = 7; // `fri-sun`: Sunday closes a range as 7
                }
                if a > b {
                    return Err(format!(
                        "has the range {range:?} in the {} field, which runs backwards: write the \
                         smaller value first",
                        self.name
                    ));
                }
                (a, b)
            } else if range.is_empty() {
                return Err(format!(
                    "has an empty list item in the {} field: remove the extra comma",
                    self.name
                ));
            } else {
                let a = self.value(range)?;
                // `a/n` means from a to the end of the field, stepping by n.
                (a, if item.contains('/') { self.max } else { a })
            };
            for v in (lo..=hi).step_by(step as usize) {
                bits |= 1 << v;
            }
        }
        Ok((bits, text.starts_with('*')))
    }
}

impl Cron {
    /// Parses `minute hour day-of-month month day-of-week`, each field `*`, a value, a range
    /// `a-b`, a step `*/n`, `a-b/n` or `a/n`, or a comma list of those. Months and days of the week
    /// take names (`jan`, `mon`). When both day fields are restricted, a day matching either fires.
    pub fn parse(text: &str) -> Result<Cron, String> {
        let parts: Vec<&str> = text.split_whitespace().collect();
        if parts.len() != 5 {
            return Err(format!(
                "has {} fields; a cron expression has 5: minute hour day-of-month month \
                 day-of-week (or use \"@every <duration>\")",
                parts.len()
            ));
        }
        let mut fields = [(0u64, false); 5];
        for (i, (field, part)) in FIELDS.iter().zip(&parts).enumerate() {
            fields[i] = field.parse(part)?;
        }
        let mut dow = fields[4].0;
        if dow & (1 << 7) != 0 {
            dow = (dow | 1) & 0x7f;
        }
        let cron = Cron {
            text: text.to_string(),
            minutes: fields[0].0,
            hours: fields[1].0 as u32,
            days_of_month: fields[2].0 as u32,
            months: fields[3].0 as u16,
            days_of_week: dow as u8,
            dom_star: fields[2].1,
            dow_star: fields[4].1,
        };
        // A day-of-month that no chosen month has (e.g. 30 in February) would never fire.
        let uses_dom_only = cron.dom_star || cron.dow_star;
        if uses_dom_only && !(1..=12u32).any(|m| cron.month_has_a_day(m)) {
            return Err(
                "never fires: no chosen month has the chosen day-of-month; change the \
                 day-of-month or month field"
                    .to_string(),
            );
        }
        Ok(cron)
    }

    fn month_has_a_day(&self, m: u32) -> bool {
        // 2000 is a leap year, so February counts its 29th.
        self.months & (1 << m) != 0
            && (1..=crate::time::days_in_month(2000, m)).any(|d| self.days_of_month & (1 << d) != 0)
    }

    fn day_matches(&self, day_of_month: u32, weekday: u32) -> bool {
        let dom = self.days_of_month & (1 << day_of_month) != 0;
        let dow = self.days_of_week & (1 << weekday) != 0;
        if self.dom_star || self.dow_star {
            dom && dow
        } else {
            dom || dow
        }
    }

    /// The first whole minute strictly after `now` that the expression matches, in UTC.
    pub fn next_after(&self, now: Wall) -> Wall {
        Wall::from_ms(self.search(now.ms()).unwrap_or(Millis::MAX))
    }

    // `None` when the answer would not fit in a `Millis`.
    fn search(&self, now: Millis) -> Option<Millis> {
        let mut t = (now / MINUTE + 1).checked_mul(MINUTE)?;
        // Each step moves to the next month, day, hour or minute; parsing guarantees a match
        // within a few years (29 February under an 8-year gap at most), far below this bound.
        for _ in 0..200_000 {
            let days = t / DAY;
            let (y, m, d) = civil_from_days(days as i64);
            if self.months & (1 << m) == 0 {
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                t = (days_from_civil(ny, nm, 1) as Millis).checked_mul(DAY)?;
                continue;
            }
            let weekday = ((days + 4) % 7) as u32; // 1970-01-01 was a Thursday
            if !self.day_matches(d, weekday) {
                t = (days + 1).checked_mul(DAY)?;
                continue;
            }
            let hour = (t % DAY) / HOUR;
            if self.hours & (1 << hour) == 0 {
                t = (t / HOUR + 1).checked_mul(HOUR)?;
                continue;
            }
            let minute = (t % HOUR) / MINUTE;
            if self.minutes & (1 << minute) == 0 {
                t = t.checked_add(MINUTE)?;
                continue;
            }
            return Some(t);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::{read_wall_text, rfc3339};
    use proptest::prelude::*;

    fn at(s: &str) -> Wall {
        read_wall_text(s).unwrap()
    }

    fn next(expr: &str, now: &str) -> String {
        rfc3339(Schedule::parse(expr).unwrap().next_after(at(now)).ms())
    }

    #[test]
    fn cron_next_after_known_instants() {
        // 2026-09-22 is a Tuesday.
        assert_eq!(
            next("*/15 * * * *", "2026-09-22T15:32:10Z"),
            "2026-09-22T15:45:00Z"
        );
        assert_eq!(
            next("0 9 * * mon-fri", "2026-09-22T15:32:00Z"),
            "2026-09-23T09:00:00Z"
        );
        assert_eq!(
            next("0 9 * * mon-fri", "2026-09-25T09:00:00Z"),
            "2026-09-28T09:00:00Z"
        );
        assert_eq!(
            next("30 2 1 jan *", "2026-09-22T00:00:00Z"),
            "2027-01-01T02:30:00Z"
        );
        assert_eq!(
            next("0 0 29 2 *", "2026-03-01T00:00:00Z"),
            "2028-02-29T00:00:00Z"
        );
        assert_eq!(
            next("0 0 * * 7", "2026-09-22T00:00:00Z"),
            "2026-09-27T00:00:00Z"
        );
        assert_eq!(
            next("5,10 1-3/2 * * *", "2026-09-22T01:10:00Z"),
            "2026-09-22T03:05:00Z"
        );
        assert_eq!(
            next("@daily", "2026-09-22T23:59:59.999Z"),
            "2026-09-23T00:00:00Z"
        );
        assert_eq!(
            next("59 23 31 12 *", "2026-12-31T23:59:00Z"),
            "2027-12-31T23:59:00Z"
        );
        // Both day fields restricted: the 1st of the month OR a Friday.
        assert_eq!(
            next("0 12 1 * fri", "2026-09-22T00:00:00Z"),
            "2026-09-25T12:00:00Z"
        );
        assert_eq!(
            next("0 12 1 * fri", "2026-09-26T00:00:00Z"),
            "2026-10-01T12:00:00Z"
        );
        // A starred day-of-week keeps AND semantics: the 13th only when it is a Sunday.
        assert_eq!(
            next("0 0 13 * */7", "2026-09-22T00:00:00Z"),
            "2026-12-13T00:00:00Z"
        );
        assert_eq!(
            next("0 8 * * fri-sun", "2026-09-22T00:00:00Z"),
            "2026-09-25T08:00:00Z"
        );
    }

    #[test]
    fn every_next_after_is_aligned_to_the_epoch() {
        let s = Schedule::parse("@every 30m").unwrap();
        assert_eq!(s, Schedule::Every(30 * MINUTE));
        assert_eq!(
            rfc3339(s.next_after(at("2026-09-22T15:32:00Z")).ms()),
            "2026-09-22T16:00:00Z"
        );
        assert_eq!(
            rfc3339(s.next_after(at("2026-09-22T16:00:00Z")).ms()),
            "2026-09-22T16:30:00Z"
        );
        let never = Wall::from_ms(Millis::MAX);
        assert_eq!(s.next_after(never), never);
        assert_eq!(Schedule::Every(0).next_after(Wall::from_ms(5)), never);
        let cron = Schedule::parse("*/5 * * * *").unwrap();
        assert_eq!(cron.next_after(never), never);
        let late = Wall::from_ms(Millis::MAX - 2 * DAY);
        assert!(cron.next_after(late) > late);
        assert_eq!(
            Schedule::parse("*/4294967295 * * * *")
                .unwrap()
                .next_after(Wall::default()),
            Wall::from_ms(HOUR)
        );
        assert_eq!(s.to_string(), "@every 30m");
    }

    /// A direct, non-skipping matcher to check the search against.
    fn matches(c: &Cron, t: Millis) -> bool {
        let days = t / DAY;
        let (_, m, d) = civil_from_days(days as i64);
        c.months & (1 << m) != 0
            && c.day_matches(d, ((days + 4) % 7) as u32)
            && c.hours & (1 << ((t % DAY) / HOUR)) != 0
            && c.minutes & (1 << ((t % HOUR) / MINUTE)) != 0
    }

    proptest! {
        #[test]
        fn cron_next_after_is_the_first_match(
            minute in prop::sample::select(vec!["*", "0", "*/7", "5,35", "10-20/5", "59"]),
            hour in prop::sample::select(vec!["*", "0", "9-17", "*/6", "23"]),
            dom in prop::sample::select(vec!["*", "1", "15", "29", "31", "1-7", "*/10"]),
            month in prop::sample::select(vec!["*", "feb", "1,7", "jun-aug", "*/5"]),
            dow in prop::sample::select(vec!["*", "mon-fri", "sun", "6", "*/3"]),
            now in 0u64..4_102_444_800_000,
        ) {
            let expr = format!("{minute} {hour} {dom} {month} {dow}");
            let Ok(Schedule::Cron(cron)) = Schedule::parse(&expr) else {
                return Ok(()); // combinations that never fire are refused at parse
            };
            let next = cron.next_after(Wall::from_ms(now)).ms();
            prop_assert!(next > now && next % MINUTE == 0, "{expr}");
            prop_assert!(matches(&cron, next), "{expr}: {} does not match", rfc3339(next));
            // No earlier minute matches (checked where the gap is small enough to walk).
            if next - now <= 40 * DAY {
                let mut t = (now / MINUTE + 1) * MINUTE;
                while t < next {
                    prop_assert!(!matches(&cron, t), "{expr}: skipped {}", rfc3339(t));
                    t += MINUTE;
                }
            }
        }
    }

    #[test]
    fn invalid_cron_names_the_field() {
        for (expr, field) in [
            ("60 * * * *", "minute"),
            ("* 24 * * *", "hour"),
            ("* * 0 * *", "day-of-month"),
            ("* * * 13 *", "month"),
            ("* * * * 8", "day-of-week"),
            ("* * * * mon-xyz", "day-of-week"),
            ("*/0 * * * *", "minute"),
            ("5-1 * * * *", "minute"),
            ("* * * foo *", "month"),
            ("1,,2 * * * *", "minute"),
        ] {
            let err = Schedule::parse(expr).unwrap_err();
            assert!(err.contains(field), "{expr}: {err}");
        }
        assert!(Schedule::parse("* * * *").unwrap_err().contains("5"));
        assert!(
            Schedule::parse("0 0 30 feb *")
                .unwrap_err()
                .contains("never")
        );
        assert!(Schedule::parse("@every").is_err());
        assert!(Schedule::parse("@every 0s").is_err());
        assert!(Schedule::parse("@every soon").is_err());
        assert!(Schedule::parse("@fortnightly").is_err());
    }
}
