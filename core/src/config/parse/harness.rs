//! The `[harness.<name>]` table: the agent's command and when it runs, and its relay keys (the
//! lease, the success check, the receipt), with the references to other tables they make.

use std::collections::BTreeSet;

use toml::Value;

use super::{Declared, RELAY_ONLY_KEYS, Reader};
use crate::config::{
    DEFAULT_KEEP_RUNS, DEFAULT_KILL_GRACE, DEFAULT_SUCCESS_CHECK_INTERVAL,
    DEFAULT_SUCCESS_CHECK_TIMEOUT, FileKind, Harness, HarnessRelay, MAX_KEEP_RUNS, OnOverlap,
    OperatingHours, Schedule, format_duration,
};
use crate::time::Millis;

/// Reads a `kind.<name>` reference and checks it is declared; returns the name.
pub(super) fn reference(
    r: &mut Reader,
    key: &str,
    kind: &str,
    declared: &BTreeSet<&str>,
    complete: bool,
) -> Option<String> {
    let text = r.str(key)?;
    reference_to(r, key, text, kind, declared, complete)
}

/// Checks that `text`, the value of `key`, is `kind.<name>` with `<name>` declared.
pub(super) fn reference_to(
    r: &mut Reader,
    key: &str,
    text: &str,
    kind: &str,
    declared: &BTreeSet<&str>,
    complete: bool,
) -> Option<String> {
    let shown = format!("{key} = {text:?}");
    let Some(name) = text.strip_prefix(kind).and_then(|t| t.strip_prefix('.')) else {
        r.err(
            key,
            format!("{shown} must name a table as \"{kind}.<name>\", e.g. \"{kind}.main\""),
        );
        return None;
    };
    if !declared.contains(name) {
        if complete {
            let have = if declared.is_empty() {
                format!("no [{kind}.*] table is declared")
            } else {
                let list: Vec<String> = declared.iter().map(|n| format!("{kind}.{n}")).collect();
                format!("declared: {}", list.join(", "))
            };
            r.err(key, format!("{shown} names no declared [{kind}.{name}] table ({have}): declare it or fix the name"));
        }
        return None;
    }
    Some(name.to_string())
}

/// The first `${NAME}` or `{placeholder}` in `s`, if any.
pub(super) fn find_placeholder(s: &str) -> Option<&str> {
    if let Some(at) = s.find("${") {
        let end = s[at..].find('}').map_or(s.len(), |e| at + e + 1);
        return Some(&s[at..end]);
    }
    let bytes = s.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b != b'{' {
            continue;
        }
        let ident = bytes[i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_' || **c == b'.')
            .count();
        if bytes.get(i + 1 + ident) == Some(&b'}') {
            return Some(&s[i..i + ident + 2]);
        }
    }
    None
}

