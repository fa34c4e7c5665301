//! The operator's commands on the queue store: `relay endpoint …` and `relay todo …`.
//!
//! They open the store named by `--db` directly (the server need not run). Every listing has
//! `--json` (one JSON document on stdout); errors are one line on stderr and a non-zero exit.

// These commands exist to print.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use relay_core::Error;
use relay_core::ledger::{
    Actor, Answer, LedgerConfig, LimitsChange, Op, Todo, TodoFilter, TodoState, TokenHash,
    flow::QueueLine,
};
use relay_core::time::WallClock;
use relay_core::time::rfc3339;
use relay_core::wire::{AddTodoArgs, BudgetArg, GetTodoOut, TodoOut};
use relay_server::clock::SystemClock;
use relay_server::store::{Endpoint, NewEndpoint, Store};
use serde_json::{Value, json};

/// The store option every store-touching command shares.
#[derive(Args, Clone, Debug)]
pub struct DbOpt {
    /// The queue store: sqlite:PATH, sqlite::memory: or postgres://USER@HOST:PORT/DB.
    // hide_env_values: a Postgres URL may carry a password; `--help` must not print it.
    #[arg(long, global = true, env = "RELAY_DB", hide_env_values = true, default_value = DEFAULT_DB)]
    pub db: String,
}

