//! One named test per rule of the queue side.

use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::error::ErrorCode;
use crate::testing::Queue;
use crate::time::{MINUTE, SECOND};

const T0: Millis = 1_790_000_000_000;
const TTL: Millis = 5 * MINUTE;

fn ep(name: &str) -> Actor {
    Actor::endpoint(name)
}

fn opts() -> ClaimOpts {
    ClaimOpts {
        ttl: TTL,
        claimant: Some("harness/box/fixer/run-1".into()),
        token_hash: None,
    }
}

fn fenced(token: &str) -> ClaimOpts {
    ClaimOpts {
        token_hash: Some(TokenHash::of(token)),
        ..opts()
    }
}

fn new(id: &str, queue: &str) -> NewTodo {
    NewTodo {
        id: id.into(),
        queue: queue.into(),
        title: format!("title of {id}"),
        ..NewTodo::default()
    }
}

/// A ledger with todos `td_1..=td_n` on queue `ci`, owned by endpoint `e`, created 1 ms apart.
fn ledger_with(n: u32, max_attempts: u32) -> Ledger {
    let mut l = Ledger::new(LedgerConfig::default());
    for i in 1..=n {
        l.add_todo(
            T0 + Millis::from(i),
            "e",
            NewTodo {
                max_attempts: Some(max_attempts),
                ..new(&format!("td_{i}"), "ci")
            },
        )
        .unwrap();
    }
    l
}

