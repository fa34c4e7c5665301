//! The statements both dialects share, built once from the column lists.

use relay_core::Error;
use relay_core::ledger::rows::ClaimQuery;
use relay_core::ledger::{Actor, Newest, Sweep, TodoFilter};

use super::cols::{
    ATTEMPT_AMENDED, ATTEMPT_COLS, ATTEMPT_REWRITTEN, ENDPOINT_COLS, TODO_COLS, Val, label,
    placeholders, select_list, set_list, time, todo_updated,
};
use crate::store::types::{PendingChange, PendingPage};

/// The statements both backends share, written once; `mark` is the dialect's parameter sign
/// (`?` for SQLite's `?1`, `$` for Postgres's `$1`).
pub(crate) struct Shared {
    mark: char,
    /// `SELECT <todo columns> FROM todos t`, to which each query adds its WHERE.
    pub todo_select: String,
    /// The todo's open attempt.
    pub open_attempt: String,
    pub insert_todo: String,
    pub insert_attempt: String,
    /// Attempts newest first, all or closed only. Two fixed statements, not a boolean
    /// parameter: a planner cannot see through one, and SQLite re-prepares such a query on
    /// every use.
    pub attempts: String,
    pub closed_attempts: String,
    /// The columns of [`todo_update`].
    ///
    /// [`todo_update`]: super::cols::todo_update
    pub update_todo: String,
    /// The columns of [`attempt_update`], while the attempt is open.
    ///
    /// [`attempt_update`]: super::cols::attempt_update
    pub update_open_attempt: String,
    /// Closed attempts of a todo at or below a seq.
    pub prune: String,
    /// What may still change on a closed attempt (late reports, the answer), and nothing else.
    pub update_amend: String,
    /// The endpoint's todo with an idempotency key.
    pub by_key: String,
    pub insert_endpoint: String,
}

/// The doorbell scan's query: pending rows numbered in (`after`, `horizon`], only the columns a
/// ring needs, through the partial index `todos_change`.
pub(crate) fn pending_since(mark: char) -> String {
    format!(
        "SELECT id, endpoint, queue, attempts_total, change_seq FROM todos \
         WHERE state = 'pending' AND change_seq > {mark}1 AND change_seq <= {mark}2 \
         ORDER BY change_seq LIMIT {mark}3"
    )
}

/// The page of a scan that read `changes` (at most `limit`) below `horizon`: a full page resumes
/// after its last row, a short one has seen everything up to the horizon.
pub(crate) fn pending_page(changes: Vec<PendingChange>, limit: usize, horizon: u64) -> PendingPage {
    let watermark = match changes.last() {
        Some(last) if changes.len() >= limit => last.change_seq,
        _ => horizon,
    };
    PendingPage { changes, watermark }
}

