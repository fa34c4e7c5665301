//! The ledger program: random sequences of queue operations with random time steps,
//! `check()` after every step.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::{Error, ErrorCode};
use crate::ledger::{
    Actor, Answer, Attempt, Budget, ClaimOpts, Claimed, Ledger, LedgerConfig, LimitsChange,
    NewTodo, Op, Outcome, Report, Todo, TodoFilter, TokenHash, Usage,
};
use crate::time::{MINUTE, Millis, SECOND};

/// Endpoints, todo ids, queues and tokens are drawn from small sets so that operations collide:
/// the interesting cases are two claimers on one todo, a stale token, a foreign id.
const ENDPOINTS: [&str; 2] = ["e1", "e2"];
const QUEUES: [&str; 2] = ["q1", "q2"];
const TODOS: u8 = 6;
const TOKENS: u8 = 4;

/// Where a decoded program's clock starts (ms since the epoch).
pub const PROGRAM_START: Millis = 1_790_000_000_000;

/// Decodes bytes positionally into ledger operations from [`PROGRAM_START`]; every byte string
/// is a valid program. Some tags only let time pass: they move the `now` of what follows.
pub fn decode_ops(bytes: &[u8]) -> Vec<Op> {
    let mut it = bytes.iter().copied();
    let mut ops = Vec::new();
    let mut now = PROGRAM_START;
    let mut next = || it.next();
    while let Some(tag) = next() {
        let mut b = || next().unwrap_or(0);
        // The actor: 0 and 1 are endpoints, 2 is the operator.
        let actor = |x: u8| actor_of(x % 3);
        let ttl = |x: u8| Millis::from(x % 8 + 1) * 30 * SECOND;
        let token = |x: u8| token_hash((!x.is_multiple_of(TOKENS + 1)).then_some(x % (TOKENS + 1)));
        let report = |actor: u8, token: Option<TokenHash>, len: u16| Report {
            result: Some(json!({"by": actor})),
            summary: summary(len),
            artifact: (len % 5 == 1).then(|| "mcp://cairn/x1".to_string()),
            token_hash: token,
            ..Report::default()
        };
        // A usage that grows with its byte, none for 0: reports and heartbeats repeat, cross and
        // lower one another, and budgets are crossed.
        let usage = |x: u8| {
            (x != 0).then(|| Usage {
                cost_micros: u64::from(x) * 10_000,
                input_tokens: u64::from(x % 16) * 100,
                output_tokens: u64::from(x / 16) * 10,
            })
        };
        let op = match tag % 21 {
            0 => {
                now += Millis::from(b()) * 5 * SECOND;
                continue;
            }
            1 => {
                let (endpoint, todo, queue) = (b() % 2, b() % TODOS, b() % 2);
                let budget = b();
                // A few priorities (one out of range, refused) and delays, some both (refused),
                // from the bytes already drawn (so that older programs decode as before).
                let flow = budget.wrapping_mul(73).wrapping_add(todo);
                Op::AddTodo {
                    now,
                    endpoint: ENDPOINTS[usize::from(endpoint)].into(),
                    new: NewTodo {
                        id: todo_id(todo),
                        queue: QUEUES[usize::from(queue)].into(),
                        title: format!("todo {todo}"),
                        max_attempts: Some(u32::from(b() % 4 + 1)),
                        payload: Some(json!({"n": todo})),
                        // Few keys, so that adds repeat one; a key of 201 bytes is refused.
                        idempotency_key: match budget % 5 {
                            0 | 1 => None,
                            4 if budget > 250 => Some("k".repeat(201)),
                            k => Some(format!("key-{k}")),
                        },
                        deadline_seconds: (budget % 3 == 0).then(|| u64::from(budget) * 10),
                        max_same_failures: (budget % 4 != 0).then_some(u32::from(budget % 4)),
                        max_input_requests: (budget % 7 != 0).then_some(u32::from(budget % 3)),
                        answer_within_seconds: (budget % 2 == 0).then(|| u64::from(budget) * 5),
                        budget: Budget {
                            cost_micros: (budget % 5 == 2).then(|| u64::from(budget) * 20_000),
                            tokens: (budget % 11 == 3).then(|| u64::from(budget) * 40),
                        },
                        priority: match flow % 5 {
                            0 | 1 => None,
                            2 => Some(5),
                            3 => Some(-5),
                            _ => Some(if flow > 250 { 101 } else { 50 }),
                        },
                        delay_seconds: (flow % 7 == 3).then(|| u64::from(flow) / 4),
                        run_at: (flow % 11 == 3 || flow > 252).then(|| now + u64::from(flow) * 100),
                        // Two keys, none, or one of 129 bytes (refused).
                        concurrency_key: match flow % 13 {
                            12 if flow > 200 => Some("k".repeat(129)),
                            n if n % 3 == 0 => None,
                            n => Some(format!("key-{}", n % 2)),
                        },
                        ..NewTodo::default()
                    },
                }
            }
            2 => {
                let a = b();
                let q = b();
                Op::ClaimNext {
                    now,
                    actor: actor(a),
                    queues: (q % 3 != 0).then(|| vec![QUEUES[usize::from(q % 2)].to_string()]),
                    opts: ClaimOpts {
                        ttl: ttl(b()),
                        claimant: Some(format!("claimer-{}\u{0}\u{1b}[0m🦀", a % 3)),
                        token_hash: token(b()),
                    },
                }
            }
            3 => Op::Claim {
                now,
                actor: actor(b()),
                id: todo_id(b() % TODOS),
                opts: ClaimOpts {
                    ttl: ttl(b()),
                    claimant: None,
                    token_hash: token(b()),
                },
            },
            4 => Op::Heartbeat {
                now,
                actor: actor(b()),
                id: todo_id(b() % TODOS),
                ttl: ttl(b()),
                token_hash: token(b()),
                usage: usage(b()),
            },
            5 | 6 => {
                let (a, id, tok) = (b() % 3, todo_id(b() % TODOS), token(b()));
                let mut report = report(a, tok, u16::from(b()) * 12);
                let class = b();
                report.retryable = (class % 3 != 0).then_some(class % 7 != 1);
                report.failure_signature = match class % 5 {
                    0 => None,
                    4 if class > 250 => Some("s".repeat(129)),
                    n => Some(format!("sig-{}", n % 2)),
                };
                report.usage = usage(class / 2);
                let actor = actor_of(a);
                if tag % 19 == 5 {
                    Op::Complete {
                        now,
                        actor,
                        id,
                        report,
                    }
                } else {
                    Op::Fail {
                        now,
                        actor,
                        id,
                        report,
                    }
                }
            }
            7 => Op::Release {
                now,
                actor: actor(b()),
                id: todo_id(b() % TODOS),
                summary: Some("released".into()),
                token_hash: token(b()),
                usage: usage(b()),
            },
            19 => {
                let (a, id, tok, len) = (b() % 3, todo_id(b() % TODOS), token(b()), b());
                let mut report = report(a, tok, u16::from(len) * 12);
                report.result = None;
                report.usage = usage(b());
                Op::RequestInput {
                    now,
                    actor: actor_of(a),
                    id,
                    // Empty (refused), short, or past the cut, with the summary's characters.
                    question: summary(u16::from(len % 4) * 300).unwrap_or_default(),
                    report,
                }
            }
            20 => {
                let (a, id, k) = (b(), todo_id(b() % TODOS), b());
                Op::AnswerTodo {
                    now,
                    actor: actor(a),
                    id,
                    // Empty or over 8 KiB (both refused), or an answer of a few bytes.
                    answer: match k % 5 {
                        0 => String::new(),
                        1 => "y".repeat(8193),
                        _ => summary(u16::from(k)).unwrap_or_else(|| "yes".into()),
                    },
                    key: (k % 3 != 0).then(|| format!("ans-{}", k % 2)),
                    // Now and then the question of a given attempt (a task's input request).
                    seq: (k % 4 == 3).then_some(u32::from(k % 3) + 1),
                }
            }
            8 => Op::Reap { now },
            9 => Op::RequeueDue { now },
            10 => Op::Retry {
                now,
                actor: Actor::cli(),
                id: todo_id(b() % TODOS),
            },
            11 => Op::Cancel {
                now,
                actor: Actor::cli(),
                id: todo_id(b() % TODOS),
            },
            12 => Op::RevokeEndpoint {
                now,
                endpoint: ENDPOINTS[usize::from(b() % 2)].into(),
            },
            13 => Op::GetTodo {
                actor: actor(b()),
                id: todo_id(b() % TODOS),
                attempts_limit: usize::from(b() % 8),
            },
            14 => {
                // One byte, as before keyset paging (so earlier programs decode alike): the
                // actor, and above it the page: its size, and a keyset position at a time adds
                // may have used, so that it ties with some todo's created_at and the id decides.
                let who = b();
                let k = who / 3;
                let after = (!k.is_multiple_of(4)).then(|| {
                    let at = PROGRAM_START + Millis::from(k >> 4) * 5 * SECOND;
                    (at, todo_id((k >> 2) % TODOS))
                });
                let limit = if k.is_multiple_of(2) {
                    100
                } else {
                    usize::from(k >> 5)
                };
                Op::ListTodos {
                    actor: actor(who),
                    filter: TodoFilter {
                        after,
                        limit,
                        ..TodoFilter::default()
                    },
                }
            }
            15 => Op::DeleteTodo {
                actor: Actor::cli(),
                id: todo_id(b() % TODOS),
            },
            17 | 18 => Op::NoteLate {
                now,
                actor: actor(b()),
                id: todo_id(b() % TODOS),
                outcome: [Outcome::Completed, Outcome::Failed, Outcome::Released]
                    [usize::from(b() % 3)],
                summary: summary(u16::from(b()) * 3),
                token_hash: token(b()),
            },
            _ => {
                // An eighth of these bytes change a queue's limits (one out of bounds, refused;
                // now and then by an endpoint, forbidden), mostly lifting them so that programs
                // still claim, or read them; the rest purge.
                let x = b();
                match x % 8 {
                    3 => {
                        let l = b();
                        let limit = |v: u8, big: u32| match v % 4 {
                            0 => None,
                            1 | 2 if v % 8 < 4 => Some(None),
                            1 => Some(Some(1)),
                            _ => Some(Some(big)),
                        };
                        Op::SetQueueLimits {
                            now,
                            actor: actor(x / 4 + u8::from(x > 60)),
                            queue: QUEUES[usize::from(x / 8 % 2)].into(),
                            change: LimitsChange {
                                max_claimed: if l == 255 { Some(Some(0)) } else { limit(l, 3) },
                                max_claimed_per_key: limit(l / 4, 2),
                                claims_per_minute: limit(l / 16, 5),
                            },
                        }
                    }
                    5 if x > 200 => Op::QueueFlow { now },
                    _ => Op::PurgeFinished {
                        now,
                        retention: Millis::from(x) * MINUTE,
                    },
                }
            }
        };
        ops.push(op);
    }
    ops
}

