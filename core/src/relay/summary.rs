//! The attempt summary, the artifact choice and the receipt text:
//! pure functions the machine calls and the driver may reuse.

use serde_json::Value;

use super::redact::Redactor;
use crate::bounds::{SUMMARY_MAX_BYTES, check_artifact, cut_at_char_boundary, prose_char};
use crate::time::{Millis, SECOND};

/// The driver reads at most this much of the attempt summary file; the machine cuts longer
/// input to it as well.
pub const AGENT_SUMMARY_MAX_BYTES: usize = 16 * 1024;
/// How many of the check's last output lines the summary carries.
pub const CHECK_TAIL_LINES: usize = 20;
/// How many run-log lines a receipt carries.
pub const RECEIPT_LOG_LINES: usize = 200;
pub const RECEIPT_TAGS: [&str; 3] = ["receipt", "harness", "relay"];
/// Marks every cut.
pub const CUT: &str = "…";

/// `45s`, `12m04s`, `16m`, `1h05m`: short, and exact enough for a summary line.
pub fn format_duration(ms: Millis) -> String {
    let s = ms / SECOND;
    match s {
        0..60 => format!("{s}s"),
        60..3600 if s.is_multiple_of(60) => format!("{}m", s / 60),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ if (s % 3600) / 60 == 0 => format!("{}h", s / 3600),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

crate::names! {
    /// How the agent's process ended: its text is `HARNESS_AGENT_OUTCOME` (the check's
    /// environment), `result.harness.agent_outcome` and the word after `agent` on the first line.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum AgentOutcome {
        /// Exit code 0 within the timeout.
        Success => "success",
        /// Any other exit, a signal, or a spawn that failed.
        Failed => "failed",
        /// Stopped at its timeout, whatever it exited with.
        TimedOut => "timed_out",
    }
}

crate::names! {
    /// Why an attempt's verdict is what it is: `result.harness.reason` of its `complete` or `fail`,
    /// and the first part of a failure's signature. (An abort's `fail` carries a
    /// [`StopReason`](super::StopReason)'s text there instead.)
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum VerdictReason {
        /// No check: the agent exited 0.
        AgentSucceeded => "agent_succeeded",
        /// No check: the agent exited otherwise.
        AgentFailed => "agent_failed",
        /// No check: the agent ran into its timeout.
        AgentTimedOut => "agent_timed_out",
        /// No check: the agent could not be started.
        SpawnFailed => "spawn_failed",
        /// The success check exited 0 after the agent.
        CheckPassed => "check_passed",
        /// The success check exited otherwise (not `CHECK_NOT_YET`).
        CheckFailed => "check_failed",
        /// The success check ran into its timeout.
        CheckTimedOut => "check_timed_out",
        /// The success check could not be started.
        CheckNotStarted => "check_not_started",
        /// The success check kept answering "not yet" (`CHECK_NOT_YET`) until its timeout.
        CheckInconclusive => "check_inconclusive",
        /// `success_check_before` passed: no agent ran.
        CheckPassedBeforeSpawn => "check_passed_before_spawn",
        /// The agent asked a question where the source offers no `request_input`.
        NeedsInputUnsupported => "needs_input_unsupported",
    }
}

impl VerdictReason {
    /// The work is done: the verdict is a `complete`, every other reason a `fail`.
    pub fn passed(self) -> bool {
        matches!(
            self,
            VerdictReason::AgentSucceeded
                | VerdictReason::CheckPassed
                | VerdictReason::CheckPassedBeforeSpawn
        )
    }
}

/// What the agent did, for the first line and the report's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentRun {
    pub outcome: AgentOutcome,
    /// The exit code, -1 when signalled or never started.
    pub exit: i32,
    pub duration: Millis,
}

/// What the success check did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckRunSummary {
    pub exit: i32,
    /// From the first start to the last exit, waits included.
    pub duration: Millis,
}

/// The line the daemon authors: `attempt 2/5 · agent success (exit 0) after 12m04s · check exit
/// 1 after 2m`, without the check clause when no check ran.
pub fn first_line(
    attempt: u32,
    max_attempts: u32,
    agent: AgentRun,
    check: Option<CheckRunSummary>,
) -> String {
    let mut line = format!(
        "attempt {attempt}/{max_attempts} · agent {} (exit {}) after {}",
        agent.outcome,
        agent.exit,
        format_duration(agent.duration)
    );
    if let Some(check) = check {
        line.push_str(&format!(
            " · check exit {} after {}",
            check.exit,
            format_duration(check.duration)
        ));
    }
    line
}

