//! The contract's client side on answers written by hand: exactly the table's fields, our own
//! server's full shape (from the real ledger), extra fields, and each needed field missing.

use serde_json::{Value, json};

use super::*;
use crate::ledger::{Actor, ClaimOpts, Ledger, LedgerConfig, NewTodo, Report, TokenHash};
use crate::relay::RequestId;
use crate::testing::Queue;
use crate::testing::relay::{contract_tools, t0};
use crate::time::{MINUTE, SECOND, Wall, read_wall_text, rfc3339};
use crate::wire::ClaimOut;

const TOKEN: &str = "tok-C0NTRACT-s3cr3t";

/// A claim answer with the contract table's fields and nothing more.
fn contract_only() -> Value {
    json!({
        "empty": false,
        "todo": {
            "id": "td_1", "queue": "ci-failures", "title": "CI red on main",
            "kind": "check_suite", "source": "gitea", "payload": {"sha": "abc123"},
            "work_order": null, "attempt": 2, "max_attempts": 5,
            "created_at": "2026-09-22T11:58:00Z"
        },
        "attempt_seq": 7,
        "lease_token": TOKEN,
        "prior_attempts": [{
            "seq": 6, "attempt": 1, "outcome": "failed", "died": false,
            "claimant": "harness/box/fixer/run-1", "claimed_at": "2026-09-22T11:59:00Z",
            "ended_at": "2026-09-22T11:59:30Z", "summary": "first try", "artifact": null
        }]
    })
}

fn claimed(answer: &Value) -> ClaimedTodo {
    match decode_claim(answer) {
        Ok(ClaimAnswer::Claimed(c)) => c,
        other => panic!("not a claim: {other:?}"),
    }
}

fn error(answer: &Value) -> AnswerError {
    match decode_claim(answer) {
        Err(e) => e,
        Ok(other) => panic!("decoded: {other:?}"),
    }
}

#[test]
fn a_contract_only_claim_answer_decodes() {
    let c = claimed(&contract_only());
    assert_eq!(c.todo_id, "td_1");
    assert_eq!((c.attempt, c.max_attempts, c.attempt_seq), (2, 5, 7));
    assert_eq!(c.lease_token, Some(LeaseToken::new(TOKEN)));
    assert_eq!(
        c.todo,
        json!({"id": "td_1", "queue": "ci-failures", "title": "CI red on main",
               "kind": "check_suite", "source": "gitea", "payload": {"sha": "abc123"},
               "work_order": null, "created_at": "2026-09-22T11:58:00Z"})
    );
    assert_eq!(
        c.prior_attempts,
        [PriorAttempt {
            seq: Some(6),
            number: Some(1),
            outcome: Some("failed".into()),
            died: Some(false),
            claimant: Some("harness/box/fixer/run-1".into()),
            claimed_at: read_wall_text("2026-09-22T11:59:00Z"),
            ended_at: read_wall_text("2026-09-22T11:59:30Z"),
            summary: Some("first try".into()),
            artifact: None,
            question: None,
            answer: None,
        }]
    );
    assert_eq!(
        c.budget_remaining, None,
        "no budget in the answer, none in the claim"
    );
}

