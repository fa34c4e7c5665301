//! A todo as a task, over an in-memory ledger through the serving functions the server runs:
//! creation and its replay, every status, the answer and the cancel, and the refusals.

use serde_json::{Value, json};

use super::*;
use crate::ErrorCode;
use crate::grant::Grant;
use crate::ledger::{Actor, Answer, Op, TASK_SECRET_HEX};
use crate::serve::Caller;
use crate::testing::ServingWorld as World;

const POLL: Millis = 2_000;

fn caller(endpoint: &str, tasks: bool) -> Caller {
    Caller {
        endpoint: endpoint.into(),
        session: None,
        grant: Grant::all(),
        tasks: tasks.then_some(POLL),
    }
}

/// What these tests ask of the world besides its calls.
trait Tasks {
    fn get(&mut self, c: &Caller, id: &str) -> Value;
    fn claim(&mut self, c: &Caller) -> (String, String);
}

impl Tasks for World {
    fn get(&mut self, c: &Caller, id: &str) -> Value {
        self.task(c, TaskMethod::Get, json!({"taskId": id}))
            .expect("tasks/get")
            .result
    }

    /// Claims the next todo with a fence; answers its id and token.
    fn claim(&mut self, c: &Caller) -> (String, String) {
        let a = self
            .call(c, "claim_next", json!({"require_fence": true}))
            .unwrap();
        let id = a.answer["todo"]["id"].as_str().unwrap().to_string();
        (id, a.answer["lease_token"].as_str().unwrap().to_string())
    }
}

/// Adds a todo as a task; answers the CreateTaskResult.
fn create(w: &mut World, c: &Caller, args: Value) -> Value {
    let served = w.call(c, "add_todo", args).expect("add_todo");
    assert!(served.task, "{}", served.answer);
    served.result()
}

/// Adds a todo as a task; answers its task id.
fn create_id(w: &mut World, c: &Caller, args: Value) -> String {
    let made = create(w, c, args);
    made["taskId"].as_str().expect("a task id").to_string()
}

#[test]
fn add_todo_answers_a_task_only_to_a_request_that_declares_the_extension() {
    let mut w = World::default();
    let plain = w
        .call(
            &caller("ci", false),
            "add_todo",
            json!({"queue": "q", "title": "t"}),
        )
        .unwrap();
    assert!(!plain.task);
    assert!(w.ledger.todo("td_1").unwrap().task_id.is_none());
    assert_eq!(plain.result()["structuredContent"]["id"], "td_1");

    let c = caller("ci", true);
    let made = create(
        &mut w,
        &c,
        json!({"queue": "q", "title": "t", "idempotency_key": "k"}),
    );
    assert_eq!(made["resultType"], "task");
    assert_eq!(made["status"], "working");
    assert_eq!(made["ttlMs"], Value::Null);
    assert_eq!(made["pollIntervalMs"], POLL);
    let id = made["taskId"].as_str().unwrap();
    // The todo id, a dot, 160 bits of secret.
    let (todo, secret) = id.rsplit_once('.').unwrap();
    assert_eq!((todo, secret.len()), ("td_2", TASK_SECRET_HEX));
    // The answer was lost: the same add again answers the same task, and adds nothing.
    let again = create(
        &mut w,
        &c,
        json!({"queue": "q", "title": "t", "idempotency_key": "k"}),
    );
    assert_eq!(again["taskId"], made["taskId"]);
    assert_eq!(w.ledger.todos().count(), 2);
    // The task's Debug (a log line's) never shows the secret.
    let task_id = w.ledger.todo("td_2").unwrap().task_id.clone().unwrap();
    assert!(!format!("{task_id:?}").contains(secret));
}

