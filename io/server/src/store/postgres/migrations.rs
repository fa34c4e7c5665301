//! The Postgres store's numbered migrations, and applying them.

use deadpool_postgres::Object;
use relay_core::Error;

/// The numbered migrations (the same numbers and meaning as SQLite's, in Postgres dialect).
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "todos", MIGRATION_0001),
    (2, "todo_attempts", MIGRATION_0002),
    (3, "endpoints", MIGRATION_0003),
    (4, "todo_change_seq", MIGRATION_0004),
    (5, "failure_classes", MIGRATION_0005),
    (6, "board", MIGRATION_0006),
    (7, "mcp_sessions", MIGRATION_0007),
    (8, "session_streams", MIGRATION_0008),
    (9, "board_bulk", MIGRATION_0009),
    (10, "lease_due", MIGRATION_0010),
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
/// by queue, in claim order. Triggers keep the heads, for every writer of `todos`:
///
/// - a todo with a key that becomes live (added, or back from a state that is not) lowers its
///   key's head to itself if it comes first (`key_heads_lower`);
/// - a head that leaves the live states (finished, waiting on input, deleted) hands the head to
///   the next live todo of its key, or drops it (`key_heads_raise`).
///
/// Under READ COMMITTED two transactions may change one key at once; the head row's lock
/// orders them. A raise takes it first, so every later statement of the raise reads the key
/// with a view that holds every commit before it (a raise that read the key before taking it
/// could hand the head to a todo that another transaction was finishing, and leave it there). A
/// lowering waits on a raise that holds it and then compares with the head the raise wrote; a
/// todo added while a raise reads the key is not seen by the raise, but its own lowering comes
/// after. So a head is never after its key's first live todo, and once the writers commit it is
/// that todo.
const MIGRATION_0016: &str = r#"
CREATE TABLE key_heads (
    endpoint        text   NOT NULL,
    queue           text   NOT NULL,
    concurrency_key text   NOT NULL,
    priority        bigint NOT NULL,
    created_at      bigint NOT NULL,
    id              text   COLLATE "C" NOT NULL,
    PRIMARY KEY (endpoint, queue, concurrency_key)
);
CREATE INDEX key_heads_order ON key_heads (endpoint, priority DESC, created_at, id);
CREATE INDEX todos_keyed ON todos (endpoint, queue, concurrency_key, priority DESC, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed') AND concurrency_key IS NOT NULL;
CREATE INDEX todos_keyless ON todos (endpoint, queue, priority DESC, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed') AND concurrency_key IS NULL;
INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    SELECT DISTINCT ON (endpoint, queue, concurrency_key)
           endpoint, queue, concurrency_key, priority, created_at, id
      FROM todos
     WHERE state IN ('pending', 'claimed', 'failed') AND concurrency_key IS NOT NULL
     ORDER BY endpoint, queue, concurrency_key, priority DESC, created_at, id;

CREATE FUNCTION key_heads_lower() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO key_heads AS h (endpoint, queue, concurrency_key, priority, created_at, id)
    VALUES (NEW.endpoint, NEW.queue, NEW.concurrency_key, NEW.priority, NEW.created_at, NEW.id)
    ON CONFLICT (endpoint, queue, concurrency_key) DO UPDATE
       SET priority = EXCLUDED.priority, created_at = EXCLUDED.created_at, id = EXCLUDED.id
     WHERE (-EXCLUDED.priority, EXCLUDED.created_at, EXCLUDED.id) < (-h.priority, h.created_at, h.id);
    RETURN NULL;
END $$;

CREATE FUNCTION key_heads_raise() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM 1 FROM key_heads h
      WHERE h.endpoint = OLD.endpoint AND h.queue = OLD.queue
        AND h.concurrency_key = OLD.concurrency_key
      FOR UPDATE;
    DELETE FROM key_heads h
     WHERE h.endpoint = OLD.endpoint AND h.queue = OLD.queue
       AND h.concurrency_key = OLD.concurrency_key;
    INSERT INTO key_heads (endpoint, queue, concurrency_key, priority, created_at, id)
    SELECT t.endpoint, t.queue, t.concurrency_key, t.priority, t.created_at, t.id FROM todos t
     WHERE t.endpoint = OLD.endpoint AND t.queue = OLD.queue
       AND t.concurrency_key = OLD.concurrency_key
       AND t.state IN ('pending', 'claimed', 'failed')
     ORDER BY t.priority DESC, t.created_at, t.id LIMIT 1
    ON CONFLICT (endpoint, queue, concurrency_key) DO UPDATE
       SET priority = EXCLUDED.priority, created_at = EXCLUDED.created_at, id = EXCLUDED.id;
    RETURN NULL;
END $$;

CREATE TRIGGER key_heads_added AFTER INSERT ON todos FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.state IN ('pending', 'claimed', 'failed'))
    EXECUTE FUNCTION key_heads_lower();
CREATE TRIGGER key_heads_back AFTER UPDATE OF state ON todos FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.state IN ('pending', 'claimed', 'failed')
          AND OLD.state NOT IN ('pending', 'claimed', 'failed'))
    EXECUTE FUNCTION key_heads_lower();
