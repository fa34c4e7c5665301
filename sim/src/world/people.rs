//! People in the loop, and spend: the questions agents ask, the operators who answer them late,
//! twice or never, and what the agents spend against their todos' budgets.

use relay_core::ErrorCode;
use relay_core::ledger::{TodoState, transition};
use relay_core::time::{Millis, SECOND};
use relay_core::wire::UsageArg;

use crate::options::Mutation;

use super::*;

/// How an agent keeps its usage file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writes {
    /// Its totals so far, rewritten whole.
    Figures,
    /// Nothing: the file stays as the daemon created it, empty.
    Nothing,
    /// Figures the server would refuse: nothing is sent, and the driver warns once.
    Garbage,
}

/// What one agent process spends: from its spawn until it exits, at its own rates.
#[derive(Clone, Debug)]
pub(super) struct Spend {
    from: Millis,
    until: Option<Millis>,
    /// Per minute of running.
    cost_micros: u64,
    input_tokens: u64,
    output_tokens: u64,
    writes: Writes,
}

impl Spend {
    /// The usage file as the agent has left it at `now`.
    fn file(&self, now: Millis) -> Vec<u8> {
        let ran = self.until.unwrap_or(now).min(now).saturating_sub(self.from);
        let so_far = |per_minute: u64| per_minute * ran / MINUTE;
        match self.writes {
            Writes::Nothing => Vec::new(),
            Writes::Garbage => br#"{"cost_usd": "plenty", "input_tokens": -1}"#.to_vec(),
            Writes::Figures => {
                let c = so_far(self.cost_micros);
                format!(
                    r#"{{"cost_usd": {}.{:06}, "input_tokens": {}, "output_tokens": {}}}"#,
                    c / 1_000_000,
                    c % 1_000_000,
                    so_far(self.input_tokens),
                    so_far(self.output_tokens)
                )
                .into_bytes()
            }
        }
    }

    /// The process has exited: its spend stops growing.
    pub(super) fn stop(&mut self, now: Millis) {
        self.until.get_or_insert(now);
    }
}

impl World {
    /// Todo `n`'s question budget, answer deadline (seconds) and spend budget, drawn from a
    /// stream of the todo's own. A todo that nobody may answer must have an answer deadline
    /// (see [`World::on_question`]), so that it ends `no_answer` rather than waiting forever.
    pub(super) fn todo_people(&self, n: usize) -> (Option<u32>, Option<u64>, Budget) {
        let mut r = Rng::stream(self.o.seed, &format!("todo-{n}"));
        // Some todos allow one question or none: the next one dead-letters them.
        let max_input_requests = r.chance(300).then(|| r.range(0, 1) as u32);
        let answer_within = r
            .chance(600)
            .then(|| r.range(5 * MINUTE, ANSWER_WITHIN_MAX) / SECOND);
        let budget = if r.chance(self.o.people.budgets) {
            let cost = r.range(50_000, 1_500_000);
            let tokens = r.range(3_000, 80_000);
            match r.below(3) {
                0 => Budget {
                    cost_micros: Some(cost),
                    tokens: None,
                },
                1 => Budget {
                    cost_micros: None,
                    tokens: Some(tokens),
                },
                _ => Budget {
                    cost_micros: Some(cost),
                    tokens: Some(tokens),
                },
            }
        } else {
            Budget::default()
        };
        (max_input_requests, answer_within, budget)
    }

    /// What a newly spawned agent will spend, and how it keeps its usage file.
    pub(super) fn draw_spend(&mut self) -> Spend {
        let r = &mut self.asking;
        let writes = match r.below(20) {
            0 => Writes::Garbage,
            1..=3 => Writes::Nothing,
            _ => Writes::Figures,
        };
        let input_tokens = r.range(500, 8_000);
        Spend {
            from: self.now,
            until: None,
            cost_micros: r.range(2_000, 60_000),
            input_tokens,
            output_tokens: input_tokens / 8,
            writes,
        }
    }

    /// Whether this agent run ends by asking a person (its summary file then holds
    /// `needs_input`), and the file.
    pub(super) fn agent_asks(&mut self, todo: &str) -> Option<Vec<u8>> {
        // An MCP task's agent asks three times as often: its client is there to answer, and the
        // few tasks of a seed should reach their input requests often enough to mean something.
        let task = self.ledger.todo(todo).is_some_and(|t| t.task_id.is_some());
        let ask = self.o.people.ask;
        let per_mille = if task { (ask * 3).min(750) } else { ask };
        self.asking.chance(per_mille).then(|| {
            format!(
                r#"{{"needs_input": "which branch for {todo}, main or release-2?", "summary": "two branches match"}}"#
            )
            .into_bytes()
        })
    }

