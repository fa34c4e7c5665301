//! One test per scenario of the worker's lease behaviour (admission to error handling), named
//! after what it checks, plus the property tests whose bodies live in `crate::testing::relay`.
//! Times are explicit; commands are asserted exactly where the scenario is about them.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::error::ErrorCode;
use crate::ledger::{Ledger, LedgerConfig, NewTodo};
use crate::relay::invariants::shown;
use crate::testing::Queue;
use crate::testing::relay::*;
use crate::time::{HOUR, MINUTE, Millis, SECOND, Wall, parse_rfc3339, read_wall_text};

const TOKEN: &str = "q3vZw-T0K3N-f3nc3";

fn claim_1() -> ClaimedTodo {
    claimed("td_1", 1, 5, Some(TOKEN))
}

/// A driver on the default settings whose first run holds `claim_1`.
fn running() -> Driver {
    let mut d = Driver::new(settings());
    d.start(claim_1());
    d
}

fn at(s: &str) -> Millis {
    parse_rfc3339(s).unwrap_or_else(|| panic!("bad time {s}"))
}

fn conflict() -> LeaseError {
    LeaseError::Code(ErrorCode::Conflict)
}

/// The one report in `cmds`: verb, summary, artifact, result.
fn the_report(cmds: &[Command]) -> (ReportVerb, String, Option<String>, Value) {
    let reports: Vec<_> = cmds
        .iter()
        .filter_map(|c| match c {
            Command::SendReport {
                verb,
                summary,
                artifact,
                result,
                ..
            } => Some((*verb, summary.clone(), artifact.clone(), result.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(reports.len(), 1, "expected one report in {cmds:#?}");
    reports[0].clone()
}

fn count(cmds: &[Command], pick: fn(&Command) -> bool) -> usize {
    cmds.iter().filter(|c| pick(c)).count()
}

fn is_spawn(c: &Command) -> bool {
    matches!(c, Command::Spawn { .. })
}
fn is_check(c: &Command) -> bool {
    matches!(c, Command::RunCheck { .. })
}
fn is_term(c: &Command) -> bool {
    matches!(
        c,
        Command::Signal {
            signal: Signal::Term,
            ..
        }
    )
}

/// What a firing refused before any lease call emits: the run_skipped event, then its record.
fn skipped(run_id: u64, trigger: &str, reason: SkippedReason, now: Wall) -> Vec<Command> {
    let mut record = RunRecord {
        harness: "fixer".into(),
        run_id,
        trigger: trigger.into(),
        outcome: RunOutcome::Skipped,
        skipped_reason: Some(reason),
        claim_error: None,
        started_at: crate::time::rfc3339(now.ms()),
        ended_at: None,
        exit_code: None,
        lease: "queue.ci".into(),
        todo_id: None,
        attempt: None,
        relay_outcome: None,
        check_exit: None,
        artifact: None,
    };
    record.ended_at = Some(record.started_at.clone());
    vec![
        Command::Emit {
            event: Event::closing(&record),
        },
        Command::WriteRunRecord { record },
    ]
}

fn env_of(c: &Command) -> Vec<(String, String)> {
    match c {
        Command::Spawn { env, .. } | Command::RunCheck { env, .. } => env.merged([]),
        _ => panic!("no env on {c:?}"),
    }
}

fn var(env: &[(String, String)], name: &str) -> Option<String> {
    env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

// ---- admission before claim -------------------------------------------------------------------

#[test]
fn firing_during_a_run() {
    let mut d = running();
    let cmds = d.fire();
    assert_eq!(
        cmds,
        skipped(2, "channel.sb", SkippedReason::Overlap, d.clock().wall)
    );
}

#[test]
fn a_held_firing_claims_only_when_it_starts() {
    let mut s = settings();
    s.on_overlap = OnOverlap::Queue;
    let mut d = Driver::new(s);
    d.start(claim_1());
    assert_eq!(
        d.fire(),
        [],
        "the firing is held, and nothing is sent for it"
    );
    assert_eq!(
        d.fire(),
        skipped(2, "channel.sb", SkippedReason::Overlap, d.clock().wall),
        "one firing is held; a further one is skipped"
    );
    d.exit(0, None);
    let cmds = d.report_ok(false);
    let claims: Vec<_> = cmds.iter().filter(|c| is_claim(c)).collect();
    assert_eq!(
        claims.len(),
        1,
        "the held firing claims once the run closes"
    );
    assert_eq!(claims[0].run_id(), 3);
    let closed = cmds
        .iter()
        .position(|c| matches!(c, Command::WriteRunRecord { record } if record.run_id == 1));
    let claimed_at = cmds.iter().position(is_claim);
    assert!(
        closed < claimed_at,
        "the run ends before the held firing claims"
    );
}

#[test]
fn outside_hours() {
    let mut d = Driver::new(settings());
    let cmds = d.input(Input::Firing {
        trigger: "schedule".into(),
        within_hours: false,
    });
    assert_eq!(
        cmds,
        skipped(1, "schedule", SkippedReason::OutsideHours, d.clock().wall)
    );
}

#[test]
fn a_disabled_harness_or_lease_source_claims_nothing() {
    let mut s = settings();
    s.enabled = false;
    let mut d = Driver::new(s);
    assert_eq!(
        d.fire(),
        skipped(1, "channel.sb", SkippedReason::Disabled, d.clock().wall)
    );
    let mut s = settings();
    s.lease_enabled = false;
    let mut d = Driver::new(s);
    assert_eq!(
        d.fire(),
        skipped(
            1,
            "channel.sb",
            SkippedReason::LeaseDisabled,
            d.clock().wall
        )
    );
}

// ---- claim ----------------------------------------------------------------------------------

#[test]
fn claimed_and_spawned() {
    let mut d = Driver::new(settings());
    let fired = d.fire();
    let mut running = RunRecord::new("fixer", "queue.ci", 1, "channel.sb", d.clock().wall);
    assert_eq!(
        fired,
        [
            Command::WriteRunRecord {
                record: running.clone()
            },
            Command::Emit {
                event: Event::RunStarted {
                    harness: "fixer".into(),
                    run_id: 1,
                    trigger: "channel.sb".into(),
                }
            },
            Command::SendClaimNext {
                request: RequestId(1),
                run_id: 1,
                queue: Some("ci-failures".into()),
                lease_ttl_seconds: 300,
                require_fence: true,
                claimant: "harness/buildbox/fixer/run-1".into(),
            }
        ]
    );
    d.now += 800;
    let cmds = d.input(Input::ClaimAnswered {
        request: RequestId(1),
        claim: claim_1(),
    });
    running.todo_id = Some("td_1".into());
    running.attempt = Some(1);
    assert_eq!(
        cmds[..2],
        [
            Command::Emit {
                event: Event::RelayClaimed {
                    harness: "fixer".into(),
                    run_id: 1,
                    todo_id: "td_1".into(),
                    attempt: 1
                }
            },
            Command::WriteRunRecord { record: running },
        ]
    );
    assert!(matches!(&cmds[2], Command::WriteContextFile { path, .. }
        if path == "/state/jobs/fixer/1.relay.json"));
    assert!(is_spawn(&cmds[3]) && cmds.len() == 4);
    assert_eq!(count(&d.commands(), is_claim), 1);
}

#[test]
fn nothing_to_claim() {
    let mut d = Driver::new(settings());
    d.input(Input::Firing {
        trigger: "catch_up".into(),
        within_hours: true,
    });
    let cmds = d.input(Input::ClaimEmpty {
        request: RequestId(1),
    });
    let record = &records(&cmds)[0];
    assert_eq!(record.outcome, RunOutcome::Skipped);
    assert_eq!(record.skipped_reason, Some(SkippedReason::NoWork));
    assert_eq!(record.relay_outcome, Some(RelayOutcome::NoWork));
    assert_eq!(
        cmds[0],
        Command::Emit {
            event: Event::RunSkipped {
                harness: "fixer".into(),
                run_id: 1,
                trigger: "catch_up".into(),
                reason: SkippedReason::NoWork,
                claim_error: None,
            }
        },
        "the run that found no work ends with run_skipped"
    );
    assert_eq!(cmds.len(), 2);
    assert!(
        !d.commands()
            .iter()
            .any(|c| is_spawn(c) || matches!(c, Command::WriteContextFile { .. }))
    );
    assert!(!d.relay.in_flight());
}

#[test]
fn endpoint_lacks_the_verb() {
    let mut d = Driver::new(settings());
    d.fire();
    let cmds = d.input(Input::ClaimFailed {
        request: RequestId(1),
        error: LeaseError::Code(ErrorCode::Forbidden),
    });
    let record = &records(&cmds)[0];
    assert_eq!(record.skipped_reason, Some(SkippedReason::ClaimFailed));
    assert_eq!(record.claim_error.as_deref(), Some("forbidden"));
    assert_eq!(cmds.len(), 2, "the event and the record; nothing spawned");
    // The doctor half: the endpoint's tools/list lacks the verb.
    let caps = check_capabilities(&tools_list(&[("list_todos", &["queue"])]));
    assert!(caps.missing_verbs.contains(&"claim_next".to_string()));
}

#[test]
fn a_claim_answer_without_a_needed_field_is_refused_and_named() {
    let mut d = Driver::new(settings());
    d.fire();
    let error = AnswerError {
        verb: "claim_next",
        field: "todo.attempt",
        problem: contract::Problem::Missing,
    };
    let cmds = d.input(Input::ClaimFailed {
        request: RequestId(1),
        error: LeaseError::Malformed(Box::new(error)),
    });
    let record = &records(&cmds)[0];
    assert_eq!(record.outcome, RunOutcome::Skipped);
    assert_eq!(record.skipped_reason, Some(SkippedReason::ClaimFailed));
    assert_eq!(record.claim_error.as_deref(), Some("malformed_answer"));
    let warning = cmds.iter().find_map(|c| match c {
        Command::WarnRunLog { text, .. } => Some(text.clone()),
        _ => None,
    });
    let warning = warning.unwrap_or_else(|| panic!("no run-log warning in {cmds:#?}"));
    assert!(warning.contains("todo.attempt"), "{warning}");
    assert!(warning.contains("the lease will lapse"), "{warning}");
    assert_eq!(
        d.advance(10 * MINUTE),
        [],
        "nothing is sent: the lease lapses"
    );
    assert!(
        !d.commands()
            .iter()
            .any(|c| is_spawn(c) || is_heartbeat(c) || is_report(c))
    );
    assert!(!d.relay.in_flight());
}

#[test]
fn a_claim_without_a_fence_is_refused() {
    let mut d = Driver::new(settings());
    let cmds = d.claim(claimed("td_1", 1, 5, None));
    let record = records(&cmds)
        .last()
        .map(|r| (*r).clone())
        .unwrap_or_else(|| panic!());
    assert_eq!(record.skipped_reason, Some(SkippedReason::ClaimFailed));
    assert_eq!(record.claim_error.as_deref(), Some("no_fence"));
    assert_eq!(record.relay_outcome, None);
    assert!(cmds.iter().any(|c| matches!(c, Command::WarnRunLog { .. })));
    assert_eq!(
        d.advance(10 * MINUTE),
        [],
        "no heartbeat, no report: the lease lapses"
    );
    assert!(
        !d.commands()
            .iter()
            .any(|c| is_spawn(c) || is_heartbeat(c) || is_report(c))
    );
}

// ---- context file and environment ------------------------------------------------------------

#[test]
fn second_attempt_sees_the_first() {
    let mut claim = claimed("td_1", 2, 5, Some(TOKEN));
    claim.attempt_seq = 2;
    claim.prior_attempts = vec![PriorAttempt {
        seq: Some(1),
        number: Some(1),
        outcome: Some("failed".into()),
        died: Some(false),
        claimant: Some("harness/buildbox/fixer/run-1".into()),
        claimed_at: read_wall_text("2026-09-22T11:00:00Z"),
        ended_at: read_wall_text("2026-09-22T11:20:00Z"),
        summary: Some("tests still red".into()),
        artifact: None,
        question: None,
        answer: None,
    }];
    let mut d = Driver::new(settings());
    // The wall clock runs an hour behind the monotonic one: the file's times are wall times.
    d.wall_offset = -(HOUR as i64);
    let cmds = d.claim(claim);
    let Some(Command::WriteContextFile { bytes, .. }) = cmds
        .iter()
        .find(|c| matches!(c, Command::WriteContextFile { .. }))
    else {
        panic!("no context file");
    };
    let file: Value = serde_json::from_slice(bytes).unwrap_or_default();
    let prior = &file["prior_attempts"][0];
    assert_eq!(prior["number"], 1);
    assert_eq!(prior["outcome"], "failed");
    assert_eq!(prior["died"], false);
    assert_eq!(prior["summary"], "tests still red");
    assert_eq!(file["version"], 1);
    assert_eq!(
        file["attempt"],
        json!({"seq": 2, "number": 2, "max": 5, "claimed_at": "2026-09-22T11:00:00Z",
               "idempotency_key": "td_1:2",
               "lease_ttl_seconds": 300})
    );
    assert_eq!(file["summary_file"], "/state/jobs/fixer/1.summary");
    assert_eq!(
        file["untrusted"],
        json!([
            "todo.title",
            "todo.payload",
            "todo.work_order",
            "prior_attempts[].summary",
            "prior_attempts[].question",
            "prior_attempts[].answer"
        ])
    );
    // A prior attempt that asked nothing carries no question or answer key at all.
    assert!(prior.get("question").is_none() && prior.get("answer").is_none());
    let todo_keys: Vec<&String> = file["todo"]
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(
        todo_keys,
        [
            "created_at",
            "id",
            "kind",
            "payload",
            "queue",
            "source",
            "title",
            "work_order"
        ]
    );
    // Byte-identical argv and prompt to an unleased run of the same harness.
    let Some(Command::Spawn { argv, stdin, .. }) = cmds.iter().find(|c| is_spawn(c)) else {
        panic!("no spawn");
    };
    assert_eq!(argv, &settings().argv);
    assert_eq!(stdin, &settings().prompt);
    let env = env_of(
        cmds.iter()
            .find(|c| is_spawn(c))
            .unwrap_or_else(|| panic!()),
    );
    assert_eq!(var(&env, "HARNESS_ATTEMPT").as_deref(), Some("2"));
    assert_eq!(var(&env, "HARNESS_MAX_ATTEMPTS").as_deref(), Some("5"));
    assert_eq!(var(&env, "HARNESS_TODO_ID").as_deref(), Some("td_1"));
    assert_eq!(var(&env, "HARNESS_ATTEMPT_SEQ").as_deref(), Some("2"));
    assert_eq!(
        var(&env, "HARNESS_IDEMPOTENCY_KEY").as_deref(),
        Some("td_1:2")
    );
    assert_eq!(
        var(&env, "HARNESS_RELAY_FILE").as_deref(),
        Some("/state/jobs/fixer/1.relay.json")
    );
}

#[test]
fn relay_variables_override_env_file_and_daemon_env() {
    let mut s = settings();
    s.env_file
        .push(("HARNESS_TODO_ID".into(), "from-env-file".into()));
    let mut d = Driver::new(s);
    let cmds = d.claim(claim_1());
    let Some(Command::Spawn { env, .. }) = cmds.iter().find(|c| is_spawn(c)) else {
        panic!("no spawn");
    };
    let merged = env.merged([("HARNESS_ATTEMPT".to_string(), "9".to_string())]);
    assert_eq!(var(&merged, "HARNESS_TODO_ID").as_deref(), Some("td_1"));
    assert_eq!(var(&merged, "HARNESS_ATTEMPT").as_deref(), Some("1"));
    assert_eq!(var(&merged, "GH_TOKEN").as_deref(), Some(ENV_FILE_SECRET));
}

#[test]
fn the_token_stays_out() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.advance(3 * MINUTE);
    // Even an agent and a check that somehow print the token do not carry it further.
    d.exit(1, Some(format!("stuck; my lease is {TOKEN}").as_bytes()));
    d.check_exit(1, &format!("auth failed for {TOKEN}\n"));
    d.report_ok(false);
    for c in d.commands() {
        if let Command::SendHeartbeat { lease_token, .. }
        | Command::SendReport { lease_token, .. } = &c
        {
            assert_eq!(lease_token.expose(), TOKEN);
        }
        assert!(!shown(&c).contains(TOKEN), "token in {}", shown(&c));
    }
    // The event file is the driver's (as for an unleased triggered run); the daemon's e2e test
    // must check that file, the run log and the real process environment for the token's bytes.
}

// ---- heartbeats -----------------------------------------------------------------------------

#[test]
fn a_long_run_keeps_its_lease() {
    let mut d = running();
    let start = d.now;
    d.advance(40 * MINUTE);
    let beats: Vec<(Millis, Command)> = d
        .log
        .iter()
        .filter(|(_, c)| is_heartbeat(c))
        .cloned()
        .collect();
    assert_eq!(beats.len(), 40);
    for (i, (t, c)) in beats.iter().enumerate() {
        assert_eq!(*t, start + (i as u64 + 1) * MINUTE);
        let Command::SendHeartbeat {
            todo_id,
            lease_token,
            lease_ttl_seconds,
            ..
        } = c
        else {
            panic!()
        };
        assert_eq!(
            (todo_id.as_str(), lease_token.expose(), *lease_ttl_seconds),
            ("td_1", TOKEN, 300)
        );
    }
    assert!(
        !d.commands()
            .iter()
            .any(|c| matches!(c, Command::Signal { .. }))
    );
    assert!(
        d.describe()
            .attempt
            .is_some_and(|a| a.lease_deadline.is_some())
    );
}

#[test]
fn the_lease_deadline_counts_from_the_send_time() {
    let mut d = Driver::new(settings());
    d.auto_heartbeat = AutoHeartbeat::Off;
    d.start(claim_1());
    d.advance(MINUTE); // heartbeat sent at +1m
    let request = d.last_request(is_heartbeat);
    d.advance(20 * SECOND);
    d.input(Input::HeartbeatOk { request }); // answered 20 s later
    let deadline = d.describe().attempt.and_then(|a| a.lease_deadline);
    assert_eq!(
        deadline.as_deref(),
        Some("2026-09-22T12:06:00Z"),
        "send time + ttl"
    );
}

// ---- lease loss -----------------------------------------------------------------------------

#[test]
fn taken_over() {
    let mut d = running();
    d.auto_heartbeat = AutoHeartbeat::Reply(Err(conflict()));
    let cmds = d.advance(MINUTE);
    let run_id = d.run_id();
    assert!(cmds.contains(&Command::Emit {
        event: Event::RelayLeaseLost {
            harness: "fixer".into(),
            run_id,
            todo_id: "td_1".into()
        }
    }));
    let term = d.log.iter().find(|(_, c)| is_term(c)).map(|(t, _)| *t);
    assert_eq!(term, Some(t0() + MINUTE), "stopped at once");
    assert!(d.advance(10 * SECOND).contains(&Command::Signal {
        run_id,
        signal: Signal::Kill
    }));
    let cmds = d.exit(-9, None);
    let record = &records(&cmds)[0];
    assert_eq!(record.outcome, RunOutcome::Cancelled);
    assert_eq!(record.relay_outcome, Some(RelayOutcome::LeaseLost));
    assert_eq!(count(&d.commands(), is_report), 0);
    assert_eq!(count(&d.commands(), is_heartbeat), 1);
}

/// Found by the simulator: a host that wakes from a pause longer than the lease finds its
/// heartbeat (due earlier) and its lease deadline due at once. The deadline goes first, and
/// nothing is sent on a lease that is already gone.
#[test]
fn a_host_waking_after_its_lease_sends_nothing_and_stops_at_once() {
    let mut d = running();
    d.now += 3 * settings().lease_ttl; // the host was frozen
    let cmds = d.input(Input::TimerFired);
    assert_eq!(count(&cmds, is_heartbeat), 0, "{cmds:?}");
    assert!(cmds.iter().any(is_term), "{cmds:?}");
    assert!(cmds.iter().any(|c| matches!(
        c,
        Command::Emit {
            event: Event::RelayLeaseLost { .. }
        }
    )));
}

#[test]
fn switchboard_unreachable() {
    let start = at("2026-09-22T11:58:00Z");
    let mut d = Driver::new_with(settings(), Capabilities::full(true), 1, start);
    d.start(claim_1());
    d.advance_to(at("2026-09-22T12:00:00Z")); // heartbeats at 11:59 and 12:00 succeed
    d.auto_heartbeat = AutoHeartbeat::Reply(Err(LeaseError::Transport));
    d.advance_to(at("2026-09-22T12:04:59.999Z"));
    assert!(
        !d.commands()
            .iter()
            .any(|c| matches!(c, Command::Signal { .. }))
    );
    let cmds = d.advance_to(at("2026-09-22T12:05:01Z"));
    let term = d.log.iter().find(|(_, c)| is_term(c)).map(|(t, _)| *t);
    assert_eq!(term, Some(at("2026-09-22T12:05:00Z")));
    assert!(cmds.iter().any(|c| matches!(
        c,
        Command::Emit {
            event: Event::RelayLeaseLost { .. }
        }
    )));
    // Retries never spaced further apart than the interval.
    let times: Vec<Millis> = d
        .log
        .iter()
        .filter(|(_, c)| is_heartbeat(c))
        .map(|(t, _)| *t)
        .collect();
    assert!(times.len() > 6, "transport failures are retried: {times:?}");
    assert!(times.windows(2).all(|w| w[1] - w[0] <= MINUTE));
    assert_eq!(
        d.advance(5 * MINUTE)
            .iter()
            .filter(|c| is_heartbeat(c))
            .count(),
        0
    );
}

/// The lease deadline runs on the monotonic clock: the worker's wall clock stepping back an
/// hour (an NTP correction, a VM restore, `date -s`) mid-attempt, with the server unreachable
/// from then on,
/// still stops the agent at the true deadline; stepping forward an hour stops nothing early.
/// Only the text of the records and of describe follows the wall clock.
#[test]
fn a_wall_clock_step_moves_no_deadline() {
    for step in [-(HOUR as i64), HOUR as i64] {
        let mut d = Driver::new(settings()); // claimed at 12:00:00, lease_ttl 5m
        d.start(claim_1());
        d.advance(2 * MINUTE); // heartbeats at 12:01 and 12:02: the lease runs to 12:07
        d.auto_heartbeat = AutoHeartbeat::Reply(Err(LeaseError::Transport));
        d.wall_offset = step;
        let shown = d.describe().attempt.and_then(|a| a.lease_deadline);
        let expected = crate::time::rfc3339((at("2026-09-22T12:07:00Z") as i64 + step) as u64);
        assert_eq!(
            shown,
            Some(expected),
            "describe shows the deadline in wall time"
        );
        d.advance_to(at("2026-09-22T12:06:59.999Z"));
        assert!(
            !d.commands().iter().any(is_term),
            "step {step}: stopped early"
        );
        d.advance_to(at("2026-09-22T12:07:01Z"));
        let term = d.log.iter().find(|(_, c)| is_term(c)).map(|(t, _)| *t);
        assert_eq!(term, Some(at("2026-09-22T12:07:00Z")), "step {step}");
        let cmds = d.exit(-15, None);
        let record = &records(&cmds)[0];
        assert_eq!(record.relay_outcome, Some(RelayOutcome::LeaseLost));
        let wall_end = (at("2026-09-22T12:07:01Z") as i64 + step) as u64;
        assert_eq!(record.ended_at, Some(crate::time::rfc3339(wall_end)));
        assert_eq!(record.started_at, "2026-09-22T12:00:00Z");
    }
}

// ---- verdict --------------------------------------------------------------------------------

#[test]
fn the_world_disagrees_with_the_agent() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    let cmds = d.exit(0, None);
    let check = cmds
        .iter()
        .find(|c| is_check(c))
        .unwrap_or_else(|| panic!("no check"));
    let Command::RunCheck { argv, workdir, .. } = check else {
        panic!()
    };
    assert_eq!(
        (argv[0].as_str(), workdir.as_str()),
        ("./scripts/required-checks-green.sh", "/src/app")
    );
    let env = env_of(check);
    assert_eq!(var(&env, "HARNESS_AGENT_EXIT").as_deref(), Some("0"));
    assert_eq!(
        var(&env, "HARNESS_AGENT_OUTCOME").as_deref(),
        Some("success")
    );
    assert_eq!(var(&env, "HARNESS_TODO_ID").as_deref(), Some("td_1"));
    let cmds = d.check_exit(1, "2 required checks failing\n");
    let (verb, summary, _, result) = the_report(&cmds);
    assert_eq!(verb, ReportVerb::Fail);
    assert_eq!(result["harness"]["reason"], "check_failed");
    assert!(summary.ends_with("2 required checks failing"));
}

#[test]
fn a_timed_out_agent_whose_fix_landed() {
    let mut s = with_check(settings(), 10 * MINUTE, 30 * SECOND);
    s.timeout = Some(45 * MINUTE);
    let mut d = Driver::new(s);
    d.start(claim_1());
    let run_id = d.run_id();
    assert!(d.advance(45 * MINUTE).contains(&Command::Signal {
        run_id,
        signal: Signal::Term
    }));
    assert!(d.advance(10 * SECOND).contains(&Command::Signal {
        run_id,
        signal: Signal::Kill
    }));
    let cmds = d.exit(-9, None);
    let env = env_of(
        cmds.iter()
            .find(|c| is_check(c))
            .unwrap_or_else(|| panic!("no check")),
    );
    assert_eq!(
        var(&env, "HARNESS_AGENT_OUTCOME").as_deref(),
        Some("timed_out")
    );
    assert_eq!(var(&env, "HARNESS_AGENT_EXIT").as_deref(), Some("-1"));
    let (verb, summary, _, result) = the_report(&d.check_exit(0, ""));
    assert_eq!(verb, ReportVerb::Complete);
    assert!(summary.starts_with(
        "attempt 1/5 · agent timed_out (exit -1) after 45m10s · check exit 0 after 0s"
    ));
    assert_eq!(result["harness"]["agent_outcome"], "timed_out");
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(
        (record.outcome, record.relay_outcome),
        (RunOutcome::Success, Some(RelayOutcome::Completed))
    );
}

#[test]
fn a_timed_out_agent_without_a_check_fails() {
    let mut s = settings();
    s.timeout = Some(10 * MINUTE);
    let mut d = Driver::new(s);
    d.start(claim_1());
    d.advance(10 * MINUTE);
    let (verb, _, _, result) = the_report(&d.exit(-15, None));
    assert_eq!(
        (verb, result["harness"]["reason"].clone()),
        (ReportVerb::Fail, json!("agent_timed_out"))
    );
    assert_eq!(
        records(&d.report_ok(false))[0].outcome,
        RunOutcome::TimedOut
    );
}

#[test]
fn ci_still_running() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.exit(0, None);
    for _ in 0..3 {
        d.advance(5 * SECOND); // the check takes 5 s
        assert!(!d.check_exit(75, "waiting for CI\n").iter().any(is_check));
        assert_eq!(
            count(&d.advance(30 * SECOND), is_check),
            1,
            "re-run 30 s later"
        );
    }
    d.advance(5 * SECOND);
    let (verb, summary, _, result) = the_report(&d.check_exit(0, "all green\n"));
    let runs: Vec<Millis> = d
        .log
        .iter()
        .filter(|(_, c)| is_check(c))
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(runs.len(), 4);
    assert!(runs.windows(2).all(|w| w[1] - w[0] == 35 * SECOND));
    assert_eq!(verb, ReportVerb::Complete);
    assert_eq!(
        (
            result["harness"]["check_runs"].clone(),
            result["harness"]["check_exit"].clone()
        ),
        (json!(4), json!(0))
    );
    assert!(summary.contains("check exit 0 after 1m50s"));
}

#[test]
fn a_check_that_stays_inconclusive_fails() {
    let mut d = Driver::new(with_check(settings(), 2 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.exit(0, None);
    let mut reports = Vec::new();
    for _ in 0..10 {
        d.advance(SECOND);
        reports.extend(d.check_exit(75, ""));
        if reports.iter().any(is_report) {
            break;
        }
        d.advance(30 * SECOND);
    }
    let (verb, _, _, result) = the_report(&reports);
    assert_eq!(
        (verb, result["harness"]["reason"].clone()),
        (ReportVerb::Fail, json!("check_inconclusive"))
    );
}

#[test]
fn a_check_still_running_at_its_timeout_is_killed() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.exit(0, None);
    let run_id = d.run_id();
    let cmds: Vec<Command> = d
        .advance(10 * MINUTE)
        .into_iter()
        .filter(|c| !is_heartbeat(c))
        .collect();
    assert_eq!(cmds, [Command::KillCheck { run_id }]);
    let (verb, _, _, result) = the_report(&d.input(Input::CheckExited {
        run_id,
        exit: ExitStatus::Signal(9),
        output_tail: Vec::new(),
    }));
    assert_eq!(
        (verb, result["harness"]["reason"].clone()),
        (ReportVerb::Fail, json!("check_timed_out"))
    );
}

#[test]
fn already_green() {
    let mut s = with_check(settings(), 10 * MINUTE, 30 * SECOND);
    if let Some(c) = s.success_check.as_mut() {
        c.before = true;
    }
    let mut d = Driver::new(s);
    let cmds = d.claim(claim_1());
    assert_eq!(count(&cmds, is_check), 1);
    assert!(!cmds.iter().any(is_spawn));
    // The check is told HARNESS_RELAY_FILE, so the file is written before it starts.
    let written = cmds
        .iter()
        .position(|c| matches!(c, Command::WriteContextFile { .. }))
        .expect("the context file is written before the check");
    let check = cmds.iter().position(is_check).unwrap_or_else(|| panic!());
    assert!(written < check);
    let Command::WriteContextFile { path, .. } = &cmds[written] else {
        panic!()
    };
    let env = env_of(&cmds[check]);
    assert_eq!(
        var(&env, "HARNESS_RELAY_FILE").as_deref(),
        Some(path.as_str())
    );
    assert_eq!(
        var(&env, "HARNESS_AGENT_EXIT"),
        None,
        "no agent has run yet"
    );
    let (verb, summary, artifact, result) = the_report(&d.check_exit(0, ""));
    assert_eq!(
        (verb, summary.as_str(), artifact),
        (
            ReportVerb::Complete,
            "success_check passed before spawn",
            None
        )
    );
    assert_eq!(result["harness"]["agent_exit"], Value::Null);
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Completed));
    assert_eq!(record.exit_code, None);
    assert_eq!(count(&d.commands(), is_spawn), 0);
}

#[test]
fn a_red_check_before_the_spawn_proceeds_to_the_work() {
    let mut s = with_check(settings(), 10 * MINUTE, 30 * SECOND);
    if let Some(c) = s.success_check.as_mut() {
        c.before = true;
    }
    let mut d = Driver::new(s);
    d.claim(claim_1());
    let cmds = d.check_exit(1, "");
    // The context file was written before the check; the spawn follows at once.
    assert!(is_spawn(&cmds[0]), "{cmds:?}");
    assert_eq!(
        count(&cmds, |c| matches!(c, Command::WriteContextFile { .. })),
        0
    );
}

// ---- report ---------------------------------------------------------------------------------

#[test]
fn report_retried_through_a_blip() {
    let mut d = running();
    d.advance(12 * MINUTE + 4 * SECOND);
    let (verb, _, _, result) = the_report(&d.exit(1, None));
    assert_eq!(verb, ReportVerb::Fail);
    assert_eq!(
        result,
        json!({"harness": {"host": "buildbox", "harness": "fixer", "run_id": 1, "attempt": 1,
            "agent_exit": 1, "agent_outcome": "failed", "duration_s": 724,
            "check_exit": null, "check_runs": 0, "reason": "agent_failed"}})
    );
    assert_eq!(
        d.report_failed(LeaseError::Transport),
        [],
        "no immediate resend"
    );
    let retry = d.advance(MINUTE);
    assert_eq!(count(&retry, is_report), 1, "retried within the interval");
    let cmds = d.report_ok(false);
    let record = &records(&cmds)[0];
    assert_eq!(
        (record.outcome, record.relay_outcome),
        (RunOutcome::Failed, Some(RelayOutcome::Failed))
    );
    assert_eq!(count(&d.commands(), is_report), 2);
    assert_eq!(d.advance(10 * MINUTE), [], "the run is over");
}

/// Found by the simulator: a heartbeat that crossed the report on the wire is refused because
/// the report already closed the attempt. That refusal alone is not a lost lease: the report's
/// answer decides, and a report waiting for its retry is sent again at once (the server answers
/// a repeat under the same token as it answered the first).
#[test]
fn a_heartbeat_refused_while_the_report_is_out_lets_the_report_decide() {
    // The report is in flight when the refusal arrives: its answer decides.
    let mut d = running();
    d.auto_heartbeat = AutoHeartbeat::Off;
    d.exit(0, None);
    d.advance(MINUTE);
    let hb = d.last_request(is_heartbeat);
    let cmds = d.input(Input::HeartbeatFailed {
        request: hb,
        error: conflict(),
    });
    assert!(
        cmds.is_empty(),
        "nothing stops, nothing is recorded yet: {cmds:?}"
    );
    assert_eq!(
        count(&d.advance(3 * MINUTE), is_heartbeat),
        0,
        "no more heartbeats"
    );
    let cmds = d.report_ok(false);
    assert_eq!(
        records(&cmds)[0].relay_outcome,
        Some(RelayOutcome::Completed)
    );

    // The report is waiting for a retry: it goes again at once, and a refusal of the report
    // itself is the lost lease.
    let mut d = running();
    d.auto_heartbeat = AutoHeartbeat::Off;
    d.exit(0, None);
    d.advance(MINUTE);
    let hb = d.last_request(is_heartbeat);
    assert_eq!(
        d.report_failed(LeaseError::Transport),
        [],
        "the retry waits"
    );
    let cmds = d.input(Input::HeartbeatFailed {
        request: hb,
        error: conflict(),
    });
    assert_eq!(
        count(&cmds, is_report),
        1,
        "the report is repeated now: {cmds:?}"
    );
    let cmds = d.report_failed(conflict());
    assert_eq!(
        records(&cmds)[0].relay_outcome,
        Some(RelayOutcome::LeaseLost)
    );
}

#[test]
fn a_report_not_accepted_by_the_deadline_is_lost() {
    let mut d = running();
    d.exit(1, None);
    d.auto_heartbeat = AutoHeartbeat::Reply(Err(LeaseError::Transport));
    let mut log = Vec::new();
    for _ in 0..20 {
        if let Some(request) = request_in(&d.commands(), is_report) {
            log.extend(d.input(Input::ReportFailed {
                request,
                error: LeaseError::Transport,
            }));
        }
        log.extend(d.advance(30 * SECOND));
    }
    let record = records(&log)
        .last()
        .map(|r| (*r).clone())
        .unwrap_or_else(|| panic!("not closed"));
    assert_eq!(
        (record.outcome, record.relay_outcome),
        (RunOutcome::Failed, Some(RelayOutcome::ReportLost))
    );
}

#[test]
fn a_report_answered_conflict_is_lease_loss() {
    let mut d = running();
    d.exit(0, None);
    let cmds = d.report_failed(conflict());
    let record = &records(&cmds)[0];
    assert_eq!(
        (record.outcome, record.relay_outcome),
        (RunOutcome::Cancelled, Some(RelayOutcome::LeaseLost))
    );
    assert!(
        !cmds.iter().any(|c| matches!(c, Command::Signal { .. })),
        "no process to stop"
    );
}

// ---- summary --------------------------------------------------------------------------------

#[test]
fn the_agent_explains_itself() {
    let mut d = running();
    d.advance(16 * MINUTE);
    let file = br#"{"summary": "bumped the fixture; flaky test remains", "artifact": "mcp://cairn/Ab12Cd34"}"#;
    let (_, summary, artifact, result) = the_report(&d.exit(0, Some(file)));
    assert_eq!(
        summary,
        "attempt 1/5 · agent success (exit 0) after 16m\nbumped the fixture; flaky test remains"
    );
    assert_eq!(artifact.as_deref(), Some("mcp://cairn/Ab12Cd34"));
    assert!(
        result["harness"].get("summary").is_none() && result["harness"].get("artifact").is_none()
    );
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(record.artifact.as_deref(), Some("mcp://cairn/Ab12Cd34"));
}

#[test]
fn a_token_in_the_agents_summary() {
    let github = "ghp_16C7e42F292c6912E7710c838347Ae178B4a";
    let mut d = running();
    let text = format!("pushed with {github}; also {HEADER_SECRET} and {ENV_FILE_SECRET}");
    let (_, summary, _, _) = the_report(&d.exit(1, Some(text.as_bytes())));
    assert!(summary.contains("pushed with ghp_[REDACTED]; also [REDACTED] and [REDACTED]"));
    for secret in [github, HEADER_SECRET, ENV_FILE_SECRET] {
        assert!(!summary.contains(secret));
    }
}

#[test]
fn a_long_summary_is_capped_keeping_the_first_line() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.exit(1, Some("é".repeat(3000).as_bytes()));
    let (_, summary, _, _) = the_report(&d.check_exit(1, &"check says no\n".repeat(50)));
    assert!(summary.len() <= 2048);
    assert!(summary.starts_with("attempt 1/5 · agent failed (exit 1)"));
    assert!(
        summary.ends_with("é…"),
        "the check output went first, then the agent text was cut"
    );
}