fn actor_of(a: u8) -> Actor {
    match a {
        0 | 1 => Actor::endpoint(ENDPOINTS[usize::from(a)]),
        _ => Actor::cli(),
    }
}

fn todo_id(n: u8) -> String {
    format!("td_{n}")
}

fn token_hash(t: Option<u8>) -> Option<TokenHash> {
    t.map(|n| TokenHash::of(&format!("tok-{n}")))
}

/// A summary of about `len` bytes; by `len`, plain, or with NUL and other controls, escape
/// sequences and non-BMP characters, so that every store is held to the ledger's text rule.
fn summary(len: u16) -> Option<String> {
    const UNITS: [&str; 4] = [
        "ab€",
        "a\u{0}b\u{1b}[2J",
        "🦀x\u{10FFFF}",
        "\t\n\u{7f}\u{85}é",
    ];
    (len > 0).then(|| UNITS[usize::from(len / 12) % UNITS.len()].repeat(usize::from(len) / 3 + 1))
}

/// What one operation answered, in a form two implementations can be compared on.
pub type Observation = Result<Value, ErrorCode>;

fn todo_obs(t: &Todo) -> Value {
    json!({
        "id": t.id, "state": t.state.as_str(), "attempt": t.attempt,
        "attempts_total": t.attempts_total, "attempts_pruned": t.attempts_pruned,
        "lease_expires_at": t.lease_expires_at, "next_retry_at": t.next_retry_at,
        "dead_letter": t.dead_letter(), "owner": t.owner,
        "dead_letter_reason": t.dead_letter_reason.map(|r| r.as_str()),
        "idempotency_key": t.idempotency_key, "deadline_at": t.deadline_at,
        "max_same_failures": t.max_same_failures, "asking": t.asking, "budget": t.budget,
        "spent": t.spent, "priority": t.priority, "run_at": t.run_at,
        "concurrency_key": t.concurrency_key,
    })
}