CREATE TRIGGER key_heads_left AFTER UPDATE OF state ON todos FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL AND OLD.state IN ('pending', 'claimed', 'failed')
          AND NEW.state NOT IN ('pending', 'claimed', 'failed'))
    EXECUTE FUNCTION key_heads_raise();
CREATE TRIGGER key_heads_deleted AFTER DELETE ON todos FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL AND OLD.state IN ('pending', 'claimed', 'failed'))
    EXECUTE FUNCTION key_heads_raise();
"#;

/// Priorities and delayed todos: `claim_next` takes a higher priority first (FIFO within one),
/// and a pending todo is not claimable before its `run_at`. The FIFO index leads with the
/// priority so that a claim still walks it in order and stops at the first rows it can take.
/// `todos_delayed` holds only the delayed todos still waiting (the retry sweep clears a `run_at`
/// once it has come), so the sweep finds the due ones without a scan.
const MIGRATION_0014: &str = "
ALTER TABLE todos ADD COLUMN priority bigint NOT NULL DEFAULT 0
    CHECK (priority BETWEEN -100 AND 100);
ALTER TABLE todos ADD COLUMN run_at bigint;
DROP INDEX todos_fifo;
CREATE INDEX todos_fifo ON todos (endpoint, priority DESC, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed');
CREATE INDEX todos_delayed ON todos (run_at) WHERE state = 'pending' AND run_at IS NOT NULL;
";

/// Flow control: a todo's `concurrency_key`; `queue_limits`, a row per queue with limits;
/// `queue_claims`, the claims of the rate-limited queues within their window. `todos_claimed_keys`
/// counts what a limited queue holds from its claimed todos alone.
const MIGRATION_0015: &str = "
ALTER TABLE todos ADD COLUMN concurrency_key text
    CHECK (octet_length(concurrency_key) BETWEEN 1 AND 128);
CREATE INDEX todos_claimed_keys ON todos (queue, concurrency_key) WHERE state = 'claimed';
CREATE TABLE queue_limits (
    queue text PRIMARY KEY,
    max_claimed bigint CHECK (max_claimed BETWEEN 1 AND 1000000),
    max_claimed_per_key bigint CHECK (max_claimed_per_key BETWEEN 1 AND 1000000),
    claims_per_minute bigint CHECK (claims_per_minute BETWEEN 1 AND 1000000),
    updated_at bigint NOT NULL
);
CREATE TABLE queue_claims (
    queue text NOT NULL,
    claimed_at bigint NOT NULL
);
CREATE INDEX queue_claims_window ON queue_claims (queue, claimed_at);
";

/// A todo made as an MCP task keeps its task id (never changed after the add).
const MIGRATION_0013: &str = "
ALTER TABLE todos ADD COLUMN task_id text CHECK (octet_length(task_id) BETWEEN 1 AND 200);
";

/// The todos table before attempt history. Ids sort bytewise (`COLLATE "C"`) like Rust strings,
/// so FIFO ties and sweep order match the ledger whatever the database's locale.
const MIGRATION_0001: &str = r#"
CREATE TABLE todos (
    id               text COLLATE "C" NOT NULL PRIMARY KEY,
    endpoint         text    NOT NULL,
    queue            text    NOT NULL,
    title            text    NOT NULL,
    kind             text,
    source           text,
    payload          text,
    work_order       text,
    assignee         text,
    state            text    NOT NULL
        CHECK (state IN ('pending', 'claimed', 'failed', 'done', 'canceled')),
    owner            text,
    attempt          integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    lease_expires_at bigint,
    claimed_at       bigint,
    next_retry_at    bigint,
    result           text,
    created_at       bigint  NOT NULL,
    updated_at       bigint  NOT NULL,
    CHECK ((state = 'claimed') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);
-- claim_next: the live todos of an endpoint in FIFO order.
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed');
-- the reaper and the retry sweep
CREATE INDEX todos_lease ON todos (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX todos_retry ON todos (next_retry_at) WHERE state = 'failed';
-- retention: finished todos by age
CREATE INDEX todos_finished ON todos (updated_at) WHERE state IN ('done', 'canceled', 'failed');
"#;

/// Attempt history, as in SQLite's 0002 (see there for the backfill's counters), with the
/// one-open-attempt rule as a deferred exclusion constraint.
const MIGRATION_0002: &str = r#"
CREATE TABLE todo_attempts (
    todo_id           text COLLATE "C" NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    seq               integer NOT NULL CHECK (seq >= 1),
    attempt           integer NOT NULL CHECK (attempt >= 0),
    claimer_kind      text    NOT NULL CHECK (claimer_kind IN ('endpoint', 'owner')),
    claimer_endpoint  text,
    claimer_session   text,
    owner             text    NOT NULL,
    claimant          text    CHECK (octet_length(claimant) <= 128),
    claimed_at        bigint  NOT NULL,
    last_heartbeat_at bigint,
    lease_expires_at  bigint  NOT NULL,
    ended_at          bigint,
    outcome           text    CHECK (outcome IN ('completed', 'failed', 'released',
                                     'lease_expired', 'reaped', 'canceled', 'revoked')),
    disposition       text    CHECK (disposition IN ('done', 'retry_scheduled', 'requeued',
                                     'dead_lettered', 'canceled')),
    summary           text    CHECK (octet_length(summary) <= 2048),
    summary_truncated boolean NOT NULL DEFAULT false,
    artifact          text    CHECK (octet_length(artifact) <= 512),
    lease_token_hash  bytea   CHECK (octet_length(lease_token_hash) = 32),
    PRIMARY KEY (todo_id, seq),
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CHECK ((ended_at IS NULL) = (disposition IS NULL))
);
-- At most one open attempt per todo, checked at COMMIT: the transaction's final rows count, not
-- the order in which it wrote them.
ALTER TABLE todo_attempts ADD CONSTRAINT todo_attempts_one_open
    EXCLUDE USING btree (todo_id WITH =) WHERE (ended_at IS NULL)
    DEFERRABLE INITIALLY DEFERRED;

ALTER TABLE todos ADD COLUMN attempts_total  integer NOT NULL DEFAULT 0 CHECK (attempts_total >= 0);
ALTER TABLE todos ADD COLUMN attempts_pruned integer NOT NULL DEFAULT 0 CHECK (attempts_pruned >= 0);

UPDATE todos SET attempts_total = attempt, attempts_pruned = attempt WHERE state <> 'claimed';
UPDATE todos SET attempts_total = greatest(attempt, 1), attempts_pruned = greatest(attempt, 1) - 1
    WHERE state = 'claimed';
INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint, owner,
                           claimant, claimed_at, lease_expires_at)
SELECT id, attempts_total, attempt,
       CASE WHEN owner = 'operator' THEN 'owner' ELSE 'endpoint' END,
       CASE WHEN owner = 'operator' THEN NULL ELSE owner END,
       owner, 'migrated', coalesce(claimed_at, lease_expires_at, updated_at), lease_expires_at
FROM todos WHERE state = 'claimed';
"#;

const MIGRATION_0003: &str = r#"
CREATE TABLE endpoints (
    name       text COLLATE "C" NOT NULL PRIMARY KEY,
    token_hash bytea  NOT NULL CHECK (octet_length(token_hash) = 32),
    verbs      text   NOT NULL,
    queues     text,
    created_at bigint NOT NULL,
    revoked_at bigint
);
"#;

/// The change sequence the out-of-process doorbell scan follows (as SQLite's 0004): a trigger
/// numbers every insert and update of a todo row from a sequence, and a partial index serves
/// the scan. Sequence numbers are taken before commit, so numbers may commit out of order; see
/// [`PgStore::pending_since`] for how the scan never steps over one still in flight.
///
/// [`PgStore::pending_since`]: super::PgStore::pending_since
const MIGRATION_0004: &str = r#"
ALTER TABLE todos ADD COLUMN change_seq bigint NOT NULL DEFAULT 0;
CREATE SEQUENCE todo_change_seq;
CREATE INDEX todos_change ON todos (change_seq) WHERE state = 'pending';
CREATE FUNCTION todos_change_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.change_seq := nextval('todo_change_seq');
    RETURN NEW;
END
$$;
CREATE TRIGGER todos_change BEFORE INSERT OR UPDATE ON todos
    FOR EACH ROW EXECUTE FUNCTION todos_change_seq();
"#;

/// Recovery by failure class, as SQLite's 0005 (see there).
const MIGRATION_0005: &str = r#"
ALTER TABLE todos ADD COLUMN dead_letter_reason text CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todos ADD COLUMN idempotency_key text
    CHECK (octet_length(idempotency_key) BETWEEN 1 AND 200);
ALTER TABLE todos ADD COLUMN deadline_at bigint;
ALTER TABLE todos ADD COLUMN max_same_failures integer NOT NULL DEFAULT 0
    CHECK (max_same_failures BETWEEN 0 AND 10);
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key);
CREATE INDEX todos_deadline ON todos (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('pending', 'failed');
ALTER TABLE todo_attempts ADD COLUMN failure_signature text
    CHECK (octet_length(failure_signature) <= 128);
ALTER TABLE todo_attempts ADD COLUMN dead_letter_reason text CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todo_attempts ADD COLUMN late_reports text;
ALTER TABLE todo_attempts ADD COLUMN late_reports_total integer NOT NULL DEFAULT 0
    CHECK (late_reports_total >= 0);
UPDATE todo_attempts SET dead_letter_reason =
    CASE outcome WHEN 'revoked' THEN 'revoked' ELSE 'attempts_exhausted' END
    WHERE disposition = 'dead_lettered';
UPDATE todos SET dead_letter_reason = coalesce(
    (SELECT a.dead_letter_reason FROM todo_attempts a
      WHERE a.todo_id = todos.id AND a.seq = todos.attempts_total), 'attempts_exhausted')
    WHERE state = 'failed' AND next_retry_at IS NULL;
"#;

/// The Board (as SQLite's 0006): operators, their sessions, the closing operator of an
/// attempt, the paused queues.
const MIGRATION_0006: &str = r#"
CREATE TABLE operators (
    name       text COLLATE "C" NOT NULL PRIMARY KEY,
    token_hash bytea  NOT NULL UNIQUE CHECK (octet_length(token_hash) = 32),
    created_at bigint NOT NULL,
    revoked_at bigint
);
CREATE TABLE board_sessions (
    id_hash    bytea  NOT NULL PRIMARY KEY CHECK (octet_length(id_hash) = 32),
    operator   text COLLATE "C" NOT NULL REFERENCES operators (name) ON DELETE CASCADE,
    created_at bigint NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX board_sessions_operator ON board_sessions (operator);
-- Which operator closed an attempt (NULL: no operator did).
ALTER TABLE todo_attempts ADD COLUMN closed_by text CHECK (octet_length(closed_by) <= 64);
CREATE TABLE paused_queues (
    queue     text COLLATE "C" NOT NULL PRIMARY KEY,
    paused_at bigint NOT NULL
);
"#;

/// As SQLite's 0009: which sessions hold a doorbell stream, so that the per-endpoint cap can
/// make room by ending the least recently used session that holds none.
const MIGRATION_0008: &str = "
ALTER TABLE mcp_sessions ADD COLUMN stream_until bigint;
";

/// MCP sessions in the store (as SQLite's 0007), and the doorbell across servers: a todo that
/// becomes pending (added, released, reaped, re-queued, retried: from any server or the CLI)
/// sends a NOTIFY on [`READY_CHANNEL`] from its own transaction, delivered on commit to every
/// server listening. The payload names the schema, so stores in different schemas of one
/// database ring only their own. Only a change *into* `pending` notifies (the doorbell scan's
/// rule: see `rows::pending_since`), so updates of a pending todo cost nothing.
///
/// [`READY_CHANNEL`]: super::READY_CHANNEL
const MIGRATION_0007: &str = r#"
CREATE TABLE mcp_sessions (
    id_hash      bytea  NOT NULL PRIMARY KEY CHECK (octet_length(id_hash) = 32),
    endpoint     text COLLATE "C" NOT NULL,
    protocol     text   NOT NULL CHECK (octet_length(protocol) <= 32),
    created_at   bigint NOT NULL,
    last_used_at bigint NOT NULL
);
CREATE INDEX mcp_sessions_endpoint ON mcp_sessions (endpoint);
CREATE INDEX mcp_sessions_idle ON mcp_sessions (last_used_at);
CREATE FUNCTION todos_ready_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('relay_todo_ready', json_build_object(
        'schema', current_schema(), 'id', NEW.id, 'endpoint', NEW.endpoint,
        'queue', NEW.queue, 'attempts_total', NEW.attempts_total)::text);
    RETURN NULL;
END
$$;
CREATE TRIGGER todos_ready_insert AFTER INSERT ON todos
    FOR EACH ROW WHEN (NEW.state = 'pending') EXECUTE FUNCTION todos_ready_notify();
CREATE TRIGGER todos_ready_update AFTER UPDATE ON todos
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state <> 'pending')
    EXECUTE FUNCTION todos_ready_notify();
"#;

/// The Board's bulk actions (as SQLite's 0010).
const MIGRATION_0009: &str = r#"
CREATE TABLE board_bulk (
    id           text COLLATE "C" NOT NULL PRIMARY KEY,
    operator     text   NOT NULL,
    queue        text   NOT NULL,
    action       text   NOT NULL CHECK (action = 'retry' OR action = 'cancel'),
    filter       text   NOT NULL,
    created_at   bigint NOT NULL,
    confirmed_at bigint,
    finished_at  bigint
);
CREATE INDEX board_bulk_open ON board_bulk (created_at) WHERE finished_at IS NULL;
CREATE TABLE board_bulk_items (
    bulk_id         text COLLATE "C" NOT NULL REFERENCES board_bulk (id) ON DELETE CASCADE,
    todo_id         text COLLATE "C" NOT NULL,
    listed_state    text    NOT NULL,
    listed_attempts integer NOT NULL,
    result          text    CHECK (result = 'applied' OR result = 'skipped'),
    note            text,
    done_at         bigint,
    PRIMARY KEY (bulk_id, todo_id)
);
"#;

/// Fewer index entries for each write of a todo, so that a heartbeat rewrites its todo and its
/// attempt in place (HOT: Postgres adds no index entry when no indexed column changes and the
/// page has room):
/// - the reaper searches `lease_due_at`, a mark no later than the lease that a heartbeat leaves
///   alone, where it searched the lease itself (see `rows::pg_derived`);
/// - retention searches `finished_at`, `updated_at` once a todo is finished, where it searched
///   `updated_at`, which a heartbeat sets;
/// - the change sequence's trigger runs only for a row that is pending after the write (its
///   index covers pending rows only), where it ran for every write;
/// - the idempotency keys' unique index holds only the todos that have one.
///
/// The tables keep the default fillfactor: a heartbeat rewrites a row that a claim has just
/// written, on a page with room, and the rows left done are most of the table (a fifth of each
/// page left free made a million done todos a quarter larger in the scale bench).
const MIGRATION_0010: &str = r#"
ALTER TABLE todos ADD COLUMN lease_due_at bigint;
UPDATE todos SET lease_due_at = lease_expires_at WHERE lease_expires_at IS NOT NULL;
DROP INDEX todos_lease;
CREATE INDEX todos_lease ON todos (lease_due_at) WHERE state = 'claimed';
ALTER TABLE todos ADD COLUMN finished_at bigint;
UPDATE todos SET finished_at = updated_at WHERE state IN ('done', 'canceled', 'failed');
DROP INDEX todos_finished;
CREATE INDEX todos_finished ON todos (finished_at) WHERE finished_at IS NOT NULL;
DROP TRIGGER todos_change ON todos;
CREATE TRIGGER todos_change BEFORE INSERT OR UPDATE ON todos
    FOR EACH ROW WHEN (NEW.state = 'pending') EXECUTE FUNCTION todos_change_seq();
DROP INDEX todos_idempotency;
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
"#;

/// `/healthz`'s write probe (as SQLite's 0011).
const MIGRATION_0011: &str = "
CREATE TABLE store_heartbeat (
    id      integer NOT NULL PRIMARY KEY CHECK (id = 1),
    beat_at bigint  NOT NULL
);
";

/// Waiting for a human, and spend (as SQLite's 0012). Postgres alters the CHECK lists in place
/// and adds the columns without rewriting the tables (constant defaults).
const MIGRATION_0012: &str = "
ALTER TABLE todos DROP CONSTRAINT todos_state_check;
ALTER TABLE todos ADD CONSTRAINT todos_state_check CHECK (state IN ('pending', 'claimed',
    'failed', 'done', 'canceled', 'input_required'));
ALTER TABLE todos DROP CONSTRAINT todos_dead_letter_reason_check;
ALTER TABLE todos ADD CONSTRAINT todos_dead_letter_reason_check CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked',
     'input_requests_exhausted', 'no_answer', 'budget_exhausted'));