// ---- artifact -------------------------------------------------------------------------------

#[test]
fn malformed_handle() {
    let mut d = running();
    let cmds = d.exit(
        1,
        Some(br#"{"summary": "done", "artifact": "file:///etc/passwd"}"#),
    );
    let (_, _, artifact, _) = the_report(&cmds);
    assert_eq!(artifact, None);
    assert!(
        cmds.iter()
            .any(|c| matches!(c, Command::WarnRunLog { text, .. } if text.contains("dropped")))
    );
}

// ---- receipts -------------------------------------------------------------------------------

fn with_receipt() -> HarnessSettings {
    let mut s = settings();
    s.attempt_receipt = Some("cairn.main".into());
    s
}

#[test]
fn receipt_on_failure() {
    let mut d = Driver::new(with_receipt());
    d.start(claim_1());
    let cmds = d.exit(1, None);
    assert_eq!(count(&cmds, is_report), 0, "the receipt comes first");
    let Some(Command::UploadReceipt {
        request,
        source,
        markdown,
        tags,
        timeout,
        run_log_lines,
        redactor,
        ..
    }) = cmds.iter().find(|c| is_receipt(c)).cloned()
    else {
        panic!("no receipt");
    };
    assert_eq!(
        (source.as_str(), timeout, run_log_lines),
        ("cairn.main", 30 * SECOND, 200)
    );
    assert_eq!(tags, ["receipt", "harness", "relay"]);
    assert!(markdown.contains("attempt 1/5 · agent failed (exit 1)"));
    let log = format!("\u{1b}[1mcurl -H 'X-Key: {HEADER_SECRET}'\u{1b}[0m\nline 2\n");
    let section = summary::receipt_log_section(log.as_bytes(), run_log_lines, &redactor);
    assert!(section.contains("curl -H 'X-Key: [REDACTED]'\nline 2") && !section.contains('\u{1b}'));
    let cmds = d.input(Input::ReceiptUploaded {
        request,
        handle: "mcp://cairn/Rc1pt".into(),
    });
    let (verb, _, artifact, _) = the_report(&cmds);
    assert_eq!(
        (verb, artifact.as_deref()),
        (ReportVerb::Fail, Some("mcp://cairn/Rc1pt"))
    );
    assert_eq!(count(&d.commands(), is_receipt), 1);
}

#[test]
fn cairn_down() {
    let mut d = Driver::new(with_receipt());
    d.start(claim_1());
    d.exit(1, None);
    let verdict_at = d.now;
    let request = d.last_request(is_receipt);
    assert_eq!(count(&d.advance(30 * SECOND - 1), is_report), 0);
    let cmds = d.advance(1);
    let (verb, _, artifact, _) = the_report(&cmds);
    assert_eq!((verb, artifact), (ReportVerb::Fail, None));
    assert_eq!(d.now, verdict_at + 30 * SECOND);
    assert!(cmds.iter().any(|c| matches!(c, Command::WarnRunLog { .. })));
    // The late answer is stale.
    assert_eq!(
        d.input(Input::ReceiptUploaded {
            request,
            handle: "mcp://cairn/late".into()
        }),
        []
    );
}

// ---- aborts ---------------------------------------------------------------------------------

#[test]
fn daemon_shutdown_with_release_granted() {
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    let run_id = d.run_id();
    let cmds = d.input(Input::StopRequested {
        reason: StopReason::Shutdown,
    });
    assert_eq!(
        cmds,
        [Command::Signal {
            run_id,
            signal: Signal::Term
        }]
    );
    let (verb, summary, artifact, result) = the_report(&d.exit(-15, None));
    assert_eq!(
        (verb, artifact, result),
        (ReportVerb::Release, None, Value::Null)
    );
    assert!(summary.contains("daemon stopping"));
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(
        (record.outcome, record.relay_outcome),
        (RunOutcome::Cancelled, Some(RelayOutcome::Released))
    );
    assert_eq!(count(&d.commands(), is_check), 0, "no success check runs");
}

#[test]
fn an_abort_without_release_fails_with_the_reason() {
    let mut d = Driver::with_capabilities(settings(), Capabilities::full(false));
    d.start(claim_1());
    d.input(Input::StopRequested {
        reason: StopReason::UsageLimit,
    });
    let (verb, summary, _, result) = the_report(&d.exit(-15, None));
    assert_eq!(
        (verb, result["harness"]["reason"].clone()),
        (ReportVerb::Fail, json!("usage_limit"))
    );
    assert!(summary.contains("usage limit"));
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Failed));
}