/// The columns Postgres derives from a todo's own on every write (migration 0010), so that
/// its indexes need no column a heartbeat changes and a heartbeat rewrites the row in place (a
/// HOT update: no new index entry), each with its value as SQL:
/// - `lease_due_at`, the mark the reaper searches: never later than the lease. A write that
///   continues one claim (claimed before and after, the same attempt: a heartbeat) keeps the
///   mark, or lowers it to a lease that shrank; any other write sets it to the lease. The
///   reaper moves the marks of leases still running up to their leases.
/// - `finished_at`, what retention searches: `updated_at` once the todo is finished.
///
/// `old` is the row before the write (none for an insert); `new` gives a column's new value.
/// Set by the statements rather than by a trigger or a generated column: Postgres prepares
/// those expressions again at every statement, these are planned once.
pub(crate) fn pg_derived(
    old: Option<&str>,
    new: impl Fn(&str) -> String,
) -> [(&'static str, String); 2] {
    // Typed, as a parameter used twice must be typed alike at each use.
    let (state, lease) = (
        format!("{}::text", new("state")),
        format!("{}::bigint", new("lease_expires_at")),
    );
    let due = match old {
        Some(o) => format!(
            "CASE WHEN {o}.state = 'claimed' AND {state} = 'claimed' \
             AND {o}.attempts_total = {}::integer THEN least({o}.lease_due_at, {lease}) \
             ELSE {lease} END",
            new("attempts_total")
        ),
        None => lease,
    };
    let finished = format!(
        "CASE WHEN {state} IN ({}) THEN {}::bigint END",
        FINISHED
            .iter()
            .map(|s| format!("'{s}'"))
            .collect::<Vec<_>>()
            .join(", "),
        new("updated_at")
    );
    [("lease_due_at", due), ("finished_at", finished)]
}

/// `, col = value, …` of [`pg_derived`], to append to an UPDATE's SET list.
pub(crate) fn pg_derived_set(old: &str, new: impl Fn(&str) -> String) -> String {
    pg_derived(Some(old), new)
        .iter()
        .map(|(c, v)| format!(", {c} = {v}"))
        .collect()
}

impl Shared {
    pub(crate) fn new(mark: char) -> Shared {
        let pg = mark == '$';
        let attempts = |filter: &str| {
            format!(
                "SELECT {} FROM todo_attempts a WHERE a.todo_id = {mark}1{filter} \
                 ORDER BY a.seq DESC LIMIT {mark}2",
                select_list("a", &ATTEMPT_COLS)
            )
        };
        Shared {
            mark,
            todo_select: format!("SELECT {} FROM todos t", select_list("t", &TODO_COLS)),
            open_attempt: format!(
                "SELECT {} FROM todo_attempts a WHERE a.todo_id = {mark}1 AND a.ended_at IS NULL",
                select_list("a", &ATTEMPT_COLS)
            ),
            // No conflict target: the id and the endpoint's idempotency key are both unique.
            insert_todo: {
                let (mut cols, mut vals) =
                    (TODO_COLS.join(", "), placeholders(mark, TODO_COLS.len()));
                if pg {
                    for (c, v) in pg_derived(None, |c| format!("${}", todo_col(c) + 1)) {
                        cols.push_str(&format!(", {c}"));
                        vals.push_str(&format!(", {v}"));
                    }
                }
                format!("INSERT INTO todos ({cols}) VALUES ({vals}) ON CONFLICT DO NOTHING")
            },
            insert_attempt: format!(
                "INSERT INTO todo_attempts ({}) VALUES ({})",
                ATTEMPT_COLS.join(", "),
                placeholders(mark, ATTEMPT_COLS.len())
            ),
            attempts: attempts(""),
            closed_attempts: attempts(" AND a.ended_at IS NOT NULL"),
            update_todo: format!(
                "UPDATE todos SET {}{} WHERE id = {mark}1",
                set_list(
                    mark,
                    &todo_updated().map(|i| TODO_COLS[i]).collect::<Vec<_>>(),
                    2
                ),
                if pg {
                    pg_derived_set("todos", |col| {
                        let at = todo_updated().position(|i| TODO_COLS[i] == col);
                        format!("${}", at.map_or(0, |i| i + 2))
                    })
                } else {
                    String::new()
                }
            ),
            update_open_attempt: format!(
                "UPDATE todo_attempts SET {} \
                 WHERE todo_id = {mark}1 AND seq = {mark}2 AND ended_at IS NULL",
                set_list(mark, &ATTEMPT_COLS[ATTEMPT_REWRITTEN], 3)
            ),
            prune: format!(
                "DELETE FROM todo_attempts WHERE todo_id = {mark}1 AND seq <= {mark}2 \
                 AND ended_at IS NOT NULL"
            ),
            update_amend: format!(
                "UPDATE todo_attempts SET {} \
                 WHERE todo_id = {mark}1 AND seq = {mark}2 AND ended_at IS NOT NULL",
                set_list(mark, &ATTEMPT_COLS[ATTEMPT_AMENDED], 3)
            ),
            by_key: format!(
                "SELECT {} FROM todos t WHERE t.endpoint = {mark}1 AND t.idempotency_key = {mark}2",
                select_list("t", &TODO_COLS)
            ),
            insert_endpoint: format!(
                "INSERT INTO endpoints ({ENDPOINT_COLS}) VALUES ({}) ON CONFLICT (name) DO NOTHING",
                placeholders(mark, 6)
            ),
        }
    }
}

impl Shared {
    /// A statement's parameters, in this dialect.
    pub(super) fn query(&self) -> Query {
        Query::new(self.mark)
    }

    /// The walk's query for the first `limit` claimable rows, in claim order, and its
    /// parameters, then `lock` (the dialect's lock clause): `limit` 1 is `claim_next`'s,
    /// and Postgres' batch reads several at once. `now` is the first value bound.
    pub(crate) fn next_claimable_n(
        &self,
        c: &ClaimQuery<'_>,
        limit: usize,
        lock: &str,
    ) -> Result<(String, Vec<Val>), Error> {
        let mut q = Query::new(self.mark);
        let which = self.claimable_where(&mut q, c, Keys::NotHeld)?;
        let sql = format!(
            "{} WHERE {which} ORDER BY {CLAIM_ORDER} LIMIT {limit}{lock}",
            self.todo_select
        );
        Ok((sql, q.vals))
    }

    /// What a claim's rows must satisfy, `now` bound first: mirrors transition::claimable
    /// (scope, queue filter, assignee, deadline, then pending and due (run_at), or claimed with
    /// a lapsed lease and attempts left, or failed with the retry due and attempts left) and
    /// flow::Holds::holds (a queue held whole, paused, full or at its rate, is skipped; the
    /// todos of held keys as `keys` says).
    pub(super) fn claimable_where(
        &self,
        q: &mut Query,
        c: &ClaimQuery<'_>,
        keys: Keys<'_>,
    ) -> Result<String, Error> {
        let ClaimQuery {
            op,
            now,
            actor,
            queues,
            holds,
        } = *c;
        let now = q.bind(time(op, now)?);
        let owner = q.bind_text(actor.owner());
        let scope = match actor {
            Actor::Endpoint { endpoint, .. } => format!("t.endpoint = {}", q.bind_text(endpoint)),
            Actor::Operator { .. } => q.always().into(),
        };
        let mut which = vec![scope];
        if let Some(qs) = queues {
            which.push(q.queue_in(qs));
        }
        if !holds.queues.is_empty() {
            which.push(format!("NOT ({})", q.queue_in(&holds.queues)));
        }
        match keys {
            Keys::NotHeld if !holds.keys.is_empty() => which.push(format!(
                "(t.concurrency_key IS NULL OR NOT ({}))",
                q.key_in(&holds.keys)
            )),
            Keys::NotHeld => {}
            Keys::NoneIn(lane) => which.push(format!(
                "t.concurrency_key IS NULL AND t.queue = {lane}.queue"
            )),
            Keys::Of(head) => which.push(format!(
                "t.concurrency_key IS NOT NULL AND t.queue = {head}.queue \
                 AND t.concurrency_key = {head}.concurrency_key"
            )),
        }
        which.push(format!(
            "(t.assignee IS NULL OR t.assignee = {owner})
               AND (t.deadline_at IS NULL OR t.deadline_at > {now})
               AND {live} -- lets the partial FIFO indexes serve
               AND ((t.state = 'pending' AND (t.run_at IS NULL OR t.run_at <= {now}))
                    OR (t.state = 'claimed' AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= {now})
                        AND t.attempt < t.max_attempts)
                    OR (t.state = 'failed' AND t.next_retry_at <= {now} AND t.attempt < t.max_attempts))",
            live = q.one_of("t.state", LIVE)
        ));
        Ok(which.join(" AND "))
    }

    /// A todo's attempts newest first, as `which` says.
    pub(crate) fn attempts_query(&self, id: &str, which: Newest) -> (&str, Vec<Val>) {
        let sql = if which.closed_only {
            &self.closed_attempts
        } else {
            &self.attempts
        };
        let limit = Val::Big(Some(i64::try_from(which.limit).unwrap_or(i64::MAX)));
        (sql, vec![label(Some(id)), limit])
    }

    /// `list_todos`' query and parameters.
    pub(crate) fn list(&self, actor: &Actor, filter: &TodoFilter) -> (String, Vec<Val>) {
        let mut q = Query::new(self.mark);
        let mut clauses = Vec::new();
        if let Actor::Endpoint { endpoint, .. } = actor {
            clauses.push(format!("t.endpoint = {}", q.bind(label(Some(endpoint)))));
        }
        if let Some(s) = filter.state {
            clauses.push(format!("t.state = {}", q.bind(label(Some(s.as_str())))));
        }
        if let Some(qs) = &filter.queues {
            clauses.push(q.queue_in(qs));
        }
        if let Some((at, id)) = &filter.after {
            // A row value, so that the (created_at, id) order's index can seek to it.
            let at = q.bind(Val::Big(Some(i64::try_from(*at).unwrap_or(i64::MAX))));
            let id = q.bind(label(Some(id)));
            clauses.push(format!("(t.created_at, t.id) > ({at}, {id})"));
        }
        let which = if clauses.is_empty() {
            q.always().to_string()
        } else {
            clauses.join(" AND ")
        };
        let limit = q.bind(Val::Big(Some(
            i64::try_from(filter.limit).unwrap_or(i64::MAX),
        )));
        let sql = format!(
            "{} WHERE {which} ORDER BY t.created_at, t.id LIMIT {limit}",
            self.todo_select
        );
        (sql, q.vals)
    }

    /// A sweep's candidate query (its ids in no order: Postgres adds `ORDER BY id` and its lock
    /// clause, SQLite sorts them after, so that its planner picks the sweep's partial index
    /// rather than walking the primary key over every todo) and its one parameter.
    pub(crate) fn sweep(&self, op: &str, sweep: Sweep<'_>) -> Result<(String, Val), Error> {
        let m = self.mark;
        let q = Query::new(m);
        Ok(match sweep {
            // mirrors transition::reap. On Postgres through the reaper's mark, which is never
            // later than the lease (see `pg_derived`).
            Sweep::Reap { now } if !q.sqlite() => (
                format!(
                    "SELECT id FROM todos WHERE state = 'claimed' AND lease_due_at <= {m}1
                       AND (lease_expires_at IS NULL OR lease_expires_at <= {m}1)"
                ),
                time(op, now)?,
            ),
            Sweep::Reap { now } => (
                format!(
                    "SELECT id FROM todos WHERE state = 'claimed'
                       AND (lease_expires_at IS NULL OR lease_expires_at <= {m}1)"
                ),
                time(op, now)?,
            ),
            // mirrors transition::requeue_due (the waiting todos through the small partial
            // index `todos_waiting`: few todos wait for a human). On SQLite as a UNION ALL (an id in both halves
            // comes twice; the store drops the repeat), so that each half searches its partial
            // index (the retry and the deadline one; the second half names the deadline index's
            // predicate) instead of the OR scanning the table. A plain UNION merges the halves
            // in id order, which walks the primary key again.
            Sweep::RequeueDue { now } if q.sqlite() => (
                format!(
                    "SELECT id FROM todos WHERE state = 'failed' AND next_retry_at <= {m}1
                       AND attempt < max_attempts
                     UNION ALL
                     SELECT id FROM todos WHERE deadline_at <= {m}1 AND deadline_at IS NOT NULL
                       AND state IN ('pending', 'failed')
                       AND (state = 'pending' OR (state = 'failed' AND next_retry_at IS NOT NULL))
                     UNION ALL
                     SELECT id FROM todos WHERE state = 'input_required'
                       AND (answer_due_at <= {m}1 OR deadline_at <= {m}1)
                     UNION ALL
                     SELECT id FROM todos WHERE state = 'pending' AND run_at <= {m}1
                       AND run_at IS NOT NULL"
                ),
                time(op, now)?,
            ),
            Sweep::RequeueDue { now } => (
                format!(
                    "SELECT id FROM todos WHERE (state = 'failed' AND next_retry_at <= {m}1
                       AND attempt < max_attempts)
                       OR (deadline_at <= {m}1 AND (state = 'pending'
                           OR (state = 'failed' AND next_retry_at IS NOT NULL)))
                       OR (state = 'input_required'
                           AND (answer_due_at <= {m}1 OR deadline_at <= {m}1))
                       OR (state = 'pending' AND run_at <= {m}1)"
                ),
                time(op, now)?,
            ),
            // mirrors transition::revoke
            Sweep::Revoke { endpoint, .. } => (
                format!("SELECT id FROM todos WHERE endpoint = {m}1 AND state = 'claimed'"),
                label(Some(endpoint)),
            ),
            // mirrors ledger::purgeable. On Postgres through `finished_at`, `updated_at` once a
            // todo is finished (see `pg_derived`): a heartbeat's `updated_at` then changes no
            // indexed column.
            Sweep::Purge { cutoff } if !q.sqlite() => (
                format!(
                    "SELECT id FROM todos WHERE finished_at <= {m}1
                       AND (state IN ('done', 'canceled')
                            OR (state = 'failed' AND next_retry_at IS NULL))"
                ),
                time(op, cutoff)?,
            ),
            Sweep::Purge { cutoff } => (
                format!(
                    "SELECT id FROM todos WHERE updated_at <= {m}1
                       AND {finished}
                       AND (state IN ('done', 'canceled')
                            OR (state = 'failed' AND next_retry_at IS NULL))",
                    finished = q.one_of("state", FINISHED)
                ),
                time(op, cutoff)?,
            ),
        })
    }
}

