//! The SQLite store's numbered migrations, and applying them.

use relay_core::Error;
use rusqlite::{Connection, TransactionBehavior, params};

/// The numbered migrations, applied in order, each recorded in `schema_migrations`.
pub(crate) const MIGRATIONS: &[(u32, &str, &str)] = &[
    (1, "todos", MIGRATION_0001),
    (2, "todo_attempts", MIGRATION_0002),
    (3, "endpoints", MIGRATION_0003),
    (4, "todo_change_seq", MIGRATION_0004),
    (5, "failure_classes", MIGRATION_0005),
    (6, "board", MIGRATION_0006),
    (7, "mcp_sessions", MIGRATION_0007),
    (8, "write_path", MIGRATION_0008),
    (9, "session_streams", MIGRATION_0009),
    (10, "board_bulk", MIGRATION_0010),
    (11, "store_heartbeat", MIGRATION_0011),
    (12, "asking", MIGRATION_0012),
    (13, "tasks", MIGRATION_0013),
    (14, "flow", MIGRATION_0014),
    (15, "flow_limits", MIGRATION_0015),
    (16, "key_heads", MIGRATION_0016),
];

/// Claims past held keys (see `rows::heads`): `key_heads`, a row per (endpoint, queue, key)
/// with live todos naming the first of them in claim order, ordered as the FIFO index is;
/// `todos_keyed` and `todos_keyless`, the live todos with a key by key and those without one
/// by queue, in claim order. Triggers keep the heads for every writer of `todos` (their
/// conditions name the states as `OR`s, as migration 8 explains): a todo with a key that
/// becomes live lowers its key's head to itself if it comes first; one that leaves the live
/// states (finished, waiting on input, deleted) has its key's head read again. One writer, so
/// a head is always its key's first live todo.
const MIGRATION_0016: &str = "
CREATE TABLE key_heads (
    endpoint        TEXT    NOT NULL,
    queue           TEXT    NOT NULL,
    concurrency_key TEXT    NOT NULL,
    priority        INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    id              TEXT    NOT NULL,
    PRIMARY KEY (endpoint, queue, concurrency_key)
) WITHOUT ROWID;
CREATE INDEX key_heads_order ON key_heads (endpoint, priority DESC, created_at, id);
CREATE INDEX todos_keyed ON todos (endpoint, queue, concurrency_key, priority DESC, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed')
      AND concurrency_key IS NOT NULL;
CREATE INDEX todos_keyless ON todos (endpoint, queue, priority DESC, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed')
      AND concurrency_key IS NULL;
INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    SELECT t.endpoint, t.queue, t.concurrency_key, t.priority, t.created_at, t.id FROM todos t
     WHERE (t.state = 'pending' OR t.state = 'claimed' OR t.state = 'failed')
       AND t.concurrency_key IS NOT NULL
       AND t.id = (SELECT u.id FROM todos u
                    WHERE u.endpoint = t.endpoint AND u.queue = t.queue
                      AND u.concurrency_key = t.concurrency_key
                      AND (u.state = 'pending' OR u.state = 'claimed' OR u.state = 'failed')
                    ORDER BY u.priority DESC, u.created_at, u.id LIMIT 1);

CREATE TRIGGER key_heads_added AFTER INSERT ON todos
WHEN NEW.concurrency_key IS NOT NULL AND (NEW.state = 'pending' OR NEW.state = 'claimed' OR NEW.state = 'failed')
BEGIN
    INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    VALUES (NEW.endpoint, NEW.queue, NEW.concurrency_key, NEW.priority, NEW.created_at, NEW.id)
    ON CONFLICT (endpoint, queue, concurrency_key) DO UPDATE
       SET priority = excluded.priority, created_at = excluded.created_at, id = excluded.id
     WHERE (-excluded.priority, excluded.created_at, excluded.id)
         < (-key_heads.priority, key_heads.created_at, key_heads.id);
END;
CREATE TRIGGER key_heads_changed AFTER UPDATE OF state ON todos
WHEN NEW.concurrency_key IS NOT NULL
 AND (OLD.state = 'pending' OR OLD.state = 'claimed' OR OLD.state = 'failed')
  <> (NEW.state = 'pending' OR NEW.state = 'claimed' OR NEW.state = 'failed')
BEGIN
    DELETE FROM key_heads WHERE endpoint = NEW.endpoint AND queue = NEW.queue
        AND concurrency_key = NEW.concurrency_key;
    INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    SELECT t.endpoint, t.queue, t.concurrency_key, t.priority, t.created_at, t.id FROM todos t
     WHERE t.endpoint = NEW.endpoint AND t.queue = NEW.queue
       AND t.concurrency_key = NEW.concurrency_key
       AND (t.state = 'pending' OR t.state = 'claimed' OR t.state = 'failed')
     ORDER BY t.priority DESC, t.created_at, t.id LIMIT 1;
END;
CREATE TRIGGER key_heads_deleted AFTER DELETE ON todos
WHEN OLD.concurrency_key IS NOT NULL AND (OLD.state = 'pending' OR OLD.state = 'claimed' OR OLD.state = 'failed')
BEGIN
    DELETE FROM key_heads WHERE endpoint = OLD.endpoint AND queue = OLD.queue
        AND concurrency_key = OLD.concurrency_key;
    INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    SELECT t.endpoint, t.queue, t.concurrency_key, t.priority, t.created_at, t.id FROM todos t
     WHERE t.endpoint = OLD.endpoint AND t.queue = OLD.queue
       AND t.concurrency_key = OLD.concurrency_key
       AND (t.state = 'pending' OR t.state = 'claimed' OR t.state = 'failed')
     ORDER BY t.priority DESC, t.created_at, t.id LIMIT 1;
END;
";

/// Priorities and delayed todos: `claim_next` takes a higher priority first (FIFO within one),
/// and a pending todo is not claimable before its `run_at`. The FIFO index leads with the
/// priority so that a claim still walks it in order and stops at the first rows it can take.
/// `todos_delayed` holds only the delayed todos still waiting (the retry sweep clears a `run_at`
/// once it has come), so the sweep finds the due ones without a scan.
const MIGRATION_0014: &str = "
ALTER TABLE todos ADD COLUMN priority INTEGER NOT NULL DEFAULT 0
    CHECK (priority BETWEEN -100 AND 100);
ALTER TABLE todos ADD COLUMN run_at INTEGER;
DROP INDEX todos_fifo;
CREATE INDEX todos_fifo ON todos (endpoint, priority DESC, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed');
CREATE INDEX todos_delayed ON todos (run_at) WHERE state = 'pending' AND run_at IS NOT NULL;
";

/// Flow control: a todo's `concurrency_key`; `queue_limits`, a row per queue with limits;
/// `queue_claims`, the claims of the rate-limited queues within their window. `todos_claimed_keys`
/// counts what a limited queue holds from its claimed todos alone.
const MIGRATION_0015: &str = "
ALTER TABLE todos ADD COLUMN concurrency_key TEXT
    CHECK (length(CAST(concurrency_key AS BLOB)) BETWEEN 1 AND 128);
CREATE INDEX todos_claimed_keys ON todos (queue, concurrency_key) WHERE state = 'claimed';
CREATE TABLE queue_limits (
    queue TEXT PRIMARY KEY,
    max_claimed INTEGER CHECK (max_claimed BETWEEN 1 AND 1000000),
    max_claimed_per_key INTEGER CHECK (max_claimed_per_key BETWEEN 1 AND 1000000),
    claims_per_minute INTEGER CHECK (claims_per_minute BETWEEN 1 AND 1000000),
    updated_at INTEGER NOT NULL
);
CREATE TABLE queue_claims (
    queue TEXT NOT NULL,
    claimed_at INTEGER NOT NULL
);
CREATE INDEX queue_claims_window ON queue_claims (queue, claimed_at);
";

/// A todo made as an MCP task keeps its task id (never changed after the add).
const MIGRATION_0013: &str = "
ALTER TABLE todos ADD COLUMN task_id TEXT CHECK (length(CAST(task_id AS BLOB)) BETWEEN 1 AND 200);
";

/// The migrations that rebuild a table another one references: foreign keys are off while
/// they run (see `migrate`).
const REBUILDS: &[u32] = &[12];

/// The todos table as it was before attempt history (the design's "before").
const MIGRATION_0001: &str = "
CREATE TABLE todos (
    id               TEXT    NOT NULL PRIMARY KEY,
    endpoint         TEXT    NOT NULL,
    queue            TEXT    NOT NULL,
    title            TEXT    NOT NULL,
    kind             TEXT,
    source           TEXT,
    payload          TEXT,
    work_order       TEXT,
    assignee         TEXT,
    state            TEXT    NOT NULL
        CHECK (state IN ('pending', 'claimed', 'failed', 'done', 'canceled')),
    owner            TEXT,
    attempt          INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_expires_at INTEGER,
    claimed_at       INTEGER,
    next_retry_at    INTEGER,
    result           TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    CHECK ((state = 'claimed') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
) STRICT;
-- claim_next: the live todos of an endpoint in FIFO order.
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed');
-- the reaper and the retry sweep
CREATE INDEX todos_lease ON todos (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX todos_retry ON todos (next_retry_at) WHERE state = 'failed';
-- retention: finished todos by age
CREATE INDEX todos_finished ON todos (updated_at) WHERE state IN ('done', 'canceled', 'failed');
";

/// Attempt history: the attempts table, the todo counters, and one open attempt for every lease
/// in flight. `attempts_total` starts at `attempt` so that a later claim's seq continues the
/// count; the attempts before the migration have no row and count as pruned.
const MIGRATION_0002: &str = "
CREATE TABLE todo_attempts (
    todo_id           TEXT    NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    seq               INTEGER NOT NULL CHECK (seq >= 1),
    attempt           INTEGER NOT NULL CHECK (attempt >= 0),
    claimer_kind      TEXT    NOT NULL CHECK (claimer_kind IN ('endpoint', 'owner')),
    claimer_endpoint  TEXT,
    claimer_session   TEXT,
    owner             TEXT    NOT NULL,
    claimant          TEXT    CHECK (length(CAST(claimant AS BLOB)) <= 128),
    claimed_at        INTEGER NOT NULL,
    last_heartbeat_at INTEGER,
    lease_expires_at  INTEGER NOT NULL,
    ended_at          INTEGER,
    outcome           TEXT    CHECK (outcome IN ('completed', 'failed', 'released',
                                     'lease_expired', 'reaped', 'canceled', 'revoked')),
    disposition       TEXT    CHECK (disposition IN ('done', 'retry_scheduled', 'requeued',
                                     'dead_lettered', 'canceled')),
    summary           TEXT    CHECK (length(CAST(summary AS BLOB)) <= 2048),
    summary_truncated INTEGER NOT NULL DEFAULT 0 CHECK (summary_truncated IN (0, 1)),
    artifact          TEXT    CHECK (length(CAST(artifact AS BLOB)) <= 512),
    lease_token_hash  BLOB    CHECK (length(lease_token_hash) = 32),
    PRIMARY KEY (todo_id, seq),
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CHECK ((ended_at IS NULL) = (disposition IS NULL))
) STRICT, WITHOUT ROWID;
-- At most one open attempt per todo. SQLite checks it per row; the store closes the dead
-- attempt before it opens the next one, so a takeover never trips it.
CREATE UNIQUE INDEX todo_attempts_one_open ON todo_attempts (todo_id) WHERE ended_at IS NULL;

ALTER TABLE todos ADD COLUMN attempts_total  INTEGER NOT NULL DEFAULT 0 CHECK (attempts_total >= 0);
ALTER TABLE todos ADD COLUMN attempts_pruned INTEGER NOT NULL DEFAULT 0 CHECK (attempts_pruned >= 0);

UPDATE todos SET attempts_total = attempt, attempts_pruned = attempt WHERE state <> 'claimed';
UPDATE todos SET attempts_total = max(attempt, 1), attempts_pruned = max(attempt, 1) - 1
    WHERE state = 'claimed';
INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint, owner,
                           claimant, claimed_at, lease_expires_at)
SELECT id, attempts_total, attempt,
       CASE WHEN owner = 'operator' THEN 'owner' ELSE 'endpoint' END,
       CASE WHEN owner = 'operator' THEN NULL ELSE owner END,
       owner, 'migrated', coalesce(claimed_at, lease_expires_at, updated_at), lease_expires_at
FROM todos WHERE state = 'claimed';
";

const MIGRATION_0003: &str = "
CREATE TABLE endpoints (
    name       TEXT    NOT NULL PRIMARY KEY,
    token_hash BLOB    NOT NULL CHECK (length(token_hash) = 32),
    verbs      TEXT    NOT NULL,
    queues     TEXT,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
) STRICT;
";

/// The change sequence the out-of-process doorbell scan follows: every insert or update of a
/// todo row takes the next number of a per-store counter (triggers, so that no write path can
/// forget it), and the scan reads only pending rows numbered above its watermark, through a
/// partial index: O(new rows) per tick whatever the backlog. SQLite has one writer at a time, so
/// numbers commit in order and a reader's snapshot holds every row up to the counter it reads.
/// Rows from before this migration keep 0 (the first scan starts at the counter anyway).
const MIGRATION_0004: &str = "
ALTER TABLE todos ADD COLUMN change_seq INTEGER NOT NULL DEFAULT 0;
CREATE TABLE todo_change_counter (
    id INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    n  INTEGER NOT NULL CHECK (n >= 0)
) STRICT;
INSERT INTO todo_change_counter (id, n) VALUES (1, 0);
CREATE INDEX todos_change ON todos (change_seq) WHERE state = 'pending';
CREATE TRIGGER todos_change_insert AFTER INSERT ON todos BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
-- Every column but change_seq itself, so the trigger's own update does not fire it again.
CREATE TRIGGER todos_change_update AFTER UPDATE OF id, endpoint, queue, title, kind, source,
    payload, work_order, assignee, state, owner, attempt, max_attempts, lease_expires_at,
    claimed_at, next_retry_at, result, created_at, updated_at, attempts_total, attempts_pruned
    ON todos BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
";

/// Recovery by failure class: why a dead letter is one (on the todo, and on the attempt whose
/// close made it), the per-endpoint idempotency key (unique, so that concurrent adds with one
/// key make one todo), the deadline, the repeated-failure budget, a failed attempt's signature
/// and the late reports kept on closed attempts. Dead letters from before say
/// `attempts_exhausted`, or `revoked` when their newest attempt was revoked; todos from before
/// keep `max_same_failures = 0` (the rule off), as they were added without it.
const MIGRATION_0005: &str = "
ALTER TABLE todos ADD COLUMN dead_letter_reason TEXT CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todos ADD COLUMN idempotency_key TEXT
    CHECK (length(CAST(idempotency_key AS BLOB)) BETWEEN 1 AND 200);
ALTER TABLE todos ADD COLUMN deadline_at INTEGER;
ALTER TABLE todos ADD COLUMN max_same_failures INTEGER NOT NULL DEFAULT 0
    CHECK (max_same_failures BETWEEN 0 AND 10);
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key);
-- the retry sweep's deadline half
CREATE INDEX todos_deadline ON todos (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('pending', 'failed');
ALTER TABLE todo_attempts ADD COLUMN failure_signature TEXT
    CHECK (length(CAST(failure_signature AS BLOB)) <= 128);
ALTER TABLE todo_attempts ADD COLUMN dead_letter_reason TEXT CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todo_attempts ADD COLUMN late_reports TEXT;
ALTER TABLE todo_attempts ADD COLUMN late_reports_total INTEGER NOT NULL DEFAULT 0
    CHECK (late_reports_total >= 0);
UPDATE todo_attempts SET dead_letter_reason =
    CASE outcome WHEN 'revoked' THEN 'revoked' ELSE 'attempts_exhausted' END
    WHERE disposition = 'dead_lettered';
UPDATE todos SET dead_letter_reason = coalesce(
    (SELECT a.dead_letter_reason FROM todo_attempts a
      WHERE a.todo_id = todos.id AND a.seq = todos.attempts_total), 'attempts_exhausted')
    WHERE state = 'failed' AND next_retry_at IS NULL;
";

/// The Board: operators (only the SHA-256 of a token), their sessions (only the SHA-256 of the
/// cookie's secret; a revoke deletes them), the operator who closed an attempt, and the paused
/// queues.
const MIGRATION_0006: &str = "
CREATE TABLE operators (
    name       TEXT    NOT NULL PRIMARY KEY,
    token_hash BLOB    NOT NULL UNIQUE CHECK (length(token_hash) = 32),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
) STRICT;
CREATE TABLE board_sessions (
    id_hash    BLOB    NOT NULL PRIMARY KEY CHECK (length(id_hash) = 32),
    operator   TEXT    NOT NULL REFERENCES operators (name) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
) STRICT;
CREATE INDEX board_sessions_operator ON board_sessions (operator);
-- Which operator closed an attempt (NULL: no operator did).
ALTER TABLE todo_attempts ADD COLUMN closed_by TEXT CHECK (length(CAST(closed_by AS BLOB)) <= 64);
CREATE TABLE paused_queues (
    queue     TEXT    NOT NULL PRIMARY KEY,
    paused_at INTEGER NOT NULL
) STRICT;
";

/// MCP sessions in the store, so that any server on the database answers any session and a
/// restart keeps them: only the SHA-256 of a session id, its endpoint, the protocol revision it
/// negotiated and its last use (for the idle sweep). (Postgres' 0007 also adds the doorbell's
/// NOTIFY trigger; SQLite's doorbell stays in-process.)
const MIGRATION_0007: &str = "
CREATE TABLE mcp_sessions (
    id_hash      BLOB    NOT NULL PRIMARY KEY CHECK (length(id_hash) = 32),
    endpoint     TEXT    NOT NULL,
    protocol     TEXT    NOT NULL CHECK (length(protocol) <= 32),
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER NOT NULL
) STRICT;
CREATE INDEX mcp_sessions_endpoint ON mcp_sessions (endpoint);
CREATE INDEX mcp_sessions_idle ON mcp_sessions (last_used_at);
";

/// Which sessions hold a doorbell stream (until when, by the holding server's last keep-alive),
/// so that a session at the per-endpoint cap can make room by ending the least recently used
/// session that holds none.
const MIGRATION_0009: &str = "
ALTER TABLE mcp_sessions ADD COLUMN stream_until INTEGER;
";

/// The write path's hidden work, cut.
///
/// The partial indexes on a list of states name them as `OR`s instead of `IN`. SQLite evaluates
/// `state IN (a, b, c)` (a constant list of more than two) through a temporary b-tree that it
/// builds and frees on every run of a statement, and every update of a todo's state evaluates
/// the predicate of each of these indexes for the old row and the new one: four temporary
/// b-trees an update, each a fresh page cache to allocate and free, were a third of the
/// writer's time under 16 callers. An `OR` of equalities compares in place. The queries the
/// indexes serve write the predicates in the same form (`rows::Query::one_of`), so that the
/// planner matches them term for term. The CHECK constraints keep their lists: changing one
/// means rebuilding the table.
///
/// The change sequence numbers only rows that are pending after the write: the doorbell scan
/// reads pending rows alone, and a todo that becomes pending takes a new number then. Every other
/// write (a claim, a heartbeat, a close) no longer runs the triggers' two extra updates.
const MIGRATION_0008: &str = "
DROP INDEX todos_fifo;
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed');
DROP INDEX todos_finished;
CREATE INDEX todos_finished ON todos (updated_at)
    WHERE (state = 'done' OR state = 'canceled' OR state = 'failed');
DROP TRIGGER todos_change_insert;
DROP TRIGGER todos_change_update;
CREATE TRIGGER todos_change_insert AFTER INSERT ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
CREATE TRIGGER todos_change_update AFTER UPDATE OF id, endpoint, queue, title, kind, source,
    payload, work_order, assignee, state, owner, attempt, max_attempts, lease_expires_at,
    claimed_at, next_retry_at, result, created_at, updated_at, attempts_total, attempts_pruned,
    dead_letter_reason, idempotency_key, deadline_at, max_same_failures
    ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
";

/// The Board's bulk actions: what an operator asked for (a retry or cancel of every todo a
/// queue's filter matched), each todo listed as it stood then, and what became of it. Items
/// without a result are what is left to do: a server that stops midway resumes from them.
const MIGRATION_0010: &str = "
CREATE TABLE board_bulk (
    id           TEXT    NOT NULL PRIMARY KEY,
    operator     TEXT    NOT NULL,
    queue        TEXT    NOT NULL,
    action       TEXT    NOT NULL CHECK (action = 'retry' OR action = 'cancel'),
    filter       TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    confirmed_at INTEGER,
    finished_at  INTEGER
) STRICT;
CREATE INDEX board_bulk_open ON board_bulk (created_at) WHERE finished_at IS NULL;
CREATE TABLE board_bulk_items (
    bulk_id         TEXT    NOT NULL REFERENCES board_bulk (id) ON DELETE CASCADE,
    todo_id         TEXT    NOT NULL,
    listed_state    TEXT    NOT NULL,
    listed_attempts INTEGER NOT NULL,
    result          TEXT    CHECK (result = 'applied' OR result = 'skipped'),
    note            TEXT,
    done_at         INTEGER,
    PRIMARY KEY (bulk_id, todo_id)
) STRICT;
";

/// `/healthz`'s write probe (`Store::probe_write`): one row, its time rewritten by every probe,
/// so the table never grows.
const MIGRATION_0011: &str = "
CREATE TABLE store_heartbeat (
    id      INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    beat_at INTEGER NOT NULL
) STRICT;
";

/// Waiting for a human, and spend (issue 31): the todo state `input_required`, the attempt
/// outcome `needs_input` with disposition `awaiting_input`, the dead-letter reasons
/// `input_requests_exhausted`, `no_answer` and `budget_exhausted`; a todo's question budget,
/// answer window, spend limit and spend; an attempt's question, its answer and its usage.
///
/// The lists of states, outcomes and reasons are CHECK constraints, which SQLite cannot alter:
/// both tables are rebuilt (SQLite's documented procedure: a new table, the rows copied, the old
/// one dropped, the new one renamed, its indexes and triggers made again), with foreign keys
/// off for the migration (`migrate` turns them off around a rebuild and checks them before the
/// commit), since dropping `todos` would otherwise delete every attempt.
const MIGRATION_0012: &str = "
CREATE TABLE todos_new (
    id                  TEXT    NOT NULL PRIMARY KEY,
    endpoint            TEXT    NOT NULL,
    queue               TEXT    NOT NULL,
    title               TEXT    NOT NULL,
    kind                TEXT,
    source              TEXT,
    payload             TEXT,
    work_order          TEXT,
    assignee            TEXT,
    state               TEXT    NOT NULL CHECK (state IN ('pending', 'claimed', 'failed', 'done',
                                                          'canceled', 'input_required')),
    owner               TEXT,
    attempt             INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts        INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_expires_at    INTEGER,
    claimed_at          INTEGER,
    next_retry_at       INTEGER,
    result              TEXT,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    attempts_total      INTEGER NOT NULL DEFAULT 0 CHECK (attempts_total >= 0),
    attempts_pruned     INTEGER NOT NULL DEFAULT 0 CHECK (attempts_pruned >= 0),
    change_seq          INTEGER NOT NULL DEFAULT 0,
    dead_letter_reason  TEXT    CHECK (dead_letter_reason IN ('attempts_exhausted',
                                   'non_retryable', 'deadline', 'repeated_failure', 'revoked',
                                   'input_requests_exhausted', 'no_answer', 'budget_exhausted')),
    idempotency_key     TEXT    CHECK (length(CAST(idempotency_key AS BLOB)) BETWEEN 1 AND 200),
    deadline_at         INTEGER,
    max_same_failures   INTEGER NOT NULL DEFAULT 0 CHECK (max_same_failures BETWEEN 0 AND 10),
    max_input_requests  INTEGER NOT NULL DEFAULT 3 CHECK (max_input_requests BETWEEN 0 AND 100),
    input_requests      INTEGER NOT NULL DEFAULT 0 CHECK (input_requests >= 0),
    answer_within_ms    INTEGER CHECK (answer_within_ms > 0),
    answer_due_at       INTEGER,
    budget_cost_micros  INTEGER CHECK (budget_cost_micros > 0),
    budget_tokens       INTEGER CHECK (budget_tokens > 0),
    spent_cost_micros   INTEGER NOT NULL DEFAULT 0 CHECK (spent_cost_micros >= 0),
    spent_input_tokens  INTEGER NOT NULL DEFAULT 0 CHECK (spent_input_tokens >= 0),
    spent_output_tokens INTEGER NOT NULL DEFAULT 0 CHECK (spent_output_tokens >= 0),
    CHECK ((state = 'claimed') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK (answer_due_at IS NULL OR state = 'input_required')
) STRICT;
INSERT INTO todos_new (id, endpoint, queue, title, kind, source, payload, work_order, assignee,
    state, owner, attempt, max_attempts, lease_expires_at, claimed_at, next_retry_at, result,
    created_at, updated_at, attempts_total, attempts_pruned, change_seq, dead_letter_reason,
    idempotency_key, deadline_at, max_same_failures)
SELECT id, endpoint, queue, title, kind, source, payload, work_order, assignee,
    state, owner, attempt, max_attempts, lease_expires_at, claimed_at, next_retry_at, result,
    created_at, updated_at, attempts_total, attempts_pruned, change_seq, dead_letter_reason,
    idempotency_key, deadline_at, max_same_failures FROM todos;
CREATE TABLE todo_attempts_new (
    todo_id             TEXT    NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    seq                 INTEGER NOT NULL CHECK (seq >= 1),
    attempt             INTEGER NOT NULL CHECK (attempt >= 0),
    claimer_kind        TEXT    NOT NULL CHECK (claimer_kind IN ('endpoint', 'owner')),
    claimer_endpoint    TEXT,
    claimer_session     TEXT,
    owner               TEXT    NOT NULL,
    claimant            TEXT    CHECK (length(CAST(claimant AS BLOB)) <= 128),
    claimed_at          INTEGER NOT NULL,
    last_heartbeat_at   INTEGER,
    lease_expires_at    INTEGER NOT NULL,
    ended_at            INTEGER,
    outcome             TEXT    CHECK (outcome IN ('completed', 'failed', 'released',
                                   'lease_expired', 'reaped', 'canceled', 'revoked',
                                   'needs_input')),
    disposition         TEXT    CHECK (disposition IN ('done', 'retry_scheduled', 'requeued',
                                   'dead_lettered', 'canceled', 'awaiting_input')),
    summary             TEXT    CHECK (length(CAST(summary AS BLOB)) <= 2048),
    summary_truncated   INTEGER NOT NULL DEFAULT 0 CHECK (summary_truncated IN (0, 1)),
    artifact            TEXT    CHECK (length(CAST(artifact AS BLOB)) <= 512),
    lease_token_hash    BLOB    CHECK (length(lease_token_hash) = 32),
    failure_signature   TEXT    CHECK (length(CAST(failure_signature AS BLOB)) <= 128),
    dead_letter_reason  TEXT    CHECK (dead_letter_reason IN ('attempts_exhausted',
                                   'non_retryable', 'deadline', 'repeated_failure', 'revoked',
                                   'input_requests_exhausted', 'no_answer', 'budget_exhausted')),
    late_reports        TEXT,
    late_reports_total  INTEGER NOT NULL DEFAULT 0 CHECK (late_reports_total >= 0),
    closed_by           TEXT    CHECK (length(CAST(closed_by AS BLOB)) <= 64),
    question            TEXT    CHECK (length(CAST(question AS BLOB)) <= 2048),
    answer              TEXT    CHECK (length(CAST(answer AS BLOB)) <= 8192),
    answered_at         INTEGER,
    answered_by         TEXT    CHECK (length(CAST(answered_by AS BLOB)) <= 200),
    answer_key          TEXT    CHECK (length(CAST(answer_key AS BLOB)) <= 200),
    usage_cost_micros   INTEGER NOT NULL DEFAULT 0 CHECK (usage_cost_micros >= 0),
    usage_input_tokens  INTEGER NOT NULL DEFAULT 0 CHECK (usage_input_tokens >= 0),
    usage_output_tokens INTEGER NOT NULL DEFAULT 0 CHECK (usage_output_tokens >= 0),
    PRIMARY KEY (todo_id, seq),
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CHECK ((ended_at IS NULL) = (disposition IS NULL)),
    CHECK (answer IS NULL OR question IS NOT NULL)
) STRICT, WITHOUT ROWID;
INSERT INTO todo_attempts_new (todo_id, seq, attempt, claimer_kind, claimer_endpoint,
    claimer_session, owner, claimant, claimed_at, last_heartbeat_at, lease_expires_at, ended_at,
    outcome, disposition, summary, summary_truncated, artifact, lease_token_hash,
    failure_signature, dead_letter_reason, late_reports, late_reports_total, closed_by)
SELECT todo_id, seq, attempt, claimer_kind, claimer_endpoint,
    claimer_session, owner, claimant, claimed_at, last_heartbeat_at, lease_expires_at, ended_at,
    outcome, disposition, summary, summary_truncated, artifact, lease_token_hash,
    failure_signature, dead_letter_reason, late_reports, late_reports_total, closed_by
FROM todo_attempts;
DROP TABLE todo_attempts;
DROP TABLE todos;
ALTER TABLE todos_new RENAME TO todos;
ALTER TABLE todo_attempts_new RENAME TO todo_attempts;
CREATE UNIQUE INDEX todo_attempts_one_open ON todo_attempts (todo_id) WHERE ended_at IS NULL;
CREATE INDEX todos_lease ON todos (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX todos_retry ON todos (next_retry_at) WHERE state = 'failed';
CREATE INDEX todos_change ON todos (change_seq) WHERE state = 'pending';
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key);
CREATE INDEX todos_deadline ON todos (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('pending', 'failed');
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed');
CREATE INDEX todos_finished ON todos (updated_at)
    WHERE (state = 'done' OR state = 'canceled' OR state = 'failed');
CREATE INDEX todos_waiting ON todos (id) WHERE state = 'input_required';
CREATE TRIGGER todos_change_insert AFTER INSERT ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
CREATE TRIGGER todos_change_update AFTER UPDATE OF id, endpoint, queue, title, kind, source,
    payload, work_order, assignee, state, owner, attempt, max_attempts, lease_expires_at,
    claimed_at, next_retry_at, result, created_at, updated_at, attempts_total, attempts_pruned,
    dead_letter_reason, idempotency_key, deadline_at, max_same_failures, max_input_requests,
    input_requests, answer_within_ms, answer_due_at, budget_cost_micros, budget_tokens,
    spent_cost_micros, spent_input_tokens, spent_output_tokens
    ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
";

/// Applies the migrations above the database's version, up to `target`, in one transaction.
pub(super) fn migrate(conn: &mut Connection, target: u32) -> Result<(), Error> {
    let err = |e: rusqlite::Error| Error::internal(format!("migrating the SQLite store: {e}"));
    // A rebuild drops a referenced table: with foreign keys on, that would delete the rows
    // that reference it. SQLite changes the setting only outside a transaction; the rebuild's
    // transaction checks the keys itself before it commits.
    let fk: i64 = conn
        .query_row("PRAGMA foreign_keys", [], |r| r.get(0))
        .map_err(err)?;
    conn.execute_batch("PRAGMA foreign_keys = OFF")
        .map_err(err)?;
    let done = migrate_in_tx(conn, target);
    if fk == 1 {
        conn.execute_batch("PRAGMA foreign_keys = ON")
            .map_err(err)?;
    }
    done
}

fn migrate_in_tx(conn: &mut Connection, target: u32) -> Result<(), Error> {
    let err = |e: rusqlite::Error| Error::internal(format!("migrating the SQLite store: {e}"));
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version    INTEGER NOT NULL PRIMARY KEY,
             name       TEXT    NOT NULL,
             applied_at INTEGER NOT NULL
         ) STRICT;",
    )
    .map_err(err)?;
    let current: i64 = tx
        .query_row(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            [],
            |r| r.get(0),
        )
        .map_err(err)?;
    let applied_at = wall_clock_ms();
    for (version, name, sql) in MIGRATIONS {
        if i64::from(*version) <= current || *version > target {
            continue;
        }
        tx.execute_batch(sql).map_err(|e| {
            Error::internal(format!(
                "migrating the SQLite store: migration {version:04} ({name}) failed: {e}"
            ))
        })?;
        if REBUILDS.contains(version) {
            let broken: i64 = tx
                .query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
                    r.get(0)
                })
                .map_err(err)?;
            if broken > 0 {
                return Err(Error::internal(format!(
                    "migrating the SQLite store: migration {version:04} ({name}) left {broken} \
                     rows whose foreign key names no row; nothing was changed"
                )));
            }
        }
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
            params![version, name, applied_at],
        )
        .map_err(err)?;
    }
    tx.commit().map_err(err)
}

/// When a migration was applied: the shell's clock, recorded for operators only.
fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The newest migration's number.
pub(crate) fn latest_migration() -> u32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}