pub(super) fn harness(
    r: &mut Reader,
    name: String,
    kind: FileKind,
    refs: &Declared,
) -> Option<Harness> {
    const ARGV_EXAMPLE: &str = "[\"claude\", \"-p\"]";
    let command = match r.string_array("command", ARGV_EXAMPLE) {
        None if !r.has("command") => {
            r.err("command", format!("command is missing: set command to the agent's argv, e.g. command = {ARGV_EXAMPLE}"));
            None
        }
        None => None,
        Some(argv) if argv.is_empty() => {
            r.err(
                "command",
                format!(
                    "command = [] is empty: give the agent's argv, e.g. command = {ARGV_EXAMPLE}"
                ),
            );
            None
        }
        Some(argv) if argv[0].is_empty() => {
            r.err(
                "command[0]",
                "command[0] is empty: the first element is the program to run".to_string(),
            );
            None
        }
        Some(argv) => Some(argv),
    };
    let prompt_file = r.string("prompt_file");
    let workdir = r.string("workdir");
    let env_file = r.string("env_file");
    let timeout = r.duration("timeout", true);
    let kill_grace = r.duration("kill_grace", true).unwrap_or(DEFAULT_KILL_GRACE);
    let on_overlap = match r.str("on_overlap") {
        None => OnOverlap::Skip,
        Some("skip") => OnOverlap::Skip,
        Some("queue") => OnOverlap::Queue,
        Some(other) => {
            r.err(
                "on_overlap",
                format!("on_overlap = {other:?} must be \"skip\" or \"queue\""),
            );
            OnOverlap::Skip
        }
    };
    let operating_hours = operating_hours(r);
    let schedule = r
        .str("schedule")
        .and_then(|text| match Schedule::parse(text) {
            Ok(s) => Some(s),
            Err(e) => {
                r.err("schedule", format!("schedule = {text:?} {e}"));
                None
            }
        });
    let mut triggers = Vec::new();
    if let Some(list) = r.string_array("triggers", "[\"channel.main\"]") {
        if list.is_empty() {
            r.err("triggers", "triggers = [] is empty: list channels such as [\"channel.main\"], or remove triggers".to_string());
        }
        for (i, text) in list.iter().enumerate() {
            let key = format!("triggers[{i}]");
            if let Some(ch) = reference_to(r, &key, text, "channel", &refs.channels, refs.complete)
            {
                if triggers.contains(&ch) {
                    r.err(
                        &key,
                        format!("{key} repeats channel.{ch}: list each channel once"),
                    );
                } else {
                    triggers.push(ch);
                }
            }
        }
    }
    let catch_up = r.bool("catch_up").unwrap_or(false);
    // Without a schedule there is no slot to miss: the key would be accepted and ignored.
    if catch_up && !r.t.contains_key("schedule") {
        r.err(
            "catch_up",
            "catch_up = true needs a schedule: it fires once at start when a schedule slot was \
             missed while the daemon was down; add schedule = \"@every …\" or remove catch_up"
                .to_string(),
        );
    }
    let keep_runs = match r.t.get("keep_runs") {
        None => DEFAULT_KEEP_RUNS,
        Some(v) => match v.as_integer() {
            Some(n) if (1..=i64::from(MAX_KEEP_RUNS)).contains(&n) => n as u32,
            Some(n) => {
                r.err(
                    "keep_runs",
                    format!("keep_runs = {n} must be between 1 and {MAX_KEEP_RUNS}"),
                );
                DEFAULT_KEEP_RUNS
            }
            None => {
                r.wrong_type("keep_runs", "a whole number", v);
                DEFAULT_KEEP_RUNS
            }
        },
    };
    let enabled = r.bool("enabled").unwrap_or(true);
    let description = r.string("description");
    let relay = harness_relay(r, kind, refs);

    Some(Harness {
        name,
        declared_in: r.file.to_string(),
        command: command?,
        prompt_file,
        workdir,
        env_file,
        timeout,
        kill_grace,
        on_overlap,
        operating_hours,
        schedule,
        triggers,
        catch_up,
        keep_runs,
        enabled,
        description,
        relay,
    })
}

/// A list of process exit codes (0 to 255), default empty.
fn exit_codes(r: &mut Reader, key: &str) -> Vec<i32> {
    let Some(v) = r.t.get(key) else {
        return Vec::new();
    };
    let codes: Option<Vec<i32>> = v.as_array().and_then(|items| {
        items
            .iter()
            .map(|i| i.as_integer().and_then(|n| i32::try_from(n).ok()))
            .collect()
    });
    match codes {
        Some(c) if c.iter().all(|n| (0..=255).contains(n)) => c,
        Some(_) => {
            r.err(
                key,
                format!("{key} holds exit codes from 0 to 255, e.g. {key} = [3, 78]"),
            );
            Vec::new()
        }
        None => {
            let v = v.clone();
            r.wrong_type(key, "an array of whole numbers (exit codes)", &v);
            Vec::new()
        }
    }
}

pub(super) fn operating_hours(r: &mut Reader) -> Option<OperatingHours> {
    let v = r.t.get("operating_hours")?;
    let windows: Vec<&str> = if let Some(s) = v.as_str() {
        vec![s]
    } else if let Some(items) = v.as_array() {
        if items.is_empty() {
            r.err("operating_hours", "operating_hours = [] has no window: list windows such as \"mon-fri 09:00-18:00\", or remove the key".to_string());
            return None;
        }
        let strs: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
        if strs.len() != items.len() {
            r.wrong_type("operating_hours", "a window string or an array of them", v);
            return None;
        }
        strs
    } else {
        r.wrong_type(
            "operating_hours",
            "a window string such as \"mon-fri 09:00-18:00\" or an array of them",
            v,
        );
        return None;
    };
    match OperatingHours::parse(&windows) {
        Ok(h) => Some(h),
        Err((i, e)) => {
            let key = if v.is_array() {
                format!("operating_hours[{i}]")
            } else {
                "operating_hours".to_string()
            };
            r.err(
                &key,
                format!("{key} = {:?} {e} (a window is [DAYS] HH:MM-HH:MM [OFFSET], e.g. \"mon-fri 09:00-18:00 +02:00\")", windows[i]),
            );
            None
        }
    }
}

