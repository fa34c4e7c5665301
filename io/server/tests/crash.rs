//! Group commit under `kill -9`: a child process (this test binary, re-run as `child`) drives the
//! SQLite store (and, when `RELAY_TEST_POSTGRES` names a server, the Postgres store with its
//! batch writers, in a schema of its own) with 8 concurrent callers (add → claim_next → complete, over and over) and
//! prints one line for every operation the store acknowledged. The parent kills it with SIGKILL
//! once it has seen a number of acknowledgements (wherever the writer is: between batches or
//! inside one), reopens the file, and checks that every acknowledged operation is there and that
//! no todo is half-changed (a claimed todo has exactly one open attempt, a done or pending one
//! none, and `attempts_total` counts its attempt rows). Three rounds on the same file, each
//! child going on from what the last one left.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use relay_core::ledger::{
    Actor, Answer, ClaimOpts, LedgerConfig, NewTodo, Op, Report, TodoFilter, TodoState, TokenHash,
};
use relay_core::time::SECOND;
use relay_server::store::{PgStore, Store};

#[path = "support/pg_schema.rs"]
mod pg_schema;

const CHILD_ENV: &str = "RELAY_CRASH_TEST_DB";
const ENDPOINT: &str = "crash";
const CALLERS: usize = 8;
/// Acknowledgements the parent waits for before each kill.
const KILL_AFTER: usize = 600;
const T0: u64 = 1_790_000_000_000;

/// The store a target names: `sqlite:PATH`, or `pgschema:NAME` (a schema of the database
/// `RELAY_TEST_POSTGRES` names).
async fn open(target: &str) -> Store {
    match target.strip_prefix("pgschema:") {
        Some(schema) => {
            let url = std::env::var("RELAY_TEST_POSTGRES").expect("RELAY_TEST_POSTGRES");
            Store::Postgres(
                PgStore::open_in_schema(&url, schema, LedgerConfig::default())
                    .await
                    .unwrap(),
            )
        }
        None => Store::open(target, LedgerConfig::default()).await.unwrap(),
    }
}