fn report(token: Option<&str>) -> Report {
    Report {
        token_hash: token.map(TokenHash::of),
        ..Report::default()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, Error>) -> ErrorCode {
    r.expect_err("expected an error").code
}

#[test]
fn claim_opens_an_attempt_whose_seq_is_attempts_total() {
    let mut l = ledger_with(1, 5);
    let c = l.claim(T0 + 10, &ep("e"), "td_1", &fenced("tok")).unwrap();
    assert_eq!((c.attempt_seq, c.attempts_total, c.todo.attempt), (1, 1, 1));
    assert_eq!(c.todo.state, TodoState::Claimed);
    assert_eq!(c.todo.lease_expires_at, Some(T0 + 10 + TTL));
    assert!(c.prior_attempts.is_empty() && !c.takeover);
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(a.claimer_kind, ClaimerKind::Endpoint);
    assert_eq!(a.claimer_endpoint.as_deref(), Some("e"));
    assert_eq!(a.owner, "e");
    assert_eq!(a.claimant.as_deref(), Some("harness/box/fixer/run-1"));
    assert_eq!(a.lease_token_hash, Some(TokenHash::of("tok")));
    assert!(a.is_open() && !a.died());
    l.check().unwrap();
}

#[test]
fn claim_next_is_fifo_by_creation_within_the_queue_filter() {
    let mut l = ledger_with(0, 5);
    l.add_todo(T0 + 3, "e", new("c", "ci")).unwrap();
    l.add_todo(T0 + 1, "e", new("b", "other")).unwrap();
    l.add_todo(T0 + 2, "e", new("a", "ci")).unwrap();
    let ci = ["ci".to_string()];
    let first = l
        .claim_next(T0 + 5, &ep("e"), Some(&ci), &opts())
        .unwrap()
        .unwrap();
    assert_eq!(first.todo.id, "a");
    let second = l
        .claim_next(T0 + 5, &ep("e"), Some(&ci), &opts())
        .unwrap()
        .unwrap();
    assert_eq!(second.todo.id, "c");
    assert!(
        l.claim_next(T0 + 5, &ep("e"), Some(&ci), &opts())
            .unwrap()
            .is_none()
    );
    let any = l
        .claim_next(T0 + 5, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!(any.todo.id, "b");
    l.check().unwrap();
}

#[test]
fn claim_next_takes_a_higher_priority_first_and_fifo_within_one() {
    let mut l = ledger_with(0, 5);
    let at = |p: Option<i32>, id: &str| NewTodo {
        priority: p,
        ..new(id, "ci")
    };
    l.add_todo(T0 + 1, "e", at(None, "old_default")).unwrap();
    l.add_todo(T0 + 2, "e", at(Some(-5), "low")).unwrap();
    l.add_todo(T0 + 3, "e", at(Some(7), "high_first")).unwrap();
    l.add_todo(T0 + 4, "e", at(Some(7), "high_second")).unwrap();
    l.add_todo(T0 + 5, "e", at(Some(0), "new_default")).unwrap();
    let mut order = Vec::new();
    while let Some(c) = l.claim_next(T0 + 9, &ep("e"), None, &opts()).unwrap() {
        order.push(c.todo.id);
    }
    assert_eq!(
        order,
        [
            "high_first",
            "high_second",
            "old_default",
            "new_default",
            "low"
        ]
    );
    l.check().unwrap();
}

#[test]
fn a_delayed_todo_is_not_claimable_before_its_time_and_keeps_its_place_after() {
    let mut l = ledger_with(0, 5);
    let run_at = T0 + 10 * SECOND;
    l.add_todo(
        T0,
        "e",
        NewTodo {
            run_at: Some(run_at),
            ..new("at", "ci")
        },
    )
    .unwrap();
    l.add_todo(
        T0 + 1,
        "e",
        NewTodo {
            delay_seconds: Some(5),
            ..new("delayed", "ci")
        },
    )
    .unwrap();
    l.add_todo(T0 + 2, "e", new("now", "ci")).unwrap();
    let next = |l: &mut Ledger, now: Millis| {
        l.claim_next(now, &ep("e"), None, &opts())
            .unwrap()
            .map(|c| c.todo.id)
    };
    assert_eq!(next(&mut l, T0 + 3).as_deref(), Some("now"));
    assert_eq!(next(&mut l, T0 + 1 + 5 * SECOND - 1), None);
    // A claim by id is refused alike, saying until when the todo waits.
    let early = l
        .claim(T0 + 3, &ep("e"), "at", &opts())
        .expect_err("delayed");
    assert_eq!(early.code, ErrorCode::Conflict, "{early}");
    assert!(early.message.contains("run_at, 2"), "{early}");
    assert_eq!(
        next(&mut l, T0 + 1 + 5 * SECOND).as_deref(),
        Some("delayed")
    );
    assert_eq!(next(&mut l, run_at - 1), None);
    assert_eq!(next(&mut l, run_at).as_deref(), Some("at"));
    // An instant already past is due at once.
    l.add_todo(
        run_at,
        "e",
        NewTodo {
            run_at: Some(T0),
            ..new("past", "ci")
        },
    )
    .unwrap();
    assert_eq!(next(&mut l, run_at).as_deref(), Some("past"));
    l.check().unwrap();
}

#[test]
fn the_retry_sweep_clears_a_delayed_todos_time_once_it_has_come_so_that_it_rings() {
    let mut l = ledger_with(0, 5);
    let add = |l: &mut Ledger, id: &str, delay: u64| {
        let n = NewTodo {
            delay_seconds: Some(delay),
            ..new(id, "ci")
        };
        l.add_todo(T0, "e", n).unwrap();
    };
    add(&mut l, "soon", 5);
    add(&mut l, "later", 50);
    assert!(l.requeue_due(T0 + 5 * SECOND - 1).unwrap().is_empty());
    let came = l.requeue_due(T0 + 5 * SECOND).unwrap();
    assert_eq!(came.len(), 1, "{came:?}");
    let t = &came[0];
    assert_eq!(
        (t.id.as_str(), t.state, t.run_at),
        ("soon", TodoState::Pending, None)
    );
    assert_eq!(t.updated_at, T0 + 5 * SECOND);
    // Once cleared, the next sweep leaves it alone; the later one still waits.
    assert!(l.requeue_due(T0 + 6 * SECOND).unwrap().is_empty());
    let later = l.todos().find(|t| t.id == "later").unwrap();
    assert_eq!(later.run_at, Some(T0 + 50 * SECOND));
    l.check().unwrap();
}

fn keyed(id: &str, key: Option<&str>) -> NewTodo {
    NewTodo {
        concurrency_key: key.map(str::to_string),
        ..new(id, "ci")
    }
}

fn per_key(n: u32) -> Limits {
    Limits {
        max_claimed_per_key: Some(n),
        ..Limits::default()
    }
}

#[test]
fn a_key_at_its_limit_is_passed_over_and_flows_again_when_its_todo_closes() {
    let mut l = Ledger::new(LedgerConfig::default());
    for (i, (id, key)) in [
        ("a1", Some("A")),
        ("a2", Some("A")),
        ("b1", Some("B")),
        ("free", None),
    ]
    .into_iter()
    .enumerate()
    {
        l.add_todo(T0 + i as Millis, "e", keyed(id, key)).unwrap();
    }
    l.set_limits(T0, "ci", per_key(1)).unwrap();
    let next = |l: &mut Ledger, now: Millis| {
        l.claim_next(now, &ep("e"), None, &opts())
            .unwrap()
            .map(|c| c.todo.id)
    };
    assert_eq!(next(&mut l, T0 + 10).as_deref(), Some("a1"));
    assert_eq!(
        next(&mut l, T0 + 10).as_deref(),
        Some("b1"),
        "a2 waits for A"
    );
    assert_eq!(
        next(&mut l, T0 + 10).as_deref(),
        Some("free"),
        "no key, no key limit"
    );
    assert_eq!(
        next(&mut l, T0 + 10),
        None,
        "every waiting todo is held back"
    );
    // A claim by id is refused alike, saying which limit.
    let e = l.claim(T0 + 10, &ep("e"), "a2", &opts()).expect_err("held");
    assert_eq!(e.code, ErrorCode::Conflict, "{e}");
    assert!(e.message.contains("max_claimed_per_key 1"), "{e}");
    let flow = l
        .apply(Op::QueueFlow { now: T0 + 10 })
        .unwrap()
        .flow()
        .unwrap();
    assert_eq!(flow.load.claimed_with("ci", "A"), 1);
    assert_eq!(flow.load.claimed_in("ci"), 3);
    l.complete(T0 + 20, &ep("e"), "a1", &Report::default())
        .unwrap();
    assert_eq!(next(&mut l, T0 + 20).as_deref(), Some("a2"));
    l.check().unwrap();
}

/// What an operator reads (`flow::lines`, `flow::why_held`): the held-back count is the waiting
/// todos the limits pass over, not those of a free key, a delayed one, or a paused queue's.
#[test]
fn an_operator_reads_what_the_limits_hold_back_and_why() {
    use super::flow::{self, Held};
    let mut l = Ledger::new(LedgerConfig::default());
    for (i, (id, key)) in [
        ("a1", Some("A")),
        ("a2", Some("A")),
        ("a3", Some("A")),
        ("b1", Some("B")),
    ]
    .into_iter()
    .enumerate()
    {
        l.add_todo(T0 + i as Millis, "e", keyed(id, key)).unwrap();
    }
    l.set_limits(T0, "ci", per_key(1)).unwrap();
    l.claim(T0 + 10, &ep("e"), "a1", &opts()).unwrap();
    let flow = l
        .apply(Op::QueueFlow { now: T0 + 10 })
        .unwrap()
        .flow()
        .unwrap();
    let waiting = [
        ("ci".to_string(), Some("A".to_string()), 2),
        ("ci".to_string(), Some("B".to_string()), 1),
    ];
    let lines = flow::lines(&flow, &waiting);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!((line.claimed, line.held_back), (1, 2), "{line:?}");
    assert_eq!(line.held_keys, ["A"]);
    assert_eq!(line.held, None, "the queue itself is not full");
    let todo = |id: &str| l.todos().find(|t| t.id == id).unwrap().clone();
    assert_eq!(
        flow::why_held(&flow, T0 + 10, &todo("a2")),
        Some(Held::KeyFull("A".into(), 1))
    );
    assert_eq!(flow::why_held(&flow, T0 + 10, &todo("b1")), None);
    assert_eq!(flow::why_held(&flow, T0 + 10, &todo("a1")), None, "claimed");
}

#[test]
fn a_lapsed_lease_keeps_its_place_until_it_is_reaped_or_taken_over() {
    let mut l = Ledger::new(LedgerConfig::default());
    l.add_todo(T0, "e", keyed("a1", Some("A"))).unwrap();
    l.add_todo(T0 + 1, "e", keyed("a2", Some("A"))).unwrap();
    l.set_limits(T0, "ci", per_key(1)).unwrap();
    l.claim(T0 + 2, &ep("e"), "a1", &opts()).unwrap();
    let lapsed = T0 + 2 + TTL;
    // The holder may still be running: nobody else of key A starts.
    assert!(
        l.claim_next(lapsed, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
    assert!(l.claim(lapsed, &ep("e"), "a2", &opts()).is_err());
    // Its own takeover adds nobody, so it is allowed.
    let c = l.claim(lapsed, &ep("e"), "a1", &opts()).unwrap();
    assert!(c.takeover);
    // Once reaped, the key frees and the oldest waiting todo of it is next.
    l.reap(lapsed + TTL).unwrap();
    let c = l
        .claim_next(lapsed + TTL, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!(c.todo.id, "a1");
    l.check().unwrap();
}

#[test]
fn max_claimed_and_claims_per_minute_hold_the_whole_queue() {
    let mut l = ledger_with(6, 5);
    l.add_todo(T0, "e", new("other", "ops")).unwrap();
    let limits = Limits {
        max_claimed: Some(2),
        claims_per_minute: Some(3),
        ..Limits::default()
    };
    l.set_limits(T0, "ci", limits).unwrap();
    let next = |l: &mut Ledger, now: Millis| {
        let qs = ["ci".to_string()];
        l.claim_next(now, &ep("e"), Some(&qs), &opts())
            .unwrap()
            .map(|c| c.todo.id)
    };
    assert_eq!(next(&mut l, T0 + 10).as_deref(), Some("td_1"));
    assert_eq!(next(&mut l, T0 + 10).as_deref(), Some("td_2"));
    assert_eq!(next(&mut l, T0 + 10), None, "max_claimed 2");
    let e = l
        .claim(T0 + 10, &ep("e"), "td_3", &opts())
        .expect_err("full");
    assert!(e.message.contains("max_claimed 2"), "{e}");
    // Another queue flows.
    let any = l
        .claim_next(T0 + 10, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!(any.todo.id, "other");
    l.complete(T0 + 20, &ep("e"), "td_1", &Report::default())
        .unwrap();
    assert_eq!(
        next(&mut l, T0 + 20).as_deref(),
        Some("td_3"),
        "a third claim"
    );
    l.complete(T0 + 30, &ep("e"), "td_2", &Report::default())
        .unwrap();
    assert_eq!(
        next(&mut l, T0 + 30),
        None,
        "three claims within the minute"
    );
    assert_eq!(next(&mut l, T0 + 10 + MINUTE - 1), None);
    assert_eq!(
        next(&mut l, T0 + 10 + MINUTE).as_deref(),
        Some("td_4"),
        "the window rolled"
    );
    // Lifting every limit forgets them.
    let flow = l.set_limits(T0, "ci", Limits::default()).unwrap();
    assert!(flow.limits.is_empty(), "{flow:?}");
    assert_eq!(next(&mut l, T0 + 10 + MINUTE).as_deref(), Some("td_5"));
    l.check().unwrap();
}

#[test]
fn bad_limits_and_keys_are_refused_naming_the_field_and_change_nothing() {
    let mut l = ledger_with(1, 5);
    let set = |l: &mut Ledger, actor: Actor, queue: &str, change: LimitsChange| {
        l.apply(Op::SetQueueLimits {
            now: T0,
            actor,
            queue: queue.into(),
            change,
        })
    };
    let zero = LimitsChange {
        max_claimed_per_key: Some(Some(0)),
        ..LimitsChange::default()
    };
    let e = set(&mut l, Actor::cli(), "ci", zero).expect_err("zero");
    assert_eq!(e.code, ErrorCode::Invalid);
    assert!(e.message.contains("max_claimed_per_key"), "{e}");
    let big = LimitsChange {
        claims_per_minute: Some(Some(flow::LIMIT_MAX + 1)),
        ..LimitsChange::default()
    };
    let e = set(&mut l, Actor::cli(), "ci", big).expect_err("too big");
    assert!(e.message.contains("claims_per_minute"), "{e}");
    let one = LimitsChange {
        max_claimed: Some(Some(1)),
        ..LimitsChange::default()
    };
    let e = set(&mut l, ep("e"), "ci", one).expect_err("an endpoint");
    assert_eq!(e.code, ErrorCode::Forbidden);
    let e = set(&mut l, Actor::cli(), "bad queue", one).expect_err("a bad name");
    assert_eq!(e.code, ErrorCode::Invalid);
    let flow = l.apply(Op::QueueFlow { now: T0 }).unwrap().flow().unwrap();
    assert!(flow.limits.is_empty(), "nothing changed: {flow:?}");
    // A change leaves the limits it does not name.
    set(&mut l, Actor::cli(), "ci", one).unwrap();
    let rate = LimitsChange {
        claims_per_minute: Some(Some(5)),
        ..LimitsChange::default()
    };
    let flow = set(&mut l, Actor::cli(), "ci", rate)
        .unwrap()
        .flow()
        .unwrap();
    assert_eq!(
        flow.limits[0].1.describe(),
        "max_claimed 1, claims_per_minute 5"
    );

    for key in ["", "k\u{7}", &"k".repeat(129)] {
        let e = l
            .add_todo(T0, "e", keyed("x", Some(key)))
            .expect_err("bad key");
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(e.message.contains("concurrency_key"), "{e}");
    }
    assert!(l.todo("x").is_none());
    l.add_todo(T0, "e", keyed("x", Some(&"k".repeat(128))))
        .unwrap();
}

#[test]
fn bad_priorities_and_schedules_are_refused_naming_the_field_and_add_nothing() {
    let mut l = ledger_with(0, 5);
    let year = RUN_AT_MAX_AHEAD_SECS;
    let cases = [
        (
            NewTodo {
                priority: Some(101),
                ..new("a", "ci")
            },
            "priority",
        ),
        (
            NewTodo {
                priority: Some(-101),
                ..new("a", "ci")
            },
            "priority",
        ),
        (
            NewTodo {
                run_at: Some(T0 + 5),
                delay_seconds: Some(5),
                ..new("a", "ci")
            },
            "run_at or delay_seconds",
        ),
        (
            NewTodo {
                run_at: Some(T0 + year * 1000 + 1),
                ..new("a", "ci")
            },
            "run_at",
        ),
        (
            NewTodo {
                delay_seconds: Some(year + 1),
                ..new("a", "ci")
            },
            "delay_seconds",
        ),
    ];
    for (n, field) in cases {
        let e = l.add_todo(T0, "e", n).expect_err("refused");
        assert_eq!(e.code, ErrorCode::Invalid, "{e}");
        assert!(e.message.contains(field), "{field}: {e}");
    }
    assert_eq!(l.todos().count(), 0);
    // The bounds themselves are accepted.
    for (id, p) in [("lo", PRIORITY_MIN), ("hi", PRIORITY_MAX)] {
        l.add_todo(
            T0,
            "e",
            NewTodo {
                priority: Some(p),
                delay_seconds: Some(year),
                ..new(id, "ci")
            },
        )
        .unwrap();
    }
}

#[test]
fn claim_next_never_sees_another_endpoints_todos() {
    let mut l = ledger_with(2, 5);
    assert!(
        l.claim_next(T0 + 5, &ep("other"), None, &opts())
            .unwrap()
            .is_none()
    );
    assert_eq!(
        code(l.claim(T0 + 5, &ep("other"), "td_1", &opts())),
        ErrorCode::NotFound
    );
}

#[test]
fn assignee_restricts_who_may_claim() {
    let mut l = ledger_with(0, 5);
    l.add_todo(
        T0,
        "e",
        NewTodo {
            assignee: Some("someone-else".into()),
            ..new("mine-not", "ci")
        },
    )
    .unwrap();
    l.add_todo(
        T0 + 1,
        "e",
        NewTodo {
            assignee: Some("e".into()),
            ..new("mine", "ci")
        },
    )
    .unwrap();
    let c = l
        .claim_next(T0 + 2, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!(c.todo.id, "mine");
    assert!(
        l.claim_next(T0 + 2, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
}

#[test]
fn takeover_closes_the_dead_attempt_first() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("old")).unwrap();
    // Still held: nobody else gets it.
    assert!(
        l.claim_next(T0 + TTL - 1, &ep("e"), None, &fenced("new"))
            .unwrap()
            .is_none()
    );
    let c = l
        .claim_next(T0 + TTL, &ep("e"), None, &fenced("new"))
        .unwrap()
        .unwrap();
    assert!(c.takeover);
    assert_eq!((c.attempt_seq, c.todo.attempt), (2, 2));
    let dead = &c.prior_attempts[0];
    assert_eq!(dead.seq, 1);
    assert_eq!(dead.outcome, Some(Outcome::LeaseExpired));
    assert_eq!(dead.disposition, Some(Disposition::Requeued));
    assert_eq!(dead.ended_at, Some(T0 + TTL));
    assert!(dead.died());
    // The stale holder can no longer write, with or without its token.
    let stale = l.complete(T0 + TTL + 1, &ep("e"), "td_1", &report(Some("old")));
    assert_eq!(code(stale), ErrorCode::Conflict);
    l.check().unwrap();
}

#[test]
fn takeover_only_while_attempts_remain() {
    let mut l = ledger_with(1, 1);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    assert!(
        l.claim_next(T0 + TTL + 1, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
    // The reaper dead-letters it instead.
    let reaped = l.reap(T0 + TTL + 1).unwrap();
    assert!(reaped[0].dead_letter());
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition),
        (Some(Outcome::Reaped), Some(Disposition::DeadLettered))
    );
    l.check().unwrap();
}

#[test]
fn a_failed_todo_is_claimable_once_its_retry_is_due() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let failed = l.fail(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    let due = failed.next_retry_at.unwrap();
    assert!(due > T0 + 1);
    assert!(
        l.claim_next(due - 1, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
    let c = l.claim_next(due, &ep("e"), None, &opts()).unwrap().unwrap();
    assert_eq!((c.todo.attempt, c.todo.next_retry_at), (2, None));
    assert_eq!(
        c.prior_attempts[0].disposition,
        Some(Disposition::RetryScheduled)
    );
    l.check().unwrap();
}

#[test]
fn heartbeat_extends_the_lease_and_records_last_heartbeat_at() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    let t = l
        .heartbeat(
            T0 + MINUTE,
            &ep("e"),
            "td_1",
            2 * TTL,
            Some(TokenHash::of("tok")),
        )
        .unwrap();
    assert_eq!(t.lease_expires_at, Some(T0 + MINUTE + 2 * TTL));
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(a.last_heartbeat_at, Some(T0 + MINUTE));
    assert_eq!(a.lease_expires_at, T0 + MINUTE + 2 * TTL);
    l.check().unwrap();
}

/// The shell-sim sweep found it: a server whose wall clock stepped back after a claim closed the
/// attempt "before it was claimed", breaking the ledger's own invariant. A close is stamped no
/// earlier than its claim; the attempt reads as lasting no time.
#[test]
fn a_clock_stepped_back_never_closes_an_attempt_before_its_claim() {
    let mut l = ledger_with(2, 5);
    l.claim(T0 + 30 * SECOND, &ep("e"), "td_1", &fenced("a"))
        .unwrap();
    l.claim(T0 + 30 * SECOND, &ep("e"), "td_2", &fenced("b"))
        .unwrap();
    // Thirty seconds back: an operator cancels one, the worker completes the other.
    l.cancel(T0, &Actor::operator("cli"), "td_1").unwrap();
    l.complete(T0, &ep("e"), "td_2", &report(Some("b")))
        .unwrap();
    for id in ["td_1", "td_2"] {
        let a = l.attempts(id).next().unwrap();
        assert_eq!(a.ended_at, Some(T0 + 30 * SECOND), "{id}");
    }
    l.check().unwrap();
}

/// The lease rule of a close, broken on purpose: a holder's report stamped at its lease's end,
/// a death before it. An operator's late close is not the holder's, and a close clamped to its
/// claim's instant (a clock stepped back) is not a stale write.
#[test]
fn the_checker_sees_a_stale_write_and_an_early_death_but_not_an_operators_close() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    l.complete(T0 + SECOND, &ep("e"), "td_1", &report(Some("tok")))
        .unwrap();
    l.check().unwrap();
    let t = l.todo("td_1").unwrap().clone();
    let done = l.attempts("td_1").next().unwrap().clone();
    let broken = |f: &dyn Fn(&mut Attempt)| {
        let mut a = done.clone();
        f(&mut a);
        check_todo(&t, [&a])
    };
    let stale = broken(&|a| a.ended_at = Some(T0 + TTL)).unwrap_err();
    assert!(stale.contains("stale_write"), "{stale}");
    broken(&|a| (a.ended_at, a.closed_by) = (Some(T0 + TTL), Some("op:cli".into()))).unwrap();
    broken(&|a| (a.ended_at, a.lease_expires_at) = (Some(T0), T0)).unwrap();
    let early = broken(&|a| a.outcome = Some(Outcome::Reaped)).unwrap_err();
    assert!(early.contains("died_early"), "{early}");
    assert_eq!(
        lease_breach(Outcome::Reaped, (T0, T0 + TTL), T0 + TTL, false),
        None
    );
}

/// A store writes only the columns transitions change, so a transition that changed another
/// (a bug) is refused whole, naming the todo, instead of being half written.
#[test]
fn a_change_to_a_column_no_transition_writes_is_refused_whole() {
    let mut l = ledger_with(1, 5);
    let before = l.todo("td_1").unwrap().clone();
    let write = |l: &mut Ledger, f: &dyn Fn(&mut Todo)| {
        let mut change = Change {
            todo: before.clone(),
            writes: Vec::new(),
        };
        f(&mut change.todo);
        rows::ready(rows::write(&mut memory::Mem(l), "test", &before, change))
    };
    let broken: [&dyn Fn(&mut Todo); 3] = [
        &|t| t.title = "another title".into(),
        &|t| t.asking.max_requests += 1,
        &|t| t.created_at += SECOND,
    ];
    for f in broken {
        let e = write(&mut l, f).unwrap_err();
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(e.message.contains("td_1") && e.message.contains("does not write"));
        assert_eq!(l.todo("td_1"), Some(&before), "nothing was written");
    }
    let written = write(&mut l, &|t| t.updated_at += SECOND).unwrap();
    assert_eq!(written.updated_at, before.updated_at + SECOND);
}

#[test]
fn a_lapsed_lease_cannot_be_revived() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    let hb = l.heartbeat(T0 + TTL, &ep("e"), "td_1", TTL, Some(TokenHash::of("tok")));
    assert_eq!(code(hb), ErrorCode::Conflict);
    let done = l.complete(T0 + TTL, &ep("e"), "td_1", &report(Some("tok")));
    assert_eq!(code(done), ErrorCode::Conflict);
}

#[test]
fn the_fence_is_no_oracle() {
    let mut l = ledger_with(2, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("Zq9-secret"))
        .unwrap();
    let wrong = l
        .complete(T0 + 1, &ep("e"), "td_1", &report(Some("Wx7-guess")))
        .unwrap_err();
    let missing = l
        .complete(T0 + 1, &ep("e"), "td_1", &report(None))
        .unwrap_err();
    // td_2 is held by the operator: "not the owner" must read exactly like a fence mismatch.
    l.claim(T0, &Actor::cli(), "td_2", &opts()).unwrap();
    let not_owner = l
        .complete(T0 + 1, &ep("e"), "td_2", &report(None))
        .unwrap_err();
    assert_eq!(wrong.code, ErrorCode::Conflict);
    assert_eq!(wrong, missing);
    assert_eq!(
        wrong.message.replace("td_1", "ID"),
        not_owner.message.replace("td_2", "ID")
    );
    assert!(!wrong.message.contains("Wx7-guess") && !wrong.message.contains("Zq9-secret"));
    // Nothing changed.
    assert_eq!(
        l.get_todo(&ep("e"), "td_1", 10).unwrap().todo.state,
        TodoState::Claimed
    );
    l.check().unwrap();
}

#[test]
fn a_fenced_report_repeated_after_its_answer_was_lost_is_answered_again() {
    for verb in ["complete", "fail", "release"] {
        let mut l = ledger_with(1, 1);
        l.claim(T0, &ep("e"), "td_1", &fenced("Zq9")).unwrap();
        let send = |l: &mut Ledger, now| match verb {
            "complete" => l.complete(now, &ep("e"), "td_1", &report(Some("Zq9"))),
            "fail" => l.fail(now, &ep("e"), "td_1", &report(Some("Zq9"))),
            _ => l.release(now, &ep("e"), "td_1", None, Some(TokenHash::of("Zq9"))),
        };
        let first = send(&mut l, T0 + 1).unwrap();
        let after = l.clone();
        let again = send(&mut l, T0 + 2).unwrap();
        assert_eq!(again, first, "{verb}: the repeat answers as the first did");
        assert_eq!(l, after, "{verb}: and changes nothing");
        // Another verb, another token or another endpoint is not a repeat.
        let other = if verb == "complete" {
            l.fail(T0 + 3, &ep("e"), "td_1", &report(Some("Zq9")))
        } else {
            l.complete(T0 + 3, &ep("e"), "td_1", &report(Some("Zq9")))
        };
        assert_eq!(code(other), ErrorCode::Conflict, "{verb}");
        let wrong = l.complete(T0 + 3, &ep("e"), "td_1", &report(Some("nope")));
        assert_eq!(code(wrong), ErrorCode::Conflict);
        l.check().unwrap();
    }
}

/// Found by fuzzing the simulator: a fail applied, its answer lost, the retry came due and
/// another holder claimed the todo before the repeat arrived. The repeat is still the same
/// report under the same token: it is answered as the first was, and the new holder's attempt
/// is untouched.
#[test]
fn a_repeat_is_recognised_after_the_todo_moved_on() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("first")).unwrap();
    let failed = l
        .fail(T0 + 1, &ep("e"), "td_1", &report(Some("first")))
        .unwrap();
    let due = failed.next_retry_at.unwrap();
    l.claim_next(due, &ep("e"), None, &fenced("second"))
        .unwrap()
        .unwrap();
    let before = l.clone();
    let again = l
        .fail(due + 1, &ep("e"), "td_1", &report(Some("first")))
        .unwrap();
    assert_eq!(again, failed, "the repeat answers what the first did");
    assert_eq!(l, before, "nothing changed");
    // The same token under another verb is still refused.
    let other = l.complete(due + 2, &ep("e"), "td_1", &report(Some("first")));
    assert_eq!(code(other), ErrorCode::Conflict);
}

/// Found by fuzzing the simulator: a fail that dead-lettered, its answer lost, and an operator
/// retried (or canceled) the dead letter before the repeat arrived. The repeat still answers the
/// dead letter the report made, not the todo as the operator left it.
#[test]
fn a_repeated_fail_answers_its_dead_letter_after_an_operator_acted() {
    for operator in ["retry", "cancel"] {
        let mut l = ledger_with(1, 1);
        l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
        let dead = l
            .fail(T0 + 1, &ep("e"), "td_1", &report(Some("tok")))
            .unwrap();
        assert!(dead.dead_letter());
        let acted = match operator {
            "retry" => l.retry(T0 + 2, &Actor::cli(), "td_1"),
            _ => l.cancel(T0 + 2, &Actor::cli(), "td_1"),
        };
        assert!(!acted.unwrap().dead_letter());
        let before = l.clone();
        let again = l
            .fail(T0 + 3, &ep("e"), "td_1", &report(Some("tok")))
            .unwrap();
        assert_eq!(
            again, dead,
            "{operator}: the repeat answers the dead letter"
        );
        assert_eq!(l, before, "{operator}: nothing changed");
    }
}

#[test]
fn an_unfenced_report_is_never_replayed() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.complete(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    assert_eq!(
        code(l.complete(T0 + 2, &ep("e"), "td_1", &report(None))),
        ErrorCode::Conflict
    );
}

#[test]
fn an_unfenced_claim_refuses_a_token() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let r = l.complete(T0 + 1, &ep("e"), "td_1", &report(Some("made-up")));
    assert_eq!(code(r), ErrorCode::Conflict);
    l.complete(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
}

#[test]
fn operator_variants_skip_the_fence_and_the_owner() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    l.heartbeat(T0 + 1, &Actor::cli(), "td_1", TTL, None)
        .unwrap();
    let t = l
        .complete(T0 + 2, &Actor::cli(), "td_1", &report(None))
        .unwrap();
    assert_eq!(t.state, TodoState::Done);
    // An operator's own claim is recorded as the owner's and is never fenced.
    l.retry(T0 + 3, &Actor::cli(), "td_1").unwrap();
    l.claim(T0 + 4, &Actor::cli(), "td_1", &fenced("ignored"))
        .unwrap();
    let a = l.attempts("td_1").last().unwrap();
    assert_eq!(
        (a.claimer_kind, a.lease_token_hash),
        (ClaimerKind::Owner, None)
    );
    assert_eq!(a.owner, OPERATOR_OWNER);
    l.check().unwrap();
}

#[test]
fn complete_closes_the_attempt_completed_and_keeps_the_result() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    let r = Report {
        result: Some(json!({"ok": true})),
        summary: Some("all green".into()),
        artifact: Some("mcp://cairn/Ab12".into()),
        token_hash: Some(TokenHash::of("tok")),
        ..Report::default()
    };
    let t = l.complete(T0 + SECOND, &ep("e"), "td_1", &r).unwrap();
    assert_eq!(
        (t.state, t.owner.as_deref(), t.lease_expires_at),
        (TodoState::Done, None, None)
    );
    assert_eq!(t.result, Some(json!({"ok": true})));
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(a.outcome, Some(Outcome::Completed));
    assert_eq!(a.disposition, Some(Disposition::Done));
    assert_eq!(a.summary.as_deref(), Some("all green"));
    assert_eq!(a.artifact.as_deref(), Some("mcp://cairn/Ab12"));
    assert!(!a.died());
    // A second report under another token is a conflict, and the attempt is not closed again.
    let stranger = Report {
        token_hash: Some(TokenHash::of("other")),
        ..r.clone()
    };
    assert_eq!(
        code(l.complete(T0 + 2 * SECOND, &ep("e"), "td_1", &stranger)),
        ErrorCode::Conflict
    );
    assert_eq!(
        l.attempts("td_1").next().unwrap().ended_at,
        Some(T0 + SECOND)
    );
    l.check().unwrap();
}

#[test]
fn fail_schedules_a_retry_with_backoff() {
    let mut l = ledger_with(1, 3);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let t = l.fail(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    assert_eq!(t.state, TodoState::Failed);
    assert!(!t.dead_letter());
    let expected = T0 + 1 + l.config().backoff.delay("td_1", 1, 1);
    assert_eq!(t.next_retry_at, Some(expected));
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition),
        (Some(Outcome::Failed), Some(Disposition::RetryScheduled))
    );
}

#[test]
fn fail_at_max_attempts_dead_letters() {
    let mut l = ledger_with(1, 2);
    let mut now = T0;
    for n in 1..=2 {
        l.requeue_due(now).unwrap();
        let c = l.claim_next(now, &ep("e"), None, &opts()).unwrap().unwrap();
        assert_eq!(c.todo.attempt, n);
        let t = l.fail(now + 1, &ep("e"), "td_1", &report(None)).unwrap();
        assert_eq!(t.dead_letter(), n == 2);
        now = t.next_retry_at.unwrap_or(now) + 1;
    }
    let last = l.attempts("td_1").last().unwrap();
    assert_eq!(last.disposition, Some(Disposition::DeadLettered));
    assert!(
        l.claim_next(now + TTL * 100, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
    l.check().unwrap();
}

#[test]
fn release_requeues_and_does_not_burn_an_attempt() {
    let mut l = ledger_with(1, 1);
    l.claim(T0, &ep("e"), "td_1", &fenced("tok")).unwrap();
    let t = l
        .release(
            T0 + 1,
            &ep("e"),
            "td_1",
            Some("daemon stopping"),
            Some(TokenHash::of("tok")),
        )
        .unwrap();
    assert_eq!(
        (t.state, t.attempt, t.attempts_total),
        (TodoState::Pending, 0, 1)
    );
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition, a.summary.as_deref()),
        (
            Some(Outcome::Released),
            Some(Disposition::Requeued),
            Some("daemon stopping")
        )
    );
    // max_attempts = 1 and the released attempt did not count: it can be claimed again.
    let c = l
        .claim_next(T0 + 2, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!((c.attempt_seq, c.todo.attempt), (2, 1));
    l.check().unwrap();
}

#[test]
fn the_reaper_closes_lapsed_leases_as_reaped() {
    let mut l = ledger_with(2, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.claim(T0 + MINUTE, &ep("e"), "td_2", &opts()).unwrap();
    assert!(l.reap(T0 + TTL - 1).unwrap().is_empty());
    let reaped = l.reap(T0 + TTL).unwrap();
    assert_eq!(reaped.len(), 1);
    assert_eq!(
        (reaped[0].id.as_str(), reaped[0].state),
        ("td_1", TodoState::Pending)
    );
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition, a.died()),
        (Some(Outcome::Reaped), Some(Disposition::Requeued), true)
    );
    l.check().unwrap();
}

#[test]
fn the_reaper_and_a_takeover_close_the_dead_attempt_exactly_once() {
    // Takeover first: the reaper then finds a valid lease and does nothing.
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.claim_next(T0 + TTL, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert!(l.reap(T0 + TTL).unwrap().is_empty());
    let outcomes: Vec<_> = l.attempts("td_1").map(|a| a.outcome).collect();
    assert_eq!(outcomes, vec![Some(Outcome::LeaseExpired), None]);
    // Reaper first: the todo is pending, so the claim is fresh and closes nothing.
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.reap(T0 + TTL).unwrap();
    let c = l
        .claim_next(T0 + TTL, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert!(!c.takeover);
    let outcomes: Vec<_> = l.attempts("td_1").map(|a| a.outcome).collect();
    assert_eq!(outcomes, vec![Some(Outcome::Reaped), None]);
    l.check().unwrap();
}

#[test]
fn requeue_due_moves_failed_todos_back_to_pending() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let due = l
        .fail(T0, &ep("e"), "td_1", &report(None))
        .unwrap()
        .next_retry_at
        .unwrap();
    assert!(l.requeue_due(due - 1).unwrap().is_empty());
    let moved = l.requeue_due(due).unwrap();
    assert_eq!(
        (moved[0].state, moved[0].next_retry_at),
        (TodoState::Pending, None)
    );
    assert_eq!(l.attempts("td_1").count(), 1, "requeue writes no attempt");
    l.check().unwrap();
}

#[test]
fn retry_never_resets_attempts_total() {
    let mut l = ledger_with(1, 1);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let t = l
        .fail(
            T0 + 1,
            &ep("e"),
            "td_1",
            &Report {
                result: Some(json!(1)),
                ..report(None)
            },
        )
        .unwrap();
    assert!(t.dead_letter());
    let t = l.retry(T0 + 2, &Actor::cli(), "td_1").unwrap();
    assert_eq!(
        (t.state, t.attempt, t.attempts_total),
        (TodoState::Pending, 0, 1)
    );
    assert_eq!((t.result, t.next_retry_at), (None, None));
    let c = l
        .claim_next(T0 + 3, &ep("e"), None, &opts())
        .unwrap()
        .unwrap();
    assert_eq!((c.attempt_seq, c.todo.attempt), (2, 1));
    // A live lease cannot be retried out from under its holder.
    assert_eq!(
        code(l.retry(T0 + 4, &Actor::cli(), "td_1")),
        ErrorCode::Conflict
    );
    l.check().unwrap();
}

/// Found by fuzzing the simulator: an operator canceled a claimed todo and retried it at once;
/// a second worker claimed it while the first, not yet told, still ran. A retry now waits for
/// the canceled attempt's lease to lapse.
#[test]
fn a_canceled_attempt_blocks_a_retry_until_its_lease_lapses() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.cancel(T0 + 1, &Actor::cli(), "td_1").unwrap();
    let early = l.retry(T0 + 2, &Actor::cli(), "td_1").unwrap_err();
    assert_eq!(early.code, ErrorCode::Conflict);
    assert!(early.message.contains("retry at or after"), "{early}");
    assert_eq!(
        l.get_todo(&Actor::cli(), "td_1", 5).unwrap().todo.state,
        TodoState::Canceled
    );
    let t = l.retry(T0 + TTL, &Actor::cli(), "td_1").unwrap();
    assert_eq!(t.state, TodoState::Pending);
    // A todo canceled while pending has no holder to wait for.
    l.add_todo(T0, "e", new("td_2", "ci")).unwrap();
    l.cancel(T0 + 1, &Actor::cli(), "td_2").unwrap();
    l.retry(T0 + 2, &Actor::cli(), "td_2").unwrap();
    l.check().unwrap();
}

#[test]
fn cancel_closes_the_open_attempt_as_canceled() {
    let mut l = ledger_with(2, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let t = l.cancel(T0 + 1, &Actor::cli(), "td_1").unwrap();
    assert_eq!((t.state, t.owner), (TodoState::Canceled, None));
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition, a.died()),
        (Some(Outcome::Canceled), Some(Disposition::Canceled), false)
    );
    l.cancel(T0 + 1, &Actor::cli(), "td_2").unwrap();
    assert_eq!(l.attempts("td_2").count(), 0);
    assert_eq!(
        code(l.cancel(T0 + 2, &Actor::cli(), "td_2")),
        ErrorCode::Conflict
    );
    // A late report from the canceled holder is refused.
    assert_eq!(
        code(l.complete(T0 + 2, &ep("e"), "td_1", &report(None))),
        ErrorCode::Conflict
    );
    l.check().unwrap();
}