fn attempt_obs(a: &Attempt) -> Value {
    json!({
        "seq": a.seq, "attempt": a.attempt, "outcome": a.outcome.map(|o| o.as_str()),
        "disposition": a.disposition.map(|d| d.as_str()), "ended_at": a.ended_at,
        "died": a.died(), "summary": a.summary, "claimant": a.claimant,
        "summary_truncated": a.summary_truncated, "last_heartbeat_at": a.last_heartbeat_at,
        "failure_signature": a.failure_signature,
        "dead_letter_reason": a.dead_letter_reason.map(|r| r.as_str()),
        "late_reports": a.late_reports.iter()
            .map(|l| json!([l.at, l.outcome.as_str(), l.summary]))
            .collect::<Vec<_>>(),
        "late_reports_total": a.late_reports_total, "question": a.question,
        "usage": a.usage,
    })
}

fn claimed_obs(c: &Claimed) -> Value {
    json!({
        "todo": todo_obs(&c.todo), "seq": c.attempt_seq, "takeover": c.takeover,
        "prior": c.prior_attempts.iter().map(attempt_obs).collect::<Vec<_>>(),
    })
}

/// What an operation answered, as an observation.
pub fn observe(answer: Result<Answer, Error>) -> Observation {
    answer
        .map(|a| match a {
            Answer::Todo(t) => todo_obs(&t),
            Answer::Existing(t) => json!({"existing": todo_obs(&t)}),
            Answer::Late(seq) => json!({"late": seq}),
            Answer::Claimed(c) | Answer::Next(Some(c)) => claimed_obs(&c),
            Answer::Next(None) => json!({"empty": true}),
            Answer::Todos(ts) => Value::Array(ts.iter().map(todo_obs).collect()),
            Answer::View(v) => json!({
                "todo": todo_obs(&v.todo),
                "attempts": v.attempts.iter().map(attempt_obs).collect::<Vec<_>>(),
            }),
            Answer::Ids(ids) | Answer::Queues(ids) => json!(ids),
            Answer::Deleted => Value::Null,
            Answer::Flow(f) => json!({
                "limits": f.limits.iter().map(|(q, l)| json!([q, l])).collect::<Vec<_>>(),
                "claimed": f.load.claimed.iter().map(|((q, k), n)| json!([q, k, n]))
                    .collect::<Vec<_>>(),
                "recent": f.load.recent, "paused": f.paused,
            }),
        })
        .map_err(|e| e.code)
}