#[test]
fn a_stop_while_claiming_releases_the_claim_at_once() {
    let mut d = Driver::new(settings());
    d.fire();
    assert_eq!(
        d.input(Input::StopRequested {
            reason: StopReason::OperatorStop
        }),
        []
    );
    let cmds = d.input(Input::ClaimAnswered {
        request: RequestId(1),
        claim: claim_1(),
    });
    assert!(!cmds.iter().any(is_spawn));
    assert_eq!(the_report(&cmds).0, ReportVerb::Release);
}

// ---- restart --------------------------------------------------------------------------------

#[test]
fn crash_mid_attempt() {
    let mut d = running();
    d.advance(3 * MINUTE);
    let left = d.last_record();
    assert_eq!(left.outcome, RunOutcome::Running);
    drop(d); // the daemon is killed: its machine and token are gone
    let reconciled = reconcile_interrupted(left, Wall::from_ms(t0() + 4 * MINUTE));
    assert_eq!(reconciled.outcome, RunOutcome::Interrupted);
    assert_eq!(reconciled.relay_outcome, None);
    assert_eq!(reconciled.ended_at.as_deref(), Some("2026-09-22T12:04:00Z"));
    let mut fresh = Driver::new_with(settings(), Capabilities::full(true), 2, t0() + 4 * MINUTE);
    assert_eq!(
        fresh.relay.poll_timeout(),
        None,
        "nothing is sent for the old run"
    );
    let cmds = fresh.fire();
    assert!(
        cmds.iter()
            .any(|c| matches!(c, Command::SendClaimNext { claimant, .. }
        if claimant == "harness/buildbox/fixer/run-2"))
    );
    assert_eq!(count(&fresh.commands(), is_report), 0);
}