/// An MCP task's end is final: an operator may neither retry nor cancel a task's finished todo
/// (a dead letter included, which the task reads `completed`); a plain todo's dead letter may
/// still be canceled. Found by the simulator: a cancel that read a claimed task, then wrote
/// after the worker's last fail had dead-lettered it, turned `completed` into `cancelled`.
#[test]
fn a_tasks_end_is_final_for_the_operator_too() {
    let mut l = ledger_with(1, 1);
    for id in ["tk_1", "tk_2"] {
        let task = NewTodo {
            max_attempts: Some(1),
            task_id: Some(TaskId::new(id, &"a".repeat(TASK_SECRET_HEX))),
            ..new(id, "ci")
        };
        l.add_todo(T0, "e", task).unwrap();
    }
    for id in ["td_1", "tk_1", "tk_2"] {
        l.claim(T0 + 1, &ep("e"), id, &opts()).unwrap();
    }
    let dead = l.fail(T0 + 2, &ep("e"), "tk_1", &report(None)).unwrap();
    assert!(dead.dead_letter());
    l.complete(T0 + 2, &ep("e"), "tk_2", &report(None)).unwrap();
    l.fail(T0 + 2, &ep("e"), "td_1", &report(None)).unwrap();
    for id in ["tk_1", "tk_2"] {
        let cancel = l.cancel(T0 + 3, &Actor::cli(), id).unwrap_err();
        assert_eq!(cancel.code, ErrorCode::Conflict, "{id}: {cancel}");
        assert_eq!(
            code(l.retry(T0 + 3, &Actor::cli(), id)),
            ErrorCode::Conflict
        );
    }
    assert_eq!(l.todo("tk_1"), Some(&dead));
    let t = l.cancel(T0 + 3, &Actor::cli(), "td_1").unwrap();
    assert_eq!(t.state, TodoState::Canceled);
    l.check().unwrap();
}

