//! The ledger program: random sequences of queue operations with random time steps,
//! `check()` after every step.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::{Error, ErrorCode};
use crate::ledger::{
    Actor, Attempt, ClaimOpts, Ledger, LedgerConfig, NewTodo, Report, Todo, TodoFilter, TokenHash,
};
use crate::time::{MINUTE, Millis, SECOND};

use super::Queue;

/// Endpoints, todo ids, queues and tokens are drawn from small sets so that operations collide:
/// the interesting cases are two claimers on one todo, a stale token, a foreign id.
const ENDPOINTS: [&str; 2] = ["e1", "e2"];
const QUEUES: [&str; 2] = ["q1", "q2"];
const TODOS: u8 = 6;
const TOKENS: u8 = 4;

/// One operation on the queue side, as the property test and the fuzz target generate it.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Let time pass.
    Advance(Millis),
    Add {
        endpoint: u8,
        todo: u8,
        queue: u8,
        max_attempts: u32,
    },
    ClaimNext {
        actor: u8,
        queue: Option<u8>,
        ttl: Millis,
        /// `Some(n)`: a fenced claim whose token is `tok-n`.
        token: Option<u8>,
    },
    Claim {
        actor: u8,
        todo: u8,
        ttl: Millis,
        token: Option<u8>,
    },
    Heartbeat {
        actor: u8,
        todo: u8,
        ttl: Millis,
        token: Option<u8>,
    },
    Complete {
        actor: u8,
        todo: u8,
        token: Option<u8>,
        summary_len: u16,
    },
    Fail {
        actor: u8,
        todo: u8,
        token: Option<u8>,
        summary_len: u16,
    },
    Release {
        actor: u8,
        todo: u8,
        token: Option<u8>,
    },
    Reap,
    RequeueDue,
    Retry {
        todo: u8,
    },
    Cancel {
        todo: u8,
    },
    Revoke {
        endpoint: u8,
    },
    Get {
        actor: u8,
        todo: u8,
        limit: u8,
    },
    List {
        actor: u8,
    },
    Delete {
        todo: u8,
    },
    Purge {
        retention: Millis,
    },
}

/// Decodes bytes positionally into operations; every byte string is a valid program.
pub fn decode_ops(bytes: &[u8]) -> Vec<Op> {
    let mut it = bytes.iter().copied();
    let mut ops = Vec::new();
    let mut next = || it.next();
    while let Some(tag) = next() {
        let mut b = || next().unwrap_or(0);
        // The actor: 0 and 1 are endpoints, 2 is the operator.
        let actor = |x: u8| x % 3;
        let ttl = |x: u8| Millis::from(x % 8 + 1) * 30 * SECOND;
        let token = |x: u8| (!x.is_multiple_of(TOKENS + 1)).then_some(x % (TOKENS + 1));
        let op = match tag % 17 {
            0 => Op::Advance(Millis::from(b()) * 5 * SECOND),
            1 => Op::Add {
                endpoint: b() % 2,
                todo: b() % TODOS,
                queue: b() % 2,
                max_attempts: u32::from(b() % 4 + 1),
            },
            2 => Op::ClaimNext {
                actor: actor(b()),
                queue: {
                    let q = b();
                    (q % 3 != 0).then_some(q % 2)
                },
                ttl: ttl(b()),
                token: token(b()),
            },
            3 => Op::Claim {
                actor: actor(b()),
                todo: b() % TODOS,
                ttl: ttl(b()),
                token: token(b()),
            },
            4 => Op::Heartbeat {
                actor: actor(b()),
                todo: b() % TODOS,
                ttl: ttl(b()),
                token: token(b()),
            },
            5 => Op::Complete {
                actor: actor(b()),
                todo: b() % TODOS,
                token: token(b()),
                summary_len: u16::from(b()) * 12,
            },
            6 => Op::Fail {
                actor: actor(b()),
                todo: b() % TODOS,
                token: token(b()),
                summary_len: u16::from(b()) * 12,
            },
            7 => Op::Release {
                actor: actor(b()),
                todo: b() % TODOS,
                token: token(b()),
            },
            8 => Op::Reap,
            9 => Op::RequeueDue,
            10 => Op::Retry { todo: b() % TODOS },
            11 => Op::Cancel { todo: b() % TODOS },
            12 => Op::Revoke { endpoint: b() % 2 },
            13 => Op::Get {
                actor: actor(b()),
                todo: b() % TODOS,
                limit: b() % 8,
            },
            14 => Op::List { actor: actor(b()) },
            15 => Op::Delete { todo: b() % TODOS },
            _ => Op::Purge {
                retention: Millis::from(b()) * MINUTE,
            },
        };
        ops.push(op);
    }
    ops
}

