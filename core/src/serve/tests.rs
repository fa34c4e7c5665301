//! The serving function over an in-memory ledger: grants, the scoped claim, what a call
//! reports for the doorbell and the metrics, and the answers as the daemon's decoder reads them.

use serde_json::{Value, json};

use super::*;
use crate::relay::{ClaimAnswer, decode_claim};

use crate::testing::ServingWorld as World;

fn strings(xs: &[&str]) -> Vec<String> {
    xs.iter().map(|s| s.to_string()).collect()
}

fn caller(verbs: &[&str], queues: Option<&[&str]>) -> Caller {
    Caller {
        endpoint: "ci".into(),
        session: Some("s1".into()),
        grant: Grant::new(&strings(verbs), queues.map(strings)),
        tasks: None,
    }
}

fn code(r: Result<Served, Error>) -> ErrorCode {
    r.expect_err("refused").code
}

#[test]
fn an_added_todo_rings_fresh_and_a_fenced_claim_decodes_as_the_daemon_reads_it() {
    let mut w = World::default();
    let all = caller(&["add_todo", "claim_next"], None);
    let added = w
        .call(&all, "add_todo", json!({"queue": "q", "title": "fix it"}))
        .unwrap();
    assert_eq!(added.answer["id"], "td_1");
    let (t, offer) = added.ring.expect("a ring");
    assert_eq!((t.id.as_str(), offer), ("td_1", Offer::Fresh));
    let claimed = w
        .call(&all, "claim_next", json!({"require_fence": true}))
        .unwrap();
    assert_eq!(claimed.closed, None);
    let Ok(ClaimAnswer::Claimed(c)) = decode_claim(&claimed.answer) else {
        panic!("not a claim: {}", claimed.answer);
    };
    assert_eq!((c.todo_id.as_str(), c.attempt), ("td_1", 1));
    assert_eq!(c.lease_token, Some(LeaseToken::new("tok-2")));
    let empty = w.call(&all, "claim_next", json!({})).unwrap();
    assert_eq!(decode_claim(&empty.answer), Ok(ClaimAnswer::Empty));
    assert_eq!(empty.result()["isError"], false);
}

#[test]
fn reports_say_what_they_closed_and_a_release_rings_requeued() {
    let mut w = World::default();
    let c = caller(
        &["add_todo", "claim_next", "complete", "fail", "release"],
        None,
    );
    for _ in 0..3 {
        w.call(
            &c,
            "add_todo",
            json!({"queue": "q", "title": "t", "max_attempts": 1}),
        )
        .unwrap();
    }
    let claim = |w: &mut World| {
        let a = w
            .call(&c, "claim_next", json!({"require_fence": true}))
            .unwrap();
        let id = a.answer["todo"]["id"].as_str().unwrap().to_string();
        let token = a.answer["lease_token"].as_str().unwrap().to_string();
        (id, token)
    };
    // Each report claims the next todo and closes its attempt.
    let mut report = |verb: &str| {
        let (id, token) = claim(&mut w);
        let served = w.call(&c, verb, json!({"id": id, "lease_token": token}));
        (id, served.unwrap())
    };
    let (_, done) = report("complete");
    assert_eq!(done.closed, Some((Outcome::Completed, Disposition::Done)));
    assert_eq!(done.ring, None);
    let (_, dead) = report("fail");
    let dead_letter = Some((Outcome::Failed, Disposition::DeadLettered));
    assert_eq!(
        (dead.closed, &dead.answer["dead_letter"]),
        (dead_letter, &json!(true))
    );
    let (id, back) = report("release");
    let released = Some((Outcome::Released, Disposition::Requeued));
    assert_eq!(back.closed, released);
    let rang = back.ring.map(|(t, o)| (t.id, o));
    assert_eq!(rang, Some((id, Offer::Requeued)));
    // A stale token is refused as a tool error.
    let stale = w.call(
        &c,
        "complete",
        json!({"id": "td_3", "lease_token": "tok-x"}),
    );
    let e = stale.expect_err("stale");
    assert_eq!(refusal(&e)["isError"], true);
    assert_eq!(
        refusal(&e)["structuredContent"]["error"]["code"],
        e.code.as_str()
    );
}

#[test]
fn a_takeover_reports_the_lapsed_attempt_closed() {
    let mut w = World::default();
    let c = caller(&["add_todo", "claim_next"], None);
    w.call(&c, "add_todo", json!({"queue": "q", "title": "t"}))
        .unwrap();
    w.call(&c, "claim_next", json!({"lease_ttl_seconds": 1}))
        .unwrap();
    w.now += 2_000;
    let again = w.call(&c, "claim_next", json!({})).unwrap();
    assert_eq!(
        again.closed,
        Some((Outcome::LeaseExpired, Disposition::Requeued))
    );
}