#[test]
fn revoking_an_endpoint_dead_letters_its_claimed_todos() {
    let mut l = ledger_with(2, 5);
    l.add_todo(T0, "other", new("theirs", "ci")).unwrap();
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.claim(T0, &ep("other"), "theirs", &opts()).unwrap();
    let changed = l.revoke_endpoint(T0 + 1, "e").unwrap();
    assert_eq!(changed.len(), 1);
    assert!(changed[0].dead_letter());
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a.outcome, a.disposition),
        (Some(Outcome::Revoked), Some(Disposition::DeadLettered))
    );
    assert_eq!(
        l.get_todo(&Actor::cli(), "td_2", 5).unwrap().todo.state,
        TodoState::Pending
    );
    assert_eq!(
        l.get_todo(&Actor::cli(), "theirs", 5).unwrap().todo.state,
        TodoState::Claimed
    );
    l.check().unwrap();
}

#[test]
fn get_todo_lists_attempts_newest_first_with_the_open_one() {
    let mut l = ledger_with(1, 5);
    for i in 0..3 {
        let now = T0 + i * TTL;
        l.claim_next(now, &ep("e"), None, &opts()).unwrap().unwrap();
    }
    let v = l.get_todo(&ep("e"), "td_1", 2).unwrap();
    assert_eq!(
        v.attempts.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![3, 2]
    );
    assert!(v.attempts[0].is_open());
    assert_eq!((v.attempts_total, v.attempts_pruned), (3, 0));
}