/// `--json`, which every listing has.
#[derive(Args, Clone, Copy, Debug)]
pub struct JsonOpt {
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The default store: a SQLite file in the working directory.
pub const DEFAULT_DB: &str = "sqlite:relay.db";

#[derive(Subcommand)]
pub enum EndpointCmd {
    /// Vend an endpoint; prints its bearer token once (only its SHA-256 is stored).
    Create {
        /// The endpoint's name (its URL is /mcp/NAME): letters, digits, '_', '-', '.'.
        name: String,
        /// The verbs (tools) it may use, comma-separated: claim_next, claim, heartbeat,
        /// complete, fail, release, get_todo, list_todos, add_todo.
        #[arg(long, value_delimiter = ',', required = true)]
        verbs: Vec<String>,
        /// The queues it may use, comma-separated (default: every queue).
        #[arg(long, value_delimiter = ',')]
        queues: Option<Vec<String>>,
    },
    /// List endpoints.
    List(JsonOpt),
    /// Revoke an endpoint: its token stops working, its open attempts close as `revoked` and
    /// its claimed todos become dead letters.
    Revoke {
        /// The endpoint's name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum OperatorCmd {
    /// Create an operator of the Board; prints its token once (only its SHA-256 is stored).
    Create {
        /// The operator's name, shown as who closed an attempt: letters, digits, '_', '-', '.'.
        name: String,
    },
    /// List operators.
    List(JsonOpt),
    /// Revoke an operator: its token stops opening the Board and its sessions end.
    Revoke {
        /// The operator's name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum QueueCmd {
    /// Pause a queue: claim_next skips it (answers empty); adds are still accepted.
    Pause {
        /// The queue's name.
        queue: String,
    },
    /// Resume a paused queue.
    Resume {
        /// The queue's name.
        queue: String,
    },
    /// List the paused queues.
    Paused(JsonOpt),
    /// Set or lift a queue's flow limits: a number from 1 to 1000000, or `none` to lift it.
    Set {
        /// The queue's name.
        queue: String,
        /// Claimed todos at once in the queue.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true)]
        max_claimed: Option<String>,
        /// Claimed todos at once with one concurrency_key.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true)]
        max_claimed_per_key: Option<String>,
        /// Claims within a rolling minute.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true)]
        claims_per_minute: Option<String>,
    },
    /// Show the queues with limits or paused: their limits, what is claimed, what is held back.
    Show {
        /// Only this queue.
        queue: Option<String>,
        #[command(flatten)]
        out: JsonOpt,
    },
}

#[derive(Subcommand)]
pub enum TodoCmd {
    /// Add a todo for an endpoint; prints the new todo's id.
    Add(Box<AddArgs>),
    /// List todos, oldest first.
    List {
        /// Only this endpoint's todos.
        #[arg(long)]
        endpoint: Option<String>,
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this state: pending, claimed, failed, done, canceled, input_required.
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        #[command(flatten)]
        out: JsonOpt,
    },
    /// Show a todo and its attempt timeline, newest first.
    Show {
        id: String,
        /// How many attempts to show.
        #[arg(long, default_value_t = 100)]
        attempts: usize,
        #[command(flatten)]
        out: JsonOpt,
    },
    /// Retry a failed, done or canceled todo now (resets its attempt count).
    Retry { id: String },
    /// Cancel a pending, claimed, failed or waiting todo.
    Cancel { id: String },
    /// Answer the question of a todo waiting for input (input_required); it becomes pending,
    /// and its next attempt receives the question and the answer.
    Answer {
        id: String,
        /// The answer, 1 to 8192 bytes.
        #[arg(long)]
        text: String,
    },
}

#[derive(Args)]
pub struct AddArgs {
    /// The endpoint that owns the todo (only it can see and claim it).
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    queue: String,
    /// One line saying what to do.
    #[arg(long)]
    title: String,
    #[arg(long)]
    kind: Option<String>,
    #[arg(long)]
    source: Option<String>,
    /// Any JSON the worker needs.
    #[arg(long)]
    payload: Option<String>,
    /// Any JSON describing how to do the work.
    #[arg(long)]
    work_order: Option<String>,
    /// Attempts before a dead letter (default 5).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Only this claimer may claim it.
    #[arg(long)]
    assignee: Option<String>,
    /// A key for this logical add (at most 200 bytes): while the todo it made exists, another
    /// add with it prints that todo's id instead of adding one.
    #[arg(long)]
    idempotency_key: Option<String>,
    /// A time budget in seconds: once it has passed, no new attempt starts and the todo becomes
    /// a dead letter (reason deadline).
    #[arg(long)]
    deadline_seconds: Option<u64>,
    /// Dead-letter when this many newest failed attempts report the same failure signature
    /// (default 2; 0 turns it off).
    #[arg(long)]
    max_same_failures: Option<u32>,
    /// Questions its attempts may ask a human before the next one dead-letters it (default 3;
    /// 0: never ask).
    #[arg(long)]
    max_input_requests: Option<u32>,
    /// How long an answer may take, in seconds from the question (reason no_answer past it).
    #[arg(long)]
    answer_within_seconds: Option<u64>,
    /// A spend limit in US dollars across its attempts (reason budget_exhausted at it).
    #[arg(long)]
    budget_usd: Option<f64>,
    /// A spend limit in tokens (input and output) across its attempts.
    #[arg(long)]
    budget_tokens: Option<u64>,
    /// Higher is claimed first, from -100 to 100 (default 0); FIFO within one priority.
    #[arg(long, allow_hyphen_values = true)]
    priority: Option<i32>,
    /// Not claimable before this instant (RFC 3339, e.g. 2026-12-24T09:00:00Z; at most a year
    /// ahead). Not with --delay-seconds.
    #[arg(long)]
    run_at: Option<String>,
    /// Not claimable for this many seconds from now (at most a year). Not with --run-at.
    #[arg(long)]
    delay_seconds: Option<u64>,
    /// At most the queue's max_claimed_per_key todos with this key are claimed at once (1 to 128
    /// bytes, e.g. a repository or branch).
    #[arg(long)]
    concurrency_key: Option<String>,
}

/// Prints the error as one line and answers the exit code.
pub fn fail(e: &Error) -> ExitCode {
    eprintln!("relay: {}", e.message);
    ExitCode::FAILURE
}

pub fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::internal(format!("cannot start the async runtime: {e}")))
}

/// The store `--db` / `RELAY_DB` names; an error says where the name came from.
pub async fn open(db: &DbOpt) -> Result<Store, Error> {
    Store::open(&db.db, LedgerConfig::default())
        .await
        .map_err(|e| {
            Error::new(
                e.code,
                format!(
                    "{} (store from --db / RELAY_DB; default {DEFAULT_DB})",
                    e.message
                ),
            )
        })
}

fn now() -> relay_core::Millis {
    SystemClock.now()
}

fn block<T>(f: impl std::future::Future<Output = Result<T, Error>>) -> Result<T, Error> {
    runtime()?.block_on(f)
}

pub fn endpoint(db: &DbOpt, cmd: EndpointCmd) -> ExitCode {
    match block(run_endpoint(db, cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

pub fn operator(db: &DbOpt, cmd: OperatorCmd) -> ExitCode {
    match block(run_operator(db, cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

pub fn queue(db: &DbOpt, cmd: QueueCmd) -> ExitCode {
    match block(run_queue(db, cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

async fn run_operator(db: &DbOpt, cmd: OperatorCmd) -> Result<(), Error> {
    match cmd {
        OperatorCmd::Create { name } => {
            relay_core::board::check_operator_name("operator create", &name)?;
            let token = relay_server::server::new_bearer_token()?;
            let store = open(db).await?;
            store
                .operator_create(now(), &name, TokenHash::of(&token))
                .await?;
            out!("{token}");
            Ok(())
        }
        OperatorCmd::List(JsonOpt { json }) => {
            let store = open(db).await?;
            let all = store.operator_list().await?;
            if json {
                let list: Vec<Value> = all
                    .iter()
                    .map(|o| {
                        json!({
                            "name": o.name,
                            "created_at": rfc3339(o.created_at),
                            "revoked_at": o.revoked_at.map(rfc3339),
                        })
                    })
                    .collect();
                out!("{}", json!({ "operators": list }));
                return Ok(());
            }
            if all.is_empty() {
                out!("no operators; create one with `relay operator create NAME`");
                return Ok(());
            }
            out!("{:<20} {:<8} CREATED", "NAME", "STATE");
            for o in &all {
                let state = if o.revoked_at.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                out!(
                    "{:<20} {:<8} {}",
                    esc(&o.name),
                    state,
                    rfc3339(o.created_at)
                );
            }
            Ok(())
        }
        OperatorCmd::Revoke { name } => {
            let store = open(db).await?;
            store.operator_revoke(now(), &name).await?;
            out!("revoked {name}; its Board sessions ended");
            Ok(())
        }
    }
}

/// A `relay queue set` flag's value: `none` lifts the limit, a whole number sets it (whose
/// bounds the ledger checks).
fn limit_arg(flag: &str, v: Option<String>) -> Result<Option<Option<u32>>, Error> {
    let Some(v) = v else { return Ok(None) };
    if v == "none" {
        return Ok(Some(None));
    }
    v.parse::<u32>().map(|n| Some(Some(n))).map_err(|_| {
        Error::invalid(format!(
            "queue set: --{flag} must be a whole number from 1 to {}, or none to lift it; got \
             {v:?}",
            relay_core::ledger::flow::LIMIT_MAX
        ))
    })
}

/// `relay queue show`'s JSON of one line.
fn queue_line_json(l: &QueueLine) -> Value {
    json!({
        "queue": l.queue,
        "paused": l.paused,
        "max_claimed": l.limits.max_claimed,
        "max_claimed_per_key": l.limits.max_claimed_per_key,
        "claims_per_minute": l.limits.claims_per_minute,
        "claimed": l.claimed,
        "claims_last_minute": l.recent,
        "held": l.held.as_ref().map(ToString::to_string),
        "held_keys": l.held_keys,
        "held_back": l.held_back,
    })
}

/// `relay queue show`'s text: a line per queue, then why each held one waits.
fn print_queue_lines(lines: &[QueueLine]) {
    let limit = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |n| n.to_string());
    out!(
        "{:<20} {:<7} {:>11} {:>8} {:>10} {:>7} {:>9}",
        "QUEUE",
        "PAUSED",
        "MAX_CLAIMED",
        "PER_KEY",
        "PER_MINUTE",
        "CLAIMED",
        "HELD_BACK"
    );
    for l in lines {
        out!(
            "{:<20} {:<7} {:>11} {:>8} {:>10} {:>7} {:>9}",
            esc(&l.queue),
            if l.paused { "yes" } else { "no" },
            limit(l.limits.max_claimed),
            limit(l.limits.max_claimed_per_key),
            limit(l.limits.claims_per_minute),
            l.claimed,
            l.held_back
        );
    }
    for l in lines {
        for why in l.reasons() {
            out!("{}: held back: {}", esc(&l.queue), esc(&why));
        }
    }
}

async fn run_queue(db: &DbOpt, cmd: QueueCmd) -> Result<(), Error> {
    let store = open(db).await?;
    let (queue, paused) = match cmd {
        QueueCmd::Set {
            queue,
            max_claimed,
            max_claimed_per_key,
            claims_per_minute,
        } => {
            let change = LimitsChange {
                max_claimed: limit_arg("max-claimed", max_claimed)?,
                max_claimed_per_key: limit_arg("max-claimed-per-key", max_claimed_per_key)?,
                claims_per_minute: limit_arg("claims-per-minute", claims_per_minute)?,
            };
            if change == LimitsChange::default() {
                return Err(Error::invalid(
                    "queue set: name a limit to change: --max-claimed, --max-claimed-per-key or \
                     --claims-per-minute (a number, or none to lift it)",
                ));
            }
            let op = Op::SetQueueLimits {
                now: now(),
                actor: Actor::cli(),
                queue: queue.clone(),
                change,
            };
            let flow = store.apply(op).await?.flow()?;
            let after = flow
                .limits
                .iter()
                .find(|(q, _)| q == &queue)
                .map(|(_, l)| *l)
                .unwrap_or_default();
            out!("{}: {}", esc(&queue), after.describe());
            return Ok(());
        }
        QueueCmd::Show {
            queue,
            out: JsonOpt { json },
        } => {
            let mut lines = store.queue_lines(now()).await?;
            lines.retain(|l| queue.as_ref().is_none_or(|q| q == &l.queue));
            if json {
                let list: Vec<Value> = lines.iter().map(queue_line_json).collect();
                out!("{}", json!({ "queues": list }));
            } else if lines.is_empty() {
                match &queue {
                    Some(q) => out!("{}: no limits, not paused", esc(q)),
                    None => out!("no queue has limits or is paused"),
                }
            } else {
                print_queue_lines(&lines);
            }
            return Ok(());
        }
        QueueCmd::Pause { queue } => (queue, true),
        QueueCmd::Resume { queue } => (queue, false),
        QueueCmd::Paused(JsonOpt { json }) => {
            let paused = store.apply(Op::PausedQueues).await?.queues()?;
            if json {
                out!("{}", json!({ "paused": paused }));
            } else if paused.is_empty() {
                out!("no paused queues");
            } else {
                for q in &paused {
                    out!("{}", esc(q));
                }
            }
            return Ok(());
        }
    };
    let op = Op::PauseQueue {
        now: now(),
        actor: Actor::cli(),
        queue: queue.clone(),
        paused,
    };
    store.apply(op).await?.queues()?;
    let verb = if paused { "paused" } else { "resumed" };
    out!("{verb} {}", esc(&queue));
    Ok(())
}

pub fn todo(db: &DbOpt, cmd: TodoCmd) -> ExitCode {
    match block(run_todo(db, cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn endpoint_json(e: &Endpoint) -> Value {
    json!({
        "name": e.name,
        "verbs": e.verbs,
        "queues": e.queues,
        "created_at": rfc3339(e.created_at),
        "revoked_at": e.revoked_at.map(rfc3339),
    })
}

async fn run_endpoint(db: &DbOpt, cmd: EndpointCmd) -> Result<(), Error> {
    match cmd {
        EndpointCmd::Create {
            name,
            verbs,
            queues,
        } => {
            let verbs = relay_core::grant::vend(&name, &verbs, queues.as_deref())?;
            let token = relay_server::server::new_bearer_token()?;
            let store = open(db).await?;
            store
                .endpoint_create(
                    now(),
                    NewEndpoint {
                        name,
                        token_hash: TokenHash::of(&token),
                        verbs,
                        queues,
                    },
                )
                .await?;
            out!("{token}");
            Ok(())
        }
        EndpointCmd::List(JsonOpt { json }) => {
            let store = open(db).await?;
            let all = store.endpoint_list().await?;
            if json {
                let list: Vec<Value> = all.iter().map(endpoint_json).collect();
                out!("{}", json!({ "endpoints": list }));
                return Ok(());
            }
            if all.is_empty() {
                out!("no endpoints; vend one with `relay endpoint create NAME --verbs …`");
                return Ok(());
            }
            out!("{:<20} {:<8} {:<24} VERBS", "NAME", "STATE", "QUEUES");
            for e in &all {
                let state = if e.revoked_at.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                let queues = e.queues.as_ref().map_or("*".to_string(), |q| q.join(","));
                out!(
                    "{:<20} {:<8} {:<24} {}",
                    esc(&e.name),
                    state,
                    esc(&queues),
                    esc(&e.verbs.join(","))
                );
            }
            Ok(())
        }
        EndpointCmd::Revoke { name } => {
            let store = open(db).await?;
            let (_, todos) = store.endpoint_revoke(now(), &name).await?;
            out!(
                "revoked {name}; {} claimed todo(s) dead-lettered",
                todos.len()
            );
            Ok(())
        }
    }
}

fn parse_json(flag: &str, text: Option<String>) -> Result<Option<Value>, Error> {
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| {
            Error::invalid(format!(
                "{flag}: not valid JSON ({e}); pass e.g. {flag} '{{\"key\": \"value\"}}'"
            ))
        })
    })
    .transpose()
}

/// Worker- and client-written text for a terminal: controls and bidi overrides made visible
/// (`--json` output stays exact).
fn esc(s: &str) -> std::borrow::Cow<'_, str> {
    relay_core::limits::escape_text(s)
}

fn todo_line(t: &Todo) -> String {
    let retry = match (t.state, t.next_retry_at) {
        (TodoState::Failed, Some(at)) => format!(" (retry at {})", rfc3339(at)),
        (TodoState::Failed, None) => format!(
            " (dead letter: {})",
            t.dead_letter_reason.map_or("?", |r| r.as_str())
        ),
        _ => String::new(),
    };
    format!(
        "{:<26} {:<9} {:<14} {:<16} {}/{}  {}{retry}",
        esc(&t.id),
        t.state.as_str(),
        esc(&t.endpoint),
        esc(&t.queue),
        t.attempt,
        t.max_attempts,
        esc(&t.title)
    )
}

fn todo_json(t: &Todo) -> Value {
    let mut v = serde_json::to_value(TodoOut::from(t)).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("endpoint".into(), json!(t.endpoint));
    }
    v
}

async fn run_todo(db: &DbOpt, cmd: TodoCmd) -> Result<(), Error> {
    match cmd {
        TodoCmd::Add(a) => {
            let payload = parse_json("--payload", a.payload)?;
            let work_order = parse_json("--work-order", a.work_order)?;
            let store = open(db).await?;
            let e = store.endpoint_get(&a.endpoint).await?;
            relay_core::grant::check_owner(
                &a.endpoint,
                e.as_ref()
                    .map(|e| (e.revoked_at.is_some(), e.queues.as_deref())),
                &a.queue,
                ["--endpoint", "--queue"],
            )?;
            let id = relay_server::server::new_todo_id()?;
            let args = AddTodoArgs {
                queue: a.queue,
                title: a.title,
                kind: a.kind,
                source: a.source,
                payload,
                work_order,
                max_attempts: a.max_attempts,
                assignee: a.assignee,
                idempotency_key: a.idempotency_key,
                deadline_seconds: a.deadline_seconds,
                max_same_failures: a.max_same_failures,
                max_input_requests: a.max_input_requests,
                answer_within_seconds: a.answer_within_seconds,
                budget: Some(BudgetArg {
                    cost_usd: a.budget_usd,
                    tokens: a.budget_tokens,
                }),
                priority: a.priority,
                run_at: a.run_at,
                delay_seconds: a.delay_seconds,
                concurrency_key: a.concurrency_key,
            };
            // The same conversion as the add_todo tool; its errors name the wire's arguments,
            // which this command spells as flags.
            let new = args.into_new_todo("todo add", id, None).map_err(|e| {
                let mut message = e.message;
                for (arg, flag) in [
                    ("budget.cost_usd", "--budget-usd"),
                    ("budget.tokens", "--budget-tokens"),
                    ("run_at", "--run-at"),
                ] {
                    message = message.replace(arg, flag);
                }
                Error::invalid(message)
            })?;
            let add = Op::AddTodo {
                now: now(),
                endpoint: a.endpoint,
                new,
            };
            let t = store.apply(add).await?.todo()?;
            out!("{}", t.id);
            Ok(())
        }
        TodoCmd::List {
            endpoint,
            queue,
            state,
            limit,
            out: JsonOpt { json },
        } => {
            let state = state
                .map(|s| {
                    TodoState::parse(&s).ok_or_else(|| {
                        Error::invalid(format!(
                            "--state {s:?}: choose pending, claimed, failed, done or canceled"
                        ))
                    })
                })
                .transpose()?;
            let store = open(db).await?;
            let actor = endpoint.map_or(Actor::cli(), Actor::endpoint);
            let filter = TodoFilter {
                queues: queue.map(|q| vec![q]),
                state,
                after: None,
                limit,
            };
            let todos = store
                .apply(Op::ListTodos { actor, filter })
                .await?
                .todos()?;
            if json {
                let list: Vec<Value> = todos.iter().map(todo_json).collect();
                out!("{}", json!({ "todos": list }));
                return Ok(());
            }
            if todos.is_empty() {
                out!("no todos");
                return Ok(());
            }
            out!(
                "{:<26} {:<9} {:<14} {:<16} {:<5} TITLE",
                "ID",
                "STATE",
                "ENDPOINT",
                "QUEUE",
                "TRIES"
            );
            for t in &todos {
                out!("{}", todo_line(t));
            }
            Ok(())
        }
        TodoCmd::Show {
            id,
            attempts,
            out: JsonOpt { json },
        } => {
            let store = open(db).await?;
            let get = Op::GetTodo {
                actor: Actor::cli(),
                id: id.clone(),
                attempts_limit: attempts,
            };
            let view = store.apply(get).await.and_then(Answer::view).map_err(|e| {
                if e.code == relay_core::ErrorCode::NotFound {
                    Error::not_found(format!(
                        "todo {id}: no such todo; `relay todo list` shows them"
                    ))
                } else {
                    e
                }
            })?;
            if json {
                let mut v = serde_json::to_value(GetTodoOut::from(&view)).unwrap_or_default();
                if let Some(t) = v.get_mut("todo").and_then(Value::as_object_mut) {
                    t.insert("endpoint".into(), json!(view.todo.endpoint));
                }
                out!("{v}");
                return Ok(());
            }
            let t = &view.todo;
            out!("{}  {}", esc(&t.id), esc(&t.title));
            out!(
                "  state {}{}  endpoint {}  queue {}  attempt {}/{}  attempts ever {}",
                t.state,
                match t.dead_letter_reason {
                    Some(r) if t.dead_letter() => format!(" (dead letter: {r})"),
                    _ => String::new(),
                },
                esc(&t.endpoint),
                esc(&t.queue),
                t.attempt,
                t.max_attempts,
                t.attempts_total
            );
            if let Some(at) = t.next_retry_at {
                out!("  next retry at {}", rfc3339(at));
            }
            if let Some(at) = t.deadline_at {
                out!("  deadline {}", rfc3339(at));
            }
            if let Some(k) = &t.idempotency_key {
                out!("  idempotency key {}", esc(k));
            }
            if !t.spent.is_zero() || !t.budget.is_none() {
                out!(
                    "  spent {} of budget {}",
                    t.spent.describe(),
                    t.budget.describe()
                );
            }
            if t.state == relay_core::ledger::TodoState::InputRequired {
                let asked = view.attempts.first().and_then(|a| a.question.as_ref());
                out!(
                    "  waiting for an answer since {}{} (relay todo answer {} --text …): {}",
                    rfc3339(t.updated_at),
                    t.asking
                        .answer_due_at
                        .map_or(String::new(), |d| format!(", due by {}", rfc3339(d))),
                    esc(&t.id),
                    asked.map_or(String::new(), |q| esc(&q.text).into_owned())
                );
            }
            if let Some(text) = relay_core::ledger::attention(&view) {
                out!("  attention: {}", esc(&text));
            }
            if let Some(p) = &t.payload {
                out!("  payload {}", esc(&p.to_string()));
            }
            if let Some(r) = &t.result {
                out!("  result {}", esc(&r.to_string()));
            }
            out!("  attempts (newest first):");
            if view.attempts.is_empty() {
                out!("    none yet");
            }
            for a in &view.attempts {
                let end = match (a.ended_at, a.outcome, a.disposition) {
                    (Some(at), Some(o), Some(d)) => {
                        format!(
                            "{o} → {d} at {}{}",
                            rfc3339(at),
                            if a.died() { " (died)" } else { "" }
                        )
                    }
                    _ => format!("open, lease until {}", rfc3339(a.lease_expires_at)),
                };
                out!(
                    "    #{} (try {}) by {}{} claimed {}: {end}",
                    a.seq,
                    a.attempt,
                    esc(&a.owner),
                    a.claimant
                        .as_ref()
                        .map_or(String::new(), |c| format!(" [{}]", esc(c))),
                    rfc3339(a.claimed_at)
                );
                if let Some(s) = &a.summary {
                    out!("      summary: {}", esc(s));
                }
                if let Some(op) = &a.closed_by {
                    out!("      closed by operator: {}", esc(op));
                }
                if let Some(art) = &a.artifact {
                    out!("      artifact: {}", esc(art));
                }
                if let Some(sig) = &a.failure_signature {
                    out!("      failure signature: {}", esc(sig));
                }
                if let Some(q) = &a.question {
                    out!("      asked: {}", esc(&q.text));
                    if let (Some(ans), Some(at), Some(by)) =
                        (&q.answer, q.answered_at, &q.answered_by)
                    {
                        out!(
                            "      answered {} by {}: {}",
                            rfc3339(at),
                            esc(by),
                            esc(ans)
                        );
                    }
                }
                if !a.usage.is_zero() {
                    out!("      spent {}", a.usage.describe());
                }
                for l in &a.late_reports {
                    out!(
                        "      late report at {}: {}{}",
                        rfc3339(l.at),
                        l.outcome,
                        l.summary
                            .as_ref()
                            .map_or(String::new(), |s| format!(": {}", esc(s)))
                    );
                }
                if a.late_reports_total as usize > a.late_reports.len() {
                    out!(
                        "      ({} more late reports, counted only)",
                        a.late_reports_total as usize - a.late_reports.len()
                    );
                }
            }
            if view.attempts_pruned > 0 {
                out!("  ({} older attempts pruned)", view.attempts_pruned);
            }
            Ok(())
        }
        TodoCmd::Retry { id } => {
            let store = open(db).await?;
            let (now, actor) = (now(), Actor::cli());
            let t = store.apply(Op::Retry { now, actor, id }).await?.todo()?;
            out!("{}: {}", esc(&t.id), t.state);
            Ok(())
        }
        TodoCmd::Cancel { id } => {
            let store = open(db).await?;
            let (now, actor) = (now(), Actor::cli());
            let t = store.apply(Op::Cancel { now, actor, id }).await?.todo()?;
            out!("{}: {}", esc(&t.id), t.state);
            Ok(())
        }
        TodoCmd::Answer { id, text } => {
            let store = open(db).await?;
            let (now, actor) = (now(), Actor::cli());
            let op = Op::AnswerTodo {
                now,
                actor,
                id,
                answer: text,
                key: None,
                seq: None,
            };
            let t = store.apply(op).await?.todo()?;
            out!("{}: {}", esc(&t.id), t.state);
            Ok(())
        }
    }
}