    /// The usage the driver sends with a heartbeat or report of `run_id`: the agent's usage
    /// file read now and parsed by core. Nothing before the spawn, nor for a file it cannot use
    /// (the driver's one warning for the attempt is counted).
    pub(super) fn usage_of(&mut self, r: usize, run_id: u64) -> Option<UsageArg> {
        let now = self.now;
        let run = self.hosts[r].runs.get_mut(&run_id)?;
        let bytes = run.spend.as_ref()?.file(now);
        let (usage, warning) = run.usage_file.read(Ok(Some(bytes)));
        if warning.is_some() {
            self.count("usage_unreadable");
        }
        usage
    }

    /// A relay's question left todo `id` waiting: an operator answers it after a while, or,
    /// when the todo has an answer deadline, sometimes never (the retry sweep then dead-letters
    /// it `no_answer`). A todo without a deadline is always answered: nothing else would end its
    /// wait.
    pub(super) fn on_question(&mut self, id: &str) {
        self.count("asked");
        let Some(t) = self.ledger.todo(id) else {
            return;
        };
        let seq = t.attempts_total;
        // A task's question is its client's to answer (`tasks/update`); now and then an
        // operator answers it at the Board too, and one of the two comes too late.
        if t.task_id.is_some() && !self.answering.chance(250) {
            return;
        }
        if t.asking.answer_within.is_some() && self.answering.chance(self.o.people.unanswered) {
            self.count("left_unanswered");
            return;
        }
        let delay = self
            .answering
            .range(SECOND, self.o.people.answer_delay_max.max(SECOND));
        self.schedule(
            self.now + delay,
            Ev::Answer {
                id: id.to_string(),
                text: format!("use release-2 (for question {seq})"),
                key: format!("answer-{id}-{seq}"),
                repeat: false,
            },
        );
    }

    /// An operator answers todo `id` (`relay todo answer`, under a key). The world remembers
    /// every answer the ledger accepts, by the attempt that asked; the invariants hold the
    /// ledger to it. Now and then the operator repeats the answer under the same key, as a
    /// client whose reply was lost does: that must answer the todo as it is and change nothing.
    pub(super) fn operator_answers(&mut self, id: &str, text: String, key: String, repeat: bool) {
        let Some(before) = self.ledger.todo(id).cloned() else {
            return;
        };
        self.touched.insert(id.to_string());
        let waiting = before.state == TodoState::InputRequired;
        let answered = if waiting && self.o.mutation == Some(Mutation::AnswerDropped) {
            self.drop_answer(&before, &text, &key)
        } else {
            let op = Op::AnswerTodo {
                now: self.now,
                actor: Actor::cli(),
                id: id.to_string(),
                answer: text.clone(),
                key: Some(key.clone()),
                seq: None,
            };
            self.ledger.apply(op).and_then(ledger::Answer::todo)
        };
        let t = match answered {
            Ok(t) => t,
            Err(e) if !waiting && e.code == ErrorCode::Conflict => {
                // Too late: the todo was canceled, or dead-lettered for want of an answer.
                self.count("answer_refused");
                return;
            }
            Err(e) => {
                self.violate(Kind::Correctness, "server", e.to_string());
                return;
            }
        };
        if !waiting {
            // Accepted only as the repeat of an answer the ledger took under this key.
            if self.given.iter().any(|((t, _), g)| t == id && g.key == key) {
                self.count("answer_repeated");
            } else {
                self.violate(
                    Kind::Correctness,
                    "answered_once",
                    format!(
                        "an answer to {id}, {}, not waiting, was accepted",
                        before.state
                    ),
                );
            }
            return;
        }
        let seq = before.attempts_total;
        let given = Given {
            text: text.clone(),
            key: key.clone(),
            by: transition::answered_by(&Actor::cli()),
        };
        if let Some(first) = self.given.insert((id.to_string(), seq), given) {
            self.violate(
                Kind::Correctness,
                "answered_once",
                format!("{id} seq {seq} was answered a second time (first {first:?})"),
            );
            return;
        }
        self.count("answered");
        self.ring(&[t], Offer::Requeued);
        if !repeat && self.answering.chance(self.o.people.repeat) {
            let at = self.now + self.answering.range(SECOND, 10 * MINUTE);
            let id = id.to_string();
            self.schedule(
                at,
                Ev::Answer {
                    id,
                    text,
                    key,
                    repeat: true,
                },
            );
        }
    }

    /// The answer-dropped canary: the server acknowledges the answer and makes the todo pending
    /// again, but never writes the answer on the attempt that asked.
    fn drop_answer(
        &mut self,
        before: &Todo,
        text: &str,
        key: &str,
    ) -> Result<Todo, relay_core::Error> {
        let mut recent: Vec<Attempt> = self
            .ledger
            .attempts(&before.id)
            .filter(|a| !a.is_open())
            .cloned()
            .collect();
        recent.reverse();
        recent.truncate(ledger::PRIOR_ATTEMPTS);
        let cli = Actor::cli();
        let change = transition::answer(self.now, before, &recent, &cli, text, Some(key), None)?;
        let Some(mut change) = change else {
            return Ok(before.clone());
        };
        change.writes.clear();
        self.ledger.apply_change(change)
    }
}