fn actor_of(a: u8) -> Actor {
    match a {
        0 | 1 => Actor::endpoint(ENDPOINTS[usize::from(a)]),
        _ => Actor::Operator,
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
    })
}

fn attempt_obs(a: &Attempt) -> Value {
    json!({
        "seq": a.seq, "attempt": a.attempt, "outcome": a.outcome.map(|o| o.as_str()),
        "disposition": a.disposition.map(|d| d.as_str()), "ended_at": a.ended_at,
        "died": a.died(), "summary": a.summary, "claimant": a.claimant,
        "summary_truncated": a.summary_truncated, "last_heartbeat_at": a.last_heartbeat_at,
    })
}

/// Applies one operation to the ledger at `now` and says what it answered. `Advance` is the
/// caller's business (it moves `now`) and answers `null`.
pub fn apply_op<Q: Queue>(l: &mut Q, now: Millis, op: &Op) -> Observation {
    let todos =
        |r: Result<Vec<Todo>, Error>| r.map(|ts| Value::Array(ts.iter().map(todo_obs).collect()));
    let r = match op {
        Op::Advance(_) => Ok(Value::Null),
        Op::Add {
            endpoint,
            todo,
            queue,
            max_attempts,
        } => l
            .add_todo(
                now,
                ENDPOINTS[usize::from(*endpoint)],
                NewTodo {
                    id: todo_id(*todo),
                    queue: QUEUES[usize::from(*queue)].into(),
                    title: format!("todo {todo}"),
                    max_attempts: Some(*max_attempts),
                    payload: Some(json!({"n": todo})),
                    ..NewTodo::default()
                },
            )
            .map(|t| todo_obs(&t)),
        Op::ClaimNext {
            actor,
            queue,
            ttl,
            token,
        } => {
            let queues = queue.map(|q| vec![QUEUES[usize::from(q)].to_string()]);
            let opts = ClaimOpts {
                ttl: *ttl,
                claimant: Some(format!("claimer-{actor}\u{0}\u{1b}[0m🦀")),
                token_hash: token_hash(*token),
            };
            l.claim_next(now, &actor_of(*actor), queues.as_deref(), &opts)
                .map(|c| match c {
                    None => json!({"empty": true}),
                    Some(c) => json!({
                        "todo": todo_obs(&c.todo), "seq": c.attempt_seq, "takeover": c.takeover,
                        "prior": c.prior_attempts.iter().map(attempt_obs).collect::<Vec<_>>(),
                    }),
                })
        }
        Op::Claim {
            actor,
            todo,
            ttl,
            token,
        } => {
            let opts = ClaimOpts {
                ttl: *ttl,
                claimant: None,
                token_hash: token_hash(*token),
            };
            l.claim(now, &actor_of(*actor), &todo_id(*todo), &opts)
                .map(|c| json!({"todo": todo_obs(&c.todo), "takeover": c.takeover}))
        }
        Op::Heartbeat {
            actor,
            todo,
            ttl,
            token,
        } => l
            .heartbeat(
                now,
                &actor_of(*actor),
                &todo_id(*todo),
                *ttl,
                token_hash(*token),
            )
            .map(|t| todo_obs(&t)),
        Op::Complete {
            actor,
            todo,
            token,
            summary_len,
        }
        | Op::Fail {
            actor,
            todo,
            token,
            summary_len,
        } => {
            let report = Report {
                result: Some(json!({"by": actor})),
                summary: summary(*summary_len),
                artifact: (*summary_len % 5 == 1).then(|| "mcp://cairn/x1".to_string()),
                token_hash: token_hash(*token),
            };
            let (a, id) = (actor_of(*actor), todo_id(*todo));
            if matches!(op, Op::Complete { .. }) {
                l.complete(now, &a, &id, &report)
            } else {
                l.fail(now, &a, &id, &report)
            }
            .map(|t| todo_obs(&t))
        }
        Op::Release { actor, todo, token } => l
            .release(
                now,
                &actor_of(*actor),
                &todo_id(*todo),
                Some("released"),
                token_hash(*token),
            )
            .map(|t| todo_obs(&t)),
        Op::Reap => todos(l.reap(now)),
        Op::RequeueDue => todos(l.requeue_due(now)),
        Op::Retry { todo } => l
            .retry(now, &Actor::Operator, &todo_id(*todo))
            .map(|t| todo_obs(&t)),
        Op::Cancel { todo } => l
            .cancel(now, &Actor::Operator, &todo_id(*todo))
            .map(|t| todo_obs(&t)),
        Op::Revoke { endpoint } => todos(l.revoke_endpoint(now, ENDPOINTS[usize::from(*endpoint)])),
        Op::Get { actor, todo, limit } => l
            .get_todo(&actor_of(*actor), &todo_id(*todo), usize::from(*limit))
            .map(|v| {
                json!({
                    "todo": todo_obs(&v.todo),
                    "attempts": v.attempts.iter().map(attempt_obs).collect::<Vec<_>>(),
                })
            }),
        Op::List { actor } => todos(l.list_todos(
            &actor_of(*actor),
            &TodoFilter {
                limit: 100,
                ..TodoFilter::default()
            },
        )),
        Op::Delete { todo } => l
            .delete_todo(&Actor::Operator, &todo_id(*todo))
            .map(|()| Value::Null),
        Op::Purge { retention } => l.purge_finished(now, *retention).map(|ids| json!(ids)),
    };
    r.map_err(|e| e.code)
}

