//! Bodies of the property tests and fuzz targets, shared so that `cargo test` (proptest, on
//! stable) and `cargo fuzz` (libFuzzer) hammer exactly the same code. Compiled for tests and
//! behind the `testing` feature; never part of a production build.

// ---------------------------------------------------------------------------------------------
// Ledger operations: random sequences with random time steps, `check()` after every step.
// ---------------------------------------------------------------------------------------------

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::{Error, ErrorCode};
use crate::ledger::{
    Actor, Attempt, ClaimOpts, Claimed, Ledger, LedgerConfig, NewTodo, Report, Todo, TodoFilter,
    TodoView, TokenHash,
};
use crate::time::{MINUTE, Millis, SECOND};

/// Endpoints, todo ids, queues and tokens are drawn from small sets so that operations collide:
/// the interesting cases are two claimers on one todo, a stale token, a foreign id.
const ENDPOINTS: [&str; 2] = ["e1", "e2"];
const QUEUES: [&str; 2] = ["q1", "q2"];
const TODOS: u8 = 6;
const TOKENS: u8 = 4;

/// The queue side's operations, as the ledger offers them. The stores implement it too (in
/// their tests, blocking on each call), so one random program can drive both and their answers
/// can be compared: that is the model-based test that holds every store to the ledger.
#[allow(missing_docs)]
pub trait Queue {
    fn add_todo(&mut self, now: Millis, endpoint: &str, new: NewTodo) -> Result<Todo, Error>;
    fn claim(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        opts: &ClaimOpts,
    ) -> Result<Claimed, Error>;
    fn claim_next(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        opts: &ClaimOpts,
    ) -> Result<Option<Claimed>, Error>;
    fn heartbeat(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        ttl: Millis,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error>;
    fn complete(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report)
    -> Result<Todo, Error>;
    fn fail(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report) -> Result<Todo, Error>;
    fn release(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        summary: Option<&str>,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error>;
    fn retry(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error>;
    fn cancel(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error>;
    fn reap(&mut self, now: Millis) -> Result<Vec<Todo>, Error>;
    fn requeue_due(&mut self, now: Millis) -> Result<Vec<Todo>, Error>;
    fn revoke_endpoint(&mut self, now: Millis, endpoint: &str) -> Result<Vec<Todo>, Error>;
    fn get_todo(&mut self, actor: &Actor, id: &str, limit: usize) -> Result<TodoView, Error>;
    fn list_todos(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error>;
    fn delete_todo(&mut self, actor: &Actor, id: &str) -> Result<(), Error>;
    fn purge_finished(&mut self, now: Millis, retention: Millis) -> Result<Vec<String>, Error>;
}

impl Queue for Ledger {
    fn add_todo(&mut self, now: Millis, endpoint: &str, new: NewTodo) -> Result<Todo, Error> {
        Ledger::add_todo(self, now, endpoint, new)
    }
    fn claim(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        opts: &ClaimOpts,
    ) -> Result<Claimed, Error> {
        Ledger::claim(self, now, actor, id, opts)
    }
    fn claim_next(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        opts: &ClaimOpts,
    ) -> Result<Option<Claimed>, Error> {
        Ledger::claim_next(self, now, actor, queues, opts)
    }
    fn heartbeat(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        ttl: Millis,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error> {
        Ledger::heartbeat(self, now, actor, id, ttl, token_hash)
    }
    fn complete(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        r: &Report,
    ) -> Result<Todo, Error> {
        Ledger::complete(self, now, actor, id, r)
    }
    fn fail(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report) -> Result<Todo, Error> {
        Ledger::fail(self, now, actor, id, r)
    }
    fn release(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        summary: Option<&str>,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error> {
        Ledger::release(self, now, actor, id, summary, token_hash)
    }
    fn retry(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error> {
        Ledger::retry(self, now, actor, id)
    }
    fn cancel(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error> {
        Ledger::cancel(self, now, actor, id)
    }
    fn reap(&mut self, now: Millis) -> Result<Vec<Todo>, Error> {
        Ledger::reap(self, now)
    }
    fn requeue_due(&mut self, now: Millis) -> Result<Vec<Todo>, Error> {
        Ledger::requeue_due(self, now)
    }
    fn revoke_endpoint(&mut self, now: Millis, endpoint: &str) -> Result<Vec<Todo>, Error> {
        Ledger::revoke_endpoint(self, now, endpoint)
    }
    fn get_todo(&mut self, actor: &Actor, id: &str, limit: usize) -> Result<TodoView, Error> {
        Ledger::get_todo(self, actor, id, limit)
    }
    fn list_todos(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        Ok(Ledger::list_todos(self, actor, filter))
    }
    fn delete_todo(&mut self, actor: &Actor, id: &str) -> Result<(), Error> {
        Ledger::delete_todo(self, actor, id)
    }
    fn purge_finished(&mut self, now: Millis, retention: Millis) -> Result<Vec<String>, Error> {
        Ok(Ledger::purge_finished(self, now, retention))
    }
}

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

// ---------------------------------------------------------------------------------------------
// Wire decoding: arbitrary bytes as a tool's arguments.
// ---------------------------------------------------------------------------------------------

/// The first byte picks the tool, the rest is read as the JSON of its arguments. Decoding never
/// panics, and every refusal is `invalid` and names the tool.
pub fn wire_decode(data: &[u8]) {
    use crate::wire::Tool;
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let tool = Tool::ALL[usize::from(pick) % Tool::ALL.len()];
    let Ok(args) = serde_json::from_slice::<Value>(rest) else {
        return;
    };
    match tool.decode(Some(&args)) {
        Ok(call) => assert_eq!(call.tool(), tool),
        Err(e) => {
            assert_eq!(e.code, ErrorCode::Invalid, "{e}");
            assert!(e.message.starts_with(tool.name()), "{e}");
        }
    }
}

// ---- config (relay_core::config) --------------------------------------------------------------
// Property bodies for the config model. Other modules add their own blocks; keep this one apart.

/// Parsing arbitrary text as a main file, as a drop-in, and as both, under both file kinds, never
/// panics; every error is one non-empty line that names its key or table, or says the TOML is
/// malformed. A config that parses also resolves (against env files holding the same text) and
/// evaluates its schedules and hours without panicking, under the same rule for errors.
pub fn config_parse_never_panics(text: &str) {
    use crate::config::{ConfigError, FileKind, Source, parse, resolve};
    use std::collections::BTreeMap;

    fn check(e: &ConfigError) {
        let shown = e.to_string();
        assert!(!e.message.trim().is_empty(), "empty error message: {e:?}");
        assert!(!shown.contains('\n'), "error spans lines: {shown}");
        let names_key = e.key.as_deref().is_some_and(|k| e.message.contains(k));
        let names_table = e
            .table
            .as_deref()
            .is_some_and(|t| shown.contains(&format!("[{t}]")));
        let malformed =
            e.key.is_none() && e.table.is_none() && e.message.contains("not valid TOML");
        assert!(
            names_key || names_table || malformed,
            "error names no key: {shown}"
        );
    }

    let main = Source::new("harness.toml", text);
    let empty = Source::new("harness.toml", "");
    let dropin = Source::new("harness.d/10-x.toml", text);
    for kind in [FileKind::Global, FileKind::Project] {
        let runs = [
            parse(&main, &[], kind),
            parse(&empty, std::slice::from_ref(&dropin), kind),
            parse(&main, std::slice::from_ref(&dropin), kind),
        ];
        for run in runs {
            match run {
                Err(errors) => {
                    assert!(!errors.0.is_empty(), "Err without errors");
                    errors.0.iter().for_each(check);
                }
                Ok(config) => {
                    for h in config.harnesses.values() {
                        for now in [0, 1_790_000_000_000, u64::MAX] {
                            if let Some(s) = &h.schedule {
                                let next = s.next_after(now);
                                assert!(next > now || next == u64::MAX, "schedule went back");
                            }
                            if let Some(hours) = &h.operating_hours {
                                let _ = hours.contains(now);
                            }
                        }
                    }
                    let none = BTreeMap::new();
                    let same: BTreeMap<String, String> = config
                        .env_files()
                        .into_iter()
                        .map(|p| (p.to_string(), text.to_string()))
                        .collect();
                    for files in [&none, &same] {
                        if let Err(errors) = resolve(&config, files) {
                            errors.0.iter().for_each(check);
                        }
                    }
                }
            }
        }
    }
}
// ---- end config -------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Relay attempt machine (core-relay): a scripted driver for tests, a lease source backed by the
// ledger, and the property bodies over input programs decoded from bytes.
// ---------------------------------------------------------------------------------------------

pub mod relay {
    //! Everything a relay test needs to drive [`crate::relay::Relay`] in a few lines, and the
    //! bodies of its property tests (each takes the bytes of a program, so a fuzz target can
    //! reuse it as it is).

    use std::collections::{BTreeMap, BTreeSet};

    use serde_json::{Value, json};

    use crate::error::ErrorCode;
    use crate::ledger::{Actor, ClaimOpts, Ledger, Report, TokenHash};
    use crate::relay::{
        Capabilities, ClaimAnswer, ClaimedTodo, Command, ContractError, Describe, ExitStatus,
        HarnessSettings, Input, LeaseError, LeaseToken, OnOverlap, Relay, ReportVerb, RequestId,
        RunOutcome, RunRecord, StopReason, SuccessCheck, decode_claim,
    };
    use crate::time::{MINUTE, Millis, Now, SECOND, parse_rfc3339, rfc3339};
    use crate::wire::ClaimOut;

    /// 2026-09-22T12:00:00Z, where every scripted test starts.
    pub fn t0() -> Millis {
        parse_rfc3339("2026-09-22T12:00:00Z").unwrap_or_default()
    }

    /// Header and env_file values the tests plant, to prove they never leak.
    pub const HEADER_SECRET: &str = "hdr-s3cr3t-value";
    pub const ENV_FILE_SECRET: &str = "envfile-s3cr3t-value";

    /// `fixer` on `buildbox`, bound to `queue.ci`: 5 m lease, 1 m heartbeats, no check.
    pub fn settings() -> HarnessSettings {
        HarnessSettings {
            harness: "fixer".into(),
            host: "buildbox".into(),
            lease: "queue.ci".into(),
            queue: Some("ci-failures".into()),
            lease_ttl: 5 * MINUTE,
            heartbeat_interval: MINUTE,
            argv: vec!["claude".into(), "-p".into()],
            prompt: Some(b"Fix the CI failure described in $HARNESS_RELAY_FILE.".to_vec()),
            workdir: "/src/app".into(),
            timeout: None,
            kill_grace: crate::relay::DEFAULT_KILL_GRACE,
            on_overlap: OnOverlap::Skip,
            enabled: true,
            lease_enabled: true,
            success_check: None,
            attempt_receipt: None,
            jobs_dir: "/state/jobs".into(),
            secrets: vec![HEADER_SECRET.into()],
            env_file: vec![("GH_TOKEN".into(), ENV_FILE_SECRET.into())],
        }
    }

    /// The settings with a success check.
    pub fn with_check(
        mut s: HarnessSettings,
        timeout: Millis,
        interval: Millis,
    ) -> HarnessSettings {
        s.success_check = Some(SuccessCheck {
            argv: vec!["./scripts/required-checks-green.sh".into()],
            timeout,
            interval,
            before: false,
        });
        s
    }

    /// A claim answer for `todo_id` at `attempt` of `max`, fenced with `token` when given.
    pub fn claimed(todo_id: &str, attempt: u32, max: u32, token: Option<&str>) -> ClaimedTodo {
        ClaimedTodo {
            todo_id: todo_id.into(),
            attempt,
            max_attempts: max,
            attempt_seq: u64::from(attempt),
            lease_token: token.map(LeaseToken::new),
            todo: json!({
                "id": todo_id, "queue": "ci-failures", "title": "CI red on main",
                "kind": "check_suite", "source": "gitea", "payload": {"sha": "abc123"},
                "work_order": null, "created_at": "2026-09-22T11:58:00Z",
            }),
            prior_attempts: Vec::new(),
        }
    }

    /// A tools/list answer declaring `verbs`, each with its input properties (and
    /// `additionalProperties: false`, as the queue server's schemas have it).
    pub fn tools_list(verbs: &[(&str, &[&str])]) -> Value {
        let tools: Vec<Value> = verbs
            .iter()
            .map(|(name, props)| {
                let props: serde_json::Map<String, Value> =
                    props.iter().map(|p| (p.to_string(), json!({}))).collect();
                json!({"name": name, "inputSchema": {"type": "object", "properties": props,
                    "additionalProperties": false}})
            })
            .collect();
        json!({ "tools": tools })
    }

    /// The drain verbs with every argument SPEC-0034 adds, release included.
    pub fn spec_0034_tools() -> Value {
        let mut verbs = crate::relay::contract::ARGUMENTS.to_vec();
        verbs.push(("list_todos", &["queue", "state", "limit"]));
        tools_list(&verbs)
    }

    /// The request id of the last command in `cmds` that `pick` selects.
    pub fn request_in(cmds: &[Command], pick: fn(&Command) -> bool) -> Option<RequestId> {
        cmds.iter().rev().filter(|c| pick(c)).find_map(request_of)
    }

    pub fn request_of(c: &Command) -> Option<RequestId> {
        match c {
            Command::SendClaimNext { request, .. }
            | Command::SendHeartbeat { request, .. }
            | Command::SendReport { request, .. }
            | Command::UploadReceipt { request, .. } => Some(*request),
            _ => None,
        }
    }

    pub fn is_claim(c: &Command) -> bool {
        matches!(c, Command::SendClaimNext { .. })
    }
    pub fn is_heartbeat(c: &Command) -> bool {
        matches!(c, Command::SendHeartbeat { .. })
    }
    pub fn is_report(c: &Command) -> bool {
        matches!(c, Command::SendReport { .. })
    }
    pub fn is_receipt(c: &Command) -> bool {
        matches!(c, Command::UploadReceipt { .. })
    }

    /// The run records among `cmds`.
    pub fn records(cmds: &[Command]) -> Vec<&RunRecord> {
        cmds.iter()
            .filter_map(|c| match c {
                Command::WriteRunRecord { record } => Some(record),
                _ => None,
            })
            .collect()
    }

    /// A Debug-and-JSON rendering of a command, for "does this byte string appear" checks.
    pub fn rendered(c: &Command) -> String {
        let mut text = format!("{c:?}");
        match c {
            Command::WriteContextFile { bytes, .. } => {
                text.push_str(&String::from_utf8_lossy(bytes));
            }
            Command::Spawn { env, .. } | Command::RunCheck { env, .. } => {
                for (k, v) in env.merged([]) {
                    text.push_str(&format!(" {k}={v}"));
                }
            }
            Command::WriteRunRecord { record } => {
                text.push_str(&serde_json::to_string(record).unwrap_or_default());
            }
            Command::Emit { event } => {
                text.push_str(&serde_json::to_string(event).unwrap_or_default());
            }
            Command::SendReport { result, .. } => text.push_str(&result.to_string()),
            _ => {}
        }
        text
    }

    /// How the scripted driver answers heartbeats on its own.
    #[derive(Clone, Debug, PartialEq)]
    pub enum AutoHeartbeat {
        /// Leave them unanswered; the test answers.
        Off,
        /// Answer each at once, with this result.
        Reply(Result<(), LeaseError>),
    }

    /// A scripted driver: feeds inputs at explicit times, fires due timers at their own
    /// instants, and keeps every command it saw.
    pub struct Driver {
        pub relay: Relay,
        /// The monotonic clock; the wall clock reads `now + wall_offset`.
        pub now: Millis,
        /// How far the wall clock has been stepped from the monotonic one (0: they agree).
        pub wall_offset: i64,
        /// Every command with the time it was emitted.
        pub log: Vec<(Millis, Command)>,
        pub auto_heartbeat: AutoHeartbeat,
    }

    impl Driver {
        /// A relay at [`t0`] whose lease source advertises SPEC-0034 with release.
        pub fn new(settings: HarnessSettings) -> Driver {
            Self::with_capabilities(settings, Capabilities::full(true))
        }

        pub fn with_capabilities(settings: HarnessSettings, caps: Capabilities) -> Driver {
            Self::new_with(settings, caps, 1, t0())
        }

        /// A relay whose first run id is `first_run_id`, starting at `now`.
        pub fn new_with(
            settings: HarnessSettings,
            caps: Capabilities,
            first_run_id: u64,
            now: Millis,
        ) -> Driver {
            let mut d = Driver {
                relay: Relay::new(settings, 7, first_run_id),
                now,
                wall_offset: 0,
                log: Vec::new(),
                auto_heartbeat: AutoHeartbeat::Reply(Ok(())),
            };
            d.input(Input::CapabilitiesKnown(caps));
            d
        }

        /// Feeds `input` at the current time; panics on a contract error.
        pub fn input(&mut self, input: Input) -> Vec<Command> {
            match self.try_input(input) {
                Ok(cmds) => cmds,
                Err(e) => panic!("contract error: {e}"),
            }
        }

        pub fn try_input(&mut self, input: Input) -> Result<Vec<Command>, ContractError> {
            self.relay.handle_input(self.clock(), input)?;
            Ok(self.drain())
        }

        /// Both clocks as the machine reads them now.
        pub fn clock(&self) -> Now {
            Now {
                mono: self.now,
                wall: self.now.saturating_add_signed(self.wall_offset),
            }
        }

        /// `harness describe` now.
        pub fn describe(&self) -> Describe {
            self.relay.describe(self.clock())
        }

        fn drain(&mut self) -> Vec<Command> {
            let mut out = Vec::new();
            while let Some(c) = self.relay.poll_command() {
                self.log.push((self.now, c.clone()));
                out.push(c);
            }
            if let AutoHeartbeat::Reply(reply) = self.auto_heartbeat.clone() {
                let requests: Vec<RequestId> = out
                    .iter()
                    .filter(|c| is_heartbeat(c))
                    .filter_map(request_of)
                    .collect();
                for request in requests {
                    let input = match reply.clone() {
                        Ok(()) => Input::HeartbeatOk { request },
                        Err(error) => Input::HeartbeatFailed { request, error },
                    };
                    out.extend(self.input(input));
                }
            }
            out
        }

        /// Moves time to `t`, handling each timer at the instant it is due.
        pub fn advance_to(&mut self, t: Millis) -> Vec<Command> {
            let mut out = Vec::new();
            // Bounded: a machine whose due timer does not move would otherwise spin forever.
            for _ in 0..100_000 {
                let Some((at, _)) = self.relay.poll_timeout().filter(|(at, _)| *at <= t) else {
                    self.now = self.now.max(t);
                    return out;
                };
                self.now = self.now.max(at);
                out.extend(self.input(Input::TimerFired));
            }
            panic!("timers due by {t} did not settle: a handled timer must move or disarm");
        }

        pub fn advance(&mut self, by: Millis) -> Vec<Command> {
            self.advance_to(self.now + by)
        }

        /// A doorbell firing within hours.
        pub fn fire(&mut self) -> Vec<Command> {
            self.input(Input::Firing {
                trigger: "channel.sb".into(),
                within_hours: true,
            })
        }

        /// The last request of the kind `pick` selects, over the whole log.
        pub fn last_request(&self, pick: fn(&Command) -> bool) -> RequestId {
            let cmds: Vec<Command> = self.log.iter().map(|(_, c)| c.clone()).collect();
            request_in(&cmds, pick).unwrap_or_else(|| panic!("no such request in the log"))
        }

        /// The run id of the attempt in flight.
        pub fn run_id(&self) -> u64 {
            self.describe()
                .attempt
                .map(|a| a.run_id)
                .unwrap_or_else(|| panic!("no attempt in flight"))
        }

        /// Fires and answers the claim with `claim`.
        pub fn claim(&mut self, claim: ClaimedTodo) -> Vec<Command> {
            let mut out = self.fire();
            let request = request_in(&out, is_claim).unwrap_or_else(|| panic!("no claim sent"));
            out.extend(self.input(Input::ClaimAnswered { request, claim }));
            out
        }

        /// Fires, claims `claim` and reports the process started.
        pub fn start(&mut self, claim: ClaimedTodo) -> Vec<Command> {
            let mut out = self.claim(claim);
            let run_id = self.run_id();
            out.extend(self.input(Input::ProcessSpawned { run_id }));
            out
        }

        pub fn spawned(&mut self) -> Vec<Command> {
            let run_id = self.run_id();
            self.input(Input::ProcessSpawned { run_id })
        }

        pub fn exit(&mut self, code: i32, summary_file: Option<&[u8]>) -> Vec<Command> {
            let run_id = self.run_id();
            self.input(Input::ProcessExited {
                run_id,
                exit: if code < 0 {
                    ExitStatus::Signal(-code)
                } else {
                    ExitStatus::Code(code)
                },
                summary_file: summary_file.map(<[u8]>::to_vec),
            })
        }

        pub fn check_exit(&mut self, code: i32, output: &str) -> Vec<Command> {
            let run_id = self.run_id();
            self.input(Input::CheckExited {
                run_id,
                exit: ExitStatus::Code(code),
                output_tail: output.as_bytes().to_vec(),
            })
        }

        /// Accepts the last report.
        pub fn report_ok(&mut self, dead_letter: bool) -> Vec<Command> {
            let request = self.last_request(is_report);
            self.input(Input::ReportAnswered {
                request,
                dead_letter,
                next_retry_at: None,
            })
        }

        pub fn report_failed(&mut self, error: LeaseError) -> Vec<Command> {
            let request = self.last_request(is_report);
            self.input(Input::ReportFailed { request, error })
        }

        /// Every command so far.
        pub fn commands(&self) -> Vec<Command> {
            self.log.iter().map(|(_, c)| c.clone()).collect()
        }

        /// The last record written.
        pub fn last_record(&self) -> RunRecord {
            let cmds = self.commands();
            records(&cmds)
                .last()
                .map(|r| (*r).clone())
                .unwrap_or_else(|| panic!("no record written"))
        }
    }

    /// A lease source backed by the real [`Ledger`], speaking the machine's commands. Tokens
    /// are `tok-<n>`; each relay is a different endpoint-session of one endpoint.
    pub struct LedgerSource {
        pub ledger: Ledger,
        pub endpoint: String,
        next_token: u32,
    }

    impl LedgerSource {
        pub fn new(ledger: Ledger, endpoint: &str) -> LedgerSource {
            LedgerSource {
                ledger,
                endpoint: endpoint.into(),
                next_token: 0,
            }
        }

        fn error(e: crate::error::Error) -> LeaseError {
            match e.code {
                ErrorCode::Internal => LeaseError::Other("internal".into()),
                code => LeaseError::Code(code),
            }
        }

        /// Serves one lease-source command at `now`; `None` for any other command.
        pub fn serve(&mut self, now: Millis, c: &Command) -> Option<Input> {
            let actor = Actor::endpoint(self.endpoint.clone());
            Some(match c {
                Command::SendClaimNext {
                    request,
                    queue,
                    lease_ttl_seconds,
                    claimant,
                    ..
                } => {
                    self.next_token += 1;
                    let token = format!("tok-{}-{}", self.endpoint, self.next_token);
                    let opts = ClaimOpts {
                        ttl: lease_ttl_seconds * SECOND,
                        claimant: Some(claimant.clone()),
                        token_hash: Some(TokenHash::of(&token)),
                    };
                    let queues = queue.clone().map(|q| vec![q]);
                    match self
                        .ledger
                        .claim_next(now, &actor, queues.as_deref(), &opts)
                    {
                        Ok(None) => Input::ClaimEmpty { request: *request },
                        Err(e) => Input::ClaimFailed {
                            request: *request,
                            error: Self::error(e),
                        },
                        // Through the wire answer and the daemon's own decoder.
                        Ok(Some(c)) => {
                            let out = ClaimOut::claimed(&c, Some(LeaseToken::new(token)));
                            let answer = serde_json::to_value(&out).unwrap_or_default();
                            match decode_claim(&answer) {
                                Ok(ClaimAnswer::Claimed(claim)) => Input::ClaimAnswered {
                                    request: *request,
                                    claim,
                                },
                                other => panic!("our own claim answer did not decode: {other:?}"),
                            }
                        }
                    }
                }
                Command::SendHeartbeat {
                    request,
                    todo_id,
                    lease_ttl_seconds,
                    lease_token,
                    ..
                } => {
                    let hash = Some(TokenHash::of(lease_token.expose()));
                    let ttl = lease_ttl_seconds * SECOND;
                    match self.ledger.heartbeat(now, &actor, todo_id, ttl, hash) {
                        Ok(_) => Input::HeartbeatOk { request: *request },
                        Err(e) => Input::HeartbeatFailed {
                            request: *request,
                            error: Self::error(e),
                        },
                    }
                }
                Command::SendReport {
                    request,
                    verb,
                    todo_id,
                    lease_token,
                    summary,
                    artifact,
                    result,
                    ..
                } => {
                    let hash = Some(TokenHash::of(lease_token.expose()));
                    let report = Report {
                        result: Some(result.clone()).filter(|r| !r.is_null()),
                        summary: Some(summary.clone()),
                        artifact: artifact.clone(),
                        token_hash: hash,
                    };
                    let answer = match verb {
                        ReportVerb::Complete => self.ledger.complete(now, &actor, todo_id, &report),
                        ReportVerb::Fail => self.ledger.fail(now, &actor, todo_id, &report),
                        ReportVerb::Release => {
                            self.ledger
                                .release(now, &actor, todo_id, Some(summary), hash)
                        }
                    };
                    match answer {
                        Ok(todo) => Input::ReportAnswered {
                            request: *request,
                            dead_letter: todo.dead_letter(),
                            next_retry_at: todo.next_retry_at.map(rfc3339),
                        },
                        Err(e) => Input::ReportFailed {
                            request: *request,
                            error: Self::error(e),
                        },
                    }
                }
                _ => return None,
            })
        }
    }

    // -----------------------------------------------------------------------------------------
    // Property bodies: a program of inputs decoded from bytes, run against one relay with a
    // world that answers only what was asked (plus stale replays), then healed until the
    // machine is idle. Each property reads the recorded trace.
    // -----------------------------------------------------------------------------------------

    /// One step of a program.
    #[derive(Clone, Debug, PartialEq)]
    pub enum RelayOp {
        Advance(Millis),
        Fire {
            within_hours: bool,
        },
        /// Answers the awaited claim (by `x % 8`): 0-2 fenced todo, 3 unfenced todo, 4 empty,
        /// 5 transport, 6 conflict, 7 forbidden.
        ClaimAnswer(u8),
        /// Answers one awaited heartbeat (by `answer % 8`): 0-4 ok, 5 transport, 6 conflict,
        /// 7 not_found.
        HeartbeatAnswer {
            pick: u8,
            answer: u8,
        },
        /// Answers the awaited report (by `x % 8`): 0-2 ok, 3 ok with dead letter,
        /// 4-5 transport, 6 conflict, 7 invalid.
        ReportAnswer(u8),
        ReceiptAnswer {
            ok: bool,
        },
        Spawned,
        SpawnFailed,
        /// The process exits; `summary` 0 none, 1 text, 2 JSON naming the lease token and a
        /// handle, 3 JSON with a malformed handle.
        Exit {
            code: i32,
            summary: u8,
        },
        /// The check exits; its output names the lease token when `leak`.
        CheckExit {
            code: i32,
            leak: bool,
        },
        CheckFailedToStart,
        Stop(StopReason),
        Capabilities {
            supported: bool,
            release: bool,
        },
        SessionExpired,
        /// Feeds an answer given earlier once more.
        Replay(u8),
        /// The wall clock steps by this many ms (either way); the monotonic one does not.
        WallStep(i64),
    }

    /// A decoded program: the harness settings it runs under and its steps.
    #[derive(Clone, Debug)]
    pub struct RelayProgram {
        pub settings: HarnessSettings,
        pub ops: Vec<RelayOp>,
        /// The world answers every heartbeat at once with success (long attempts get to their
        /// check and report); otherwise heartbeats wait for `HeartbeatAnswer` operations.
        pub auto_heartbeat: bool,
    }

    /// Every byte string is a valid program: the first bytes choose the settings, the rest are
    /// operations.
    pub fn decode_relay_program(bytes: &[u8]) -> RelayProgram {
        let mut it = bytes.iter().copied();
        let mut b = || it.next().unwrap_or(0);
        let mut s = settings();
        let (f0, f1, f2) = (b(), b(), b());
        s.on_overlap = if f0 & 1 == 0 {
            OnOverlap::Skip
        } else {
            OnOverlap::Queue
        };
        // Mostly enabled: a disabled harness only ever writes skipped records.
        s.enabled = f0 & 0b1110 != 0b1110;
        s.lease_enabled = f0 & 0b111_0000 != 0b111_0000;
        s.heartbeat_interval = [MINUTE, 30 * SECOND, 2 * MINUTE][usize::from(f1 % 3)];
        if f1 & 0b100 != 0 {
            let mut c = with_check(settings(), 3 * MINUTE, 30 * SECOND).success_check;
            if let Some(c) = c.as_mut() {
                c.before = f1 & 0b1000 != 0;
            }
            s.success_check = c;
        }
        s.attempt_receipt = (f1 & 0b10000 != 0).then(|| "cairn.main".into());
        s.timeout = (f1 & 0b100000 != 0).then_some(4 * MINUTE);
        let mut ops = vec![RelayOp::Capabilities {
            supported: f2 & 0b111 != 0b111,
            release: f2 & 0b1000 == 0,
        }];
        let auto_heartbeat = f1 & 0b100_0000 == 0;
        let rest: Vec<u8> = it.collect();
        let mut it = rest.into_iter();
        while let Some(tag) = it.next() {
            let mut b = || it.next().unwrap_or(0);
            ops.push(match tag % 20 {
                0 => RelayOp::Advance(Millis::from(b()) * SECOND),
                1 => RelayOp::Advance(Millis::from(b() % 32) * 15 * SECOND),
                2 | 3 => RelayOp::Fire {
                    within_hours: b() % 4 != 0,
                },
                4 | 5 => RelayOp::ClaimAnswer(b()),
                6 | 7 => RelayOp::HeartbeatAnswer {
                    pick: b(),
                    answer: b(),
                },
                8 | 9 => RelayOp::ReportAnswer(b()),
                10 => RelayOp::ReceiptAnswer { ok: b() % 3 != 0 },
                11 | 12 => RelayOp::Spawned,
                13 | 14 => match b() % 8 {
                    0 => RelayOp::SpawnFailed,
                    x => RelayOp::Exit {
                        code: [0, 1, 2, -9, 0, 75, 0][usize::from(x - 1)],
                        summary: b() % 4,
                    },
                },
                15 | 16 => match b() % 6 {
                    0 => RelayOp::CheckFailedToStart,
                    x => RelayOp::CheckExit {
                        code: [0, 1, 75, 75, 0][usize::from(x - 1)],
                        leak: b() % 2 == 0,
                    },
                },
                17 => match b() % 8 {
                    0..=2 => RelayOp::Stop(
                        [
                            StopReason::Shutdown,
                            StopReason::OperatorStop,
                            StopReason::HarnessRemoved,
                            StopReason::UsageLimit,
                        ][usize::from(b() % 4)],
                    ),
                    3 => RelayOp::SessionExpired,
                    _ => RelayOp::Capabilities {
                        supported: b() % 4 != 0,
                        release: b() % 2 == 0,
                    },
                },
                18 => RelayOp::Replay(b()),
                _ => RelayOp::WallStep((i64::from(b()) - 128) * 30 * SECOND as i64),
            });
        }
        RelayProgram {
            settings: s,
            ops,
            auto_heartbeat,
        }
    }

    /// One input and what it led to.
    #[derive(Clone, Debug)]
    pub struct Step {
        pub now: Millis,
        pub input: Input,
        pub commands: Vec<Command>,
        /// `harness describe` after the step, as JSON.
        pub describe: String,
        /// The relay's own `Debug` after the step.
        pub debug: String,
    }

    /// What a program did.
    #[derive(Clone, Debug)]
    pub struct Trace {
        pub settings: HarnessSettings,
        pub steps: Vec<Step>,
        /// The lease token handed to each run.
        pub tokens: BTreeMap<u64, String>,
    }

    /// The world around one relay: what it asked for and has not been answered yet.
    struct World {
        relay: Relay,
        now: Millis,
        /// The wall clock reads `now + wall_offset` (see [`RelayOp::WallStep`]).
        wall_offset: i64,
        /// Whether `WallStep` operations step the wall clock (the comparison run ignores them).
        wall_steps: bool,
        trace: Trace,
        claim: Option<(RequestId, u64)>,
        heartbeats: Vec<RequestId>,
        report: Option<RequestId>,
        receipt: Option<RequestId>,
        /// The process: run id and whether it started.
        process: Option<(u64, bool)>,
        check: Option<u64>,
        answered: Vec<Input>,
        auto_heartbeat: bool,
    }

    impl World {
        fn feed(&mut self, input: Input) -> Result<(), String> {
            // A timer due now goes first, in a step of its own, as a punctual driver delivers
            // it; the machine would handle it first anyway, and the trace then shows which
            // commands the timer caused and which the input.
            if input != Input::TimerFired
                && self
                    .relay
                    .poll_timeout()
                    .is_some_and(|(at, _)| at <= self.now)
            {
                self.feed(Input::TimerFired)?;
            }
            let now = Now {
                mono: self.now,
                wall: self.now.saturating_add_signed(self.wall_offset),
            };
            self.relay
                .handle_input(now, input.clone())
                .map_err(|e| format!("at {}: {input:?} was refused: {e}", self.now))?;
            let mut commands = Vec::new();
            while let Some(c) = self.relay.poll_command() {
                match &c {
                    Command::SendClaimNext {
                        request, run_id, ..
                    } => {
                        self.claim = Some((*request, *run_id));
                    }
                    Command::SendHeartbeat { request, .. } => self.heartbeats.push(*request),
                    Command::SendReport { request, .. } => self.report = Some(*request),
                    Command::UploadReceipt { request, .. } => self.receipt = Some(*request),
                    Command::Spawn { run_id, .. } => self.process = Some((*run_id, false)),
                    Command::RunCheck { run_id, .. } => self.check = Some(*run_id),
                    _ => {}
                }
                commands.push(c);
            }
            let describe = serde_json::to_string(&self.relay.describe(now)).unwrap_or_default();
            let debug = format!("{:?}", self.relay);
            self.trace.steps.push(Step {
                now: self.now,
                input,
                commands,
                describe,
                debug,
            });
            if self.auto_heartbeat {
                for request in std::mem::take(&mut self.heartbeats) {
                    self.answer(Input::HeartbeatOk { request })?;
                }
            }
            Ok(())
        }

        fn answer(&mut self, input: Input) -> Result<(), String> {
            self.answered.push(input.clone());
            self.feed(input)
        }

        /// Moves to `t` the way a driver does: each timer at its own instant.
        fn advance_to(&mut self, t: Millis) -> Result<(), String> {
            for _ in 0..10_000 {
                match self.relay.poll_timeout() {
                    Some((at, _)) if at <= t => {
                        self.now = self.now.max(at);
                        self.feed(Input::TimerFired)?;
                    }
                    _ => break,
                }
            }
            self.now = self.now.max(t);
            Ok(())
        }

        fn token_of(&self, run_id: u64) -> String {
            self.trace.tokens.get(&run_id).cloned().unwrap_or_default()
        }

        fn apply(&mut self, op: &RelayOp) -> Result<(), String> {
            let lease_error = |x: u8| match x {
                1 => LeaseError::Transport,
                2 => LeaseError::Code(ErrorCode::Conflict),
                3 => LeaseError::Code(ErrorCode::NotFound),
                4 => LeaseError::Code(ErrorCode::Forbidden),
                _ => LeaseError::Code(ErrorCode::Invalid),
            };
            match op {
                RelayOp::Advance(by) => self.advance_to(self.now + by)?,
                RelayOp::WallStep(by) if self.wall_steps => self.wall_offset += by,
                RelayOp::WallStep(_) => {}
                RelayOp::Fire { within_hours } => self.feed(Input::Firing {
                    trigger: "channel.sb".into(),
                    within_hours: *within_hours,
                })?,
                RelayOp::ClaimAnswer(kind) => {
                    let Some((request, run_id)) = self.claim.take() else {
                        return Ok(());
                    };
                    let input = match kind % 8 {
                        k @ 0..=3 => {
                            let token = format!("LT{run_id}-q3vZw8Kp");
                            let fenced = k < 3;
                            if fenced {
                                self.trace.tokens.insert(run_id, token.clone());
                            }
                            let token = fenced.then_some(token.as_str());
                            let claim = claimed(&format!("td_{run_id}"), 1, 3, token);
                            Input::ClaimAnswered { request, claim }
                        }
                        4 => Input::ClaimEmpty { request },
                        x => Input::ClaimFailed {
                            request,
                            error: lease_error(x - 4),
                        },
                    };
                    self.answer(input)?;
                }
                RelayOp::HeartbeatAnswer { pick, answer } => {
                    if self.heartbeats.is_empty() {
                        return Ok(());
                    }
                    let i = usize::from(*pick) % self.heartbeats.len();
                    let request = self.heartbeats.remove(i);
                    let input = match answer % 8 {
                        0..=4 => Input::HeartbeatOk { request },
                        x => Input::HeartbeatFailed {
                            request,
                            error: lease_error(x - 4),
                        },
                    };
                    self.answer(input)?;
                }
                RelayOp::ReportAnswer(kind) => {
                    let Some(request) = self.report.take() else {
                        return Ok(());
                    };
                    let input = match kind % 8 {
                        k @ 0..=3 => Input::ReportAnswered {
                            request,
                            dead_letter: k == 3,
                            next_retry_at: None,
                        },
                        4 | 5 => Input::ReportFailed {
                            request,
                            error: LeaseError::Transport,
                        },
                        6 => Input::ReportFailed {
                            request,
                            error: lease_error(2),
                        },
                        _ => Input::ReportFailed {
                            request,
                            error: lease_error(7),
                        },
                    };
                    self.answer(input)?;
                }
                RelayOp::ReceiptAnswer { ok } => {
                    let Some(request) = self.receipt.take() else {
                        return Ok(());
                    };
                    let input = if *ok {
                        Input::ReceiptUploaded {
                            request,
                            handle: "mcp://cairn/Rc9".into(),
                        }
                    } else {
                        Input::ReceiptFailed {
                            request,
                            error: "connection refused".into(),
                        }
                    };
                    self.answer(input)?;
                }
                RelayOp::Spawned => {
                    if let Some((run_id, false)) = self.process {
                        self.process = Some((run_id, true));
                        self.feed(Input::ProcessSpawned { run_id })?;
                    }
                }
                RelayOp::SpawnFailed => {
                    if let Some((run_id, false)) = self.process {
                        self.process = None;
                        self.feed(Input::SpawnFailed {
                            run_id,
                            error: "ENOENT".into(),
                        })?;
                    }
                }
                RelayOp::Exit { code, summary } => {
                    if let Some((run_id, true)) = self.process {
                        self.process = None;
                        let token = self.token_of(run_id);
                        let summary_file = match summary {
                            0 => None,
                            1 => Some(format!("tried; {ENV_FILE_SECRET} was set").into_bytes()),
                            2 => Some(
                                json!({"summary": format!("lease {token} in hand"),
                                       "artifact": "mcp://cairn/Ab12Cd34"})
                                .to_string()
                                .into_bytes(),
                            ),
                            _ => Some(
                                br#"{"summary": "x", "artifact": "file:///etc/passwd"}"#.to_vec(),
                            ),
                        };
                        let exit = if *code < 0 {
                            ExitStatus::Signal(-code)
                        } else {
                            ExitStatus::Code(*code)
                        };
                        self.feed(Input::ProcessExited {
                            run_id,
                            exit,
                            summary_file,
                        })?;
                    }
                }
                RelayOp::CheckExit { code, leak } => {
                    if let Some(run_id) = self.check.take() {
                        let output = if *leak {
                            format!("FAIL auth with {}\n", self.token_of(run_id))
                        } else {
                            "ok\n".to_string()
                        };
                        self.feed(Input::CheckExited {
                            run_id,
                            exit: ExitStatus::Code(*code),
                            output_tail: output.into_bytes(),
                        })?;
                    }
                }
                RelayOp::CheckFailedToStart => {
                    if let Some(run_id) = self.check.take() {
                        self.feed(Input::CheckFailedToStart {
                            run_id,
                            error: "EACCES".into(),
                        })?;
                    }
                }
                RelayOp::Stop(reason) => self.feed(Input::StopRequested { reason: *reason })?,
                RelayOp::Capabilities { supported, release } => {
                    let caps = if *supported {
                        Capabilities::full(*release)
                    } else {
                        Capabilities {
                            missing: vec!["claim_next.require_fence".into()],
                            release_advertised: *release,
                            ..Capabilities::default()
                        }
                    };
                    self.feed(Input::CapabilitiesKnown(caps))?;
                }
                RelayOp::SessionExpired => self.feed(Input::SessionExpired)?,
                RelayOp::Replay(pick) => {
                    if !self.answered.is_empty() {
                        let i = usize::from(*pick) % self.answered.len();
                        let input = self.answered[i].clone();
                        self.feed(input)?;
                    }
                }
            }
            Ok(())
        }

        /// Answers everything favourably and lets time pass until the relay is idle.
        fn heal(&mut self) -> Result<(), String> {
            for _ in 0..2_000 {
                if !self.relay.in_flight() {
                    return Ok(());
                }
                if let Some((request, _)) = self.claim.take() {
                    self.answer(Input::ClaimEmpty { request })?;
                } else if let Some(request) = self.report.take() {
                    self.answer(Input::ReportAnswered {
                        request,
                        dead_letter: false,
                        next_retry_at: None,
                    })?;
                } else if self.receipt.is_some() {
                    self.apply(&RelayOp::ReceiptAnswer { ok: true })?;
                } else if !self.heartbeats.is_empty() {
                    self.apply(&RelayOp::HeartbeatAnswer { pick: 0, answer: 0 })?;
                } else if let Some((_, false)) = self.process {
                    self.apply(&RelayOp::Spawned)?;
                } else if let Some((_, true)) = self.process {
                    self.apply(&RelayOp::Exit {
                        code: 0,
                        summary: 0,
                    })?;
                } else if self.check.is_some() {
                    self.apply(&RelayOp::CheckExit {
                        code: 0,
                        leak: false,
                    })?;
                } else if let Some((at, _)) = self.relay.poll_timeout() {
                    self.advance_to(at)?;
                } else {
                    return Err(format!(
                        "stuck: in flight with nothing awaited and no timer: {}",
                        serde_json::to_string(&self.relay.describe(Now::agreeing(self.now)))
                            .unwrap_or_default()
                    ));
                }
            }
            Err("the relay did not become idle".into())
        }
    }

    /// Runs a program and heals the world; the trace is what the properties read.
    pub fn run_relay_program(program: &RelayProgram) -> Result<Trace, String> {
        run_relay_program_with(program, true)
    }

    /// Runs a program, with its wall-clock steps or without them.
    fn run_relay_program_with(program: &RelayProgram, wall_steps: bool) -> Result<Trace, String> {
        let mut w = World {
            relay: Relay::new(program.settings.clone(), 11, 1),
            now: t0(),
            wall_offset: 0,
            wall_steps,
            trace: Trace {
                settings: program.settings.clone(),
                steps: Vec::new(),
                tokens: BTreeMap::new(),
            },
            claim: None,
            heartbeats: Vec::new(),
            report: None,
            receipt: None,
            process: None,
            check: None,
            answered: Vec::new(),
            auto_heartbeat: program.auto_heartbeat,
        };
        for op in &program.ops {
            w.apply(op)?;
        }
        w.heal()?;
        Ok(w.trace)
    }

    fn trace_of(bytes: &[u8]) -> Result<Trace, String> {
        run_relay_program(&decode_relay_program(bytes))
    }

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
                    a.now, a.input, b.now, b.input
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

    /// After the lease is lost (a conflict or not_found, or the deadline measured from the
    /// send time of the last successful claim or heartbeat) no heartbeat and no report goes out.
    /// A heartbeat refused once the report is out is not a loss by itself (the report may have
    /// closed the attempt): the report's own answer decides, and no heartbeat follows it.
    pub fn relay_silent_after_lease_loss(bytes: &[u8]) -> Result<(), String> {
        let trace = trace_of(bytes)?;
        let ttl = trace.settings.lease_ttl;
        // Per run: deadline, lost. Per request: its run and send time.
        let mut lease: BTreeMap<u64, (Millis, bool)> = BTreeMap::new();
        let mut reported: BTreeSet<u64> = BTreeSet::new();
        let mut disputed: BTreeSet<u64> = BTreeSet::new();
        let mut sent: BTreeMap<RequestId, (u64, Millis)> = BTreeMap::new();
        let mut claim_of: BTreeMap<RequestId, u64> = BTreeMap::new();
        let mut awaited: BTreeSet<RequestId> = BTreeSet::new();
        for (i, step) in trace.steps.iter().enumerate() {
            let now = step.now;
            for (deadline, lost) in lease.values_mut() {
                *lost |= now >= *deadline;
            }
            match &step.input {
                Input::ClaimAnswered { request, claim } if claim.lease_token.is_some() => {
                    if let (Some(run), Some((_, at))) = (claim_of.get(request), sent.get(request))
                        && awaited.remove(request)
                    {
                        lease.insert(*run, (at + ttl, now >= at + ttl));
                    }
                }
                Input::HeartbeatOk { request } if awaited.remove(request) => {
                    if let Some((run, at)) = sent.get(request)
                        && let Some((deadline, lost)) = lease.get_mut(run)
                        && !*lost
                    {
                        *deadline = (*deadline).max(at + ttl);
                    }
                }
                Input::HeartbeatFailed { request, error }
                    if error.is_lease_loss()
                        && sent
                            .get(request)
                            .is_some_and(|(run, _)| reported.contains(run))
                        && awaited.remove(request) =>
                {
                    if let Some((run, _)) = sent.get(request) {
                        disputed.insert(*run);
                    }
                }
                Input::HeartbeatFailed { request, error }
                | Input::ReportFailed { request, error }
                    if awaited.remove(request) && error.is_lease_loss() =>
                {
                    if let Some((run, _)) = sent.get(request)
                        && let Some((_, lost)) = lease.get_mut(run)
                    {
                        *lost = true;
                    }
                }
                Input::HeartbeatFailed { request, .. }
                | Input::ReportFailed { request, .. }
                | Input::ReportAnswered { request, .. } => {
                    awaited.remove(request);
                }
                _ => {}
            }
            for c in &step.commands {
                match c {
                    Command::SendClaimNext {
                        request, run_id, ..
                    } => {
                        claim_of.insert(*request, *run_id);
                        sent.insert(*request, (*run_id, now));
                        awaited.insert(*request);
                    }
                    Command::SendHeartbeat {
                        request, run_id, ..
                    }
                    | Command::SendReport {
                        request, run_id, ..
                    } => {
                        match lease.get(run_id) {
                            Some((_, false)) => {}
                            _ => {
                                return Err(format!(
                                    "step {i} at {now}: lease call after the lease was lost: {c:?}"
                                ));
                            }
                        }
                        if matches!(c, Command::SendReport { .. }) {
                            reported.insert(*run_id);
                        } else if disputed.contains(run_id) {
                            return Err(format!(
                                "step {i} at {now}: heartbeat after one was refused during the \
                                 report: {c:?}"
                            ));
                        }
                        sent.insert(*request, (*run_id, now));
                        awaited.insert(*request);
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Once a run's final record is written, no command names that run again.
    pub fn relay_nothing_after_close(bytes: &[u8]) -> Result<(), String> {
        let trace = trace_of(bytes)?;
        let mut closed: BTreeSet<u64> = BTreeSet::new();
        for (i, step) in trace.steps.iter().enumerate() {
            for c in &step.commands {
                if closed.contains(&c.run_id()) {
                    return Err(format!("step {i}: command after run closed: {c:?}"));
                }
                if let Command::WriteRunRecord { record } = c
                    && record.outcome != RunOutcome::Running
                {
                    closed.insert(record.run_id);
                }
            }
        }
        Ok(())
    }

    /// A lease token appears only as the `lease_token` of its own run's heartbeats and
    /// reports: never in any other command, any summary, result, record, event, context file,
    /// environment, warning or `describe` — even when the agent and the check print it.
    pub fn relay_token_stays_in_lease_calls(bytes: &[u8]) -> Result<(), String> {
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
            for c in &step.commands {
                if leaked(&rendered(c)) {
                    return Err(format!("step {i}: token in {}", rendered(c)));
                }
                if let Command::SendHeartbeat {
                    run_id,
                    lease_token,
                    ..
                }
                | Command::SendReport {
                    run_id,
                    lease_token,
                    ..
                } = c
                    && trace.tokens.get(run_id).map(String::as_str) != Some(lease_token.expose())
                {
                    return Err(format!("step {i}: run {run_id} presents another token"));
                }
            }
        }
        Ok(())
    }

    /// Every fenced claim ends in exactly one record with a relay outcome; nothing else gets
    /// more than one.
    pub fn relay_one_outcome_per_claim(bytes: &[u8]) -> Result<(), String> {
        let trace = trace_of(bytes)?;
        let mut outcomes: BTreeMap<u64, u32> = BTreeMap::new();
        for step in &trace.steps {
            for record in records(&step.commands) {
                if record.relay_outcome.is_some() {
                    *outcomes.entry(record.run_id).or_default() += 1;
                }
            }
        }
        if let Some((run, n)) = outcomes.iter().find(|(_, n)| **n > 1) {
            return Err(format!("run {run} recorded {n} relay outcomes"));
        }
        for run in trace.tokens.keys() {
            if outcomes.get(run) != Some(&1) {
                return Err(format!("fenced run {run} ended without a relay outcome"));
            }
        }
        Ok(())
    }

    /// `harness describe` as JSON.
    pub fn describe_json(relay: &Relay, now: Now) -> Value {
        serde_json::to_value(relay.describe(now)).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// Fuzz bodies that gather the properties above into one call per target.
// ---------------------------------------------------------------------------------------------

/// `relay_transitions`: arbitrary input programs into the attempt machine; every property of
/// the machine holds (admission first, silence after loss, nothing after close, the token only
/// in lease calls, one outcome per claim).
pub fn relay_transitions(bytes: &[u8]) -> Result<(), String> {
    relay::relay_admission_before_lease_calls(bytes)?;
    relay::relay_silent_after_lease_loss(bytes)?;
    relay::relay_nothing_after_close(bytes)?;
    relay::relay_token_stays_in_lease_calls(bytes)?;
    relay::relay_one_outcome_per_claim(bytes)?;
    relay::relay_wall_clock_moves_no_deadline(bytes)
}

/// `config_parse`: arbitrary bytes (as lossy UTF-8) as harness.toml.
pub fn config_parse(bytes: &[u8]) {
    config_parse_never_panics(&String::from_utf8_lossy(bytes));
}

/// `summary_compose`: arbitrary agent text, check output and secret into the REQ-11 summary.
/// It is valid UTF-8 of at most 2048 bytes, starts with the daemon's first line, and carries
/// no secret value.
pub fn summary_compose(bytes: &[u8]) -> Result<(), String> {
    use crate::relay::Redactor;
    use crate::relay::summary::{AgentRun, CheckRunSummary, compose_summary, first_line};
    let mut parts = bytes.splitn(3, |b| *b == 0xff);
    let agent = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let check = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let seed = parts.next().unwrap_or_default();
    // The secret is shaped so that it can never occur in the daemon-authored first line.
    let secret: String = std::iter::once('Z')
        .chain(
            seed.iter()
                .chain(&[7u8; 4])
                .take(12)
                .map(|b| char::from(b'a' + b % 26)),
        )
        .chain(std::iter::once('Q'))
        .collect();
    let planted_agent = format!("{agent}{secret}");
    let n = |i: usize| u32::from(seed.get(i).copied().unwrap_or(1));
    let first = first_line(
        n(0) % 9 + 1,
        n(1) % 9 + 1,
        AgentRun {
            outcome: "failed",
            exit: n(2) as i32 - 128,
            duration: u64::from(n(3)) * 7_919,
        },
        (n(4) % 2 == 0).then(|| CheckRunSummary {
            exit: n(5) as i32,
            duration: u64::from(n(6)) * 1_000,
        }),
    );
    let redactor = Redactor::new([secret.as_str()]);
    let with_check = (!check.is_empty()).then_some(check.as_str());
    let s = compose_summary(&first, Some(&planted_agent), with_check, &redactor);
    if s.len() > crate::bounds::SUMMARY_MAX_BYTES {
        return Err(format!("summary of {} bytes", s.len()));
    }
    if !s.starts_with(&first) {
        return Err(format!("the first line was not kept: {s:?}"));
    }
    if s.contains(&secret) {
        return Err("the secret survived redaction".into());
    }
    Ok(())
}