/// The summary of an attempt the daemon ended without a verdict (an abort).
pub fn abort_summary(attempt: u32, max_attempts: u32, reason_words: &str) -> String {
    format!("attempt {attempt}/{max_attempts} · stopped: {reason_words}")
}

/// The summary sent when the check passed before the spawn (`success_check_before`).
pub const ALREADY_SATISFIED: &str = "success_check passed before spawn";

/// What the agent's summary file said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentSummary {
    pub summary: Option<String>,
    /// The agent's artifact candidate, not yet shape-checked.
    pub artifact: Option<String>,
    /// `"retryable": false` in the file: the agent knows its failure will not go away.
    pub retryable: Option<bool>,
    /// `"needs_input": "<question>"` in the file: the agent cannot go on without a person's
    /// answer. As the file says it (never blank); the machine replaces it on arrival with
    /// [`question`]'s sendable form, or drops it when nothing is left to ask.
    pub needs_input: Option<String>,
}

/// Reads the summary file: a JSON object with a string `summary` or a non-blank string
/// `needs_input` (and maybe a string `artifact`), or otherwise the whole content as the summary.
pub fn parse_summary_file(bytes: &[u8]) -> AgentSummary {
    let bytes = &bytes[..bytes.len().min(AGENT_SUMMARY_MAX_BYTES)];
    let text = String::from_utf8_lossy(bytes);
    if let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(&text) {
        let string = |k: &str| obj.get(k).and_then(Value::as_str);
        let needs_input = string("needs_input")
            .filter(|q| !q.trim().is_empty())
            .map(str::to_string);
        if string("summary").is_some() || needs_input.is_some() {
            return AgentSummary {
                summary: string("summary")
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
                artifact: string("artifact").map(str::to_string),
                retryable: obj.get("retryable").and_then(Value::as_bool),
                needs_input,
            };
        }
    }
    let text = text.trim();
    AgentSummary {
        summary: (!text.is_empty()).then(|| text.to_string()),
        ..AgentSummary::default()
    }
}

/// The question a `request_input` carries, from the agent's `needs_input`: redacted like the
/// summary, cleaned of control characters (tab and newline kept) and trimmed, then cut to
/// [`SUMMARY_MAX_BYTES`] (the cut marked with [`CUT`]). `None` when nothing is left to ask.
pub fn question(raw: &str, redactor: &Redactor) -> Option<String> {
    let clean: String = redactor
        .redact(raw)
        .chars()
        .filter(|c| prose_char(*c))
        .collect();
    let clean = clean.trim();
    (!clean.is_empty()).then(|| cap_parts(clean, None, None, SUMMARY_MAX_BYTES))
}