// ---- dead letter ----------------------------------------------------------------------------

#[test]
fn last_attempt_fails() {
    let mut d = Driver::new(settings());
    d.start(claimed("td_1", 5, 5, Some(TOKEN)));
    d.exit(1, None);
    let cmds = d.report_ok(true);
    assert!(cmds.contains(&Command::Emit {
        event: Event::RelayReported {
            harness: "fixer".into(),
            run_id: 1,
            todo_id: "td_1".into(),
            relay_outcome: RelayOutcome::DeadLettered,
            dead_letter: true
        }
    }));
    assert_eq!(
        records(&cmds)[0].relay_outcome,
        Some(RelayOutcome::DeadLettered)
    );
    let outbound: Vec<Command> = d
        .commands()
        .into_iter()
        .filter(|c| c.is_lease_call() || is_receipt(c))
        .collect();
    assert!(
        outbound.iter().all(Command::is_lease_call),
        "only the lease source is called"
    );
}

#[test]
fn a_dead_letter_is_never_inferred() {
    let mut d = Driver::new(settings());
    d.start(claimed("td_1", 5, 5, Some(TOKEN)));
    d.exit(1, None);
    assert_eq!(
        records(&d.report_ok(false))[0].relay_outcome,
        Some(RelayOutcome::Failed)
    );
}