/// The states of the FIFO indexes (`todos_fifo`, `todos_keyless`, `todos_keyed`): the todos a
/// claim may take.
pub(super) const LIVE: &[&str] = &["pending", "claimed", "failed"];
/// The claim order (transition::claim_order) of the todos aliased `t`.
pub(super) const CLAIM_ORDER: &str = "t.priority DESC, t.created_at, t.id";

/// What a claim's WHERE says of the concurrency keys.
pub(super) enum Keys<'a> {
    /// Not a key `holds` holds.
    NotHeld,
    /// No key, in the queue of the lane aliased so (see `heads`).
    NoneIn(&'a str),
    /// The queue and key of the head aliased so (see `heads`).
    Of(&'a str),
}
/// The states of the retention index (`todos_finished`).
const FINISHED: &[&str] = &["done", "canceled", "failed"];

/// A statement's parameters as its clauses bind them, in the dialect of `mark`.
pub(super) struct Query {
    mark: char,
    pub(super) vals: Vec<Val>,
}

impl Query {
    pub(super) fn new(mark: char) -> Query {
        Query {
            mark,
            vals: Vec::new(),
        }
    }

    pub(super) fn sqlite(&self) -> bool {
        self.mark == '?'
    }

    /// Binds `v`; its placeholder.
    pub(super) fn bind(&mut self, v: Val) -> String {
        self.vals.push(v);
        format!("{}{}", self.mark, self.vals.len())
    }

    /// A text value compared with a column of the todos table. On SQLite it is cast. SQLite
    /// (3.5x) marked the plan of the claim's bare `t.assignee = ?` (and of the load's join on
    /// `t.id = ?`) as depending on the value bound, and rusqlite's statement cache clears a
    /// statement's bindings when it takes it back, which expires such a statement: SQLite
    /// re-prepared it on every use, at more cost than running it. The cast keeps the index
    /// usable without that; `cached_statements_are_not_reprepared` checks it.
    pub(super) fn bind_text(&mut self, v: &str) -> String {
        let mark = self.bind(label(Some(v)));
        if self.sqlite() {
            format!("CAST({mark} AS TEXT)")
        } else {
            mark
        }
    }

    /// `col` is one of the constant `states`, written as the partial index on them writes its
    /// predicate, so that the planner matches the two term for term. On SQLite that is a chain
    /// of `OR`s (see the SQLite migration 8): SQLite evaluates an `IN` list of more than two
    /// constants through a temporary b-tree it builds on every run of the statement.
    pub(super) fn one_of(&self, col: &str, states: &[&str]) -> String {
        let each: Vec<String> = states.iter().map(|s| format!("'{s}'")).collect();
        if self.sqlite() {
            let eq: Vec<String> = each.iter().map(|s| format!("{col} = {s}")).collect();
            format!("({})", eq.join(" OR "))
        } else {
            format!("{col} IN ({})", each.join(", "))
        }
    }

    /// A clause that holds for every row.
    pub(super) fn always(&self) -> &'static str {
        if self.sqlite() { "1" } else { "true" }
    }

    /// `(t.queue, t.concurrency_key)` is one of `keys` (at least one), bound as one value
    /// however many there are (Postgres: two arrays; SQLite: one JSON array of pairs), so that
    /// the statement's text does not change with their number and no count of them meets
    /// SQLite's limit on bound values.
    pub(super) fn key_in(&mut self, keys: &[(String, String)]) -> String {
        if !self.sqlite() {
            let (qs, ks): (Vec<String>, Vec<String>) = keys.iter().cloned().unzip();
            let (qs, ks) = (self.bind(Val::Texts(qs)), self.bind(Val::Texts(ks)));
            return format!(
                "(t.queue, t.concurrency_key) IN (SELECT * FROM unnest({qs}::text[], {ks}::text[]))"
            );
        }
        let pairs = serde_json::to_string(keys).unwrap_or_else(|_| "[]".into());
        let pairs = self.bind(label(Some(&pairs)));
        format!(
            "(t.queue, t.concurrency_key) IN (SELECT value ->> 0, value ->> 1 FROM \
             json_each({pairs}))"
        )
    }

    /// `t.queue` is one of `qs` (none: no row).
    pub(super) fn queue_in(&mut self, qs: &[String]) -> String {
        if !self.sqlite() {
            return format!("t.queue = ANY({})", self.bind(Val::Texts(qs.to_vec())));
        }
        if qs.is_empty() {
            return "0".into();
        }
        let marks: Vec<String> = qs.iter().map(|q| self.bind(label(Some(q)))).collect();
        format!("t.queue IN ({})", marks.join(", "))
    }
}

/// The position of a todo column in [`TODO_COLS`].
fn todo_col(name: &str) -> usize {
    TODO_COLS.iter().position(|c| *c == name).unwrap_or(0)
}
