//! The Board's bulk actions: listing the todos a queue page's filter matches, the confirm
//! page, and applying a confirmed action todo by todo (resumed after a stop).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use relay_core::ledger::{Actor, Op, TodoState};
use relay_core::{Error, ErrorCode};
use serde::Deserialize;

use super::login::{CsrfForm, LoggedIn, Posted, Posting};
use super::{Board, Filter, failure, html, matching, see_other, status_of};
use crate::server::Server;
use crate::store::BulkResult;

#[derive(Deserialize, Default)]
pub(super) struct BulkForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    queue: String,
    #[serde(default)]
    action: String,
    #[serde(flatten)]
    filter: Filter,
}

impl Posting for BulkForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

/// "Retry all" / "Cancel all" on a queue page: lists every todo the page's filter matches, as
/// it stands now, in a bulk action that waits for the operator's confirmation (the next page
/// shows the count). Nothing changes until then.
pub(super) async fn bulk_create(
    State(b): State<Board>,
    Posted(s, f): Posted<BulkForm>,
) -> Response {
    let made = async {
        let action = relay_core::board::BulkAction::parse(f.action.trim()).ok_or_else(|| {
            Error::invalid(format!(
                "action {:?} is no bulk action; use retry or cancel",
                f.action
            ))
        })?;
        let m = f.filter.todo_match()?;
        let queue = f.queue.trim().to_string();
        let todos = matching(&b, &s.operator, &queue, &m).await?;
        if todos.is_empty() {
            return Err(Error::invalid(format!(
                "no todo of queue {queue} matches {}; nothing to {action}",
                m.describe()
            )));
        }
        let mut raw = [0u8; 10];
        b.server.fill_random(&mut raw)?;
        let id = format!(
            "bk_{}",
            raw.iter().map(|x| format!("{x:02x}")).collect::<String>()
        );
        let mut items: Vec<crate::store::BulkItem> = todos
            .iter()
            .map(|t| crate::store::BulkItem {
                todo_id: t.id.clone(),
                listed: relay_core::board::Listed::of(t),
                applied: None,
                note: None,
            })
            .collect();
        items.sort_by(|a, c| a.todo_id.cmp(&c.todo_id));
        let bulk = crate::store::Bulk {
            id: id.clone(),
            operator: s.operator.clone(),
            queue,
            action,
            filter: m.describe(),
            // The store stamps it with its own clock.
            created_at: 0,
            confirmed_at: None,
            finished_at: None,
            items,
        };
        b.store().bulk_create(b.server.now(), bulk).await?;
        Ok::<_, Error>(id)
    };
    match made.await {
        Ok(id) => see_other(&format!("/board/bulk/{id}")),
        Err(e) => failure(&b, &s, &e),
    }
}

/// A bulk action's page: the confirmation (with the count) until confirmed, then its progress
/// and every listed todo's result.
pub(super) async fn bulk_page(
    State(b): State<Board>,
    Path(id): Path<String>,
    s: LoggedIn,
) -> Response {
    match b.store().bulk_get(&id).await {
        Ok(Some(bulk)) => html(StatusCode::OK, html::bulk(&s.csrf, &s.operator, &bulk)),
        Ok(None) => failure(
            &b,
            &s,
            &Error::not_found(format!("no bulk action {id}; start one from a queue page")),
        ),
        Err(e) => failure(&b, &s, &e),
    }
}

/// The confirmation: from now on the action is applied, todo by todo, and resumed after a stop.
pub(super) async fn bulk_confirm(
    State(b): State<Board>,
    Path(id): Path<String>,
    Posted(s, _): Posted<CsrfForm>,
) -> Response {
    if let Err(e) = b
        .store()
        .bulk_confirm(b.server.now(), &id, &s.operator)
        .await
    {
        return failure(&b, &s, &e);
    }
    tracing::info!(operator = %s.operator, bulk = %id, "board: bulk action confirmed");
    tokio::spawn(run_bulk(b.server.clone(), id.clone()));
    see_other(&format!("/board/bulk/{id}"))
}

