//! The decoding of a result row into a todo, an attempt or an endpoint.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    Asking, Attempt, Budget, ClaimerKind, DeadLetterReason, Disposition, Outcome, Question, TaskId,
    Todo, TodoState, TokenHash, Usage,
};
use serde_json::Value;

use crate::store::types::Endpoint;

/// What the decoders need from a result row; each backend maps its own types.
pub(crate) trait Row {
    fn text(&self, i: usize) -> Result<Option<String>, String>;
    fn int(&self, i: usize) -> Result<Option<i64>, String>;
    fn boolean(&self, i: usize) -> Result<bool, String>;
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String>;
}

fn bad(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("reading {what} from the store: {e}"))
}

struct Reader<'r, R: Row + ?Sized> {
    row: &'r R,
    at: usize,
    what: &'static str,
}

impl<R: Row + ?Sized> Reader<'_, R> {
    fn next(&mut self) -> usize {
        self.at += 1;
        self.at - 1
    }
    fn opt_text(&mut self) -> Result<Option<String>, Error> {
        let i = self.next();
        self.row.text(i).map_err(|e| bad(self.what, e))
    }
    fn text(&mut self) -> Result<String, Error> {
        let at = self.at;
        self.opt_text()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))
    }
    fn opt_int(&mut self) -> Result<Option<i64>, Error> {
        let i = self.next();
        self.row.int(i).map_err(|e| bad(self.what, e))
    }
    fn opt_millis(&mut self) -> Result<Option<Millis>, Error> {
        self.opt_int()?
            .map(|v| Millis::try_from(v).map_err(|e| bad(self.what, e)))
            .transpose()
    }
    fn millis(&mut self) -> Result<Millis, Error> {
        let at = self.at;
        self.opt_millis()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))
    }
    /// A usage or budget figure (`None` for NULL).
    fn opt_figure(&mut self) -> Result<Option<u64>, Error> {
        self.opt_int()?
            .map(|v| u64::try_from(v).map_err(|e| bad(self.what, e)))
            .transpose()
    }
    fn figure(&mut self) -> Result<u64, Error> {
        let at = self.at;
        self.opt_figure()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))
    }
    fn count(&mut self) -> Result<u32, Error> {
        let at = self.at;
        let v = self
            .opt_int()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))?;
        u32::try_from(v).map_err(|e| bad(self.what, e))
    }
    fn json(&mut self) -> Result<Option<Value>, Error> {
        self.opt_text()?
            .map(|s| serde_json::from_str(&s).map_err(|e| bad(self.what, e)))
            .transpose()
    }
    fn boolean(&mut self) -> Result<bool, Error> {
        let i = self.next();
        self.row.boolean(i).map_err(|e| bad(self.what, e))
    }
    fn hash(&mut self) -> Result<Option<TokenHash>, Error> {
        let i = self.next();
        match self.row.bytes(i).map_err(|e| bad(self.what, e))? {
            None => Ok(None),
            Some(b) => <[u8; 32]>::try_from(b.as_slice())
                .map(|h| Some(TokenHash(h)))
                .map_err(|_| bad(self.what, "a token hash is not 32 bytes")),
        }
    }
    fn parsed<T>(&mut self, parse: fn(&str) -> Option<T>) -> Result<Option<T>, Error> {
        match self.opt_text()? {
            None => Ok(None),
            Some(s) => parse(&s)
                .map(Some)
                .ok_or_else(|| bad(self.what, format!("unknown value {s:?}"))),
        }
    }
}