#[test]
fn grants_are_checked_before_the_arguments_and_scope_every_queue() {
    let mut w = World::default();
    let admin = caller(&["add_todo"], None);
    w.call(&admin, "add_todo", json!({"queue": "a", "title": "t"}))
        .unwrap();
    w.call(&admin, "add_todo", json!({"queue": "b", "title": "t"}))
        .unwrap();
    let scoped = caller(
        &["claim", "claim_next", "list_todos", "add_todo"],
        Some(&["a"]),
    );
    // Not granted: refused whatever the arguments are.
    assert_eq!(
        code(w.call(&scoped, "complete", json!({"bogus": 1}))),
        ErrorCode::Forbidden
    );
    assert_eq!(
        code(w.call(&scoped, "claim_next", json!({"queue": "b"}))),
        ErrorCode::Forbidden
    );
    assert_eq!(
        code(w.call(&scoped, "add_todo", json!({"queue": "b", "title": "t"}))),
        ErrorCode::Forbidden
    );
    assert_eq!(
        code(w.call(&scoped, "list_todos", json!({"queue": "b"}))),
        ErrorCode::Forbidden
    );
    // A claim by id reads the todo's queue first.
    assert_eq!(
        code(w.call(&scoped, "claim", json!({"id": "td_2"}))),
        ErrorCode::Forbidden
    );
    let e = w
        .call(&scoped, "claim", json!({"id": "td_9"}))
        .expect_err("unknown");
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(e.message.starts_with("claim td_9"), "{}", e.message);
    // What the endpoint cannot enumerate does not exist for it.
    let e = w
        .call(&scoped, "get_todo", json!({"id": "td_2"}))
        .expect_err("hidden");
    assert_eq!(e.code, ErrorCode::NotFound);
    let list = w.call(&scoped, "list_todos", json!({})).unwrap();
    let ids: Vec<&Value> = list.answer["todos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["id"])
        .collect();
    assert_eq!(ids, vec!["td_1"]);
    // The scan claims only from the granted queue; a claim by id there goes through.
    let next = w.call(&scoped, "claim_next", json!({})).unwrap();
    assert_eq!(next.answer["todo"]["id"], "td_1");
    let unscoped = caller(&["claim"], None);
    let by_id = w.call(&unscoped, "claim", json!({"id": "td_2"})).unwrap();
    assert_eq!(by_id.answer["todo"]["id"], "td_2");
}

#[test]
fn tools_call_params_name_a_known_tool() {
    assert!(tool_of(&json!({})).unwrap_err().contains("params.name"));
    assert!(
        tool_of(&json!({"name": "teleport"}))
            .unwrap_err()
            .contains("unknown tool")
    );
    let params = json!({"name": "heartbeat", "arguments": {"id": "x"}});
    let (tool, args) = tool_of(&params).unwrap();
    assert_eq!((tool, args), (Tool::Heartbeat, Some(&json!({"id": "x"}))));
}

#[test]
fn an_add_with_a_used_idempotency_key_answers_created_false_and_rings_nothing() {
    let mut w = World::default();
    let all = caller(&["add_todo"], None);
    let args = json!({"queue": "q", "title": "from a webhook", "idempotency_key": "evt-1"});
    let first = w.call(&all, "add_todo", args.clone()).unwrap();
    assert_eq!(first.answer["created"], true);
    assert!(first.ring.is_some());
    let again = w
        .call(
            &all,
            "add_todo",
            json!({"queue": "q", "title": "other", "idempotency_key": "evt-1"}),
        )
        .unwrap();
    assert_eq!(again.answer["created"], false);
    assert_eq!(again.answer["id"], first.answer["id"]);
    assert_eq!(again.answer["title"], "from a webhook");
    assert!(again.ring.is_none());
    assert_eq!(w.ledger.todos().count(), 1);
}

#[test]
fn a_stale_fenced_report_answers_conflict_and_get_todo_shows_it_late() {
    let mut w = World::default();
    let all = caller(
        &["add_todo", "claim", "complete", "fail", "list_todos"],
        None,
    );
    let id = w
        .call(&all, "add_todo", json!({"queue": "q", "title": "t"}))
        .unwrap()
        .answer["id"]
        .clone();
    let old = w
        .call(
            &all,
            "claim",
            json!({"id": id, "require_fence": true, "lease_ttl_seconds": 1}),
        )
        .unwrap();
    let old_token = old.answer["lease_token"].clone();
    w.now += 2_000;
    w.call(&all, "claim", json!({"id": id, "require_fence": true}))
        .unwrap();
    let before = w.ledger.todo(id.as_str().unwrap()).cloned();
    let late = w.call(
        &all,
        "complete",
        json!({"id": id, "lease_token": old_token, "summary": "I did finish"}),
    );
    assert_eq!(code(late), ErrorCode::Conflict);
    assert_eq!(
        w.ledger.todo(id.as_str().unwrap()).cloned(),
        before,
        "nothing else changed"
    );
    let view = w.call(&all, "get_todo", json!({"id": id})).unwrap().answer;
    let first = &view["attempts"][1];
    assert_eq!(first["seq"], 1);
    assert_eq!(first["late_reports_total"], 1);
    assert_eq!(first["late_reports"][0]["outcome"], "completed");
    assert_eq!(first["late_reports"][0]["summary"], "I did finish");
    // An unfenced stale report is not kept: it cannot be told from a stranger's.
    assert_eq!(
        code(w.call(&all, "fail", json!({"id": id}))),
        ErrorCode::Conflict
    );
    let view = w.call(&all, "get_todo", json!({"id": id})).unwrap().answer;
    assert_eq!(view["attempts"][1]["late_reports_total"], 1);
}

#[test]
fn a_non_retryable_fail_answers_its_dead_letter_reason() {
    let mut w = World::default();
    let all = caller(&["add_todo", "claim_next", "fail", "list_todos"], None);
    w.call(&all, "add_todo", json!({"queue": "q", "title": "t"}))
        .unwrap();
    let c = w
        .call(&all, "claim_next", json!({"require_fence": true}))
        .unwrap()
        .answer;
    let failed = w
        .call(&all, "fail", json!({"id": c["todo"]["id"], "lease_token": c["lease_token"], "retryable": false, "failure_signature": "auth"}))
        .unwrap();
    assert_eq!(failed.answer["dead_letter"], true);
    assert_eq!(failed.answer["dead_letter_reason"], "non_retryable");
    assert_eq!(
        failed.closed,
        Some((Outcome::Failed, Disposition::DeadLettered))
    );
    let view = w
        .call(&all, "get_todo", json!({"id": c["todo"]["id"]}))
        .unwrap()
        .answer;
    assert!(
        view["attention"]
            .as_str()
            .unwrap()
            .starts_with("Dead letter (non_retryable)")
    );
    assert_eq!(view["attempts"][0]["failure_signature"], "auth");
    let listed = w.call(&all, "list_todos", json!({})).unwrap().answer;
    assert_eq!(listed["todos"][0]["dead_letter_reason"], "non_retryable");
}

#[test]
fn a_heartbeat_at_the_budget_is_refused_after_its_stop_is_counted() {
    let mut w = World::default();
    let all = caller(&["add_todo", "claim_next", "heartbeat"], None);
    let budget = json!({"queue": "q", "title": "spend", "budget": {"tokens": 100}});
    w.call(&all, "add_todo", budget).unwrap();
    let c = w
        .call(&all, "claim_next", json!({"require_fence": true}))
        .unwrap();
    let token = c.answer["lease_token"].clone();
    let hb = |n: u64| json!({"id": "td_1", "lease_token": token, "usage": {"input_tokens": n}});
    assert_eq!(w.call(&all, "heartbeat", hb(99)).unwrap().refused, None);
    // Through the step machine: the stop is counted, and the answer is the refusal.
    let params = json!({"name": "heartbeat", "arguments": hb(100)});
    let (tool, args) = tool_of(&params).unwrap();
    let (mut s, mut step) = Serving::start(tool, args, all.clone(), w.now, &mut w.draw);
    let served = loop {
        match step {
            Step::Apply(op) => step = s.answered(w.ledger.apply(op), &mut w.draw),
            Step::Done(done) => break done.unwrap(),
        }
    };
    assert_eq!(
        served.closed,
        Some((Outcome::Canceled, Disposition::DeadLettered))
    );
    assert_eq!(served.answer["dead_letter_reason"], "budget_exhausted");
    assert_eq!(served.refused.map(|e| e.code), Some(ErrorCode::Conflict));
    // `serve` answers the refusal itself; the holder's next heartbeat is an ordinary conflict.
    assert_eq!(
        code(w.call(&all, "heartbeat", hb(101))),
        ErrorCode::Conflict
    );
    // A malformed usage is invalid and changes nothing.
    let before = w.ledger.clone();
    let bad = json!({"id": "td_1", "usage": {"cost_usd": -1.0}});
    assert_eq!(code(w.call(&all, "heartbeat", bad)), ErrorCode::Invalid);
    assert_eq!(w.ledger, before);
}

/// A `tasks/cancel` reads its task, then writes; a report may commit in between. Found by the
/// simulator (a server stalled between the two): the read saw the task working (claimed), the
/// worker's fail on its last attempt dead-lettered the todo, and the write then canceled the
/// dead letter, turning the task's `completed` into `cancelled`. The cancel is acknowledged as
/// one that lost to a completion committed first, and the task still reads `completed`.
#[test]
fn a_cancel_that_loses_to_a_dead_letter_leaves_the_task_completed() {
    use crate::task::{self, TaskCall, TaskMethod, TaskStatus};
    let mut w = World::default();
    let client = Caller {
        tasks: Some(5_000),
        ..caller(&["add_todo", "claim_next", "fail"], None)
    };
    let args = json!({"queue": "q", "title": "fix it", "max_attempts": 1});
    let made = w.call(&client, "add_todo", args).unwrap();
    let task_id = made.answer["taskId"].as_str().unwrap().to_string();
    w.call(&client, "claim_next", json!({})).unwrap();
    let params = json!({"taskId": task_id});
    let call = TaskCall::decode(TaskMethod::Cancel, Some(&params)).unwrap();
    let (mut serving, read) = TaskServing::start(call, client.clone(), w.now);
    let Step::Apply(read) = read else {
        panic!("a cancel reads its task first: {read:?}")
    };
    let write = serving.answered(w.ledger.apply(read), &mut w.draw);
    let Step::Apply(write) = write else {
        panic!("a working task's cancel writes: {write:?}")
    };
    w.call(&client, "fail", json!({"id": "td_1"})).unwrap();
    let dead = w.ledger.todo("td_1").unwrap().clone();
    assert!(dead.dead_letter());
    let done = serving.answered(w.ledger.apply(write), &mut w.draw);
    let Step::Done(Ok(acked)) = done else {
        panic!("the cancel is acknowledged: {done:?}")
    };
    assert_eq!((acked.result, acked.closed), (json!({}), None));
    let t = w.ledger.todo("td_1").unwrap();
    assert_eq!(t, &dead);
    assert_eq!(task::status(t), TaskStatus::Completed);
}

/// A `tasks/update` reads the outstanding input request, then writes the answer; other requests
/// may commit in between. If the operator answered that question meanwhile and the next attempt
/// asked another, the response (keyed `q1`) must not answer the new question (`q2`): the write
/// names the question it answers, the ledger refuses it, and the update is acknowledged as one
/// no longer outstanding.
#[test]
fn an_update_never_answers_a_question_asked_after_its_read() {
    use crate::ledger::{Actor, TodoState};
    use crate::task::{TaskCall, TaskMethod};
    let mut w = World::default();
    let client = Caller {
        tasks: Some(5_000),
        ..caller(&["add_todo", "claim_next", "request_input"], None)
    };
    let made = w
        .call(
            &client,
            "add_todo",
            json!({"queue": "q", "title": "fix it"}),
        )
        .unwrap();
    let task_id = made.answer["taskId"].as_str().unwrap().to_string();
    let ask = |w: &mut World, question: &str| {
        w.call(&client, "claim_next", json!({})).unwrap();
        let args = json!({"id": "td_1", "question": question});
        w.call(&client, "request_input", args).unwrap();
    };
    ask(&mut w, "which branch?");
    let params = json!({"taskId": task_id, "inputResponses": {
        "q1": {"action": "accept", "content": {"answer": "main"}},
    }});
    let call = TaskCall::decode(TaskMethod::Update, Some(&params)).unwrap();
    let (mut serving, read) = TaskServing::start(call, client.clone(), w.now);
    let Step::Apply(read) = read else {
        panic!("an update reads its task first: {read:?}")
    };
    let write = serving.answered(w.ledger.apply(read), &mut w.draw);
    let Step::Apply(write) = write else {
        panic!("an accepted outstanding request is written: {write:?}")
    };
    let operator = Op::AnswerTodo {
        now: w.now,
        actor: Actor::cli(),
        id: "td_1".into(),
        answer: "release-2".into(),
        key: None,
        seq: None,
    };
    w.ledger.apply(operator).unwrap();
    ask(&mut w, "which file?");
    let done = serving.answered(w.ledger.apply(write), &mut w.draw);
    let Step::Done(Ok(acked)) = done else {
        panic!("the update is acknowledged: {done:?}")
    };
    assert_eq!((acked.result, acked.ring), (json!({}), None));
    let t = w.ledger.todo("td_1").unwrap();
    assert_eq!((t.state, t.attempts_total), (TodoState::InputRequired, 2));
    let questions: Vec<_> = w
        .ledger
        .attempts("td_1")
        .map(|a| {
            let q = a.question.as_ref().unwrap();
            (a.seq, q.answer.as_deref(), q.answered_by.as_deref())
        })
        .collect();
    assert_eq!(
        questions,
        [
            (1, Some("release-2"), Some("operator:cli")),
            (2, None, None)
        ]
    );
}