#[test]
fn every_todo_state_maps_to_its_task_status() {
    let mut w = World::default();
    let c = caller("ci", true);
    let args = json!({"queue": "q", "title": "t", "max_attempts": 2});
    let id = create_id(&mut w, &c, args.clone());
    let t = w.get(&c, &id);
    assert_eq!(
        (t["status"].as_str(), t["resultType"].as_str()),
        (Some("working"), None)
    );
    assert_eq!(t["statusMessage"], "waiting for a worker");

    let (todo, token) = w.claim(&c);
    assert_eq!(w.get(&c, &id)["statusMessage"], "attempt 1/2 running");
    w.call(&c, "fail", json!({"id": todo, "lease_token": token}))
        .unwrap();
    let t = w.get(&c, &id);
    assert_eq!(t["status"], "working");
    assert!(
        t["statusMessage"]
            .as_str()
            .unwrap()
            .starts_with("attempt 1/2 failed; retry at ")
    );

    // The retry comes due; the second attempt asks a question.
    w.now += 3_600_000;
    let (_, token) = w.claim(&c);
    w.call(
        &c,
        "request_input",
        json!({"id": todo, "lease_token": token, "question": "Which branch?"}),
    )
    .unwrap();
    let t = w.get(&c, &id);
    assert_eq!(t["status"], "input_required");
    let asked = &t["inputRequests"]["q2"];
    assert_eq!(asked["method"], "elicitation/create");
    assert_eq!(asked["params"]["message"], "Which branch?");
    assert_eq!(
        asked["params"]["requestedSchema"]["required"],
        json!(["answer"])
    );

    // Completed: the todo with its result as the tool's result.
    let answer = json!({"q2": {"action": "accept", "content": {"answer": "main"}}});
    w.task(
        &c,
        TaskMethod::Update,
        json!({"taskId": id, "inputResponses": answer}),
    )
    .unwrap();
    assert_eq!(w.get(&c, &id)["status"], "working");
    let (_, token) = w.claim(&c);
    w.call(
        &c,
        "complete",
        json!({"id": todo, "lease_token": token, "result": {"pr": 7}}),
    )
    .unwrap();
    let t = w.get(&c, &id);
    assert_eq!(t["status"], "completed");
    assert_eq!(t["result"]["isError"], false);
    // The CallToolResult of the era: it says its resultType, as the ext-tasks client requires.
    assert_eq!(t["result"]["resultType"], "complete");
    assert_eq!(t["result"]["structuredContent"]["result"], json!({"pr": 7}));
    assert_eq!(t["result"]["structuredContent"]["state"], "done");

    // A dead letter completes with isError and the attention text.
    let dead = create(
        &mut w,
        &c,
        json!({"queue": "q", "title": "t", "max_attempts": 1}),
    );
    let dead = dead["taskId"].as_str().unwrap();
    let (todo, token) = w.claim(&c);
    w.call(&c, "fail", json!({"id": todo, "lease_token": token}))
        .unwrap();
    let t = w.get(&c, dead);
    assert_eq!(
        (t["status"].as_str(), &t["result"]["isError"]),
        (Some("completed"), &json!(true))
    );
    assert_eq!(t["result"]["resultType"], "complete");
    let why = t["result"]["content"][0]["text"].as_str().unwrap();
    assert!(why.contains("attempts"), "{why}");
    // Its advice is the task's way out, not an operator's retry (which a task refuses).
    assert!(why.ends_with("add the work as a new task."), "{why}");
}

#[test]
fn a_terminal_task_status_never_changes() {
    let mut w = World::default();
    let c = caller("ci", true);
    let id = create_id(&mut w, &c, json!({"queue": "q", "title": "t"}));
    let (todo, token) = w.claim(&c);
    w.call(&c, "complete", json!({"id": todo, "lease_token": token}))
        .unwrap();
    // A cancel after the end is acknowledged and changes nothing.
    let acked = w
        .task(&c, TaskMethod::Cancel, json!({"taskId": id}))
        .unwrap();
    assert_eq!(acked.result, json!({}));
    assert_eq!(w.get(&c, &id)["status"], "completed");
    // The operator's retry of a finished task is refused, with the way out.
    let retry = w.ledger.apply(Op::Retry {
        now: w.now,
        actor: Actor::cli(),
        id: todo.clone(),
    });
    let e = retry.expect_err("refused");
    assert_eq!(e.code, ErrorCode::Conflict);
    assert!(e.message.contains("add the work again"), "{}", e.message);
    // Every finished todo is a terminal task, and only those.
    for (t, _) in w.ledger.todos().map(|t| (t.clone(), ())) {
        assert_eq!(status(&t).terminal(), ledger::finished(&t));
    }
}

#[test]
fn a_cancel_stops_a_pending_or_claimed_task_and_a_completion_committed_first_wins() {
    let mut w = World::default();
    let c = caller("ci", true);
    let pending = create_id(&mut w, &c, json!({"queue": "q", "title": "t"}));
    let served = w
        .task(&c, TaskMethod::Cancel, json!({"taskId": pending}))
        .unwrap();
    assert_eq!(served.closed, None);
    assert_eq!(w.get(&c, &pending)["status"], "cancelled");

    let claimed = create_id(&mut w, &c, json!({"queue": "q", "title": "t"}));
    let (todo, token) = w.claim(&c);
    let served = w
        .task(&c, TaskMethod::Cancel, json!({"taskId": claimed}))
        .unwrap();
    assert_eq!(
        served.closed,
        Some((
            crate::ledger::Outcome::Canceled,
            crate::ledger::Disposition::Canceled
        ))
    );
    assert_eq!(w.get(&c, &claimed)["status"], "cancelled");
    // The worker hears it at its next heartbeat; its late report changes nothing.
    let beat = w.call(&c, "heartbeat", json!({"id": todo, "lease_token": token}));
    assert_eq!(beat.unwrap_err().code, ErrorCode::Conflict);
    let late = w.call(&c, "complete", json!({"id": todo, "lease_token": token}));
    assert_eq!(late.unwrap_err().code, ErrorCode::Conflict);
    assert_eq!(w.get(&c, &claimed)["status"], "cancelled");
}