/// The signature a failed attempt reports: the same for the same failure, different when it
/// changes. The SHA-256 of the verdict reason, the agent's and the check's exit codes and the
/// check output's last non-empty line (folded and redacted, as the summary shows it), as 32 hex
/// digits. Durations and attempt numbers stay out: they change on every try.
pub fn failure_signature(
    reason: VerdictReason,
    agent_exit: Option<i32>,
    check_exit: Option<i32>,
    check_output: Option<&str>,
) -> String {
    use sha2::Digest;
    let last = check_output
        .and_then(|o| o.lines().rev().map(str::trim).find(|l| !l.is_empty()))
        .unwrap_or("");
    let text = format!(
        "{reason}\n{}\n{}\n{last}",
        agent_exit.map_or("-".into(), |e| e.to_string()),
        check_exit.map_or("-".into(), |e| e.to_string())
    );
    let digest = sha2::Sha256::digest(text.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Terminal escapes removed and carriage-return overwrites applied, as a reader saw the text.
pub fn fold_ansi(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            plain.push(c);
            continue;
        }
        match chars.next() {
            // CSI: parameters up to a final byte in @..~
            Some('[') => {
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            // OSC: up to BEL or ESC \
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' || (c == '\u{1b}' && chars.peek() == Some(&'\\')) {
                        if c == '\u{1b}' {
                            chars.next();
                        }
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    plain
        .split('\n')
        .map(|line| {
            let line = line.strip_suffix('\r').unwrap_or(line);
            line.rsplit('\r').next().unwrap_or(line)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The last `lines` lines of raw output, folded; empty lines at the end are dropped.
pub fn last_lines(output: &[u8], lines: usize) -> String {
    let text = fold_ansi(&String::from_utf8_lossy(output));
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The attempt summary: the three parts redacted, joined by newlines, and capped at
/// [`SUMMARY_MAX_BYTES`] by cutting the check output (keeping its end), then the agent's text
/// (keeping its start), and the first line only when it alone is too long.
pub fn compose_summary(
    first: &str,
    agent: Option<&str>,
    check_output: Option<&str>,
    redactor: &Redactor,
) -> String {
    let first = redactor.redact(first);
    let agent = agent.map(|s| redactor.redact(s)).filter(|s| !s.is_empty());
    let check = check_output
        .map(|s| redactor.redact(s))
        .filter(|s| !s.is_empty());
    cap_parts(
        &first,
        agent.as_deref(),
        check.as_deref(),
        SUMMARY_MAX_BYTES,
    )
}

fn join(parts: &[Option<&str>]) -> String {
    parts
        .iter()
        .flatten()
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

/// The longest suffix of `s` of at most `max` bytes that starts on a char boundary.
fn tail_within(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Caps the joined parts at `max` bytes, cutting part 3, then part 2, then part 1.
pub fn cap_parts(p1: &str, p2: Option<&str>, p3: Option<&str>, max: usize) -> String {
    let whole = join(&[Some(p1), p2, p3]);
    if whole.len() <= max {
        return whole;
    }
    if let Some(p3) = p3 {
        let room = max.saturating_sub(join(&[Some(p1), p2]).len() + 1 + CUT.len());
        let kept = tail_within(p3, room);
        if !kept.trim().is_empty() {
            return join(&[Some(p1), p2, Some(&format!("{CUT}{kept}"))]);
        }
    }
    if let Some(p2) = p2 {
        let room = max.saturating_sub(p1.len() + 1 + CUT.len());
        let kept = cut_at_char_boundary(p2, room);
        if !kept.trim().is_empty() {
            return join(&[Some(p1), Some(&format!("{kept}{CUT}"))]);
        }
    }
    if p1.len() <= max {
        return p1.to_string();
    }
    format!(
        "{}{CUT}",
        cut_at_char_boundary(p1, max.saturating_sub(CUT.len()))
    )
}

/// The artifact: at most one handle for a report: the agent's when it has the shape of one (an
/// `mcp://cairn/<id>` handle or an https URL of at most 512 bytes), else the receipt's, else
/// none. A handle dropped for its shape, or because it carries a credential (it would reach
/// the server and the run record), comes back as a run-log warning that never repeats it.
pub fn choose_artifact(
    agent: Option<&str>,
    receipt: Option<&str>,
    redactor: &Redactor,
) -> (Option<String>, Vec<String>) {
    let mut warnings = Vec::new();
    for (whose, handle) in [
        ("the attempt summary file", agent),
        ("the attempt receipt", receipt),
    ] {
        let Some(handle) = handle else {
            continue;
        };
        let why = match check_artifact(handle) {
            Err(why) => why,
            Ok(()) if redactor.redact(handle) != handle => "carries a credential".to_string(),
            Ok(()) => return (Some(handle.to_string()), warnings),
        };
        warnings.push(format!(
            "dropped the artifact handle from {whose}: it {why}"
        ));
    }
    (None, warnings)
}

/// The receipt's Markdown without its run-log section.
pub fn receipt_markdown(harness: &str, run_id: u64, summary: &str) -> String {
    format!("# Attempt receipt: {harness} run {run_id}\n\n## Summary\n\n~~~~\n{summary}\n~~~~\n")
}

/// The run-log section the driver appends to [`receipt_markdown`]: the last `lines` lines of
/// the run log, folded and redacted.
pub fn receipt_log_section(run_log_tail: &[u8], lines: usize, redactor: &Redactor) -> String {
    let tail = redactor.redact(&last_lines(run_log_tail, lines));
    format!("\n## Run log (last {lines} lines)\n\n~~~~\n{tail}\n~~~~\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let cases = [
            (0, "0s"),
            (45_999, "45s"),
            (60_000, "1m"),
            (724_000, "12m04s"),
            (3_600_000, "1h"),
            (3_900_000, "1h05m"),
        ];
        for (ms, text) in cases {
            assert_eq!(format_duration(ms), text);
        }
    }

    #[test]
    fn first_line_with_and_without_check() {
        let agent = AgentRun {
            outcome: AgentOutcome::Success,
            exit: 0,
            duration: 16 * 60_000,
        };
        assert_eq!(
            first_line(2, 5, agent, None),
            "attempt 2/5 · agent success (exit 0) after 16m"
        );
        let check = CheckRunSummary {
            exit: 1,
            duration: 120_000,
        };
        assert_eq!(
            first_line(2, 5, agent, Some(check)),
            "attempt 2/5 · agent success (exit 0) after 16m · check exit 1 after 2m"
        );
    }

    #[test]
    fn outcome_and_reason_texts_are_the_wire_texts() {
        // The texts results, environments and first lines carried before these were enums.
        let outcomes: Vec<&str> = AgentOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(outcomes, ["success", "failed", "timed_out"]);
        let reasons: Vec<&str> = VerdictReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            reasons,
            [
                "agent_succeeded",
                "agent_failed",
                "agent_timed_out",
                "spawn_failed",
                "check_passed",
                "check_failed",
                "check_timed_out",
                "check_not_started",
                "check_inconclusive",
                "check_passed_before_spawn",
                "needs_input_unsupported",
            ]
        );
        for o in AgentOutcome::ALL {
            assert_eq!(AgentOutcome::parse(&o.to_string()), Some(o));
        }
        for r in VerdictReason::ALL {
            assert_eq!(VerdictReason::parse(&r.to_string()), Some(r));
        }
        // A text no version wrote (or a stop's code) is no outcome or verdict reason.
        for unknown in [
            "",
            "Success",
            "signalled",
            "daemon_stopping",
            "agent_succeeded ",
        ] {
            assert_eq!(AgentOutcome::parse(unknown), None);
            assert_eq!(VerdictReason::parse(unknown), None);
        }
        let passed: Vec<VerdictReason> = VerdictReason::ALL
            .into_iter()
            .filter(|r| r.passed())
            .collect();
        assert_eq!(
            passed,
            [
                VerdictReason::AgentSucceeded,
                VerdictReason::CheckPassed,
                VerdictReason::CheckPassedBeforeSpawn
            ]
        );
        // The signature hashes the reason's text, as it did when the reason was a string.
        assert_eq!(
            failure_signature(
                VerdictReason::CheckFailed,
                Some(1),
                Some(2),
                Some("x\nlast\n")
            ),
            {
                use sha2::Digest;
                let d = sha2::Sha256::digest(b"check_failed\n1\n2\nlast");
                d[..16]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            }
        );
    }

    #[test]
    fn summary_file_shapes() {
        let json = br#"{"summary": " fixed it ", "artifact": "mcp://cairn/x1"}"#;
        assert_eq!(
            parse_summary_file(json),
            AgentSummary {
                summary: Some("fixed it".into()),
                artifact: Some("mcp://cairn/x1".into()),
                retryable: None,
                needs_input: None,
            }
        );
        assert_eq!(
            parse_summary_file(b"plain words\n").summary.as_deref(),
            Some("plain words")
        );
        // An object without a string summary is just text.
        assert_eq!(
            parse_summary_file(br#"{"summary": 3}"#).summary.as_deref(),
            Some(r#"{"summary": 3}"#)
        );
        assert_eq!(parse_summary_file(b"  \n"), AgentSummary::default());
        let big = vec![b'a'; 40_000];
        assert_eq!(
            parse_summary_file(&big).summary.map(|s| s.len()),
            Some(16 * 1024)
        );
    }

    #[test]
    fn a_question_is_read_from_needs_input_and_made_sendable() {
        let asked = parse_summary_file(
            br#"{"needs_input": " which branch? ", "summary": "stuck", "artifact": "mcp://cairn/q1"}"#,
        );
        assert_eq!(asked.needs_input.as_deref(), Some(" which branch? "));
        assert_eq!(asked.summary.as_deref(), Some("stuck"));
        assert_eq!(asked.artifact.as_deref(), Some("mcp://cairn/q1"));
        // needs_input alone is a structured file; a blank or non-string one asks nothing.
        let alone = parse_summary_file(br#"{"needs_input": "which branch?"}"#);
        assert_eq!(alone.needs_input.as_deref(), Some("which branch?"));
        assert_eq!(alone.summary, None);
        for nothing in [
            &br#"{"needs_input": "  ", "summary": "done"}"#[..],
            br#"{"needs_input": true, "summary": "done"}"#,
        ] {
            let s = parse_summary_file(nothing);
            assert_eq!((s.needs_input, s.summary.as_deref()), (None, Some("done")));
        }
        assert_eq!(parse_summary_file(b"needs_input: x").needs_input, None);

        let r = Redactor::new(["tok-secret-1"]);
        assert_eq!(
            question(" which branch?\n\u{7}(main or dev) ", &r).as_deref(),
            Some("which branch?\n(main or dev)")
        );
        let q = question(
            "use tok-secret-1 or ghp_abcdefghijklmnopqrstuvwxyz0123?",
            &r,
        )
        .expect("a question");
        assert!(
            !q.contains("tok-secret-1") && !q.contains("ghp_abcdefghij"),
            "{q}"
        );
        let long = question(&"é".repeat(3000), &r).expect("a question");
        assert!(
            long.len() <= SUMMARY_MAX_BYTES && long.ends_with(CUT),
            "{}",
            long.len()
        );
        assert_eq!(question(" \u{1b}\t ", &r), None);
    }

    #[test]
    fn cap_cuts_check_then_agent_then_first_line() {
        let first = "attempt 1/5 · agent failed (exit 1) after 1m";
        let agent = "é".repeat(400); // 800 bytes
        let check = (0..400)
            .map(|i| format!("line {i}"))
            .collect::<Vec<_>>()
            .join("\n");
        let s = cap_parts(first, Some(&agent), Some(&check), 2048);
        assert_eq!(s.len(), 2048);
        assert!(s.starts_with(first) && s.contains(&agent) && s.ends_with("line 399"));
        assert!(s.contains(&format!("\n{CUT}")));

        let agent = "é".repeat(2000);
        let s = cap_parts(first, Some(&agent), Some(&check), 2048);
        assert!(s.len() <= 2048 && s.starts_with(first) && s.ends_with(&format!("é{CUT}")));
        assert!(!s.contains("line"));

        let s = cap_parts(&"x".repeat(3000), None, None, 2048);
        assert_eq!(s.len(), 2048);
        assert!(s.ends_with(CUT));
    }

    #[test]
    fn ansi_is_folded_and_tails_are_last_lines() {
        assert_eq!(fold_ansi("\u{1b}[31mred\u{1b}[0m ok"), "red ok");
        assert_eq!(fold_ansi("50%\r100%\nnext"), "100%\nnext");
        assert_eq!(fold_ansi("\u{1b}]0;title\u{7}text"), "text");
        assert_eq!(last_lines(b"a\nb\nc\n\n", 2), "b\nc");
    }

    #[test]
    fn artifact_choice() {
        let r = Redactor::new(["tok-secret-1"]);
        let agent = Some("mcp://cairn/Ab12");
        let receipt = Some("mcp://cairn/Rc1");
        assert_eq!(
            choose_artifact(agent, receipt, &r),
            (Some("mcp://cairn/Ab12".into()), vec![])
        );
        assert_eq!(
            choose_artifact(None, receipt, &r),
            (Some("mcp://cairn/Rc1".into()), vec![])
        );
        assert_eq!(choose_artifact(None, None, &r), (None, vec![]));
        let (artifact, warnings) = choose_artifact(Some("file:///etc/passwd"), receipt, &r);
        assert_eq!(artifact.as_deref(), Some("mcp://cairn/Rc1"));
        assert!(warnings.len() == 1 && !warnings[0].contains("passwd"));
        let (artifact, warnings) = choose_artifact(Some("https://x.io/?t=tok-secret-1"), None, &r);
        assert_eq!(artifact, None);
        assert!(warnings[0].contains("credential") && !warnings[0].contains("tok-secret-1"));
    }
}