#[test]
fn a_foreign_or_unknown_id_is_not_found() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let other = ep("other");
    for id in ["td_1", "td_404"] {
        assert_eq!(code(l.claim(T0, &other, id, &opts())), ErrorCode::NotFound);
        assert_eq!(
            code(l.heartbeat(T0, &other, id, TTL, None)),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(l.complete(T0, &other, id, &report(None))),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(l.fail(T0, &other, id, &report(None))),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(l.release(T0, &other, id, None, None)),
            ErrorCode::NotFound
        );
        assert_eq!(code(l.get_todo(&other, id, 5)), ErrorCode::NotFound);
        assert_eq!(code(l.cancel(T0, &other, id)), ErrorCode::NotFound);
        assert_eq!(code(l.retry(T0, &other, id)), ErrorCode::NotFound);
        assert_eq!(code(l.delete_todo(&other, id)), ErrorCode::NotFound);
    }
    // The foreign and the unknown id read the same, but for the id itself.
    let foreign = l.get_todo(&other, "td_1", 5).unwrap_err().message;
    let unknown = l.get_todo(&other, "td_404", 5).unwrap_err().message;
    assert_eq!(foreign.replace("td_1", "X"), unknown.replace("td_404", "X"));
    assert!(
        l.list_todos(
            &other,
            &TodoFilter {
                limit: 10,
                ..TodoFilter::default()
            }
        )
        .unwrap()
        .is_empty()
    );
}

#[test]
fn a_long_summary_is_truncated_never_rejected() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let long = "ü".repeat(3000);
    let r = Report {
        summary: Some(long),
        ..report(None)
    };
    l.fail(T0 + 1, &ep("e"), "td_1", &r).unwrap();
    let a = l.attempts("td_1").next().unwrap();
    assert!(a.summary_truncated);
    assert_eq!(a.summary.as_ref().unwrap().len(), 2048);
}

#[test]
fn the_claimant_is_stripped_of_control_characters_and_capped() {
    let mut l = ledger_with(1, 5);
    let o = ClaimOpts {
        claimant: Some(format!("run\n-1\u{1b}{}", "x".repeat(200))),
        ..opts()
    };
    l.claim(T0, &ep("e"), "td_1", &o).unwrap();
    let c = l.attempts("td_1").next().unwrap().claimant.clone().unwrap();
    assert!(c.starts_with("run-1x") && c.len() == 128, "{c}");
}

#[test]
fn a_malformed_artifact_is_invalid_and_changes_nothing() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let before = l.clone();
    let r = Report {
        artifact: Some("file:///etc/passwd".into()),
        ..report(None)
    };
    let err = l.complete(T0 + 1, &ep("e"), "td_1", &r).unwrap_err();
    assert_eq!(err.code, ErrorCode::Invalid);
    assert!(
        err.message.contains("artifact") && err.message.contains("td_1"),
        "{err}"
    );
    assert_eq!(l, before);
}

