//! The properties of the attempt machine, each a body that takes the bytes of a program (so a
//! fuzz target can reuse it as it is).

use std::collections::BTreeSet;

use serde_json::Value;

use crate::relay::{Command, Input, OnOverlap, Relay, RunOutcome, RunRecord};
use crate::time::Now;

use crate::relay::invariants::Monitor;

use super::program::*;

/// A stepped wall clock changes nothing but text: the same program with its wall-clock
/// steps left out sends the same commands at the same monotonic instants, run records
/// differing only in their `started_at` / `ended_at` stamps and context files in their
/// `attempt.claimed_at`. (Deadlines on wall time would
/// move every timer a step crosses.)
pub fn relay_wall_clock_moves_no_deadline(bytes: &[u8]) -> Result<(), String> {
    let program = decode_relay_program(bytes);
    let stepped = run_relay_program_with(&program, true)?;
    let steady = run_relay_program_with(&program, false)?;
    let unstamped = |c: &Command| match c {
        Command::WriteRunRecord { record } => Command::WriteRunRecord {
            record: RunRecord {
                started_at: String::new(),
                ended_at: None,
                ..record.clone()
            },
        },
        Command::WriteContextFile {
            run_id,
            path,
            bytes,
        } => {
            let mut file: Value = serde_json::from_slice(bytes).unwrap_or_default();
            file["attempt"]["claimed_at"] = Value::Null;
            Command::WriteContextFile {
                run_id: *run_id,
                path: path.clone(),
                bytes: serde_json::to_vec(&file).unwrap_or_default(),
            }
        }
        other => other.clone(),
    };
    if stepped.steps.len() != steady.steps.len() {
        return Err(format!(
            "wall-clock steps changed the number of steps: {} against {}",
            stepped.steps.len(),
            steady.steps.len()
        ));
    }
    for (i, (a, b)) in stepped.steps.iter().zip(&steady.steps).enumerate() {
        let (ca, cb): (Vec<Command>, Vec<Command>) = (
            a.commands.iter().map(unstamped).collect(),
            b.commands.iter().map(unstamped).collect(),
        );
        if a.now != b.now || a.input != b.input || ca != cb {
            return Err(format!(
                "step {i} differs once the wall clock steps:\n  stepped: at {} {:?} -> {ca:?}\n  steady:  at {} {:?} -> {cb:?}",
                a.now.ms(),
                a.input,
                b.now.ms(),
                b.input
            ));
        }
    }
    Ok(())
}

/// Nothing reaches the lease source before admission: a claim only for a firing within its
/// hours (or the held one, when the previous run closed), only on a verified source, only
/// with no run in flight, always fenced; heartbeats and reports only for a fenced claim.
pub fn relay_admission_before_lease_calls(bytes: &[u8]) -> Result<(), String> {
    let trace = trace_of(bytes)?;
    let s = &trace.settings;
    let (mut verified, mut open, mut held) = (false, None::<u64>, false);
    let mut fenced: BTreeSet<u64> = BTreeSet::new();
    for (i, step) in trace.steps.iter().enumerate() {
        let mut held_may_start = false;
        match &step.input {
            Input::CapabilitiesKnown(caps) => verified = caps.supported(),
            Input::SessionExpired => verified = false,
            Input::StopRequested { .. } => held = false,
            Input::Firing { within_hours, .. } => {
                let queue = s.on_overlap == OnOverlap::Queue;
                if open.is_some() && queue && *within_hours && !held && s.enabled {
                    held = true;
                }
            }
            Input::ClaimAnswered { claim, .. } if claim.lease_token.is_some() => {
                fenced.extend(open);
            }
            _ => {}
        }
        for c in &step.commands {
            let err = |what: &str| Err(format!("step {i} ({:?}): {what}: {c:?}", step.input));
            match c {
                Command::WriteRunRecord { record }
                    if record.outcome != RunOutcome::Running && open == Some(record.run_id) =>
                {
                    open = None;
                    held_may_start = std::mem::take(&mut held);
                }
                Command::SendClaimNext {
                    run_id,
                    require_fence,
                    ..
                } => {
                    if !(verified && s.enabled && s.lease_enabled && *require_fence) {
                        return err("claim on an unverified, disabled or unfenced source");
                    }
                    if open.is_some() {
                        return err("claim while a run is in flight");
                    }
                    match &step.input {
                        Input::Firing { within_hours, .. } if !within_hours => {
                            return err("claim for a firing outside its hours");
                        }
                        Input::Firing { .. } => {}
                        _ if held_may_start => held_may_start = false,
                        _ => return err("claim without a firing"),
                    }
                    open = Some(*run_id);
                }
                Command::SendHeartbeat { run_id, .. } | Command::SendReport { run_id, .. }
                    if !fenced.contains(run_id) || open != Some(*run_id) =>
                {
                    return err("lease call without a fenced claim in flight");
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// After the lease is lost, by the server's answers, no heartbeat and no report goes out (the
/// monitor's `silent_after_lease_loss`, see [`crate::relay::invariants`]).
pub fn relay_silent_after_lease_loss(bytes: &[u8]) -> Result<(), String> {
    monitored(bytes, "silent_after_lease_loss").map(drop)
}

/// The first breach of `invariant` (see [`crate::relay::invariants`]) in a program's trace.
fn monitored(bytes: &[u8], invariant: &str) -> Result<Monitor, String> {
    let trace = trace_of(bytes)?;
    let mut monitor = Monitor::new(trace.settings.lease_ttl);
    for (i, step) in trace.steps.iter().enumerate() {
        monitor.input(step.now, &step.input);
        for c in &step.commands {
            if let Err(b) = monitor.command(c)
                && b.invariant == invariant
            {
                return Err(format!("step {i}: {}", b.detail));
            }
        }
    }
    if monitor.tokens() != &trace.tokens {
        return Err("the monitor learned other tokens than the world handed out".into());
    }
    Ok(monitor)
}

/// Once a run's final record is written, no command names that run again.
pub fn relay_nothing_after_close(bytes: &[u8]) -> Result<(), String> {
    monitored(bytes, "nothing_after_close").map(drop)
}

/// A lease token appears only as the `lease_token` of its own run's heartbeats and
/// reports: never in any other command, any summary, result, record, event, context file,
/// environment, warning or `describe` — even when the agent and the check print it.
pub fn relay_token_stays_in_lease_calls(bytes: &[u8]) -> Result<(), String> {
    monitored(bytes, "token_stays_out")?;
    let trace = trace_of(bytes)?;
    let tokens: Vec<&String> = trace.tokens.values().collect();
    for (i, step) in trace.steps.iter().enumerate() {
        let leaked = |text: &str| tokens.iter().any(|t| text.contains(t.as_str()));
        if leaked(&step.describe) || leaked(&step.debug) {
            return Err(format!(
                "step {i}: describe or the relay's Debug shows a token"
            ));
        }
        if leaked(&format!("{:?}", step.input)) {
            return Err(format!("step {i}: an input's Debug shows a token"));
        }
    }
    Ok(())
}

/// Every fenced claim ends in exactly one record with a relay outcome; nothing else gets
/// more than one.
pub fn relay_one_outcome_per_claim(bytes: &[u8]) -> Result<(), String> {
    let monitor = monitored(bytes, "one_outcome_per_claim")?;
    monitor.finish().map_err(|b| b.detail)
}

/// `harness describe` as JSON.
pub fn describe_json(relay: &Relay, now: Now) -> Value {
    serde_json::to_value(relay.describe(now)).unwrap_or_default()
}
