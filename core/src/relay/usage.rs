//! What an attempt spends, and what its todo may still spend: the usage file the agent rewrites
//! (`HARNESS_USAGE_FILE`), read by the driver before every heartbeat and report and parsed here,
//! and the budget left (`HARNESS_BUDGET_REMAINING`), computed from the claim answer's todo.
//!
//! Both are read liberally: a usage file that cannot be used is not sent (the server keeps the
//! highest figures it was told, so nothing is lost by skipping one reading) and is said once per
//! attempt in the run log; a claim answer without a usable budget gives no variable. Neither ever
//! quotes the file's content: an agent may have written anything there.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::ledger::USAGE_MAX;
use crate::wire::UsageArg;

/// The driver reads at most this much of the usage file (one byte more, to tell a longer file).
pub const USAGE_FILE_MAX_BYTES: usize = 4 * 1024;

/// Why a usage file's content is not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsageProblem {
    /// Longer than [`USAGE_FILE_MAX_BYTES`].
    TooLong,
    NotJson,
    NotAnObject,
    /// This figure is not a number the server accepts: a non-negative, finite number of dollars
    /// (at most 2^53 millionths), or a whole number of tokens from 0 to 2^53.
    Figure(&'static str),
}

impl std::fmt::Display for UsageProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UsageProblem::TooLong => write!(f, "is longer than {USAGE_FILE_MAX_BYTES} bytes"),
            UsageProblem::NotJson => f.write_str("is not JSON"),
            UsageProblem::NotAnObject => f.write_str("is not a JSON object"),
            UsageProblem::Figure("cost_usd") => {
                f.write_str("has a cost_usd that is not a number of dollars from 0 to 9 billion")
            }
            UsageProblem::Figure(name) => {
                write!(f, "has an {name} that is not a whole number from 0 to 2^53")
            }
        }
    }
}

/// The figures the usage file may hold; any other key is ignored.
const FIGURES: [&str; 3] = ["cost_usd", "input_tokens", "output_tokens"];

/// Reads the usage file's content: `Ok(None)` when it holds nothing to send (empty, blank, or an
/// object without any of the figures, as the daemon creates it), the usage when every figure
/// present is one the server accepts, or why not. A figure that is `null` is absent; keys
/// other than the three figures are ignored.
pub fn parse_usage(bytes: &[u8]) -> Result<Option<UsageArg>, UsageProblem> {
    if bytes.len() > USAGE_FILE_MAX_BYTES {
        return Err(UsageProblem::TooLong);
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|_| UsageProblem::NotJson)?;
    let Value::Object(obj) = value else {
        return Err(UsageProblem::NotAnObject);
    };
    let figure = |name: &'static str| match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => Some(v).map(|v| read_figure(name, v)).transpose(),
    };
    let [cost, input, output] = FIGURES;
    let usage = UsageArg {
        cost_usd: figure(cost)?.map(|f| f.0),
        input_tokens: figure(input)?.map(|f| f.1),
        output_tokens: figure(output)?.map(|f| f.1),
    };
    if usage == UsageArg::default() {
        return Ok(None);
    }
    Ok(Some(usage))
}

/// One figure, as dollars (`.0`) for `cost_usd` and as tokens (`.1`) for the others, held to
/// the server's own rule ([`UsageArg::to_usage`]).
fn read_figure(name: &'static str, v: &Value) -> Result<(f64, u64), UsageProblem> {
    let bad = UsageProblem::Figure(name);
    let n = v.as_f64().ok_or(bad)?;
    if name == "cost_usd" {
        let alone = UsageArg {
            cost_usd: Some(n),
            ..UsageArg::default()
        };
        alone.to_usage("usage").map_err(|_| bad)?;
        return Ok((n, 0));
    }
    // A whole number written as `1200.0` or `1.2e3` is still a whole number.
    let whole = v
        .as_u64()
        .or_else(|| (n >= 0.0 && n.fract() == 0.0 && n <= USAGE_MAX as f64).then_some(n as u64))
        .filter(|t| *t <= USAGE_MAX)
        .ok_or(bad)?;
    Ok((n, whole))
}

/// The reading of one attempt's usage file, across its heartbeats and report: what to send
/// each time, and a warning the first time the file cannot be used (never again for the
/// attempt, so that a file that stays broken does not fill the run log).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageFile {
    warned: bool,
}