/// The attempt as its close left it, without the late reports it gathered since.
/// A closed attempt without what may still change on it: its late reports and its answer.
fn unamended(a: &Attempt) -> Attempt {
    let mut a = Attempt {
        late_reports: Vec::new(),
        late_reports_total: 0,
        ..a.clone()
    };
    if let Some(q) = a.question.as_mut() {
        (q.answer, q.answered_at, q.answered_by, q.answer_key) = (None, None, None, None);
    }
    a
}

/// How a closed attempt may change: late reports only gather, an answer is written once and
/// then kept (never lost, never answered again), and nothing else of it moves.
fn amended_rightly(seen: &Attempt, a: &Attempt) -> bool {
    let answer = |x: &Attempt| x.question.as_ref().and_then(|q| q.answer.clone());
    let late_ok = a.late_reports_total >= seen.late_reports_total
        && a.late_reports.starts_with(&seen.late_reports);
    let answer_ok = answer(seen).is_none() || seen.question == a.question;
    late_ok && answer_ok && unamended(seen) == unamended(a)
}

/// Runs the operations from a fixed start time, checking after every step:
/// - `Ledger::check()` (the per-todo invariants);
/// - no operation answers `internal` (an internal error means a rule broke);
/// - history is immutable: a closed attempt never changes again (until pruned or deleted) but for
///   the late reports it gathers, and `attempts_total` never goes down;
/// - a late report never changes a todo: `note_late` leaves every todo row as it was.
pub fn ledger_ops(bytes: &[u8]) -> Result<(), String> {
    let mut l = Ledger::new(LedgerConfig {
        attempts_cap: 4,
        ..LedgerConfig::default()
    });
    let mut closed: BTreeMap<(String, u32), Attempt> = BTreeMap::new();
    let mut totals: BTreeMap<String, u32> = BTreeMap::new();
    for (step, op) in decode_ops(bytes).into_iter().enumerate() {
        let rows_before: Vec<Todo> = l.todos().cloned().collect();
        let obs = observe(l.apply(op.clone()));
        if obs == Err(ErrorCode::Internal) {
            return Err(format!("step {step}: {op:?} answered internal"));
        }
        if matches!(op, Op::NoteLate { .. }) && !l.todos().eq(rows_before.iter()) {
            return Err(format!("step {step}: {op:?}: a late report changed a todo"));
        }
        l.check().map_err(|e| format!("step {step}: {op:?}: {e}"))?;
        for t in l.todos() {
            let before = totals.insert(t.id.clone(), t.attempts_total).unwrap_or(0);
            if t.attempts_total < before {
                return Err(format!("step {step}: {} attempts_total went down", t.id));
            }
            for a in l.attempts(&t.id).filter(|a| !a.is_open()) {
                let key = (t.id.clone(), a.seq);
                match closed.get_mut(&key) {
                    Some(seen) if seen != a && amended_rightly(seen, a) => {
                        *seen = a.clone();
                    }
                    Some(seen) if seen != a => {
                        return Err(format!(
                            "step {step}: {op:?}: closed attempt {} of {} changed",
                            a.seq, t.id
                        ));
                    }
                    Some(_) => {}
                    None => {
                        closed.insert(key, a.clone());
                    }
                }
            }
        }
        // Forget what was deleted, so a re-added todo of the same id starts a fresh history.
        closed.retain(|(id, _), _| l.attempts(id).next().is_some());
        totals.retain(|id, _| l.todos().any(|t| &t.id == id));
    }
    Ok(())
}