#[test]
fn only_the_needed_fields_are_needed() {
    // The todo's other fields and prior_attempts are optional: absent reads as null / [].
    let answer = json!({
        "todo": {"id": "td_1", "attempt": 1, "max_attempts": 3},
        "attempt_seq": 1,
        "lease_token": TOKEN,
    });
    let c = claimed(&answer);
    assert_eq!(c.todo["id"], "td_1");
    assert_eq!(c.todo["title"], Value::Null);
    assert!(c.prior_attempts.is_empty());
    assert_eq!(
        decode_claim(&json!({"empty": true})),
        Ok(ClaimAnswer::Empty)
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let mut answer = contract_only();
    answer["attempts_total"] = json!(2);
    answer["shard"] = json!({"x": [1, 2]});
    answer["todo"]["state"] = json!("claimed");
    answer["todo"]["lease_expires_at"] = json!(17);
    answer["todo"]["owner"] = json!({"nested": true});
    answer["prior_attempts"][0]["claimer_kind"] = json!("endpoint");
    answer["prior_attempts"][0]["disposition"] = json!(["odd"]);
    let with_extras = claimed(&answer);
    assert_eq!(with_extras, claimed(&contract_only()));
    // The todo carries the contract's fields and nothing else into the context file.
    assert!(with_extras.todo.get("state").is_none());
    assert!(with_extras.todo.get("owner").is_none());
}

#[test]
fn a_missing_or_unusable_needed_field_is_named() {
    type Break = fn(&mut Value);
    let cases: [(&str, Break); 5] = [
        ("todo", |a| a["todo"] = Value::Null),
        ("todo.id", |a| {
            a["todo"].as_object_mut().map(|t| t.remove("id"));
        }),
        ("todo.attempt", |a| {
            a["todo"].as_object_mut().map(|t| t.remove("attempt"));
        }),
        ("todo.max_attempts", |a| {
            a["todo"].as_object_mut().map(|t| t.remove("max_attempts"));
        }),
        ("attempt_seq", |a| {
            a.as_object_mut().map(|t| t.remove("attempt_seq"));
        }),
    ];
    for (field, break_it) in cases {
        let mut answer = contract_only();
        break_it(&mut answer);
        let e = error(&answer);
        assert_eq!(
            (e.verb, e.field, e.problem),
            ("claim_next", field, Problem::Missing)
        );
        assert_eq!(
            e.to_string(),
            format!("the claim_next answer has no {field}")
        );
    }
    let wrong: [(&str, &str, Value); 6] = [
        ("todo.id", "id", json!("")),
        ("todo.id", "id", json!(17)),
        ("todo.attempt", "attempt", json!("2")),
        ("todo.attempt", "attempt", json!(0)),
        ("todo.max_attempts", "max_attempts", json!(-1)),
        ("todo.max_attempts", "max_attempts", json!(1u64 << 40)),
    ];
    for (field, key, value) in wrong {
        let mut answer = contract_only();
        answer["todo"][key] = value;
        let e = error(&answer);
        assert_eq!(e.field, field);
        assert!(matches!(e.problem, Problem::Not(_)), "{e}");
    }
    let mut answer = contract_only();
    answer["attempt_seq"] = json!(1.5);
    assert_eq!(
        error(&answer).to_string(),
        "the claim_next answer's attempt_seq is not a whole number"
    );
    // Not an object at all, or no answer (a text-only tool result).
    assert_eq!(error(&json!([1, 2])).field, "todo");
    assert_eq!(error(&Value::Null).field, "todo");
}

#[test]
fn a_claim_without_a_usable_lease_token() {
    // Absent or null: the server ignored require_fence; the machine refuses it as no_fence.
    for token in [None, Some(Value::Null)] {
        let mut answer = contract_only();
        match token {
            None => {
                answer.as_object_mut().map(|a| a.remove("lease_token"));
            }
            Some(v) => answer["lease_token"] = v,
        }
        assert_eq!(claimed(&answer).lease_token, None);
    }
    // Present but unusable: named, and the value is never quoted (it may be a token).
    for bad in [json!(""), json!(42), json!({"token": TOKEN})] {
        let mut answer = contract_only();
        answer["lease_token"] = bad;
        let e = error(&answer);
        assert_eq!(e.field, "lease_token");
        assert!(!e.to_string().contains(TOKEN));
        assert!(!format!("{e:?}").contains(TOKEN));
    }
}

#[test]
fn prior_attempts_are_read_field_by_field() {
    let mut answer = contract_only();
    answer["prior_attempts"] = json!([
        "not an attempt",
        {"seq": "6", "attempt": 1, "died": "no", "summary": 12, "outcome": "reaped"},
    ]);
    let c = claimed(&answer);
    assert_eq!(c.prior_attempts.len(), 1);
    let p = &c.prior_attempts[0];
    assert_eq!((p.seq, p.number, p.died), (None, Some(1), None));
    assert_eq!(p.summary, None);
    assert_eq!(p.outcome.as_deref(), Some("reaped"));
    answer["prior_attempts"] = json!({"not": "a list"});
    assert!(claimed(&answer).prior_attempts.is_empty());
}

#[test]
fn a_prior_attempts_times_are_read_liberally_once_and_written_strictly() {
    let mut answer = contract_only();
    answer["prior_attempts"] = json!([
        {"seq": 4, "claimed_at": "2026-09-22T13:59:00.000+02:00", "ended_at": " 2026-09-22t11:59:30z "},
        {"seq": 5, "claimed_at": "yesterday", "ended_at": 1_790_000_000_000u64},
        {"seq": 6, "claimed_at": "2026-09-22T11:59:00.25Z", "ended_at": null},
    ]);
    let c = claimed(&answer);
    let times: Vec<_> = c
        .prior_attempts
        .iter()
        .map(|p| {
            let text = |t: Wall| rfc3339(t.ms());
            (p.claimed_at.map(text), p.ended_at.map(text))
        })
        .collect();
    let text = |s: &str| Some(s.to_string());
    assert_eq!(
        times,
        [
            (text("2026-09-22T11:59:00Z"), text("2026-09-22T11:59:30Z")),
            (None, None),
            (text("2026-09-22T11:59:00.250Z"), None),
        ]
    );
    // The context file writes them as the server does, and what it cannot read as null.
    let bytes = crate::relay::context_file_bytes(
        &c,
        read_wall_text("2026-09-22T12:00:00Z").unwrap_or_default(),
        300,
        "/s",
    );
    let file: Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let prior = &file["prior_attempts"];
    assert_eq!(prior[2]["claimed_at"], "2026-09-22T11:59:00Z");
    assert_eq!(prior[2]["ended_at"], "2026-09-22T11:59:30Z");
    assert_eq!(
        (&prior[1]["claimed_at"], &prior[1]["ended_at"]),
        (&Value::Null, &Value::Null)
    );
    assert_eq!(file["attempt"]["claimed_at"], "2026-09-22T12:00:00Z");
    // And read back as written.
    let back: crate::relay::PriorAttempt =
        serde_json::from_value(prior[2].clone()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, c.prior_attempts[0]);
}

/// The real ledger after `new` (as `td_1`, "CI red on main" in `ci-failures`, three attempts)
/// was added for endpoint `sb` and claimed once under the lease token `tok-1`.
fn claimed_once(new: NewTodo) -> Ledger {
    let mut ledger = Ledger::new(LedgerConfig::default());
    let new = NewTodo {
        id: "td_1".into(),
        queue: "ci-failures".into(),
        title: "CI red on main".into(),
        max_attempts: Some(3),
        ..new
    };
    ledger
        .add_todo(t0() - MINUTE, "sb", new)
        .unwrap_or_else(|e| panic!("{e}"));
    ledger
        .claim_next(
            t0(),
            &Actor::endpoint("sb".to_string()),
            None,
            &claim_opts("tok-1"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    ledger
}

/// A fenced claim by the harness `fixer`, for five minutes.
fn claim_opts(token: &str) -> ClaimOpts {
    ClaimOpts {
        claimant: Some("harness/box/fixer/run-1".into()),
        ..ClaimOpts::fenced(300 * SECOND, TokenHash::of(token))
    }
}

#[test]
fn our_own_servers_full_answer_decodes() {
    let endpoint = Actor::endpoint("sb".to_string());
    let new = NewTodo {
        kind: Some("check_suite".into()),
        payload: Some(json!({"sha": "abc123"})),
        ..NewTodo::default()
    };
    let mut ledger = claimed_once(new);
    let report = Report {
        summary: Some("first try".into()),
        token_hash: Some(TokenHash::of("tok-1")),
        ..Report::default()
    };
    ledger
        .fail(t0() + SECOND, &endpoint, "td_1", &report)
        .unwrap_or_else(|e| panic!("{e}"));
    let later = t0() + 60 * MINUTE;
    let second = ledger
        .claim_next(later, &endpoint, None, &claim_opts(TOKEN))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("the retry is claimable an hour later"));
    let out = ClaimOut::claimed(&second, Some(LeaseToken::new(TOKEN)));
    let answer = serde_json::to_value(&out).unwrap_or_default();
    // Our server answers more than the contract names: that is the point of the test.
    assert!(answer["todo"].get("attempts_total").is_some());
    let c = claimed(&answer);
    assert_eq!(c.todo_id, "td_1");
    assert_eq!((c.attempt, c.max_attempts), (2, 3));
    assert_eq!(c.attempt_seq, u64::from(second.attempt_seq));
    assert_eq!(c.lease_token, Some(LeaseToken::new(TOKEN)));
    assert_eq!(c.todo["title"], "CI red on main");
    assert_eq!(c.todo["payload"], json!({"sha": "abc123"}));
    assert_eq!(c.prior_attempts.len(), 1);
    let p = &c.prior_attempts[0];
    assert_eq!((p.number, p.died), (Some(1), Some(false)));
    assert_eq!(p.outcome.as_deref(), Some("failed"));
    assert_eq!(p.summary.as_deref(), Some("first try"));
}

/// A todo with a budget whose first attempt spent some of it and asked a question, answered by
/// the operator: the retry's claim answer from the real ledger.
fn answered_claim() -> Value {
    use crate::ledger::{Answer, Budget, Op, Usage};
    let endpoint = Actor::endpoint("sb".to_string());
    let new = NewTodo {
        budget: Budget {
            cost_micros: Some(1_000_000),
            tokens: Some(1_000),
        },
        ..NewTodo::default()
    };
    let mut ledger = claimed_once(new);
    let usage = Usage {
        cost_micros: 300_000,
        input_tokens: 700,
        output_tokens: 200,
    };
    let ops = [
        Op::Heartbeat {
            now: t0() + SECOND,
            actor: endpoint.clone(),
            id: "td_1".into(),
            ttl: 300 * SECOND,
            token_hash: Some(TokenHash::of("tok-1")),
            usage: Some(usage),
        },
        Op::RequestInput {
            now: t0() + 2 * SECOND,
            actor: endpoint.clone(),
            id: "td_1".into(),
            question: "which branch?".into(),
            report: Report {
                summary: Some("stuck".into()),
                token_hash: Some(TokenHash::of("tok-1")),
                ..Report::default()
            },
        },
        Op::AnswerTodo {
            now: t0() + MINUTE,
            actor: Actor::cli(),
            id: "td_1".into(),
            answer: "main".into(),
            key: None,
            seq: None,
        },
    ];
    for op in ops {
        ledger
            .apply(op)
            .and_then(Answer::todo)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let second = ledger
        .claim_next(t0() + 2 * MINUTE, &endpoint, None, &claim_opts(TOKEN))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("the answered todo is claimable"));
    let out = ClaimOut::claimed(&second, Some(LeaseToken::new(TOKEN)));
    serde_json::to_value(&out).unwrap_or_default()
}

#[test]
fn a_claim_after_an_answer_carries_the_question_the_answer_and_the_budget_left() {
    let answer = answered_claim();
    let c = claimed(&answer);
    let p = &c.prior_attempts[0];
    assert_eq!(p.outcome.as_deref(), Some("needs_input"));
    assert_eq!(p.question.as_deref(), Some("which branch?"));
    assert_eq!(p.answer.as_deref(), Some("main"));
    assert_eq!(
        c.budget_remaining,
        Some(crate::relay::BudgetRemaining {
            cost_usd: Some(0.7),
            tokens: Some(100)
        })
    );
    // Neither budget nor spend travels into the context file's todo.
    assert!(c.todo.get("budget").is_none() && c.todo.get("spent").is_none());
    // A server that says nothing of spend gives no budget; a mistyped question reads as absent.
    let mut bare = answer.clone();
    bare["todo"].as_object_mut().map(|t| t.remove("budget"));
    bare["prior_attempts"][0]["question"] = json!(["which", "branch"]);
    let c = claimed(&bare);
    assert_eq!(
        (c.budget_remaining, c.prior_attempts[0].question.clone()),
        (None, None)
    );
}

fn report(verb: ReportVerb) -> Command {
    crate::testing::relay::report_command(3, verb, TOKEN)
}

fn heartbeat() -> Command {
    Command::SendHeartbeat {
        request: RequestId(2),
        run_id: 1,
        todo_id: "td_1".into(),
        lease_ttl_seconds: 300,
        lease_token: LeaseToken::new(TOKEN),
    }
}

fn claim(queue: Option<&str>) -> Command {
    Command::SendClaimNext {
        request: RequestId(1),
        run_id: 1,
        queue: queue.map(str::to_string),
        lease_ttl_seconds: 60,
        require_fence: true,
        claimant: "harness/box/fixer/run-1".into(),
    }
}

#[test]
fn report_answers_are_read_liberally() {
    let fail = |answer: Value| decode_report(ReportVerb::Fail, &answer);
    assert_eq!(
        fail(json!({"state": "failed", "attempt": 5, "max_attempts": 5, "dead_letter": true})),
        (true, None)
    );
    assert_eq!(
        fail(json!({"dead_letter": false, "next_retry_at": "2026-09-22T12:30:00Z"})),
        (false, Some("2026-09-22T12:30:00Z".into()))
    );
    // No dead_letter: an accepted fail that is not a dead letter, even at the last attempt
    // (never inferred from state or counts).
    assert_eq!(
        fail(json!({"state": "failed", "attempt": 5, "max_attempts": 5})),
        (false, None)
    );
    assert_eq!(
        fail(json!({"dead_letter": "true", "next_retry_at": 5})),
        (false, None)
    );
    assert_eq!(fail(Value::Null), (false, None));
    // Only fail's and request_input's answers say dead letter (a question past a budget).
    assert_eq!(
        decode_report(ReportVerb::Complete, &json!({"dead_letter": true})),
        (false, None)
    );
    assert_eq!(
        decode_report(ReportVerb::RequestInput, &json!({"dead_letter": true})),
        (true, None)
    );
    assert_eq!(
        decode_report(
            ReportVerb::RequestInput,
            &json!({"state": "input_required"})
        ),
        (false, None)
    );
    // Any non-error answer is success, JSON or not.
    for verb in [ReportVerb::Complete, ReportVerb::Release] {
        assert_eq!(
            answer_input(&report(verb), &Value::Null),
            Some(Ok(Input::ReportAnswered {
                request: RequestId(3),
                dead_letter: false,
                next_retry_at: None
            }))
        );
    }
    assert_eq!(
        answer_input(&heartbeat(), &json!("ok")),
        Some(Ok(Input::HeartbeatOk {
            request: RequestId(2)
        }))
    );
    assert_eq!(
        answer_input(&claim(None), &json!({"todo": {"id": "td_1"}})),
        Some(Err(AnswerError {
            verb: "claim_next",
            field: "todo.attempt",
            problem: Problem::Missing
        }))
    );
    let error = LeaseError::Code(crate::error::ErrorCode::Conflict);
    assert_eq!(
        failed_input(&heartbeat(), error.clone()),
        Some(Input::HeartbeatFailed {
            request: RequestId(2),
            error
        })
    );
    let other = Command::KillCheck { run_id: 1 };
    assert_eq!(answer_input(&other, &Value::Null), None);
    assert_eq!(failed_input(&other, LeaseError::Transport), None);
}

#[test]
fn calls_send_the_contracts_arguments_and_no_nulls() {
    let caps = Capabilities::full(true);
    let call = |c: &Command| lease_call(c, &caps).unwrap_or_else(|| panic!("a lease call"));
    let c = call(&claim(None));
    assert_eq!(c.tool, "claim_next");
    assert_eq!(
        c.arguments,
        json!({"lease_ttl_seconds": 60, "require_fence": true,
               "claimant": "harness/box/fixer/run-1"}),
        "an absent queue is left out, not null"
    );
    assert_eq!(call(&claim(Some("ci"))).arguments["queue"], "ci");
    let c = call(&heartbeat());
    assert_eq!(
        (c.tool, c.arguments),
        (
            "heartbeat",
            json!({"id": "td_1", "lease_ttl_seconds": 300, "lease_token": TOKEN})
        )
    );
    let c = call(&report(ReportVerb::Fail));
    assert_eq!(
        (c.tool, c.arguments),
        (
            "fail",
            json!({"id": "td_1", "summary": "attempt 1/5 · agent failed",
                   "artifact": "mcp://cairn/Ab12", "result": {"harness": {"run_id": 1}},
                   "lease_token": TOKEN})
        )
    );
    // release takes neither result nor artifact.
    let c = call(&report(ReportVerb::Release));
    assert_eq!(
        (c.tool, c.arguments.clone()),
        (
            "release",
            json!({"id": "td_1", "summary": "attempt 1/5 · agent failed", "lease_token": TOKEN})
        )
    );
    // The token is on the wire only: Debug names the arguments.
    let shown = format!("{c:?}");
    assert!(!shown.contains(TOKEN), "{shown}");
    assert!(shown.contains("lease_token"), "{shown}");
    assert_eq!(lease_call(&Command::KillCheck { run_id: 1 }, &caps), None);
}

#[test]
fn a_question_goes_as_request_input_and_usage_only_where_declared() {
    let usage = crate::wire::UsageArg {
        cost_usd: Some(0.42),
        input_tokens: Some(1200),
        output_tokens: None,
    };
    let asking = crate::testing::relay::our_server_capabilities();
    let c = lease_call_with(&report(ReportVerb::RequestInput), &asking, Some(&usage))
        .expect("a lease call");
    assert_eq!(
        (c.tool, c.arguments),
        (
            "request_input",
            json!({"id": "td_1", "question": "which branch?",
                   "summary": "attempt 1/5 · agent failed", "artifact": "mcp://cairn/Ab12",
                   "usage": {"cost_usd": 0.42, "input_tokens": 1200},
                   "lease_token": TOKEN})
        )
    );
    // The contract's schemas declare no usage: nothing of it is sent, on any verb.
    let plain = Capabilities::full(true);
    let verbs = [ReportVerb::Complete, ReportVerb::Fail, ReportVerb::Release];
    for c in verbs.map(report).iter().chain([&heartbeat()]) {
        let call = lease_call_with(c, &plain, Some(&usage)).expect("a lease call");
        assert!(call.arguments.get("usage").is_none(), "{}", call.tool);
        assert_eq!(Some(call), lease_call(c, &plain));
    }
    // A server that declares usage on heartbeat (and only there) gets it there.
    let mut caps = Capabilities::full(true);
    caps.declared
        .get_mut("heartbeat")
        .map(|args| args.insert("usage".into()));
    let call = lease_call_with(&heartbeat(), &caps, Some(&usage)).expect("a lease call");
    assert_eq!(
        call.arguments["usage"],
        json!({"cost_usd": 0.42, "input_tokens": 1200})
    );
    let call =
        lease_call_with(&report(ReportVerb::Complete), &caps, Some(&usage)).expect("a lease call");
    assert!(call.arguments.get("usage").is_none());
    // Never on a claim.
    let all = crate::testing::relay::our_server_capabilities();
    let call = lease_call_with(&claim(None), &all, Some(&usage)).expect("a lease call");
    assert!(call.arguments.get("usage").is_none());
    assert_eq!(
        call_params_with(&heartbeat(), &caps, Some(&usage)).expect("params")["arguments"]["usage"],
        json!({"cost_usd": 0.42, "input_tokens": 1200})
    );
}

#[test]
fn an_extension_argument_is_sent_only_where_the_schema_declares_it() {
    let args = || {
        let mut m = Map::new();
        m.insert("id".into(), json!("td_1"));
        m.insert("lease_token".into(), json!(TOKEN));
        m.insert("retryable".into(), json!(false));
        m
    };
    // The contract's schemas (no retryable): the extension is dropped, the rest kept.
    let kept = keep_declared("fail", args(), &check_caps(contract_tools()));
    assert_eq!(kept.keys().collect::<Vec<_>>(), ["id", "lease_token"]);
    // A server that declares it gets it; the same argument on another verb does not.
    let mut list = contract_tools();
    list["tools"][3]["inputSchema"]["properties"]["retryable"] = json!({"type": "boolean"});
    let caps = check_caps(list);
    let kept = keep_declared("fail", args(), &caps);
    assert_eq!(kept.get("retryable"), Some(&json!(false)));
    let kept = keep_declared("complete", args(), &caps);
    assert!(kept.get("retryable").is_none());
    // The contract's own arguments are never dropped (a server without them is refused at
    // initialize).
    let kept = keep_declared("fail", args(), &Capabilities::default());
    assert_eq!(kept.keys().collect::<Vec<_>>(), ["id", "lease_token"]);
}

fn check_caps(list: Value) -> Capabilities {
    super::super::check_capabilities(&list)
}

#[test]
fn call_params_name_the_tool_beside_its_arguments() {
    let caps = check_caps(contract_tools());
    let params = call_params(&heartbeat(), &caps).expect("a lease call");
    let call = lease_call(&heartbeat(), &caps).expect("a lease call");
    assert_eq!(
        params,
        json!({"name": "heartbeat", "arguments": call.arguments})
    );
    assert_eq!(call_params(&Command::KillCheck { run_id: 1 }, &caps), None);
    assert_eq!(
        result_input(&Command::KillCheck { run_id: 1 }, &params),
        None
    );
}

#[test]
fn tool_results_are_read_structured_or_from_their_text() {
    let structured = crate::wire::call_result(contract_only(), false);
    let text_only = json!({"content": [{"type": "text", "text": contract_only().to_string()}]});
    for result in [structured, text_only] {
        match result_input(&claim(None), &result) {
            Some(Ok(Input::ClaimAnswered { claim, .. })) => assert_eq!(claim.todo_id, "td_1"),
            other => panic!("not a claim: {other:?}"),
        }
    }
    // A heartbeat's success needs no JSON at all.
    let bare = json!({"content": [{"type": "text", "text": "ok"}]});
    assert!(matches!(
        result_input(&heartbeat(), &bare),
        Some(Ok(Input::HeartbeatOk { .. }))
    ));
    assert_eq!(
        result_input(&heartbeat(), &json!("nope")),
        Some(Err(ResultError::NotAnObject))
    );
    let malformed = crate::wire::call_result(json!({"todo": {}}), false);
    assert!(matches!(
        result_input(&claim(None), &malformed),
        Some(Err(ResultError::Malformed(_)))
    ));
}

#[test]
fn tool_errors_carry_their_code_and_an_unknown_one_goes_through_quote() {
    let err = |body: Value| crate::wire::call_result(body, true);
    let quote = |s: &str| format!("<{s}>");
    let kind = |result: &Value| match result_input(&heartbeat(), result) {
        Some(Err(e)) => e.kind(quote),
        other => panic!("not an error: {other:?}"),
    };
    let conflict = err(json!({"error": {"code": "conflict", "message": "lease lost"}}));
    assert_eq!(
        kind(&conflict),
        LeaseError::Code(crate::ErrorCode::Conflict)
    );
    let unknown = err(json!({"error": {"code": "weird", "message": "m"}}));
    assert_eq!(kind(&unknown), LeaseError::Other("<weird>".into()));
    assert_eq!(kind(&err(json!({}))), LeaseError::Other(TOOL_ERROR.into()));
    let Some(Err(e)) = result_input(&heartbeat(), &unknown) else {
        panic!("not an error");
    };
    // Server text may echo a token: `Debug` names only a known code.
    assert!(!format!("{e:?}").contains("weird"), "{e:?}");
}