pub(super) fn harness_relay(
    r: &mut Reader,
    kind: FileKind,
    refs: &Declared,
) -> Option<HarnessRelay> {
    if !r.has("lease") {
        for key in RELAY_ONLY_KEYS {
            if r.has(key) {
                r.err(key, format!(
                    "{key} describes an attempt, so it needs lease: set lease = \"queue.<name>\" \
                     or remove {key}"
                ));
            }
        }
        return None;
    }
    let project = kind == FileKind::Project;
    let lease = if project {
        r.err(
            "lease",
            "lease is not allowed in a project harness.toml: project harnesses are \
                        never triggered; declare this harness in the global harness.toml"
                .to_string(),
        );
        None
    } else {
        let lease = reference(r, "lease", "queue", &refs.queues, refs.complete);
        if !r.has("schedule") && !r.has("triggers") {
            let written = r.t.get("lease").and_then(Value::as_str).unwrap_or_default();
            r.err("lease", format!(
                "lease = {written:?} requires a triggered harness (one with schedule or triggers): \
                 add schedule or triggers, or remove lease"
            ));
        }
        lease
    };

    let success_check = match r.string_array("success_check", "[\"./scripts/checks-green.sh\"]") {
        Some(argv) if argv.is_empty() => {
            r.err(
                "success_check",
                "success_check = [] is empty: give the check's argv, or remove success_check"
                    .to_string(),
            );
            None
        }
        Some(argv) => {
            let mut ok = true;
            for (i, arg) in argv.iter().enumerate() {
                if let Some(p) = find_placeholder(arg) {
                    ok = false;
                    r.err(&format!("success_check[{i}]"), format!(
                        "success_check[{i}] contains {p}, but the check runs exactly as written and \
                         is never expanded: read the HARNESS_* variables and the harness env_file \
                         from the check's environment instead"
                    ));
                }
            }
            if argv[0].is_empty() {
                ok = false;
                r.err(
                    "success_check[0]",
                    "success_check[0] is empty: the first element is the program to run"
                        .to_string(),
                );
            }
            ok.then_some(argv)
        }
        None => None,
    };
    let timeout = r.duration("success_check_timeout", true);
    let interval = r.duration("success_check_interval", true);
    if let (Some(t), Some(i)) = (
        timeout.or((!r.has("success_check_timeout")).then_some(DEFAULT_SUCCESS_CHECK_TIMEOUT)),
        interval.or((!r.has("success_check_interval")).then_some(DEFAULT_SUCCESS_CHECK_INTERVAL)),
    ) && i >= t
    {
        let shown = |key: &str, v: Millis| match r.t.get(key).and_then(Value::as_str) {
            Some(text) => format!("{key} = {text:?}"),
            None => format!("{key} (default {})", format_duration(v)),
        };
        let msg = format!(
            "{} must be less than {}: lower success_check_interval or raise success_check_timeout",
            shown("success_check_interval", i),
            shown("success_check_timeout", t)
        );
        r.err("success_check_interval", msg);
    }
    let before = r.bool("success_check_before").unwrap_or(false);
    if before && !r.has("success_check") {
        r.err("success_check_before", "success_check_before = true needs success_check: set success_check or remove success_check_before".to_string());
    }
    let attempt_receipt = if project {
        None
    } else if r.has("attempt_receipt") {
        reference(r, "attempt_receipt", "cairn", &refs.cairns, refs.complete)
    } else {
        None
    };
    let non_retryable_exit_codes = exit_codes(r, "non_retryable_exit_codes");
    Some(HarnessRelay {
        non_retryable_exit_codes,
        lease: lease?,
        success_check,
        success_check_timeout: timeout.unwrap_or(DEFAULT_SUCCESS_CHECK_TIMEOUT),
        success_check_interval: interval.unwrap_or(DEFAULT_SUCCESS_CHECK_INTERVAL),
        success_check_before: before,
        attempt_receipt,
    })
}