/// The child's side: runs only when the parent starts this binary with [`CHILD_ENV`] set.
#[test]
fn child() {
    let Ok(target) = std::env::var(CHILD_ENV) else {
        return;
    };
    let round: u64 = std::env::var("RELAY_CRASH_TEST_ROUND")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = open(&target).await;
        let mut tasks = Vec::new();
        for w in 0..CALLERS {
            let store = store.clone();
            tasks.push(tokio::spawn(async move { drive(&store, round, w).await }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// One caller of the child: forever add a todo, claim the next one, complete it.
async fn drive(store: &Store, round: u64, w: usize) {
    let actor = Actor::endpoint(ENDPOINT);
    // Each round's clock starts past the last one's: times only move forward across restarts.
    let start = T0 + round * 1_000 * SECOND;
    for i in 0u64.. {
        let now = start + i;
        let id = format!("r{round}-w{w}-{i:06}");
        let add = Op::AddTodo {
            now,
            endpoint: ENDPOINT.into(),
            new: NewTodo {
                id: id.clone(),
                queue: "q".into(),
                title: "crash".into(),
                ..NewTodo::default()
            },
        };
        store.apply(add).await.expect("add_todo");
        ack("add", &id);
        let token = TokenHash::of(&format!("tok-{id}"));
        let claim = Op::ClaimNext {
            now,
            actor: actor.clone(),
            queues: Some(vec!["q".into()]),
            opts: ClaimOpts::fenced(3_600 * SECOND, token),
        };
        let Some(c) = store
            .apply(claim)
            .await
            .and_then(Answer::next)
            .expect("claim_next")
        else {
            continue;
        };
        ack("claim", &c.todo.id);
        let done = Op::Complete {
            now,
            actor: actor.clone(),
            id: c.todo.id.clone(),
            report: Report {
                token_hash: Some(token),
                ..Report::default()
            },
        };
        store.apply(done).await.expect("complete");
        ack("done", &c.todo.id);
    }
}

/// One acknowledged operation, written straight to the pipe (not through the test harness's
/// capture) before the caller goes on.
fn ack(what: &str, id: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ACK {what} {id}").unwrap();
    out.flush().unwrap();
}

#[derive(Default)]
struct Acked {
    /// For each todo, the furthest acknowledged step: 0 added, 1 claimed, 2 done.
    step: BTreeMap<String, u8>,
}

impl Acked {
    fn record(&mut self, line: &str) {
        let mut parts = line.split(' ');
        let (Some("ACK"), Some(what), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
            return;
        };
        let step = match what {
            "add" => 0,
            "claim" => 1,
            _ => 2,
        };
        let e = self.step.entry(id.to_string()).or_insert(step);
        *e = (*e).max(step);
    }
}

#[test]
fn every_acknowledged_operation_survives_kill_9_of_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    kill_rounds(&format!("sqlite:{}", dir.path().join("crash.db").display()));
}

/// The same on Postgres: the child's batch writers die with it, a batch in flight is rolled
/// back by the server, and every batch it acknowledged had committed.
#[test]
fn every_acknowledged_operation_survives_kill_9_of_the_postgres_writers() {
    let url = match std::env::var("RELAY_TEST_POSTGRES") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            assert!(
                std::env::var("RELAY_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "RELAY_REQUIRE_POSTGRES=1 but RELAY_TEST_POSTGRES is unset"
            );
            eprintln!("skipped (set RELAY_TEST_POSTGRES=postgres://… to run it)");
            return;
        }
    };
    let schema = format!("crash_{}", std::process::id());
    // Dropped however the test ends.
    struct DropSchema(String, String);
    impl Drop for DropSchema {
        fn drop(&mut self) {
            pg_schema::drop_schema(self.0.clone(), self.1.clone());
        }
    }
    let _drop = DropSchema(url, schema.clone());
    kill_rounds(&format!("pgschema:{schema}"));
}

/// Three rounds of a child driving the store `target` names, killed once it acknowledged
/// [`KILL_AFTER`] operations, then [`check`].
fn kill_rounds(target: &str) {
    let mut acked = Acked::default();
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, target)
            .env("RELAY_CRASH_TEST_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = 0;
        while seen < KILL_AFTER {
            let line = lines
                .next()
                .expect("the child stopped before the kill")
                .unwrap();
            if line.starts_with("ACK ") {
                acked.record(&line);
                seen += 1;
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // What the child wrote before it died was acknowledged too.
        for line in lines.map_while(Result::ok) {
            acked.record(&line);
        }
        check(target, &acked);
    }
}

/// Reopens the store and holds it to every acknowledgement, and to whole changes only.
fn check(target: &str, acked: &Acked) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = open(target).await;
        let list = Op::ListTodos {
            actor: Actor::endpoint(ENDPOINT),
            filter: TodoFilter {
                queues: None,
                state: None,
                after: None,
                limit: usize::MAX,
            },
        };
        let todos = store.apply(list).await.and_then(Answer::todos).unwrap();
        let by_id: BTreeMap<_, _> = todos.iter().map(|t| (t.id.clone(), t)).collect();
        for (id, step) in &acked.step {
            let t = by_id
                .get(id)
                .unwrap_or_else(|| panic!("acknowledged add of {id} lost"));
            match step {
                1 => assert!(
                    matches!(t.state, TodoState::Claimed | TodoState::Done),
                    "acknowledged claim of {id} lost: {:?}",
                    t.state
                ),
                2 => assert_eq!(
                    t.state,
                    TodoState::Done,
                    "acknowledged complete of {id} lost"
                ),
                _ => {}
            }
        }
        for t in &todos {
            let get = Op::GetTodo {
                actor: Actor::cli(),
                id: t.id.clone(),
                attempts_limit: usize::MAX,
            };
            let v = store.apply(get).await.and_then(Answer::view).unwrap();
            // The todo as read with its attempts, in one snapshot: on Postgres the killed
            // child's last COMMIT may still land after the list above (the server had it in
            // its socket), so the list's row can be older than these attempts.
            let t = &v.todo;
            let open = v.attempts.iter().filter(|a| a.ended_at.is_none()).count();
            let want = usize::from(t.state == TodoState::Claimed);
            assert_eq!(
                open, want,
                "{}: {:?} with {open} open attempts",
                t.id, t.state
            );
            assert_eq!(
                v.attempts.len(),
                t.attempts_total as usize,
                "{}: attempts_total does not count its attempts",
                t.id
            );
        }
    });
}