// ---- lease client session, credentials --------------------------------------------------------

#[test]
fn never_a_ring_target() {
    // Machine half: across a whole attempt the only network commands are claim, heartbeat,
    // report (and receipt); no command exists that could open a notification stream. The
    // daemon's e2e test must add: a fake server sharing a url with a channel source observes
    // exactly one GET stream, the listener's.
    let mut d = Driver::new(with_receipt());
    d.start(claim_1());
    d.advance(5 * MINUTE);
    d.exit(0, None);
    d.input(Input::ReceiptFailed {
        request: d.last_request(is_receipt),
        error: "503".into(),
    });
    d.report_ok(false);
    for c in d.commands() {
        assert!(
            c.is_lease_call()
                || is_receipt(&c)
                || matches!(
                    c,
                    Command::WriteRunRecord { .. }
                        | Command::Emit { .. }
                        | Command::WriteContextFile { .. }
                        | Command::Spawn { .. }
                        | Command::WarnRunLog { .. }
                ),
            "{c:?}"
        );
    }
}

#[test]
fn doctor_output() {
    // Machine half of `harness describe fixer` during an attempt; the daemon's e2e test must
    // check the rendered text and the protocol frame too.
    let d = running();
    let view = d.describe();
    assert_eq!(view.lease, "queue.ci");
    let attempt = view.attempt.clone().unwrap_or_else(|| panic!("no attempt"));
    assert_eq!(
        (attempt.todo_id.as_deref(), attempt.attempt),
        (Some("td_1"), Some(1))
    );
    assert_eq!(
        attempt.lease_deadline.as_deref(),
        Some("2026-09-22T12:05:00Z")
    );
    let shown = format!(
        "{} {:?} {:?}",
        describe_json(&d.relay, d.clock()),
        view,
        d.relay
    );
    for secret in [TOKEN, HEADER_SECRET, ENV_FILE_SECRET] {
        assert!(!shown.contains(secret), "{secret} shown");
    }
    assert!(format!("{:?}", LeaseToken::new(TOKEN)) == "LeaseToken(<redacted>)");
}

// ---- capabilities ---------------------------------------------------------------------------

fn predating_tools() -> Value {
    tools_list(&[
        ("claim_next", &["queue", "lease_ttl_seconds"]),
        ("heartbeat", &["id", "lease_ttl_seconds"]),
        ("complete", &["id", "result"]),
        ("fail", &["id", "result"]),
    ])
}

#[test]
fn a_server_that_predates_attempt_history() {
    let caps = check_capabilities(&predating_tools());
    assert!(!caps.supported());
    for missing in [
        "claim_next.require_fence",
        "claim_next.claimant",
        "heartbeat.lease_token",
    ] {
        assert!(caps.missing.contains(&missing.to_string()), "{missing}");
    }
    let mut d = Driver::with_capabilities(settings(), caps);
    let cmds = d.fire();
    assert_eq!(
        cmds,
        skipped(
            1,
            "channel.sb",
            SkippedReason::LeaseSourceUnsupported,
            d.clock().wall
        )
    );
}

#[test]
fn the_server_is_upgraded() {
    let mut d = Driver::with_capabilities(settings(), check_capabilities(&predating_tools()));
    d.fire();
    let upgraded = check_capabilities(&contract_tools());
    assert_eq!(upgraded, Capabilities::full(true), "the doctor row clears");
    d.input(Input::CapabilitiesKnown(upgraded));
    let cmds = d.fire();
    assert!(cmds.iter().any(|c| matches!(
        c,
        Command::SendClaimNext {
            require_fence: true,
            ..
        }
    )));
}

#[test]
fn a_claim_waits_for_the_capability_check_of_a_new_session() {
    let mut d = Driver::new(settings());
    d.input(Input::SessionExpired);
    assert_eq!(
        d.fire(),
        skipped(
            1,
            "channel.sb",
            SkippedReason::LeaseSourceUnsupported,
            d.clock().wall
        )
    );
}

#[test]
fn schema_declares_the_fence() {
    let caps = check_capabilities(&contract_tools());
    let mut d = Driver::with_capabilities(settings(), caps);
    d.start(claim_1());
    d.advance(5 * MINUTE);
    let beats: Vec<Command> = d.commands().into_iter().filter(is_heartbeat).collect();
    assert_eq!(beats.len(), 5);
    assert!(
        beats
            .iter()
            .all(|c| matches!(c, Command::SendHeartbeat { lease_token, .. }
        if lease_token.expose() == TOKEN))
    );
}

// ---- records --------------------------------------------------------------------------------

#[test]
fn a_failed_attempts_record() {
    let s = with_check(settings(), 10 * MINUTE, 30 * SECOND);
    let mut d = Driver::new_with(s, Capabilities::full(true), 7, t0());
    d.start(claimed("td_1", 2, 5, Some(TOKEN)));
    d.exit(0, Some(b"secret payload words"));
    d.check_exit(1, "");
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(record.run_id, 7);
    assert_eq!(record.lease, "queue.ci");
    assert_eq!(record.todo_id.as_deref(), Some("td_1"));
    assert_eq!(record.attempt, Some(2));
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Failed));
    assert_eq!(record.check_exit, Some(1));
    let json = serde_json::to_value(&record).unwrap_or_default();
    assert_eq!(json["relay_outcome"], "failed");
    let text = json.to_string();
    for absent in [
        "summary",
        "payload",
        "secret payload words",
        TOKEN,
        HEADER_SECRET,
    ] {
        assert!(!text.contains(absent), "{absent} in {text}");
    }
}