#[test]
fn summary_from_result_only_when_the_operator_opts_in() {
    let r = Report {
        result: Some(json!({"harness": {"reason": "check_failed"}})),
        ..report(None)
    };
    let mut off = ledger_with(1, 5);
    off.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    off.fail(T0 + 1, &ep("e"), "td_1", &r).unwrap();
    assert_eq!(off.attempts("td_1").next().unwrap().summary, None);

    let mut on = Ledger::new(LedgerConfig {
        summary_from_result: true,
        ..LedgerConfig::default()
    });
    on.add_todo(T0, "e", new("td_1", "ci")).unwrap();
    on.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    on.fail(T0 + 1, &ep("e"), "td_1", &r).unwrap();
    assert_eq!(
        on.attempts("td_1").next().unwrap().summary.as_deref(),
        Some(r#"{"harness":{"reason":"check_failed"}}"#)
    );
}

#[test]
fn the_cap_keeps_the_newest_attempts() {
    let mut l = Ledger::new(LedgerConfig {
        attempts_cap: 3,
        ..LedgerConfig::default()
    });
    l.add_todo(
        T0,
        "e",
        NewTodo {
            max_attempts: Some(100),
            ..new("td_1", "ci")
        },
    )
    .unwrap();
    for i in 0..7 {
        l.claim(T0 + i * TTL, &ep("e"), "td_1", &opts()).unwrap();
        l.check().unwrap();
    }
    let v = l.get_todo(&ep("e"), "td_1", 100).unwrap();
    assert_eq!(
        v.attempts.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![7, 6, 5]
    );
    assert_eq!((v.attempts_total, v.attempts_pruned), (7, 4));
    assert!(v.attempts[0].is_open());
}

#[test]
fn prior_attempts_are_the_five_newest_closed() {
    let mut l = ledger_with(1, 100);
    for i in 0..8 {
        l.claim(T0 + i * TTL, &ep("e"), "td_1", &opts()).unwrap();
    }
    let c = l.claim(T0 + 8 * TTL, &ep("e"), "td_1", &opts()).unwrap();
    assert_eq!(
        c.prior_attempts.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![8, 7, 6, 5, 4]
    );
    assert!(c.prior_attempts.iter().all(|a| !a.is_open()));
}

#[test]
fn deleting_a_todo_deletes_its_attempts() {
    let mut l = ledger_with(2, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.complete(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    l.delete_todo(&Actor::cli(), "td_1").unwrap();
    assert_eq!(l.attempts("td_1").count(), 0);
    assert_eq!(
        code(l.get_todo(&Actor::cli(), "td_1", 5)),
        ErrorCode::NotFound
    );
    l.check().unwrap();
}

#[test]
fn retention_purges_finished_todos_only() {
    let mut l = ledger_with(3, 1);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.complete(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    l.claim(T0, &ep("e"), "td_2", &opts()).unwrap();
    l.fail(T0 + 1, &ep("e"), "td_2", &report(None)).unwrap(); // a dead letter
    assert!(
        l.purge_finished(T0 + 1 + MINUTE - 1, MINUTE)
            .unwrap()
            .is_empty()
    );
    let gone = l.purge_finished(T0 + 1 + MINUTE, MINUTE).unwrap();
    assert_eq!(gone, vec!["td_1".to_string(), "td_2".to_string()]);
    assert_eq!(
        l.todos().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        vec!["td_3"]
    );
    l.check().unwrap();
}

#[test]
fn add_todo_rejects_bad_input_naming_the_field() {
    let mut l = ledger_with(0, 5);
    let cases = [
        (
            NewTodo {
                id: "".into(),
                ..new("x", "ci")
            },
            "id",
        ),
        (new("td_1", "bad queue"), "queue"),
        (
            NewTodo {
                title: " ".into(),
                ..new("td_1", "ci")
            },
            "title",
        ),
        (
            NewTodo {
                title: "a\nb".into(),
                ..new("td_1", "ci")
            },
            "title",
        ),
        (
            NewTodo {
                max_attempts: Some(0),
                ..new("td_1", "ci")
            },
            "max_attempts",
        ),
        (
            NewTodo {
                kind: Some("k".repeat(200)),
                ..new("td_1", "ci")
            },
            "kind",
        ),
        (
            NewTodo {
                payload: Some(json!("x".repeat(70_000))),
                ..new("td_1", "ci")
            },
            "payload",
        ),
    ];
    for (bad, field) in cases {
        let err = l.add_todo(T0, "e", bad).unwrap_err();
        assert_eq!(err.code, ErrorCode::Invalid);
        assert!(err.message.contains(field), "{field}: {err}");
    }
    assert_eq!(l.todos().count(), 0);
    l.add_todo(T0, "e", new("td_1", "ci")).unwrap();
    assert_eq!(
        code(l.add_todo(T0, "e", new("td_1", "ci"))),
        ErrorCode::Conflict
    );
}

#[test]
fn ttl_outside_one_second_to_a_day_is_invalid() {
    let mut l = ledger_with(1, 5);
    let o = ClaimOpts { ttl: 0, ..opts() };
    assert_eq!(
        code(l.claim_next(T0, &ep("e"), None, &o)),
        ErrorCode::Invalid
    );
    let o = ClaimOpts {
        ttl: (LEASE_TTL_MAX_SECS + 1) * 1000,
        ..opts()
    };
    assert_eq!(code(l.claim(T0, &ep("e"), "td_1", &o)), ErrorCode::Invalid);
}

// The safety checks themselves: break each rule behind the ledger's back and see it caught.

#[test]
fn check_catches_a_second_open_attempt() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let entry = l.todos.get_mut("td_1").unwrap();
    let mut second = entry.attempts[&1].clone();
    second.seq = 2;
    entry.attempts.insert(2, second);
    entry.todo.attempts_total = 2;
    assert!(l.check().unwrap_err().contains("open attempts"));
}

#[test]
fn check_catches_a_half_closed_attempt_and_a_seq_gap() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    l.complete(T0 + 1, &ep("e"), "td_1", &report(None)).unwrap();
    let mut broken = l.clone();
    broken
        .todos
        .get_mut("td_1")
        .unwrap()
        .attempts
        .get_mut(&1)
        .unwrap()
        .outcome = None;
    assert!(broken.check().unwrap_err().contains("together"));
    let mut gap = l.clone();
    gap.todos.get_mut("td_1").unwrap().todo.attempts_total = 2;
    assert!(gap.check().unwrap_err().contains("seqs"));
}

#[test]
fn an_attempt_cannot_be_closed_twice() {
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let entry = &l.todos["td_1"];
    let change = transition::reap(T0 + TTL, &entry.todo, entry.open())
        .unwrap()
        .unwrap();
    l.apply_change(change.clone()).unwrap();
    let before = l.clone();
    let again = l.apply_change(change).unwrap_err();
    assert_eq!(again.code, ErrorCode::Internal);
    assert!(again.message.contains("exactly once"));
    assert_eq!(l, before, "nothing applied");
}

mod properties {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use crate::testing::{decode_ops, ledger_ops, observe};

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn random_operation_sequences_never_break_check(bytes in vec(any::<u8>(), 0..600)) {
            prop_assert_eq!(ledger_ops(&bytes), Ok(()));
        }
    }

    /// The property above is only worth something if its random programs reach the interesting
    /// transitions; count them over a fixed batch of programs.
    #[test]
    fn random_programs_reach_takeovers_dead_letters_pruning_and_conflicts() {
        let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
        let mut x: u64 = 0x1234_5678;
        for _ in 0..300 {
            let bytes: Vec<u8> = (0..600)
                .map(|_| {
                    x = x
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (x >> 33) as u8
                })
                .collect();
            let mut l = Ledger::new(LedgerConfig {
                attempts_cap: 4,
                ..LedgerConfig::default()
            });
            for op in decode_ops(&bytes) {
                let obs = observe(l.apply(op.clone()));
                let mut count = |k| *seen.entry(k).or_default() += 1;
                match (&op, &obs) {
                    (_, Err(ErrorCode::Conflict)) => count("conflict"),
                    (_, Err(ErrorCode::NotFound)) => count("not_found"),
                    (Op::ClaimNext { .. } | Op::Claim { .. }, Ok(v)) if v["takeover"] == true => {
                        count("takeover")
                    }
                    (Op::Fail { .. }, Ok(v)) if v["dead_letter"] == true => count("dead_letter"),
                    (Op::Reap { .. }, Ok(v)) if v.as_array().is_some_and(|a| !a.is_empty()) => {
                        count("reaped")
                    }
                    (Op::Complete { .. }, Ok(_)) => count("completed"),
                    _ => {}
                }
                if l.todos().any(|t| t.attempts_pruned > 0) {
                    count("pruned");
                }
            }
        }
        for k in [
            "conflict",
            "not_found",
            "takeover",
            "dead_letter",
            "reaped",
            "completed",
            "pruned",
        ] {
            assert!(
                seen.get(k).copied().unwrap_or(0) > 0,
                "never reached {k}: {seen:?}"
            );
        }
    }
}

#[test]
fn a_paused_queue_answers_claim_next_empty_and_still_takes_adds() {
    let mut l = ledger_with(1, 5);
    l.add_todo(T0 + 2, "e", new("other_1", "docs")).unwrap();
    let (ci, any) = (vec!["ci".to_string()], None);
    assert_eq!(
        l.pause_queue(T0 + 3, &Actor::cli(), "ci", true).unwrap(),
        ["ci"]
    );
    // Pausing again keeps it paused, once.
    assert_eq!(
        l.pause_queue(T0 + 4, &Actor::cli(), "ci", true).unwrap(),
        ["ci"]
    );
    assert!(
        l.claim_next(T0 + 5, &ep("e"), Some(&ci), &opts())
            .unwrap()
            .is_none()
    );
    // Without a queue filter, the paused queue is skipped and the next one served.
    let c = l
        .claim_next(T0 + 5, &ep("e"), any, &opts())
        .unwrap()
        .unwrap();
    assert_eq!(c.todo.id, "other_1");
    // Adds are accepted, and a claim by id still works (an explicit choice, not a scan).
    l.add_todo(T0 + 6, "e", new("td_9", "ci")).unwrap();
    assert!(
        l.claim_next(T0 + 7, &ep("e"), any, &opts())
            .unwrap()
            .is_none()
    );
    l.claim(T0 + 8, &ep("e"), "td_9", &opts()).unwrap();
    assert!(
        l.pause_queue(T0 + 9, &Actor::cli(), "ci", false)
            .unwrap()
            .is_empty()
    );
    let c = l
        .claim_next(T0 + 10, &ep("e"), Some(&ci), &opts())
        .unwrap()
        .unwrap();
    assert_eq!(c.todo.id, "td_1");
    l.check().unwrap();
}

#[test]
fn only_an_operator_may_pause_and_only_a_queue_name() {
    let mut l = ledger_with(1, 5);
    let r = l.pause_queue(T0, &ep("e"), "ci", true);
    assert_eq!(code(r), ErrorCode::Forbidden);
    let r = l.pause_queue(T0, &Actor::cli(), "bad queue", true);
    let e = r.unwrap_err();
    assert_eq!(e.code, ErrorCode::Invalid);
    assert!(e.message.contains("queue"), "{}", e.message);
    assert!(
        l.apply(Op::PausedQueues)
            .unwrap()
            .queues()
            .unwrap()
            .is_empty()
    );
}

#[test]
fn an_attempt_an_operator_closes_records_the_operator_and_an_endpoints_report_none() {
    let mut l = ledger_with(2, 5);
    l.claim(T0 + 10, &ep("e"), "td_1", &fenced("tok")).unwrap();
    l.release(T0 + 11, &Actor::operator("alice"), "td_1", None, None)
        .unwrap();
    l.claim(T0 + 12, &ep("e"), "td_1", &opts()).unwrap();
    l.cancel(T0 + 13, &Actor::cli(), "td_1").unwrap();
    l.claim(T0 + 14, &ep("e"), "td_2", &opts()).unwrap();
    l.complete(T0 + 15, &ep("e"), "td_2", &report(None))
        .unwrap();
    let by: Vec<Option<&str>> = l
        .attempts("td_1")
        .chain(l.attempts("td_2"))
        .map(|a| a.closed_by.as_deref())
        .collect();
    assert_eq!(by, [Some("alice"), Some(CLI_OPERATOR), None]);
    l.check().unwrap();
}

// ---- recovery by failure class ---------------------------------------------------------------

fn failing(token: &str, retryable: Option<bool>, signature: Option<&str>) -> Report {
    Report {
        retryable,
        failure_signature: signature.map(str::to_string),
        summary: Some(format!("failed: {}", signature.unwrap_or("-"))),
        ..report(Some(token))
    }
}

/// Claims td_1 fenced by `tok` at `now` (its retry, if any, due by then) and fails it.
fn claim_and_fail(l: &mut Ledger, now: Millis, tok: &str, r: &Report) -> Todo {
    l.requeue_due(now).unwrap();
    l.claim(now, &ep("e"), "td_1", &fenced(tok)).unwrap();
    l.fail(
        now + SECOND,
        &ep("e"),
        "td_1",
        &Report {
            token_hash: Some(TokenHash::of(tok)),
            ..r.clone()
        },
    )
    .unwrap()
}

#[test]
fn a_non_retryable_fail_dead_letters_at_once_whatever_attempts_remain() {
    let mut l = ledger_with(1, 5);
    let t = claim_and_fail(&mut l, T0, "tok", &failing("tok", Some(false), None));
    assert!(t.dead_letter());
    assert_eq!((t.attempt, t.max_attempts), (1, 5));
    assert_eq!(t.dead_letter_reason, Some(DeadLetterReason::NonRetryable));
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(a.disposition, Some(Disposition::DeadLettered));
    assert_eq!(a.dead_letter_reason, Some(DeadLetterReason::NonRetryable));
    // retryable: true is the default: a retry is scheduled.
    let mut l = ledger_with(1, 5);
    let t = claim_and_fail(&mut l, T0, "tok", &failing("tok", Some(true), None));
    assert!(!t.dead_letter() && t.next_retry_at.is_some() && t.dead_letter_reason.is_none());
    l.check().unwrap();
}

#[test]
fn exhausted_attempts_and_revocation_say_so() {
    let mut l = ledger_with(1, 1);
    let t = claim_and_fail(&mut l, T0, "tok", &failing("tok", None, None));
    assert_eq!(
        t.dead_letter_reason,
        Some(DeadLetterReason::AttemptsExhausted)
    );
    let mut l = ledger_with(1, 5);
    l.claim(T0, &ep("e"), "td_1", &opts()).unwrap();
    let revoked = l.revoke_endpoint(T0 + 1, "e").unwrap();
    assert_eq!(
        revoked[0].dead_letter_reason,
        Some(DeadLetterReason::Revoked)
    );
    // A manual retry clears the reason with the dead letter.
    let t = l.retry(T0 + TTL, &Actor::cli(), "td_1").unwrap();
    assert_eq!((t.state, t.dead_letter_reason), (TodoState::Pending, None));
    l.check().unwrap();
}

#[test]
fn the_same_signature_twice_in_a_row_dead_letters_and_a_new_one_does_not() {
    let mut l = ledger_with(1, 5);
    let sig = |s| failing("x", None, Some(s));
    let t = claim_and_fail(&mut l, T0, "t1", &sig("E42"));
    assert!(!t.dead_letter());
    // A different failure is new evidence: retried.
    let t = claim_and_fail(&mut l, T0 + 10 * MINUTE, "t2", &sig("E43"));
    assert!(!t.dead_letter());
    let t = claim_and_fail(&mut l, T0 + 20 * MINUTE, "t3", &sig("E43"));
    assert_eq!(
        t.dead_letter_reason,
        Some(DeadLetterReason::RepeatedFailure)
    );
    assert_eq!(t.attempt, 3);
    let newest = l.attempts("td_1").last().unwrap();
    assert_eq!(newest.failure_signature.as_deref(), Some("E43"));
    // A manual retry is a new hypothesis: the same signature once more is retried.
    l.retry(T0 + 30 * MINUTE, &Actor::cli(), "td_1").unwrap();
    let t = claim_and_fail(&mut l, T0 + 31 * MINUTE, "t4", &sig("E43"));
    assert!(!t.dead_letter(), "{t:?}");
    l.check().unwrap();
}

#[test]
fn max_same_failures_zero_turns_the_rule_off_and_a_long_signature_is_refused() {
    let mut l = Ledger::new(LedgerConfig::default());
    let off = NewTodo {
        max_same_failures: Some(0),
        ..new("td_1", "ci")
    };
    l.add_todo(T0, "e", off).unwrap();
    for (i, tok) in ["a", "b", "c"].into_iter().enumerate() {
        let t = claim_and_fail(
            &mut l,
            T0 + i as u64 * HOUR_MS,
            tok,
            &failing(tok, None, Some("same")),
        );
        assert!(!t.dead_letter(), "attempt {}", i + 1);
    }
    l.requeue_due(T0 + 4 * HOUR_MS).unwrap();
    l.claim(T0 + 4 * HOUR_MS, &ep("e"), "td_1", &fenced("d"))
        .unwrap();
    let long = failing("d", None, Some(&"s".repeat(SIGNATURE_MAX_BYTES + 1)));
    let refused = l.fail(T0 + 4 * HOUR_MS + 1, &ep("e"), "td_1", &long);
    let e = refused.unwrap_err();
    assert_eq!(e.code, ErrorCode::Invalid);
    assert!(e.message.contains("failure_signature"), "{e}");
    assert_eq!(
        l.todo("td_1").unwrap().state,
        TodoState::Claimed,
        "nothing changed"
    );
    l.check().unwrap();
}

const HOUR_MS: Millis = 60 * MINUTE;

#[test]
fn a_deadline_stops_new_attempts_and_dead_letters_the_todo() {
    let mut l = Ledger::new(LedgerConfig::default());
    let timed = |id: &str| NewTodo {
        deadline_seconds: Some(600),
        ..new(id, "ci")
    };
    for id in ["td_1", "td_2", "td_3"] {
        l.add_todo(T0, "e", timed(id)).unwrap();
    }
    let deadline = T0 + 10 * MINUTE;
    assert_eq!(l.todo("td_1").unwrap().deadline_at, Some(deadline));
    // td_1: failed two seconds before the deadline, its retry (30 s) would fall after it.
    l.claim(deadline - 60 * SECOND, &ep("e"), "td_1", &fenced("a"))
        .unwrap();
    let t = l
        .fail(
            deadline - 2 * SECOND,
            &ep("e"),
            "td_1",
            &failing("a", None, None),
        )
        .unwrap();
    assert_eq!(t.dead_letter_reason, Some(DeadLetterReason::Deadline));
    // td_2: a claim running at the deadline may still report.
    l.claim(deadline - SECOND, &ep("e"), "td_2", &fenced("b"))
        .unwrap();
    let done = l
        .complete(deadline + SECOND, &ep("e"), "td_2", &report(Some("b")))
        .unwrap();
    assert_eq!(done.state, TodoState::Done);
    // td_3: pending at the deadline: unclaimable, then dead-lettered by the sweep.
    assert_eq!(
        code(l.claim(deadline, &ep("e"), "td_3", &opts())),
        ErrorCode::Conflict
    );
    assert!(
        l.claim_next(deadline, &ep("e"), None, &opts())
            .unwrap()
            .is_none()
    );
    let swept = l.requeue_due(deadline).unwrap();
    assert_eq!(
        swept.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        ["td_3"]
    );
    assert_eq!(
        swept[0].dead_letter_reason,
        Some(DeadLetterReason::Deadline)
    );
    // The operator's retry lifts the deadline: the todo can be claimed again.
    let t = l.retry(deadline + MINUTE, &Actor::cli(), "td_3").unwrap();
    assert_eq!((t.state, t.deadline_at), (TodoState::Pending, None));
    l.claim(deadline + MINUTE, &ep("e"), "td_3", &opts())
        .unwrap();
    l.check().unwrap();
}

#[test]
fn a_lapsed_lease_past_the_deadline_is_reaped_into_a_dead_letter() {
    let mut l = Ledger::new(LedgerConfig::default());
    l.add_todo(
        T0,
        "e",
        NewTodo {
            deadline_seconds: Some(60),
            ..new("td_1", "ci")
        },
    )
    .unwrap();
    l.claim(
        T0,
        &ep("e"),
        "td_1",
        &ClaimOpts {
            ttl: 2 * MINUTE,
            ..opts()
        },
    )
    .unwrap();
    let reaped = l.reap(T0 + 2 * MINUTE).unwrap();
    assert_eq!(
        reaped[0].dead_letter_reason,
        Some(DeadLetterReason::Deadline)
    );
    let a = l.attempts("td_1").next().unwrap();
    assert_eq!(a.outcome, Some(Outcome::Reaped));
    assert_eq!(a.dead_letter_reason, Some(DeadLetterReason::Deadline));
    l.check().unwrap();
}

#[test]
fn bad_budgets_are_refused_naming_the_argument() {
    let mut l = Ledger::new(LedgerConfig::default());
    for (bad, arg) in [
        (
            NewTodo {
                deadline_seconds: Some(0),
                ..new("td_1", "ci")
            },
            "deadline_seconds",
        ),
        (
            NewTodo {
                deadline_seconds: Some(DEADLINE_MAX_SECS + 1),
                ..new("td_1", "ci")
            },
            "deadline_seconds",
        ),
        (
            NewTodo {
                max_same_failures: Some(11),
                ..new("td_1", "ci")
            },
            "max_same_failures",
        ),
        (
            NewTodo {
                idempotency_key: Some(String::new()),
                ..new("td_1", "ci")
            },
            "idempotency_key",
        ),
        (
            NewTodo {
                idempotency_key: Some("k".repeat(201)),
                ..new("td_1", "ci")
            },
            "idempotency_key",
        ),
    ] {
        let e = l.add_todo(T0, "e", bad).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(e.message.contains(arg), "{e}");
    }
    assert_eq!(l.todos().count(), 0, "nothing was added");
}

#[test]
fn an_add_with_a_used_key_answers_the_first_todo_and_adds_nothing() {
    let mut l = Ledger::new(LedgerConfig::default());
    let keyed = |id: &str, title: &str| NewTodo {
        idempotency_key: Some("webhook-7".into()),
        title: title.into(),
        ..new(id, "ci")
    };
    let first = l
        .apply(Op::AddTodo {
            now: T0,
            endpoint: "e".into(),
            new: keyed("td_1", "one"),
        })
        .unwrap();
    assert!(matches!(first, Answer::Todo(_)));
    // Whatever its other arguments say.
    let again = l
        .apply(Op::AddTodo {
            now: T0 + 1,
            endpoint: "e".into(),
            new: keyed("td_2", "two"),
        })
        .unwrap();
    let Answer::Existing(t) = again else {
        panic!("{again:?}")
    };
    assert_eq!((t.id.as_str(), t.title.as_str()), ("td_1", "one"));
    assert_eq!(l.todos().count(), 1);
    // Keys are per endpoint.
    let other = l
        .apply(Op::AddTodo {
            now: T0 + 2,
            endpoint: "f".into(),
            new: keyed("td_3", "three"),
        })
        .unwrap();
    assert!(matches!(other, Answer::Todo(_)));
    // The key lives as long as its todo.
    l.apply(Op::DeleteTodo {
        actor: Actor::cli(),
        id: "td_1".into(),
    })
    .unwrap();
    let fresh = l
        .apply(Op::AddTodo {
            now: T0 + 3,
            endpoint: "e".into(),
            new: keyed("td_4", "four"),
        })
        .unwrap();
    assert!(matches!(fresh, Answer::Todo(t) if t.id == "td_4"));
    l.check().unwrap();
}

#[test]
fn a_late_report_is_kept_on_its_attempt_and_changes_nothing_else() {
    let mut l = ledger_with(1, 5);
    l.claim(
        T0,
        &ep("e"),
        "td_1",
        &ClaimOpts {
            ttl: MINUTE,
            ..fenced("old")
        },
    )
    .unwrap();
    l.claim(T0 + 2 * MINUTE, &ep("e"), "td_1", &fenced("new"))
        .unwrap();
    let before = l.todo("td_1").unwrap().clone();
    // The stale holder's report is refused...
    let stale = report(Some("old"));
    assert_eq!(
        code(l.complete(T0 + 3 * MINUTE, &ep("e"), "td_1", &stale)),
        ErrorCode::Conflict
    );
    let note = |l: &mut Ledger, n: u64, token: &str| {
        l.apply(Op::NoteLate {
            now: T0 + 3 * MINUTE + n,
            actor: ep("e"),
            id: "td_1".into(),
            outcome: Outcome::Completed,
            summary: Some("é".repeat(200)),
            token_hash: Some(TokenHash::of(token)),
        })
        .and_then(Answer::late)
        .unwrap()
    };
    // ...and kept on attempt 1: at most three, the rest counted.
    for n in 0..5 {
        assert_eq!(note(&mut l, n, "old"), Some(1));
    }
    let a1 = l.attempts("td_1").next().unwrap();
    assert_eq!(
        (a1.late_reports.len(), a1.late_reports_total),
        (LATE_REPORTS_KEPT, 5)
    );
    assert!(
        a1.late_reports
            .iter()
            .all(|r| r.summary.as_ref().unwrap().len() <= LATE_SUMMARY_MAX_BYTES)
    );
    assert_eq!(a1.late_reports[0].outcome, Outcome::Completed);
    // A token of no closed attempt, another endpoint, the open attempt's own: nothing kept.
    assert_eq!(note(&mut l, 9, "stranger"), None);
    assert_eq!(note(&mut l, 9, "new"), None);
    assert_eq!(l.todo("td_1").unwrap(), &before, "the todo is untouched");
    l.check().unwrap();
}

#[test]
fn a_dead_letter_has_a_bounded_attention_text_saying_why() {
    let mut l = ledger_with(1, 5);
    let sig = failing("x", None, Some("sig-abc"));
    claim_and_fail(
        &mut l,
        T0,
        "t1",
        &Report {
            summary: Some("x".repeat(3000)),
            ..sig.clone()
        },
    );
    claim_and_fail(&mut l, T0 + HOUR_MS, "t2", &sig);
    let view = l.get_todo(&Actor::cli(), "td_1", 20).unwrap();
    let text = attention(&view).expect("a dead letter's attention");
    assert!(text.len() <= ATTENTION_MAX_BYTES);
    assert!(text.starts_with("Dead letter (repeated_failure)"), "{text}");
    assert!(
        text.contains("#2 failed") && text.contains("#1 failed"),
        "{text}"
    );
    assert!(text.contains("sig-abc"), "{text}");
    // Not a dead letter: no attention.
    let mut l = ledger_with(1, 5);
    let view = l.get_todo(&Actor::cli(), "td_1", 20).unwrap();
    assert_eq!(attention(&view), None);
}

/// Waiting for a human, and spend budgets.
mod asking {
    use super::*;

    fn ask(l: &mut Ledger, now: Millis, token: &str, q: &str, usage: Option<Usage>) -> Todo {
        let op = Op::RequestInput {
            now,
            actor: ep("e"),
            id: "td_1".into(),
            question: q.into(),
            report: Report {
                usage,
                ..report(Some(token))
            },
        };
        l.apply(op).unwrap().todo().unwrap()
    }

    fn answer(
        l: &mut Ledger,
        now: Millis,
        actor: Actor,
        text: &str,
        key: Option<&str>,
    ) -> Result<Todo, Error> {
        let op = Op::AnswerTodo {
            now,
            actor,
            id: "td_1".into(),
            answer: text.into(),
            key: key.map(str::to_string),
            seq: None,
        };
        l.apply(op).and_then(Answer::todo)
    }

    fn heartbeat(l: &mut Ledger, now: Millis, token: &str, usage: Usage) -> Result<Todo, Error> {
        let op = Op::Heartbeat {
            now,
            actor: ep("e"),
            id: "td_1".into(),
            ttl: TTL,
            token_hash: Some(TokenHash::of(token)),
            usage: Some(usage),
        };
        l.apply(op).and_then(Answer::todo)
    }

    fn cost(micros: u64) -> Usage {
        Usage {
            cost_micros: micros,
            ..Usage::default()
        }
    }

    #[test]
    fn a_question_waits_for_its_answer_and_the_next_claim_carries_both() {
        let mut l = ledger_with(1, 2);
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        let t = ask(&mut l, T0 + 20, "t1", "Which branch?\u{0}", None);
        assert_eq!(t.state, TodoState::InputRequired);
        assert_eq!((t.attempt, t.asking.requests, t.owner), (0, 1, None));
        // Waiting is not claimable, by id or by FIFO.
        assert!(
            l.claim_next(T0 + 30, &ep("e"), None, &opts())
                .unwrap()
                .is_none()
        );
        assert_eq!(
            code(l.claim(T0 + 30, &ep("e"), "td_1", &opts())),
            ErrorCode::Conflict
        );
        let t = answer(&mut l, T0 + 40, Actor::cli(), "main", None).unwrap();
        assert_eq!(t.state, TodoState::Pending);
        let c = l
            .claim_next(T0 + 50, &ep("e"), None, &opts())
            .unwrap()
            .unwrap();
        let q = c.prior_attempts[0].question.clone().unwrap();
        assert_eq!(c.prior_attempts[0].outcome, Some(Outcome::NeedsInput));
        assert_eq!(
            c.prior_attempts[0].disposition,
            Some(Disposition::AwaitingInput)
        );
        assert_eq!(q.text, "Which branch?", "cleaned like a summary");
        assert_eq!(q.answer.as_deref(), Some("main"));
        assert_eq!(q.answered_at, Some(T0 + 40));
        assert_eq!(q.answered_by.as_deref(), Some("operator:cli"));
        // Asking did not spend one of the two attempts.
        assert_eq!(c.todo.attempt, 1);
        l.check().unwrap();
    }

    /// An answer that names its question (a task's input request) answers only that one: once
    /// the todo waits on another attempt's question, it is a conflict and changes nothing.
    #[test]
    fn an_answer_naming_its_question_never_answers_another() {
        let mut l = ledger_with(1, 2);
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        ask(&mut l, T0 + 20, "t1", "first?", None);
        answer(&mut l, T0 + 30, Actor::cli(), "yes", None).unwrap();
        l.claim(T0 + 40, &ep("e"), "td_1", &fenced("t2")).unwrap();
        ask(&mut l, T0 + 50, "t2", "second?", None);
        let before = l.clone();
        let named = |seq| Op::AnswerTodo {
            now: T0 + 60,
            actor: ep("e"),
            id: "td_1".into(),
            answer: "for the first".into(),
            key: Some("task-q1".into()),
            seq: Some(seq),
        };
        assert_eq!(code(l.apply(named(1))), ErrorCode::Conflict);
        assert_eq!(l, before);
        let t = l.apply(named(2)).and_then(Answer::todo).unwrap();
        assert_eq!(t.state, TodoState::Pending);
        l.check().unwrap();
    }

    #[test]
    fn an_answer_to_a_todo_not_waiting_is_a_conflict_and_changes_nothing() {
        let mut l = ledger_with(1, 2);
        let before = l.clone();
        assert_eq!(
            code(answer(&mut l, T0 + 5, Actor::cli(), "yes", None)),
            ErrorCode::Conflict
        );
        assert_eq!(l, before);
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        ask(&mut l, T0 + 20, "t1", "ok?", None);
        for (bad, code_) in [
            ("", ErrorCode::Invalid),
            (&"y".repeat(8193)[..], ErrorCode::Invalid),
        ] {
            let before = l.clone();
            assert_eq!(code(answer(&mut l, T0 + 30, ep("e"), bad, None)), code_);
            assert_eq!(l, before);
        }
        // Another endpoint's todo does not exist for it.
        assert_eq!(
            code(answer(&mut l, T0 + 30, ep("x"), "yes", None)),
            ErrorCode::NotFound
        );
        answer(&mut l, T0 + 40, ep("e"), "yes", Some("k1")).unwrap();
        // The same key again (its answer was lost): answered as it is, not answered twice.
        let again = answer(&mut l, T0 + 50, ep("e"), "yes", Some("k1")).unwrap();
        assert_eq!(again.state, TodoState::Pending);
        let q = l.attempts("td_1").last().unwrap().question.clone().unwrap();
        assert_eq!(
            (q.answered_at, q.answered_by.as_deref()),
            (Some(T0 + 40), Some("endpoint:e"))
        );
        // Another key, or none, is a conflict.
        assert_eq!(
            code(answer(&mut l, T0 + 60, ep("e"), "no", Some("k2"))),
            ErrorCode::Conflict
        );
        assert_eq!(
            code(answer(&mut l, T0 + 60, ep("e"), "no", None)),
            ErrorCode::Conflict
        );
        l.check().unwrap();
    }

    #[test]
    fn a_request_with_a_stale_token_is_a_conflict() {
        let mut l = ledger_with(1, 2);
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        let before = l.clone();
        let op = Op::RequestInput {
            now: T0 + 20,
            actor: ep("e"),
            id: "td_1".into(),
            question: "q".into(),
            report: report(Some("stale")),
        };
        assert_eq!(code(l.apply(op)), ErrorCode::Conflict);
        assert_eq!(l, before);
        let empty = Op::RequestInput {
            now: T0 + 20,
            actor: ep("e"),
            id: "td_1".into(),
            question: "  ".into(),
            report: report(Some("t1")),
        };
        assert_eq!(code(l.apply(empty)), ErrorCode::Invalid);
        assert_eq!(l, before);
    }

    #[test]
    fn past_max_input_requests_the_todo_dead_letters() {
        let mut l = Ledger::new(LedgerConfig::default());
        let n = NewTodo {
            max_input_requests: Some(1),
            ..new("td_1", "ci")
        };
        l.add_todo(T0, "e", n).unwrap();
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        ask(&mut l, T0 + 20, "t1", "first?", None);
        answer(&mut l, T0 + 30, Actor::cli(), "yes", None).unwrap();
        l.claim(T0 + 40, &ep("e"), "td_1", &fenced("t2")).unwrap();
        let t = ask(&mut l, T0 + 50, "t2", "second?", None);
        assert_eq!(
            t.dead_letter_reason,
            Some(DeadLetterReason::InputRequestsExhausted)
        );
        assert!(t.dead_letter());
        let view = l.apply(Op::GetTodo {
            actor: Actor::cli(),
            id: "td_1".into(),
            attempts_limit: 5,
        });
        let text = attention(&view.unwrap().view().unwrap()).unwrap();
        assert!(text.contains("asked \"second?\" (unanswered)"), "{text}");
        l.check().unwrap();
    }

    #[test]
    fn an_unanswered_question_dead_letters_after_answer_within() {
        let mut l = Ledger::new(LedgerConfig::default());
        let n = NewTodo {
            answer_within_seconds: Some(60),
            ..new("td_1", "ci")
        };
        l.add_todo(T0, "e", n).unwrap();
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        let t = ask(&mut l, T0 + 20, "t1", "ok?", None);
        assert_eq!(t.asking.answer_due_at, Some(T0 + 20 + 60 * SECOND));
        let swept = l
            .apply(Op::RequeueDue {
                now: T0 + 20 + 60 * SECOND - 1,
            })
            .unwrap();
        assert!(swept.todos().unwrap().is_empty());
        let swept = l
            .apply(Op::RequeueDue {
                now: T0 + 20 + 60 * SECOND,
            })
            .unwrap();
        let t = &swept.todos().unwrap()[0];
        assert_eq!(t.dead_letter_reason, Some(DeadLetterReason::NoAnswer));
        assert_eq!(t.asking.answer_due_at, None);
        assert_eq!(
            code(answer(&mut l, T0 + 70 * SECOND, Actor::cli(), "late", None)),
            ErrorCode::Conflict
        );
        l.check().unwrap();
    }

    #[test]
    fn spend_sums_across_attempts_and_never_decreases() {
        let mut l = ledger_with(1, 3);
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        heartbeat(
            &mut l,
            T0 + 20,
            "t1",
            Usage {
                cost_micros: 500,
                input_tokens: 10,
                output_tokens: 1,
            },
        )
        .unwrap();
        // A lower figure (a report crossing a later heartbeat) lowers nothing.
        let t = heartbeat(
            &mut l,
            T0 + 30,
            "t1",
            Usage {
                cost_micros: 200,
                input_tokens: 20,
                output_tokens: 0,
            },
        )
        .unwrap();
        assert_eq!(
            t.spent,
            Usage {
                cost_micros: 500,
                input_tokens: 20,
                output_tokens: 1
            }
        );
        let fail = Op::Fail {
            now: T0 + 40,
            actor: ep("e"),
            id: "td_1".into(),
            report: Report {
                usage: Some(cost(700)),
                ..report(Some("t1"))
            },
        };
        l.apply(fail).unwrap();
        let retry = l.todo("td_1").unwrap().next_retry_at.unwrap();
        l.claim(retry, &ep("e"), "td_1", &fenced("t2")).unwrap();
        let t = heartbeat(&mut l, retry + 1, "t2", cost(300)).unwrap();
        assert_eq!(t.spent.cost_micros, 1000);
        assert_eq!(
            l.attempts("td_1")
                .map(|a| a.usage.cost_micros)
                .collect::<Vec<_>>(),
            [700, 300]
        );
        l.check().unwrap();
    }

    #[test]
    fn a_heartbeat_at_the_budget_stops_the_attempt_and_dead_letters_the_todo() {
        let mut l = Ledger::new(LedgerConfig::default());
        let n = NewTodo {
            budget: Budget {
                cost_micros: Some(1_000_000),
                tokens: None,
            },
            ..new("td_1", "ci")
        };
        l.add_todo(T0, "e", n).unwrap();
        l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
        let t = heartbeat(&mut l, T0 + 20, "t1", cost(999_999)).unwrap();
        assert_eq!(t.state, TodoState::Claimed);
        let t = heartbeat(&mut l, T0 + 30, "t1", cost(1_000_000)).unwrap();
        assert_eq!(t.state, TodoState::Failed);
        assert_eq!(
            t.dead_letter_reason,
            Some(DeadLetterReason::BudgetExhausted)
        );
        let a = l.attempts("td_1").last().unwrap();
        assert_eq!(
            (a.outcome, a.disposition),
            (Some(Outcome::Canceled), Some(Disposition::DeadLettered))
        );
        // The holder's next call is refused, and nothing claims it again.
        assert_eq!(
            code(heartbeat(&mut l, T0 + 40, "t1", cost(1))),
            ErrorCode::Conflict
        );
        assert!(
            l.claim_next(T0 + 50, &ep("e"), None, &opts())
                .unwrap()
                .is_none()
        );
        let view = l.apply(Op::GetTodo {
            actor: Actor::cli(),
            id: "td_1".into(),
            attempts_limit: 5,
        });
        let text = attention(&view.unwrap().view().unwrap()).unwrap();
        assert!(text.contains("spent $1, 0 tokens"), "{text}");
        assert!(text.contains("budget of $1"), "{text}");
        // The operator's retry (once the stopped holder's lease lapsed) is the decision to
        // spend more: the budget reached is lifted.
        let t = l
            .apply(Op::Retry {
                now: T0 + 20 + TTL,
                actor: Actor::cli(),
                id: "td_1".into(),
            })
            .unwrap()
            .todo()
            .unwrap();
        assert!(t.budget.is_none() && t.state == TodoState::Pending);
        l.check().unwrap();
    }

    #[test]
    fn a_fail_or_release_at_the_budget_dead_letters_but_a_complete_completes() {
        for verb in ["fail", "release", "complete"] {
            let mut l = Ledger::new(LedgerConfig::default());
            let n = NewTodo {
                budget: Budget {
                    cost_micros: None,
                    tokens: Some(100),
                },
                ..new("td_1", "ci")
            };
            l.add_todo(T0, "e", n).unwrap();
            l.claim(T0 + 10, &ep("e"), "td_1", &fenced("t1")).unwrap();
            let usage = Some(Usage {
                input_tokens: 60,
                output_tokens: 40,
                ..Usage::default()
            });
            let (now, actor, id) = (T0 + 20, ep("e"), "td_1".to_string());
            let r = Report {
                usage,
                ..report(Some("t1"))
            };
            let op = match verb {
                "fail" => Op::Fail {
                    now,
                    actor,
                    id,
                    report: r,
                },
                "complete" => Op::Complete {
                    now,
                    actor,
                    id,
                    report: r,
                },
                _ => Op::Release {
                    now,
                    actor,
                    id,
                    summary: None,
                    token_hash: r.token_hash,
                    usage,
                },
            };
            let t = l.apply(op).unwrap().todo().unwrap();
            if verb == "complete" {
                assert_eq!(t.state, TodoState::Done);
            } else {
                assert_eq!(
                    t.dead_letter_reason,
                    Some(DeadLetterReason::BudgetExhausted),
                    "{verb}"
                );
            }
            assert_eq!(t.spent.tokens(), 100);
            l.check().unwrap();
        }
    }

    #[test]
    fn a_zero_budget_or_out_of_range_asking_is_refused_at_the_add() {
        let mut l = Ledger::new(LedgerConfig::default());
        for n in [
            NewTodo {
                budget: Budget {
                    cost_micros: Some(0),
                    tokens: None,
                },
                ..new("td_1", "ci")
            },
            NewTodo {
                budget: Budget {
                    cost_micros: None,
                    tokens: Some(0),
                },
                ..new("td_1", "ci")
            },
            NewTodo {
                max_input_requests: Some(101),
                ..new("td_1", "ci")
            },
            NewTodo {
                answer_within_seconds: Some(0),
                ..new("td_1", "ci")
            },
        ] {
            assert_eq!(code(l.add_todo(T0, "e", n)), ErrorCode::Invalid);
        }
        assert!(l.todos().next().is_none());
    }

    /// The checker fires on a todo waiting without a question (the rule broken on purpose).
    #[test]
    fn the_checker_refuses_a_wait_without_a_question_and_a_claimable_todo_over_budget() {
        let mut l = ledger_with(1, 2);
        let mut t = l.todo("td_1").unwrap().clone();
        t.state = TodoState::InputRequired;
        assert!(
            check_todo(&t, [])
                .unwrap_err()
                .contains("no unanswered question")
        );
        let mut t = l.todo("td_1").unwrap().clone();
        t.budget.tokens = Some(5);
        t.spent.input_tokens = 5;
        assert!(
            check_todo(&t, [])
                .unwrap_err()
                .contains("could be claimed again")
        );
        l.claim(T0 + 10, &ep("e"), "td_1", &opts()).unwrap();
        let mut a = l.attempts("td_1").next().unwrap().clone();
        a.usage.output_tokens = 9;
        let t = l.todo("td_1").unwrap().clone();
        assert!(
            check_todo(&t, [&a])
                .unwrap_err()
                .contains("less than its attempts' usage")
        );
    }
}