/// Decodes a todo from the columns of `TODO_COLS` starting at `at`.
pub(crate) fn todo<R: Row + ?Sized>(row: &R, at: usize) -> Result<Todo, Error> {
    let mut r = Reader {
        row,
        at,
        what: "a todo",
    };
    Ok(Todo {
        id: r.text()?,
        endpoint: r.text()?,
        queue: r.text()?,
        title: r.text()?,
        kind: r.opt_text()?,
        source: r.opt_text()?,
        payload: r.json()?,
        work_order: r.json()?,
        assignee: r.opt_text()?,
        state: r
            .parsed(TodoState::parse)?
            .ok_or_else(|| bad("a todo", "state is NULL"))?,
        owner: r.opt_text()?,
        attempt: r.count()?,
        max_attempts: r.count()?,
        attempts_total: r.count()?,
        attempts_pruned: r.count()?,
        lease_expires_at: r.opt_millis()?,
        claimed_at: r.opt_millis()?,
        next_retry_at: r.opt_millis()?,
        result: r.json()?,
        created_at: r.millis()?,
        updated_at: r.millis()?,
        dead_letter_reason: r.parsed(DeadLetterReason::parse)?,
        idempotency_key: r.opt_text()?,
        deadline_at: r.opt_millis()?,
        max_same_failures: r.count()?,
        asking: Asking {
            max_requests: r.count()?,
            requests: r.count()?,
            answer_within: r.opt_millis()?,
            answer_due_at: r.opt_millis()?,
        },
        budget: Budget {
            cost_micros: r.opt_figure()?,
            tokens: r.opt_figure()?,
        },
        spent: Usage {
            cost_micros: r.figure()?,
            input_tokens: r.figure()?,
            output_tokens: r.figure()?,
        },
        task_id: match r.opt_text()? {
            None => None,
            Some(s) => {
                Some(TaskId::parse(&s).ok_or_else(|| bad("a todo", "task_id is malformed"))?)
            }
        },
        priority: {
            let v = r.opt_int()?.unwrap_or(0);
            i32::try_from(v).map_err(|e| bad("a todo", e))?
        },
        run_at: r.opt_millis()?,
        concurrency_key: r.opt_text()?,
    })
}

/// Decodes an attempt from the columns of `ATTEMPT_COLS` starting at `at`; `None` when they are all NULL (an
/// outer join that found no attempt).
pub(crate) fn attempt<R: Row>(row: &R, at: usize) -> Result<Option<Attempt>, Error> {
    let mut r = Reader {
        row,
        at,
        what: "an attempt",
    };
    let Some(todo_id) = r.opt_text()? else {
        return Ok(None);
    };
    let mut a = Attempt {
        todo_id,
        seq: r.count()?,
        attempt: r.count()?,
        claimer_kind: r
            .parsed(ClaimerKind::parse)?
            .ok_or_else(|| bad("an attempt", "claimer_kind is NULL"))?,
        claimer_endpoint: r.opt_text()?,
        claimer_session: r.opt_text()?,
        owner: r.text()?,
        claimant: r.opt_text()?,
        claimed_at: r.millis()?,
        last_heartbeat_at: r.opt_millis()?,
        lease_expires_at: r.millis()?,
        ended_at: r.opt_millis()?,
        outcome: r.parsed(Outcome::parse)?,
        disposition: r.parsed(Disposition::parse)?,
        summary: r.opt_text()?,
        summary_truncated: r.boolean()?,
        artifact: r.opt_text()?,
        closed_by: r.opt_text()?,
        failure_signature: r.opt_text()?,
        dead_letter_reason: r.parsed(DeadLetterReason::parse)?,
        question: r.opt_text()?.map(|text| Question {
            text,
            answer: None,
            answered_at: None,
            answered_by: None,
            answer_key: None,
        }),
        usage: Usage {
            cost_micros: r.figure()?,
            input_tokens: r.figure()?,
            output_tokens: r.figure()?,
        },
        lease_token_hash: r.hash()?,
        late_reports: r
            .opt_text()?
            .map(|s| serde_json::from_str(&s).map_err(|e| bad("an attempt", e)))
            .transpose()?
            .unwrap_or_default(),
        late_reports_total: r.count()?,
    };
    let answer = r.opt_text()?;
    match a.question.as_mut() {
        Some(q) => {
            q.answer = answer;
            q.answered_at = r.opt_millis()?;
            q.answered_by = r.opt_text()?;
            q.answer_key = r.opt_text()?;
        }
        None if answer.is_some() => return Err(bad("an attempt", "an answer without a question")),
        None => {}
    }
    Ok(Some(a))
}

/// Decodes an endpoint from the columns of [`ENDPOINT_COLS`]; verbs and queues are JSON arrays.
///
/// [`ENDPOINT_COLS`]: super::ENDPOINT_COLS
pub(crate) fn endpoint<R: Row>(row: &R) -> Result<Endpoint, Error> {
    let mut r = Reader {
        row,
        at: 0,
        what: "an endpoint",
    };
    let name = r.text()?;
    let token_hash = r
        .hash()?
        .ok_or_else(|| bad("an endpoint", "token_hash is NULL"))?;
    let list = |v: Option<Value>| -> Result<Option<Vec<String>>, Error> {
        v.map(|v| serde_json::from_value(v).map_err(|e| bad("an endpoint", e)))
            .transpose()
    };
    let verbs = list(r.json()?)?.unwrap_or_default();
    let queues = list(r.json()?)?;
    Ok(Endpoint {
        name,
        token_hash,
        verbs,
        queues,
        created_at: r.millis()?,
        revoked_at: r.opt_millis()?,
    })
}