ALTER TABLE todos
    ADD COLUMN max_input_requests  integer NOT NULL DEFAULT 3
        CHECK (max_input_requests BETWEEN 0 AND 100),
    ADD COLUMN input_requests      integer NOT NULL DEFAULT 0 CHECK (input_requests >= 0),
    ADD COLUMN answer_within_ms    bigint CHECK (answer_within_ms > 0),
    ADD COLUMN answer_due_at       bigint,
    ADD COLUMN budget_cost_micros  bigint CHECK (budget_cost_micros > 0),
    ADD COLUMN budget_tokens       bigint CHECK (budget_tokens > 0),
    ADD COLUMN spent_cost_micros   bigint NOT NULL DEFAULT 0 CHECK (spent_cost_micros >= 0),
    ADD COLUMN spent_input_tokens  bigint NOT NULL DEFAULT 0 CHECK (spent_input_tokens >= 0),
    ADD COLUMN spent_output_tokens bigint NOT NULL DEFAULT 0 CHECK (spent_output_tokens >= 0),
    ADD CONSTRAINT todos_answer_due_waiting CHECK (answer_due_at IS NULL OR state = 'input_required');
CREATE INDEX todos_waiting ON todos (id) WHERE state = 'input_required';
ALTER TABLE todo_attempts DROP CONSTRAINT todo_attempts_outcome_check;
ALTER TABLE todo_attempts ADD CONSTRAINT todo_attempts_outcome_check CHECK (outcome IN
    ('completed', 'failed', 'released', 'lease_expired', 'reaped', 'canceled', 'revoked',
     'needs_input'));