/// Carries on every confirmed bulk action that is not finished (a server starting after a stop
/// midway). On Postgres several servers may each resume one: each todo's result is recorded
/// once, and `bulk_step` skips a todo another server already changed.
pub(crate) fn resume_bulks(server: Server) {
    tokio::spawn(async move {
        match server.store().bulk_open().await {
            Ok(ids) => {
                for id in ids {
                    tracing::info!(bulk = %id, "board: resuming a bulk action");
                    run_bulk(server.clone(), id).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "board: cannot list the bulk actions to resume"),
        }
    });
}

/// Applies a confirmed bulk action to each listed todo without a result, in todo id order:
/// `relay_core::board::bulk_step` decides, and the action is the very `Op::Retry` /
/// `Op::Cancel` a Retry or Cancel button sends, as the operator who confirmed it. Each result is
/// recorded as it happens, so a stop loses at most the todo in hand (whose state then shows it).
async fn run_bulk(server: Server, id: String) {
    use relay_core::board::{BulkAction, BulkStep, bulk_step};
    let store = server.store().clone();
    let bulk = match store.bulk_get(&id).await {
        Ok(Some(b)) if b.confirmed_at.is_some() && b.finished_at.is_none() => b,
        Ok(_) => return,
        Err(e) => {
            tracing::warn!(bulk = %id, error = %e, "board: cannot read a bulk action; it resumes at the next start");
            return;
        }
    };
    let actor = || Actor::operator(&bulk.operator);
    for item in bulk.items.iter().filter(|i| i.applied.is_none()) {
        let get = Op::GetTodo {
            actor: actor(),
            id: item.todo_id.clone(),
            attempts_limit: 1,
        };
        let (applied, note): (bool, Option<String>) = match store
            .apply(get)
            .await
            .and_then(|a| a.view())
        {
            Err(e) if e.code == ErrorCode::NotFound => (false, Some("deleted since".into())),
            Err(e) => {
                tracing::warn!(bulk = %id, error = %e, "board: a bulk action stopped; it resumes at the next start");
                return;
            }
            Ok(view) => match bulk_step(bulk.action, item.listed, &view.todo) {
                BulkStep::Skip(why) => (false, Some(why.to_string())),
                BulkStep::AlreadyApplied => (true, Some("applied before a restart".into())),
                BulkStep::Apply => {
                    let (now, todo) = (server.now(), item.todo_id.clone());
                    let op = match bulk.action {
                        BulkAction::Retry => Op::Retry {
                            now,
                            actor: actor(),
                            id: todo,
                        },
                        BulkAction::Cancel => Op::Cancel {
                            now,
                            actor: actor(),
                            id: todo,
                        },
                    };
                    match store.apply(op).await.and_then(|a| a.todo()) {
                        Ok(t) => {
                            if t.state == TodoState::Pending {
                                let offer =
                                    relay_core::doorbell::Offer::of_pending(t.attempts_total);
                                server.ring_todo(&t, offer);
                            } else {
                                server.notice(&Ok(relay_core::ledger::Answer::Todo(t)));
                            }
                            (true, None)
                        }
                        // The ledger refused it (it changed in the instant between): skipped.
                        Err(e) if status_of(&e) != StatusCode::INTERNAL_SERVER_ERROR => {
                            (false, Some(e.message))
                        }
                        Err(e) => {
                            tracing::warn!(bulk = %id, error = %e, "board: a bulk action stopped; it resumes at the next start");
                            return;
                        }
                    }
                }
            },
        };
        let result = BulkResult {
            todo_id: item.todo_id.clone(),
            applied,
            note,
        };
        if let Err(e) = store.bulk_record(server.now(), &id, result).await {
            tracing::warn!(bulk = %id, error = %e, "board: a bulk action stopped; it resumes at the next start");
            return;
        }
        server.board_notice(&id);
    }
    if let Err(e) = store.bulk_finish(server.now(), &id).await {
        tracing::warn!(bulk = %id, error = %e, "board: cannot mark a bulk action finished");
        return;
    }
    tracing::info!(bulk = %id, operator = %bulk.operator, action = %bulk.action, listed = bulk.items.len(), "board: bulk action finished");
    server.board_notice(&id);
}