impl UsageFile {
    /// `read` is what the driver got from the file: its first [`USAGE_FILE_MAX_BYTES`] + 1
    /// bytes, `Ok(None)` when it does not exist, or the reason it could not be read (a
    /// description that names no content). Answers the usage to send, and the warning to
    /// write to the run log, if any.
    pub fn read(
        &mut self,
        read: Result<Option<Vec<u8>>, String>,
    ) -> (Option<UsageArg>, Option<String>) {
        let problem = match read {
            Ok(None) => return (None, None),
            Ok(Some(bytes)) => match parse_usage(&bytes) {
                Ok(usage) => return (usage, None),
                Err(problem) => problem.to_string(),
            },
            Err(why) => format!("could not be read ({why})"),
        };
        if std::mem::replace(&mut self.warned, true) {
            return (None, None);
        }
        let warning = format!(
            "the usage file (HARNESS_USAGE_FILE) {problem}: no usage is sent while it stays so. \
             Write a JSON object such as {{\"cost_usd\": 0.42, \"input_tokens\": 1200, \
             \"output_tokens\": 300}} (this warning is not repeated for this attempt)"
        );
        (None, Some(warning))
    }
}

/// What the todo may still spend, as `HARNESS_BUDGET_REMAINING` shows it: each limit the todo's
/// budget sets, less what its attempts have spent (never below zero). `tokens` counts input and
/// output tokens together, as the budget does.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BudgetRemaining {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

impl BudgetRemaining {
    /// The variable's value: compact JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }
}

/// Millionths of a dollar, for exact differences; `None` for anything but a finite,
/// non-negative number.
fn micros(v: &Value) -> Option<u64> {
    let usd = v.as_f64().filter(|n| n.is_finite() && *n >= 0.0)?;
    let m = (usd * 1e6).round();
    (m <= USAGE_MAX as f64).then_some(m as u64)
}