// ---- visibility -----------------------------------------------------------------------------

#[test]
fn doctor_on_a_read_only_endpoint() {
    let caps = check_capabilities(&tools_list(&[("list_todos", &["queue", "state", "limit"])]));
    assert_eq!(
        caps.missing_verbs,
        ["claim_next", "heartbeat", "complete", "fail"]
    );
    assert!(!caps.release_advertised, "a missing release is a notice");
    assert!(!caps.supported());
}

// ---- pools ----------------------------------------------------------------------------------

#[test]
fn three_workers_two_todos() {
    let mut ledger = Ledger::new(LedgerConfig::default());
    for id in ["td_a", "td_b"] {
        let new = NewTodo {
            id: id.into(),
            queue: "ci-failures".into(),
            title: format!("fix {id}"),
            ..NewTodo::default()
        };
        ledger
            .add_todo(t0() - MINUTE, "sb", new)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut source = LedgerSource::new(ledger, "sb");
    let mut workers: Vec<Driver> = ["w1", "w2", "w3"]
        .iter()
        .map(|name| {
            let mut s = settings();
            s.harness = name.to_string();
            let mut d = Driver::new(s);
            d.auto_heartbeat = AutoHeartbeat::Off;
            d
        })
        .collect();
    // One doorbell fires all three; each claims on its own.
    let mut todos = Vec::new();
    for d in &mut workers {
        let cmds = d.fire();
        let claim = cmds
            .iter()
            .find(|c| is_claim(c))
            .unwrap_or_else(|| panic!("no claim"));
        let answer = source
            .serve(d.now, claim)
            .unwrap_or_else(|| panic!("not served"));
        let cmds = d.input(answer);
        if let Some(Command::Spawn { env, .. }) = cmds.iter().find(|c| is_spawn(c)) {
            todos.push(
                env.relay_var("HARNESS_TODO_ID")
                    .unwrap_or_default()
                    .to_string(),
            );
        } else {
            let record = &records(&cmds)[0];
            assert_eq!(record.skipped_reason, Some(SkippedReason::NoWork));
        }
    }
    todos.sort();
    assert_eq!(todos, ["td_a", "td_b"]);
    // The two attempts heartbeat and complete against the same ledger.
    for d in workers.iter_mut().filter(|d| d.relay.in_flight()) {
        d.spawned();
        for c in d.advance(MINUTE) {
            let answer = source
                .serve(d.now, &c)
                .unwrap_or_else(|| panic!("not served"));
            assert!(matches!(answer, Input::HeartbeatOk { .. }));
            d.input(answer);
        }
        let cmds = d.exit(0, None);
        let report = cmds
            .iter()
            .find(|c| is_report(c))
            .unwrap_or_else(|| panic!("no report"));
        let answer = source
            .serve(d.now, report)
            .unwrap_or_else(|| panic!("not served"));
        let record = records(&d.input(answer))[0].clone();
        assert_eq!(record.relay_outcome, Some(RelayOutcome::Completed));
    }
    assert!(
        source
            .ledger
            .todos()
            .all(|t| t.state == crate::ledger::TodoState::Done)
    );
}

// ---- concurrency ------------------------------------------------------------------------------

#[test]
fn no_leaked_heartbeat() {
    // Machine half: after each of 100 attempts closes, no timer is armed and nothing more is
    // asked for. The daemon's e2e test must add the task count returning to its baseline.
    let mut d = Driver::new(settings());
    for n in 0..100u32 {
        d.start(claimed(&format!("td_{n}"), 1, 5, Some(TOKEN)));
        d.advance(90 * SECOND);
        d.exit(0, None);
        d.report_ok(false);
        assert!(!d.relay.in_flight());
        assert_eq!(d.relay.poll_timeout(), None);
    }
    assert_eq!(d.advance(24 * 60 * MINUTE), []);
}

// ---- error handling -------------------------------------------------------------------------

#[test]
fn a_conflict_is_not_a_transport_error() {
    let mut d = Driver::new(settings());
    d.auto_heartbeat = AutoHeartbeat::Off;
    d.start(claim_1());
    d.advance(MINUTE);
    let request = d.last_request(is_heartbeat);
    d.now += 2 * SECOND;
    let cmds = d.input(Input::HeartbeatFailed {
        request,
        error: conflict(),
    });
    assert!(cmds.iter().any(is_term), "lease loss at once");
    assert!(!matches!(
        d.relay.poll_timeout(),
        Some((_, TimerReason::Heartbeat))
    ));
    // Contrast: a transport failure is retried within the interval, and stops nothing.
    let mut d = Driver::new(settings());
    d.auto_heartbeat = AutoHeartbeat::Off;
    d.start(claim_1());
    d.advance(MINUTE);
    let request = d.last_request(is_heartbeat);
    let cmds = d.input(Input::HeartbeatFailed {
        request,
        error: LeaseError::Transport,
    });
    assert_eq!(cmds, []);
    let next = d.relay.poll_timeout();
    let now = d.clock().mono;
    assert!(matches!(next, Some((t, TimerReason::Heartbeat)) if t <= now + SECOND && t > now));
}

#[test]
fn stale_answers_are_ignored_and_unknown_ones_refused() {
    let mut d = running();
    d.exit(0, None);
    d.report_ok(false);
    let request = d.last_request(is_heartbeat_or_report);
    assert_eq!(d.input(Input::HeartbeatOk { request }), []);
    assert_eq!(
        d.input(Input::ReportAnswered {
            request,
            dead_letter: true,
            next_retry_at: None
        }),
        []
    );
    assert_eq!(
        d.try_input(Input::HeartbeatOk {
            request: RequestId(999)
        }),
        Err(ContractError::UnknownRequest(RequestId(999)))
    );
    assert!(matches!(
        d.try_input(Input::ProcessExited {
            run_id: 1,
            exit: ExitStatus::Code(0),
            summary_file: None
        }),
        Err(ContractError::NoProcess { run_id: 1, .. })
    ));
    assert!(matches!(
        d.try_input(Input::CheckExited {
            run_id: 1,
            exit: ExitStatus::Code(0),
            output_tail: vec![]
        }),
        Err(ContractError::NoCheck { run_id: 1, .. })
    ));
}

fn is_heartbeat_or_report(c: &Command) -> bool {
    is_heartbeat(c) || is_report(c)
}

// ---- Properties (bodies in crate::testing::relay) ------------------------------------------

/// Each property as a test of its own, over the same kind of input.
macro_rules! relay_properties {
    ($($name:ident => $body:ident),* $(,)?) => {
        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            $(
                #[test]
                fn $name(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
                    $body(&bytes).map_err(TestCaseError::fail)?;
                }
            )*
        }
    };
}

relay_properties! {
    prop_no_lease_call_before_admission => relay_admission_before_lease_calls,
    prop_silent_after_lease_loss => relay_silent_after_lease_loss,
    prop_nothing_after_close => relay_nothing_after_close,
    prop_token_only_in_lease_calls => relay_token_stays_in_lease_calls,
    prop_one_relay_outcome_per_claim => relay_one_outcome_per_claim,
    prop_wall_clock_moves_no_deadline => relay_wall_clock_moves_no_deadline,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn prop_summary_is_bounded_redacted_and_keeps_its_first_line(
        bytes in proptest::collection::vec(any::<u8>(), 0..6000),
    ) {
        prop_assert_eq!(crate::testing::summary_compose(&bytes), Ok(()));
    }
}

// ---- events ---------------------------------------------------------------------------------

fn events(cmds: &[Command]) -> Vec<&Event> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Emit { event } => Some(event),
            _ => None,
        })
        .collect()
}