/// Runs the operations from a fixed start time, checking after every step:
/// - `Ledger::check()` (the per-todo invariants);
/// - no operation answers `internal` (an internal error means a rule broke);
/// - history is immutable: a closed attempt never changes again (until pruned or deleted), and
///   `attempts_total` never goes down.
pub fn ledger_ops(bytes: &[u8]) -> Result<(), String> {
    let mut l = Ledger::new(LedgerConfig {
        attempts_cap: 4,
        ..LedgerConfig::default()
    });
    let mut now: Millis = 1_790_000_000_000;
    let mut closed: BTreeMap<(String, u32), Attempt> = BTreeMap::new();
    let mut totals: BTreeMap<String, u32> = BTreeMap::new();
    for (step, op) in decode_ops(bytes).iter().enumerate() {
        if let Op::Advance(d) = op {
            now += d;
        }
        let obs = apply_op(&mut l, now, op);
        if obs == Err(ErrorCode::Internal) {
            return Err(format!("step {step}: {op:?} answered internal"));
        }
        l.check().map_err(|e| format!("step {step}: {op:?}: {e}"))?;
        for t in l.todos() {
            let before = totals.insert(t.id.clone(), t.attempts_total).unwrap_or(0);
            if t.attempts_total < before {
                return Err(format!("step {step}: {} attempts_total went down", t.id));
            }
            for a in l.attempts(&t.id).filter(|a| !a.is_open()) {
                let key = (t.id.clone(), a.seq);
                match closed.get(&key) {
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
