//! The history checker of the fault tests (tests/multi_server.rs, tests/db_faults.rs): the
//! acknowledged events the clients recorded and the database's rows at the end, checked against
//! the ledger's promises, and (tests/multi_server.rs) a key-limited queue's attempts against its
//! `max_claimed_per_key 1`. Each violation is one line; tests/multi_server.rs shows the checker
//! catches each kind.

use std::collections::BTreeMap;

use relay_core::Millis;
use relay_core::ledger::{LeaseBreach, Outcome, lease_breach};

/// One acknowledged event of the history (unacknowledged ones are not evidence of anything).
#[derive(Clone, Debug)]
pub enum Event {
    Added {
        id: String,
    },
    /// A claim or heartbeat answered: the lease of attempt `seq` runs at least to `until`.
    Leased {
        id: String,
        seq: u32,
        until: u64,
    },
    /// A complete or fail answered ok for attempt `seq`.
    Reported {
        id: String,
        seq: u32,
        outcome: &'static str,
    },
}

/// An attempt as the database holds it at the end.
#[derive(Debug)]
pub struct Row {
    pub claimed_at: i64,
    pub lease_expires_at: i64,
    pub ended_at: Option<i64>,
    pub outcome: Option<String>,
    /// The operator who closed it, when one did (not its holder: no lease applies).
    pub closed_by: Option<String>,
}

/// Every todo's state at the end, by id.
pub type Todos = BTreeMap<String, String>;
/// Every attempt at the end, by todo id and seq.
pub type Attempts = BTreeMap<(String, u32), Row>;

/// The checks; each violation is one line:
///
/// - no acknowledged add lost;
/// - no todo completed twice;
/// - each close kept its lease, by the database's clock (`relay_core::ledger::lease_breach`,
///   the rule the simulators hold too: no write accepted under a stale token, no attempt dead
///   before its lease ran out), and every acknowledged report is the one that closed its attempt;
/// - at most one open attempt per todo (attempts of a todo never overlap);
/// - every attempt closed, and every todo done or failed (the caller drained the queue first);
/// - every lease at least as long as granted, by the database's clock (no takeover, reap or next
///   attempt before the expiry any claim or heartbeat answered).
pub fn check(events: &[Event], todos: &Todos, attempts: &Attempts) -> Vec<String> {
    let mut bad = Vec::new();
    let mut reported: BTreeMap<(String, u32), &str> = BTreeMap::new();
    for e in events {
        match e {
            Event::Added { id } => {
                if !todos.contains_key(id) {
                    bad.push(format!("acknowledged add lost: {id}"));
                }
            }
            Event::Leased { id, seq, until } => {
                let Some(a) = attempts.get(&(id.clone(), *seq)) else {
                    bad.push(format!("{id}#{seq}: a granted lease's attempt is missing"));
                    continue;
                };
                let until = i64::try_from(*until).unwrap();
                let died = matches!(a.outcome.as_deref(), Some("lease_expired" | "reaped"));
                if died && a.ended_at.is_some_and(|t| t < until) {
                    bad.push(format!(
                        "{id}#{seq}: died at {:?}, before the granted {until}",
                        a.ended_at
                    ));
                }
                if let Some(next) = attempts.get(&(id.clone(), seq + 1))
                    && next.claimed_at < until
                {
                    bad.push(format!(
                        "{id}#{}: claimed at {} inside #{seq}'s granted lease (to {until})",
                        seq + 1,
                        next.claimed_at
                    ));
                }
            }
            Event::Reported { id, seq, outcome } => {
                if let Some(prev) = reported.insert((id.clone(), *seq), outcome)
                    && prev != *outcome
                {
                    bad.push(format!(
                        "{id}#{seq}: acknowledged as {prev} and as {outcome}"
                    ));
                }
                let a = attempts.get(&(id.clone(), *seq));
                if a.and_then(|a| a.outcome.as_deref()) != Some(*outcome) {
                    bad.push(format!(
                        "{id}#{seq}: acknowledged {outcome}, but the attempt closed as {:?}",
                        a.map(|a| &a.outcome)
                    ));
                }
            }
        }
    }
    let mut completed: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_todo: BTreeMap<&str, Vec<(u32, &Row)>> = BTreeMap::new();
    for ((id, seq), a) in attempts {
        by_todo.entry(id).or_default().push((*seq, a));
        let (Some(end), Some(o)) = (a.ended_at, a.outcome.as_deref()) else {
            bad.push(format!("{id}#{seq}: never closed"));
            continue;
        };
        if o == "completed" {
            *completed.entry(id).or_default() += 1;
        }
        let Some(outcome) = Outcome::parse(o) else {
            bad.push(format!("{id}#{seq}: closed as {o:?}, not an outcome"));
            continue;
        };
        let millis = |at: i64| Millis::try_from(at).unwrap_or(0);
        let expiry = a.lease_expires_at;
        match lease_breach(
            outcome,
            (millis(a.claimed_at), millis(end)),
            millis(expiry),
            a.closed_by.is_some(),
        ) {
            Some(LeaseBreach::StaleWrite) => bad.push(format!(
                "{id}#{seq}: {o} at {end}, at or after its lease expired ({expiry}): a stale \
                 token's write was accepted"
            )),
            Some(LeaseBreach::DiedEarly) => bad.push(format!(
                "{id}#{seq}: died at {end}, before its lease expired ({expiry})"
            )),
            None => {}
        }
    }
    for (id, n) in completed {
        if n > 1 {
            bad.push(format!("{id}: completed {n} times"));
        }
    }
    for (id, mut list) in by_todo {
        list.sort_by_key(|(seq, _)| *seq);
        for w in list.windows(2) {
            let ((s0, a0), (s1, a1)) = (w[0], w[1]);
            if a0.ended_at.is_none_or(|end| a1.claimed_at < end) {
                bad.push(format!("{id}: attempts #{s0} and #{s1} were open at once"));
            }
        }
    }
    for (id, state) in todos {
        if !matches!(state.as_str(), "done" | "failed") {
            bad.push(format!("{id}: left {state} after the drain"));
        }
    }
    bad
}