/// The budget left of a claimed todo (the claim answer's `todo` object): `None` when it sets no
/// usable limit (no `budget`, or one without a non-negative `cost_usd` or whole `tokens`).
/// A `spent` that is absent or unreadable counts as nothing spent.
pub fn budget_remaining(todo: &Map<String, Value>) -> Option<BudgetRemaining> {
    let budget = todo.get("budget")?.as_object()?;
    let spent = todo.get("spent").and_then(Value::as_object);
    let spent_figure = |k: &str| spent.and_then(|s| s.get(k));
    let cost_usd = budget.get("cost_usd").and_then(micros).map(|limit| {
        let used = spent_figure("cost_usd").and_then(micros).unwrap_or(0);
        limit.saturating_sub(used) as f64 / 1e6
    });
    let tokens = budget.get("tokens").and_then(Value::as_u64).map(|limit| {
        let used = ["input_tokens", "output_tokens"]
            .iter()
            .filter_map(|k| spent_figure(k).and_then(Value::as_u64))
            .fold(0u64, u64::saturating_add);
        limit.saturating_sub(used)
    });
    (cost_usd.is_some() || tokens.is_some()).then_some(BudgetRemaining { cost_usd, tokens })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn usage(cost: Option<f64>, input: Option<u64>, output: Option<u64>) -> UsageArg {
        UsageArg {
            cost_usd: cost,
            input_tokens: input,
            output_tokens: output,
        }
    }

    #[test]
    fn a_usage_file_is_read_liberally_and_sent_only_when_every_figure_is_usable() {
        let ok = [
            (&b""[..], None),
            (b"  \n", None),
            (b"{}", None),
            (br#"{"model": "x", "cost_usd": null}"#, None),
            (br#"{"cost_usd": 2}"#, Some(usage(Some(2.0), None, None))),
            (
                br#"{"cost_usd": 0.42, "input_tokens": 1200, "output_tokens": 300, "model": "m"}"#,
                Some(usage(Some(0.42), Some(1200), Some(300))),
            ),
            (
                br#"{"input_tokens": 1.2e3}"#,
                Some(usage(None, Some(1200), None)),
            ),
            (
                br#"{"output_tokens": 9007199254740992}"#,
                Some(usage(None, None, Some(1 << 53))),
            ),
        ];
        for (bytes, want) in ok {
            assert_eq!(
                parse_usage(bytes),
                Ok(want),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
        let bad = [
            (&b"cost: 2"[..], UsageProblem::NotJson),
            (b"\xff\xfe", UsageProblem::NotJson),
            (br#"{"cost_usd": 1e999}"#, UsageProblem::NotJson),
            (b"[1, 2]", UsageProblem::NotAnObject),
            (b"2.5", UsageProblem::NotAnObject),
            (br#"{"cost_usd": -1}"#, UsageProblem::Figure("cost_usd")),
            (br#"{"cost_usd": "2"}"#, UsageProblem::Figure("cost_usd")),
            (br#"{"cost_usd": 1e10}"#, UsageProblem::Figure("cost_usd")),
            (
                br#"{"input_tokens": -5}"#,
                UsageProblem::Figure("input_tokens"),
            ),
            (
                br#"{"input_tokens": 1.5}"#,
                UsageProblem::Figure("input_tokens"),
            ),
            (
                br#"{"output_tokens": 9007199254740993}"#,
                UsageProblem::Figure("output_tokens"),
            ),
            (
                br#"{"cost_usd": 1, "output_tokens": true}"#,
                UsageProblem::Figure("output_tokens"),
            ),
        ];
        for (bytes, want) in bad {
            assert_eq!(
                parse_usage(bytes),
                Err(want),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
        let long = format!(r#"{{"cost_usd": 1, "pad": "{}"}}"#, "x".repeat(5000));
        assert_eq!(parse_usage(long.as_bytes()), Err(UsageProblem::TooLong));
    }

    #[test]
    fn a_broken_usage_file_is_said_once_per_attempt_and_never_quoted() {
        let mut file = UsageFile::default();
        assert_eq!(file.read(Ok(None)), (None, None));
        let secret = br#"{"cost_usd": "sk-live-0123456789abcdefghij"}"#.to_vec();
        let (usage, warning) = file.read(Ok(Some(secret.clone())));
        let warning = warning.expect("a first warning");
        assert_eq!(usage, None);
        assert!(
            warning.contains("cost_usd") && !warning.contains("sk-live"),
            "{warning}"
        );
        assert_eq!(file.read(Ok(Some(secret))), (None, None), "said once");
        assert_eq!(file.read(Err("not a regular file".into())), (None, None));
        // A good reading after a bad one is sent as usual.
        let (usage, warning) = file.read(Ok(Some(br#"{"cost_usd": 0.5}"#.to_vec())));
        assert_eq!((usage, warning), (Some(usage_of_cost(0.5)), None));
        // Another attempt warns afresh; an unreadable file is a problem like a malformed one.
        let (_, warning) = UsageFile::default().read(Err("permission denied".into()));
        assert!(warning.is_some_and(|w| w.contains("permission denied")));
    }

    fn usage_of_cost(c: f64) -> UsageArg {
        usage(Some(c), None, None)
    }

    #[test]
    fn the_budget_left_is_each_set_limit_less_the_spend() {
        let todo = |v: Value| v.as_object().cloned().expect("an object");
        let spent = json!({"cost_usd": 0.3, "input_tokens": 700, "output_tokens": 200});
        let both = todo(json!({"budget": {"cost_usd": 1, "tokens": 1000}, "spent": spent}));
        let left = budget_remaining(&both).expect("a budget");
        assert_eq!(
            left,
            BudgetRemaining {
                cost_usd: Some(0.7),
                tokens: Some(100)
            }
        );
        assert_eq!(left.to_json(), r#"{"cost_usd":0.7,"tokens":100}"#);
        let cost_only = todo(json!({"budget": {"cost_usd": 1.0}, "spent": spent}));
        assert_eq!(
            budget_remaining(&cost_only).map(|b| b.to_json()),
            Some(r#"{"cost_usd":0.7}"#.into())
        );
        let overspent = todo(json!({"budget": {"tokens": 100}, "spent": spent}));
        assert_eq!(
            budget_remaining(&overspent).map(|b| b.to_json()),
            Some(r#"{"tokens":0}"#.into())
        );
        // Nothing spent yet, or a server that says nothing of spend.
        let fresh = todo(json!({"budget": {"cost_usd": 1}}));
        assert_eq!(
            budget_remaining(&fresh).map(|b| b.to_json()),
            Some(r#"{"cost_usd":1.0}"#.into())
        );
        for none in [
            json!({}),
            json!({"spent": spent}),
            json!({"budget": null}),
            json!({"budget": {}}),
            json!({"budget": {"cost_usd": "1", "tokens": -3}}),
        ] {
            assert_eq!(budget_remaining(&todo(none.clone())), None, "{none}");
        }
    }
}