ALTER TABLE todo_attempts DROP CONSTRAINT todo_attempts_disposition_check;
ALTER TABLE todo_attempts ADD CONSTRAINT todo_attempts_disposition_check CHECK (disposition IN
    ('done', 'retry_scheduled', 'requeued', 'dead_lettered', 'canceled', 'awaiting_input'));
ALTER TABLE todo_attempts DROP CONSTRAINT todo_attempts_dead_letter_reason_check;
ALTER TABLE todo_attempts ADD CONSTRAINT todo_attempts_dead_letter_reason_check CHECK
    (dead_letter_reason IN ('attempts_exhausted', 'non_retryable', 'deadline',
     'repeated_failure', 'revoked', 'input_requests_exhausted', 'no_answer', 'budget_exhausted'));
ALTER TABLE todo_attempts
    ADD COLUMN question            text CHECK (octet_length(question) <= 2048),
    ADD COLUMN answer              text CHECK (octet_length(answer) <= 8192),
    ADD COLUMN answered_at         bigint,
    ADD COLUMN answered_by         text CHECK (octet_length(answered_by) <= 200),
    ADD COLUMN answer_key          text CHECK (octet_length(answer_key) <= 200),
    ADD COLUMN usage_cost_micros   bigint NOT NULL DEFAULT 0 CHECK (usage_cost_micros >= 0),
    ADD COLUMN usage_input_tokens  bigint NOT NULL DEFAULT 0 CHECK (usage_input_tokens >= 0),
    ADD COLUMN usage_output_tokens bigint NOT NULL DEFAULT 0 CHECK (usage_output_tokens >= 0),
    ADD CONSTRAINT todo_attempts_answer_asked CHECK (answer IS NULL OR question IS NOT NULL);
";

/// The newest migration's number.
pub(crate) fn latest_migration() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

pub(super) async fn migrate(client: &mut Object, target: i32) -> Result<(), Error> {
    let err =
        |e: tokio_postgres::Error| Error::internal(format!("migrating the Postgres store: {e}"));
    let tx = client.transaction().await.map_err(err)?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version    integer NOT NULL PRIMARY KEY,
             name       text    NOT NULL,
             applied_at bigint  NOT NULL
         );
         LOCK TABLE schema_migrations IN EXCLUSIVE MODE;",
    )
    .await
    .map_err(err)?;
    let current: i32 = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            &[],
        )
        .await
        .map_err(err)?
        .get(0);
    let applied_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    for (version, name, sql) in MIGRATIONS {
        if *version <= current || *version > target {
            continue;
        }
        tx.batch_execute(sql).await.map_err(|e| {
            Error::internal(format!(
                "migrating the Postgres store: migration {version:04} ({name}) failed: {e}"
            ))
        })?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
            &[version, name, &applied_at],
        )
        .await
        .map_err(err)?;
    }
    tx.commit().await.map_err(err)
}