/// The concurrency key of each todo with one in a queue with `max_claimed_per_key 1`, by id.
pub type Keys = BTreeMap<String, String>;

/// Two attempts of todos with one key (in a queue with `max_claimed_per_key 1`) open at once: by
/// how many milliseconds their `[claimed_at, ended_at)` overlap (an attempt never closed is open
/// to the end), and a line that names them.
#[derive(Debug)]
pub struct Overlap {
    pub ms: i64,
    pub line: String,
}

/// Each attempt of a keyed todo that was claimed while an earlier attempt with its key was still
/// open, by the database's clock. A lapsed lease still counts as claimed until its attempt
/// closes, so the intervals run from `claimed_at` to `ended_at`, whatever the lease said; one
/// claimed at the instant another ended does not overlap it. The caller judges how much overlap
/// its clocks allow (see tests/multi_server.rs).
pub fn key_overlaps(keys: &Keys, attempts: &Attempts) -> Vec<Overlap> {
    let mut by_key: BTreeMap<&str, Vec<(i64, i64, &str, u32)>> = BTreeMap::new();
    for ((id, seq), a) in attempts {
        if let Some(key) = keys.get(id) {
            let end = a.ended_at.unwrap_or(i64::MAX);
            by_key
                .entry(key)
                .or_default()
                .push((a.claimed_at, end, id, *seq));
        }
    }
    let mut out = Vec::new();
    for (key, mut list) in by_key {
        list.sort_unstable();
        // The attempt open longest among those claimed so far.
        let mut open: Option<(i64, &str, u32)> = None;
        for (start, end, id, seq) in list {
            if let Some((until, oid, oseq)) = open
                && start < until
            {
                out.push(Overlap {
                    ms: until.min(end).saturating_sub(start),
                    line: format!(
                        "key {key:?}: {id}#{seq} claimed at {start} while {oid}#{oseq} was open \
                         (to {until})"
                    ),
                });
            }
            if open.is_none_or(|(until, _, _)| end > until) {
                open = Some((end, id, seq));
            }
        }
    }
    out
}

/// The concurrency key of each todo with one in `queue` (`schema`-qualified).
pub async fn read_keys(db: &tokio_postgres::Client, schema: &str, queue: &str) -> Keys {
    db.query(
        &format!(
            "SELECT id, concurrency_key FROM {schema}.todos \
             WHERE queue = $1 AND concurrency_key IS NOT NULL"
        ),
        &[&queue],
    )
    .await
    .expect("read the keys")
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Every todo's state and every attempt, as the database holds them (`schema`-qualified).
pub async fn read_ledger(db: &tokio_postgres::Client, schema: &str) -> (Todos, Attempts) {
    let todos: Todos = db
        .query(&format!("SELECT id, state FROM {schema}.todos"), &[])
        .await
        .expect("read the todos")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let attempts: Attempts = db
        .query(
            &format!(
                "SELECT todo_id, seq, claimed_at, lease_expires_at, ended_at, outcome, \
                 closed_by FROM {schema}.todo_attempts"
            ),
            &[],
        )
        .await
        .expect("read the attempts")
        .iter()
        .map(|r| {
            let seq: i32 = r.get(1);
            (
                (r.get(0), u32::try_from(seq).expect("a positive seq")),
                Row {
                    claimed_at: r.get(2),
                    lease_expires_at: r.get(3),
                    ended_at: r.get(4),
                    outcome: r.get(5),
                    closed_by: r.get(6),
                },
            )
        })
        .collect();
    (todos, attempts)
}
