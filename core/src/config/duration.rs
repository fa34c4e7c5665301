//! Durations as operators write them: `"30s"`, `"5m"`, `"1h30m"`, `"7d"`, `"500ms"`.

use crate::time::{DAY, HOUR, MINUTE, Millis, SECOND};
use std::fmt;

/// Units from largest to smallest; a duration string must use them in this order.
const UNITS: [(&str, Millis); 5] = [
    ("d", DAY),
    ("h", HOUR),
    ("m", MINUTE),
    ("s", SECOND),
    ("ms", 1),
];

/// Why a duration string was refused. The message never repeats more than the offending piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError(pub String);

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DurationError {}

const HINT: &str = "write whole numbers with units d, h, m, s or ms, largest first, e.g. \"1h30m\"";

/// Parses a duration such as `"1h30m"` or `"500ms"` into milliseconds.
///
/// Each part is a whole number followed by a unit (`d`, `h`, `m`, `s`, `ms`); units appear at
/// most once and largest first, so `"90m"` and `"1h30m"` are both fine but `"30m1h"` is not.
/// Zero (`"0s"`) parses; keys that need a positive duration check that themselves.
pub fn parse_duration(text: &str) -> Result<Millis, DurationError> {
    if text.is_empty() {
        return Err(DurationError(format!("is empty: {HINT}")));
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut total: Millis = 0;
    // Index into UNITS of the last unit used; the next must come strictly after it.
    let mut last_unit: Option<usize> = None;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return Err(DurationError(format!(
                "is not a duration (expected a number at position {}): {HINT}",
                start + 1
            )));
        }
        let number: Millis = text[start..i]
            .parse()
            .map_err(|_| DurationError("is too large".to_string()))?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit = &text[unit_start..i];
        if unit.is_empty() {
            let what = if i < bytes.len() && bytes[i] == b'.' {
                "has a fraction"
            } else {
                "has a number without a unit"
            };
            return Err(DurationError(format!("{what}: {HINT}")));
        }
        let Some(idx) = UNITS.iter().position(|(u, _)| *u == unit) else {
            return Err(DurationError(format!(
                "has an unknown unit {unit:?}: {HINT}"
            )));
        };
        if last_unit.is_some_and(|last| idx <= last) {
            return Err(DurationError(format!(
                "repeats a unit or puts a smaller unit first: {HINT}"
            )));
        }
        last_unit = Some(idx);
        total = number
            .checked_mul(UNITS[idx].1)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| DurationError("is too large".to_string()))?;
    }
    Ok(total)
}

/// Formats milliseconds the way [`parse_duration`] reads them, e.g. `150000` as `"2m30s"`.
pub fn format_duration(ms: Millis) -> String {
    if ms == 0 {
        return "0s".to_string();
    }
    let mut rest = ms;
    let mut out = String::new();
    for (unit, size) in UNITS {
        let n = rest / size;
        if n > 0 {
            out.push_str(&n.to_string());
            out.push_str(unit);
            rest %= size;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn duration_parsing() {
        assert_eq!(parse_duration("30s"), Ok(30 * SECOND));
        assert_eq!(parse_duration("5m"), Ok(5 * MINUTE));
        assert_eq!(parse_duration("1h"), Ok(HOUR));
        assert_eq!(parse_duration("7d"), Ok(7 * DAY));
        assert_eq!(parse_duration("1h30m"), Ok(90 * MINUTE));
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("1m500ms"), Ok(MINUTE + 500));
        assert_eq!(parse_duration("90m"), Ok(90 * MINUTE));
        assert_eq!(parse_duration("0s"), Ok(0));
        for bad in [
            "",
            "30",
            "5 m",
            "1.5h",
            "5min",
            "m",
            "30m1h",
            "1h1h",
            "-5m",
            "5M",
            " 5m",
            "1w",
            "99999999999999999999s",
            "9999999999999999d",
        ] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.0.len() > 5, "{bad}: {err}");
        }
        assert!(parse_duration("1.5h").unwrap_err().0.contains("fraction"));
        assert!(parse_duration("5min").unwrap_err().0.contains("\"min\""));
    }

    #[test]
    fn duration_formatting() {
        assert_eq!(format_duration(150_000), "2m30s");
        assert_eq!(format_duration(0), "0s");
        assert_eq!(format_duration(DAY + 500), "1d500ms");
    }

    proptest! {
        #[test]
        fn duration_round_trips(ms in 0u64..u64::MAX / 2) {
            prop_assert_eq!(parse_duration(&format_duration(ms)), Ok(ms));
        }

        #[test]
        fn duration_never_panics(s in ".{0,24}") {
            let _ = parse_duration(&s);
        }
    }
}