fn event_name(e: &Event) -> String {
    serde_json::to_value(e).unwrap_or_default()["event"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn an_attempt_emits_its_events_in_order_and_none_holds_a_secret() {
    let mut d = running();
    d.exit(0, Some(br#"{"summary":"fixed the flaky test"}"#));
    d.report_ok(false);
    let cmds = d.commands();
    let names: Vec<String> = events(&cmds).into_iter().map(event_name).collect();
    assert_eq!(
        names,
        [
            "run_started",
            "relay_claimed",
            "relay_reported",
            "run_finished"
        ]
    );
    assert_eq!(
        events(&cmds).last().map(|e| (*e).clone()),
        Some(Event::RunFinished {
            harness: "fixer".into(),
            run_id: 1,
            outcome: RunOutcome::Success,
            relay_outcome: Some(RelayOutcome::Completed),
        })
    );
    // run_finished is the run's last command but for its final record.
    let n = cmds.len();
    assert!(matches!(
        &cmds[n - 2],
        Command::Emit {
            event: Event::RunFinished { .. }
        }
    ));
    assert!(
        matches!(&cmds[n - 1], Command::WriteRunRecord { record } if record.outcome == RunOutcome::Success)
    );
    let text = serde_json::to_string(&events(&cmds)).unwrap_or_default();
    for secret in [
        TOKEN,
        HEADER_SECRET,
        ENV_FILE_SECRET,
        "fixed the flaky test",
        "ci-failures",
    ] {
        assert!(!text.contains(secret), "{secret} in {text}");
    }
    let json = serde_json::to_value(events(&cmds)[1]).unwrap_or_default();
    assert_eq!(
        json,
        json!({"event": "relay_claimed", "harness": "fixer", "run_id": 1, "todo_id": "td_1", "attempt": 1})
    );
}

#[test]
fn a_skipped_firing_is_one_run_skipped_with_its_reason() {
    let mut d = running();
    let cmds = d.fire();
    assert_eq!(
        events(&cmds),
        [&Event::RunSkipped {
            harness: "fixer".into(),
            run_id: 2,
            trigger: "channel.sb".into(),
            reason: SkippedReason::Overlap,
            claim_error: None,
        }]
    );
    let json = serde_json::to_value(events(&cmds)[0]).unwrap_or_default();
    assert_eq!(json["reason"], "overlap");
    assert!(json.get("claim_error").is_none());
}

#[test]
fn a_lost_lease_ends_with_run_finished_after_relay_lease_lost() {
    let mut d = running();
    d.auto_heartbeat = AutoHeartbeat::Reply(Err(conflict()));
    d.advance(MINUTE);
    d.exit(-15, None);
    let names: Vec<String> = events(&d.commands()).into_iter().map(event_name).collect();
    assert_eq!(
        names,
        [
            "run_started",
            "relay_claimed",
            "relay_lease_lost",
            "run_finished"
        ]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every run's events open with run_started (unless it is one run_skipped), close with
    /// exactly one run_finished or run_skipped, and the closing event comes right before the
    /// run's final record.
    #[test]
    fn prop_each_run_is_framed_by_its_events(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let trace = run_relay_program(&decode_relay_program(&bytes)).map_err(TestCaseError::fail)?;
        let cmds: Vec<&Command> = trace.steps.iter().flat_map(|s| &s.commands).collect();
        let mut seen: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
        for (i, c) in cmds.iter().enumerate() {
            match c {
                Command::Emit { event } => seen.entry(event.run_id()).or_default().push(event_name(event)),
                Command::WriteRunRecord { record } if record.outcome != RunOutcome::Running => {
                    let closing = match cmds.get(i.wrapping_sub(1)) {
                        Some(Command::Emit { event }) if event.run_id() == record.run_id => event.clone(),
                        other => return Err(TestCaseError::fail(format!("final record of run {} not preceded by its closing event: {other:?}", record.run_id))),
                    };
                    prop_assert_eq!(closing, Event::closing(record));
                }
                _ => {}
            }
        }
        for (run, names) in seen {
            let closing = names.iter().filter(|n| *n == "run_finished" || *n == "run_skipped").count();
            prop_assert!(closing <= 1, "run {}: {:?}", run, names);
            if names.len() > 1 || names[0] != "run_skipped" {
                prop_assert_eq!(&names[0], "run_started", "run {}: {:?}", run, names);
            }
            if closing == 1 {
                let last = names.last().map(String::as_str);
                prop_assert!(matches!(last, Some("run_finished" | "run_skipped")), "run {}: {:?}", run, names);
            }
        }
    }
}

// ---- reload and operator stop ---------------------------------------------------------------

#[test]
fn a_reload_waits_for_the_attempt_in_flight_and_applies_at_its_close() {
    let mut d = running();
    let mut new = settings();
    new.lease_ttl = 2 * MINUTE;
    new.argv = vec!["codex".into()];
    assert_eq!(
        d.relay.reconfigure(new.clone()),
        Reconfigured::AfterRun { run_id: 1 }
    );
    assert_eq!(
        d.relay.settings().lease_ttl,
        5 * MINUTE,
        "the attempt runs on"
    );
    let beats = d.advance(MINUTE);
    assert!(
        beats.iter().any(|c| matches!(
            c,
            Command::SendHeartbeat {
                lease_ttl_seconds: 300,
                ..
            }
        )),
        "the heartbeat still asks for the old ttl: {beats:?}"
    );
    d.exit(0, None);
    d.report_ok(false);
    assert_eq!(d.relay.settings(), &new, "applied once the attempt closed");
    let cmds = d.fire();
    assert!(cmds.iter().any(|c| matches!(
        c,
        Command::SendClaimNext {
            lease_ttl_seconds: 120,
            ..
        }
    )));
    let cmds = d.input(Input::ClaimAnswered {
        request: d.last_request(is_claim),
        claim: claimed("td_2", 1, 5, Some(TOKEN)),
    });
    assert!(
        cmds.iter()
            .any(|c| matches!(c, Command::Spawn { argv, .. } if argv == &["codex".to_string()]))
    );
}

#[test]
fn a_reload_without_an_attempt_applies_at_once_and_a_revert_drops_the_waiting_settings() {
    let mut d = Driver::new(settings());
    let mut new = settings();
    new.enabled = false;
    assert_eq!(d.relay.reconfigure(new.clone()), Reconfigured::Now);
    assert_eq!(
        d.fire(),
        skipped(1, "channel.sb", SkippedReason::Disabled, d.clock().wall)
    );
    assert_eq!(d.relay.reconfigure(new), Reconfigured::Unchanged);

    let mut d = running();
    let mut new = settings();
    new.argv = vec!["other".into()];
    assert_eq!(
        d.relay.reconfigure(new),
        Reconfigured::AfterRun { run_id: 1 }
    );
    assert_eq!(d.relay.reconfigure(settings()), Reconfigured::Unchanged);
    d.exit(0, None);
    d.report_ok(false);
    assert_eq!(
        d.relay.settings(),
        &settings(),
        "the reverted settings stay"
    );
}

#[test]
fn a_new_lease_source_is_unverified_until_its_capability_check() {
    let mut d = Driver::new(settings());
    let mut new = settings();
    new.lease = "queue.other".into();
    assert_eq!(d.relay.reconfigure(new), Reconfigured::Now);
    let cmds = d.fire();
    assert_eq!(cmds, {
        let mut s = skipped(
            1,
            "channel.sb",
            SkippedReason::LeaseSourceUnsupported,
            d.clock().wall,
        );
        if let Command::WriteRunRecord { record } = &mut s[1] {
            record.lease = "queue.other".into();
        }
        s[0] = Command::Emit {
            event: Event::RunSkipped {
                harness: "fixer".into(),
                run_id: 1,
                trigger: "channel.sb".into(),
                reason: SkippedReason::LeaseSourceUnsupported,
                claim_error: None,
            },
        };
        s
    });
    d.input(Input::CapabilitiesKnown(Capabilities::full(true)));
    assert!(d.fire().iter().any(is_claim));
}

#[test]
fn a_removed_harness_is_released_naming_the_reason_or_failed_without_release() {
    for release in [true, false] {
        let mut d = Driver::with_capabilities(settings(), Capabilities::full(release));
        d.start(claim_1());
        assert!(d.relay.stop_would_abort());
        d.input(Input::StopRequested {
            reason: StopReason::HarnessRemoved,
        });
        assert!(!d.relay.stop_would_abort(), "already stopping");
        let (verb, summary, _, result) = the_report(&d.exit(-15, None));
        assert!(summary.contains("harness removed"), "{summary}");
        if release {
            assert_eq!(verb, ReportVerb::Release);
        } else {
            assert_eq!(verb, ReportVerb::Fail);
            assert_eq!(result["harness"]["reason"], "harness_removed");
        }
        assert_eq!(count(&d.commands(), is_check), 0);
    }
}

#[test]
fn an_operator_stop_ends_the_attempt_and_a_later_firing_claims_again() {
    let mut d = Driver::new(settings());
    assert!(!d.relay.stop_would_abort(), "nothing in flight");
    d.start(claim_1());
    d.input(Input::StopRequested {
        reason: StopReason::OperatorStop,
    });
    let (verb, summary, _, _) = the_report(&d.exit(-15, None));
    assert_eq!(verb, ReportVerb::Release);
    assert!(summary.contains("operator stop"), "{summary}");
    d.report_ok(false);
    assert!(!d.relay.in_flight());
    let cmds = d.fire();
    assert!(
        cmds.iter().any(is_claim),
        "the stop does not outlive its attempt"
    );
}

#[test]
fn a_stop_once_the_verdict_is_known_changes_nothing() {
    let mut d = running();
    d.exit(0, None);
    assert!(!d.relay.stop_would_abort(), "the complete is out");
    assert_eq!(
        d.input(Input::StopRequested {
            reason: StopReason::OperatorStop
        }),
        []
    );
    let record = records(&d.report_ok(false))[0].clone();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Completed));
}

/// The failure class and signature of the one fail report in `cmds`.
fn fail_class(cmds: &[Command]) -> (Option<bool>, Option<String>) {
    cmds.iter()
        .find_map(|c| match c {
            Command::SendReport {
                verb: ReportVerb::Fail,
                retryable,
                failure_signature,
                ..
            } => Some((*retryable, failure_signature.clone())),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no fail report in {cmds:#?}"))
}

#[test]
fn a_listed_exit_code_or_the_summary_file_makes_a_failure_non_retryable() {
    // The driver's settings list exit code 3.
    let listed = fail_class(&running().exit(3, None));
    assert_eq!(listed.0, Some(false));
    let plain = fail_class(&running().exit(1, None));
    assert_eq!(plain.0, Some(true));
    let said = br#"{"summary": "the token lacks repo scope", "retryable": false}"#;
    assert_eq!(fail_class(&running().exit(1, Some(said))).0, Some(false));
    // The signature is the same for the same failure and changes with it.
    assert_eq!(fail_class(&running().exit(1, None)).1, plain.1);
    assert_ne!(listed.1, plain.1);
    assert_eq!(plain.1.as_ref().map(String::len), Some(32));
    // A listed check exit code counts as well.
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    d.start(claim_1());
    d.exit(0, None);
    assert_eq!(fail_class(&d.check_exit(3, "denied\n")).0, Some(false));
}

// ---- waiting for a human, and spend --------------------------------------------------------

/// What the agent writes to ask: a question naming the lease token (redacted on the way out),
/// with its summary and a handle.
fn asking_file() -> Vec<u8> {
    json!({"needs_input": format!("which branch? ({TOKEN})"), "summary": "stuck",
           "artifact": "mcp://cairn/Q1"})
    .to_string()
    .into_bytes()
}

/// The one report in `cmds`, whole.
fn report_in(cmds: &[Command]) -> Command {
    let reports: Vec<&Command> = cmds.iter().filter(|c| is_report(c)).collect();
    assert_eq!(reports.len(), 1, "expected one report in {cmds:#?}");
    reports[0].clone()
}

/// What the one report in `cmds` says (its request, run and token aside).
#[derive(Debug)]
struct Sent {
    verb: ReportVerb,
    summary: String,
    artifact: Option<String>,
    result: Value,
    question: Option<String>,
    retryable: Option<bool>,
    failure_signature: Option<String>,
}

fn sent(cmds: &[Command]) -> Sent {
    let Command::SendReport {
        verb,
        summary,
        artifact,
        result,
        question,
        retryable,
        failure_signature,
        ..
    } = report_in(cmds)
    else {
        unreachable!("report_in answers reports")
    };
    Sent {
        verb,
        summary,
        artifact,
        result,
        question,
        retryable,
        failure_signature,
    }
}

#[test]
fn an_agent_that_asks_sends_request_input_and_no_check_judges_it() {
    let s = with_check(settings(), 10 * MINUTE, 30 * SECOND);
    for dead_letter in [false, true] {
        let mut d = Driver::with_capabilities(s.clone(), our_server_capabilities());
        assert!(d.describe().input_advertised);
        d.start(claim_1());
        d.advance(2 * MINUTE);
        let cmds = d.exit(0, Some(&asking_file()));
        assert_eq!(
            count(&cmds, is_check),
            0,
            "the agent did not finish: no check"
        );
        let r = sent(&cmds);
        assert_eq!(r.verb, ReportVerb::RequestInput);
        assert_eq!(r.question.as_deref(), Some("which branch? ([REDACTED])"));
        assert_eq!(
            r.summary,
            "attempt 1/5 · agent success (exit 0) after 2m\nstuck"
        );
        assert_eq!(r.artifact.as_deref(), Some("mcp://cairn/Q1"));
        assert_eq!(
            (r.result, r.retryable, r.failure_signature),
            (Value::Null, None, None)
        );
        // The token is nowhere in what the machine said.
        for c in d.commands() {
            if !c.is_lease_call() {
                assert!(!shown(&c).contains(TOKEN), "{c:?}");
            }
        }
        d.report_ok(dead_letter);
        let record = d.last_record();
        let want = if dead_letter {
            RelayOutcome::DeadLettered
        } else {
            RelayOutcome::InputRequested
        };
        assert_eq!(
            (record.outcome, record.relay_outcome),
            (RunOutcome::Success, Some(want))
        );
        assert_eq!(record.artifact.as_deref(), Some("mcp://cairn/Q1"));
        assert!(!d.relay.in_flight());
    }
}

#[test]
fn a_question_where_the_server_cannot_take_one_fails_retryably_and_keeps_the_question() {
    // The contract's surface: no request_input (our server shows it only to endpoints granted
    // the verb).
    let mut d = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    assert!(!d.describe().input_advertised);
    d.start(claim_1());
    let cmds = d.exit(0, Some(&asking_file()));
    assert_eq!(count(&cmds, is_check), 0);
    let r = sent(&cmds);
    assert_eq!(r.verb, ReportVerb::Fail);
    assert_eq!(r.question, None);
    assert_eq!(r.result["harness"]["reason"], "needs_input_unsupported");
    assert_eq!(
        r.summary,
        "attempt 1/5 · agent success (exit 0) after 0s\n\
         needs input: which branch? ([REDACTED])\nstuck"
    );
    assert_eq!(
        r.retryable,
        Some(true),
        "another endpoint may be able to ask"
    );
    // The same question failing again carries the same signature (max_same_failures ends it).
    let mut again = Driver::new(with_check(settings(), 10 * MINUTE, 30 * SECOND));
    again.start(claimed("td_1", 2, 5, Some(TOKEN)));
    let second = sent(&again.exit(0, Some(&asking_file()))).failure_signature;
    assert!(r.failure_signature.is_some() && r.failure_signature == second);
    d.report_ok(false);
    assert_eq!(d.last_record().relay_outcome, Some(RelayOutcome::Failed));
    // A blank question is no question: the check judges as usual.
    let mut d = Driver::with_capabilities(
        with_check(settings(), 10 * MINUTE, 30 * SECOND),
        our_server_capabilities(),
    );
    d.start(claim_1());
    let cmds = d.exit(0, Some(br#"{"needs_input": " \t", "summary": "done"}"#));
    assert_eq!(count(&cmds, is_check), 1);
}

#[test]
fn a_stop_before_the_agent_asks_releases_and_a_lost_lease_sends_no_question() {
    let mut d = Driver::with_capabilities(settings(), our_server_capabilities());
    d.start(claim_1());
    d.input(Input::StopRequested {
        reason: StopReason::OperatorStop,
    });
    let cmds = d.exit(-15, Some(&asking_file()));
    assert_eq!(sent(&cmds).verb, ReportVerb::Release);
    let mut d = Driver::with_capabilities(settings(), our_server_capabilities());
    d.auto_heartbeat = AutoHeartbeat::Reply(Err(conflict()));
    d.start(claim_1());
    d.advance(MINUTE);
    let cmds = d.exit(-15, Some(&asking_file()));
    assert_eq!(count(&cmds, is_report), 0);
    assert_eq!(d.last_record().relay_outcome, Some(RelayOutcome::LeaseLost));
}

/// Asking, answering and spending against the real ledger, through the wire both ways: the
/// question waits for its answer, the next attempt's context file carries both (as untrusted)
/// with the budget left in its environment, and the heartbeat whose usage reaches the budget
/// is refused, which stops the agent.
#[test]
fn ask_answer_and_overspend_against_the_ledger() {
    use crate::ledger::{Actor, Budget, DeadLetterReason, Op, TodoState};
    use crate::wire::UsageArg;
    let cost = |usd: f64| UsageArg {
        cost_usd: Some(usd),
        ..UsageArg::default()
    };
    let mut ledger = Ledger::new(LedgerConfig::default());
    let new = NewTodo {
        id: "td_1".into(),
        queue: "ci-failures".into(),
        title: "which branch to fix".into(),
        max_attempts: Some(3),
        budget: Budget {
            cost_micros: Some(1_000_000),
            tokens: None,
        },
        ..NewTodo::default()
    };
    ledger
        .add_todo(t0() - MINUTE, "sb", new)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut source = LedgerSource::new(ledger, "sb");
    source.caps = our_server_capabilities();
    let mut d = Driver::with_capabilities(settings(), our_server_capabilities());
    d.auto_heartbeat = AutoHeartbeat::Off;
    let serve = |source: &mut LedgerSource, d: &mut Driver, c: &Command, usage: Option<f64>| {
        let usage = usage.map(cost);
        let answer = source
            .serve_with(d.now, c, usage.as_ref())
            .unwrap_or_else(|| panic!("not served: {c:?}"));
        d.input(answer)
    };
    let claim_and_spawn = |source: &mut LedgerSource, d: &mut Driver| {
        let cmds = d.fire();
        let claim = cmds.iter().find(|c| is_claim(c)).cloned();
        let cmds = serve(
            source,
            d,
            &claim.unwrap_or_else(|| panic!("no claim")),
            None,
        );
        let spawn = cmds.iter().find(|c| is_spawn(c)).cloned();
        let context = cmds.iter().find_map(|c| match c {
            Command::WriteContextFile { bytes, .. } => serde_json::from_slice::<Value>(bytes).ok(),
            _ => None,
        });
        d.spawned();
        let env = env_of(&spawn.unwrap_or_else(|| panic!("no spawn")));
        (env, context.unwrap_or_else(|| panic!("no context file")))
    };

    // Attempt 1 spends 30 cents and asks.
    let (env, _) = claim_and_spawn(&mut source, &mut d);
    assert_eq!(
        var(&env, "HARNESS_BUDGET_REMAINING").as_deref(),
        Some(r#"{"cost_usd":1.0}"#)
    );
    assert_eq!(
        var(&env, "HARNESS_USAGE_FILE").as_deref(),
        Some("/state/jobs/fixer/1.usage.json")
    );
    for c in d.advance(MINUTE) {
        let answer = serve(&mut source, &mut d, &c, Some(0.2));
        assert_eq!(answer, []);
    }
    let report = report_in(&d.exit(0, Some(br#"{"needs_input": "which branch?"}"#)));
    let closed = serve(&mut source, &mut d, &report, Some(0.3));
    assert_eq!(
        records(&closed)[0].relay_outcome,
        Some(RelayOutcome::InputRequested)
    );
    let todo = source.ledger.todo("td_1").cloned().expect("the todo");
    assert_eq!(todo.state, TodoState::InputRequired);
    assert_eq!(
        todo.spent.cost_micros, 300_000,
        "the report's usage, the highest"
    );
    // Nothing to claim while it waits.
    let cmds = d.fire();
    let claim = cmds.iter().find(|c| is_claim(c)).cloned().expect("a claim");
    let skipped = serve(&mut source, &mut d, &claim, None);
    assert_eq!(
        records(&skipped)[0].skipped_reason,
        Some(SkippedReason::NoWork)
    );

    // The operator answers; attempt 2 sees the question and the answer, and what is left.
    let answer = Op::AnswerTodo {
        now: d.now,
        actor: Actor::cli(),
        id: "td_1".into(),
        answer: "main".into(),
        key: None,
        seq: None,
    };
    source
        .ledger
        .apply(answer)
        .unwrap_or_else(|e| panic!("{e}"));
    let (env, context) = claim_and_spawn(&mut source, &mut d);
    let prior = &context["prior_attempts"][0];
    assert_eq!(prior["outcome"], "needs_input");
    assert_eq!(prior["question"], "which branch?");
    assert_eq!(prior["answer"], "main");
    let untrusted = context["untrusted"].as_array().cloned().unwrap_or_default();
    for path in ["prior_attempts[].question", "prior_attempts[].answer"] {
        assert!(
            untrusted.contains(&json!(path)),
            "{path} not in {untrusted:?}"
        );
    }
    assert_eq!(
        var(&env, "HARNESS_BUDGET_REMAINING").as_deref(),
        Some(r#"{"cost_usd":0.7}"#)
    );

    // Attempt 2's usage reaches the budget at its first heartbeat: refused, the agent stopped.
    let beats = d.advance(MINUTE);
    let [beat] = &beats[..] else {
        panic!("one heartbeat: {beats:?}")
    };
    let stopped = serve(&mut source, &mut d, beat, Some(0.7));
    assert_eq!(count(&stopped, is_term), 1, "{stopped:?}");
    let todo = source.ledger.todo("td_1").cloned().expect("the todo");
    assert_eq!(
        todo.dead_letter_reason,
        Some(DeadLetterReason::BudgetExhausted)
    );
    d.exit(-15, None);
    assert_eq!(d.last_record().relay_outcome, Some(RelayOutcome::LeaseLost));
    assert!(!d.relay.in_flight());
}