#[test]
fn an_update_answers_only_the_outstanding_request_once() {
    let mut w = World::default();
    let c = caller("ci", true);
    let id = create_id(&mut w, &c, json!({"queue": "q", "title": "t"}));
    let update = |w: &mut World, key: &str, action: &str| {
        let r = json!({key: {"action": action, "content": {"answer": "yes"}}});
        w.task(
            &c,
            TaskMethod::Update,
            json!({"taskId": id, "inputResponses": r}),
        )
    };
    // Nothing is outstanding yet: ignored, acknowledged.
    assert_eq!(update(&mut w, "q1", "accept").unwrap().result, json!({}));
    let (todo, token) = w.claim(&c);
    w.call(
        &c,
        "request_input",
        json!({"id": todo, "lease_token": token, "question": "Go?"}),
    )
    .unwrap();
    // A stale key and a decline change nothing.
    update(&mut w, "q9", "accept").unwrap();
    update(&mut w, "q1", "decline").unwrap();
    assert_eq!(w.get(&c, &id)["status"], "input_required");
    let answered = update(&mut w, "q1", "accept").unwrap();
    let (t, _) = answered.ring.expect("the todo is claimable again");
    assert_eq!(t.state, crate::ledger::TodoState::Pending);
    // The repeat (its ack was lost) is ignored.
    let again = update(&mut w, "q1", "accept").unwrap();
    assert_eq!(again.ring, None);
    let q = w
        .ledger
        .attempts(&todo)
        .last()
        .unwrap()
        .question
        .clone()
        .unwrap();
    assert_eq!(q.answer.as_deref(), Some("yes"));
    assert_eq!(q.answered_by.as_deref(), Some("endpoint:ci"));
}

#[test]
fn unknown_foreign_and_malformed_tasks_are_not_found_without_echoing_the_id() {
    let mut w = World::default();
    let c = caller("ci", true);
    let id = create_id(&mut w, &c, json!({"queue": "q", "title": "t"}));
    let (todo, secret) = id.rsplit_once('.').unwrap();
    let wrong_secret = format!("{todo}.{}", "f".repeat(secret.len()));
    let other_todo = format!("td_99.{secret}");
    for presented in [
        wrong_secret.as_str(),
        other_todo.as_str(),
        "nonsense",
        todo,
        "",
    ] {
        for m in [TaskMethod::Get, TaskMethod::Cancel] {
            let e = w.task(&c, m, json!({"taskId": presented})).unwrap_err();
            assert_eq!(e.code, ErrorCode::NotFound, "{presented}");
            assert!(!e.message.contains(secret), "{}", e.message);
        }
    }
    // Another endpoint's task does not exist for it.
    let e = w
        .task(
            &caller("other", true),
            TaskMethod::Get,
            json!({"taskId": id}),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    // A plain todo is no task.
    w.call(
        &caller("ci", false),
        "add_todo",
        json!({"queue": "q", "title": "t"}),
    )
    .unwrap();
    let e = w
        .task(
            &c,
            TaskMethod::Get,
            json!({"taskId": format!("td_3.{secret}")}),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    assert_eq!(w.get(&c, &id)["status"], "working");
    // get_todo answers the task id to its client only.
    let view = w.call(&c, "get_todo", json!({"id": todo})).unwrap();
    assert_eq!(view.answer["todo"]["task_id"], json!(id));
    assert_eq!(view.answer["todo"]["task"], true);
}

#[test]
fn bad_task_params_are_refused_naming_the_field() {
    let cases = [
        (TaskMethod::Get, json!({}), "taskId is required"),
        (
            TaskMethod::Get,
            json!({"taskId": 7}),
            "taskId must be a string",
        ),
        (
            TaskMethod::Get,
            json!({"taskId": "x", "extra": 1}),
            "unknown field \"extra\"",
        ),
        (
            TaskMethod::Update,
            json!({"taskId": "x"}),
            "inputResponses is required",
        ),
        (
            TaskMethod::Update,
            json!({"taskId": "x", "inputResponses": {"q1": {"action": "accept"}}}),
            "content.answer",
        ),
        (
            TaskMethod::Update,
            json!({"taskId": "x", "inputResponses": {"q1": {"action": "maybe"}}}),
            "action",
        ),
        (
            TaskMethod::Cancel,
            json!({"taskId": "x", "inputResponses": {}}),
            "unknown field",
        ),
    ];
    for (m, params, says) in cases {
        let e = TaskCall::decode(m, Some(&params)).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid, "{params}");
        assert!(e.message.contains(says), "{params}: {}", e.message);
        assert!(e.message.starts_with(m.as_str()), "{}", e.message);
    }
    // `_meta` is the envelope's, and an id of the wrong shape is simply unknown.
    let ok = TaskCall::decode(TaskMethod::Get, Some(&json!({"taskId": "x", "_meta": {}})));
    assert_eq!(ok, Ok(TaskCall::Get(Presented::Unknown)));
}

#[test]
fn a_task_answer_is_the_views_own() {
    // `detailed` reads only its view: a todo that is not a task has no task.
    let mut w = World::default();
    w.call(
        &caller("ci", false),
        "add_todo",
        json!({"queue": "q", "title": "t"}),
    )
    .unwrap();
    let view = w
        .ledger
        .apply(Op::GetTodo {
            actor: Actor::cli(),
            id: "td_1".into(),
            attempts_limit: 5,
        })
        .and_then(Answer::view)
        .unwrap();
    assert_eq!(detailed(&view, POLL), None);
}
