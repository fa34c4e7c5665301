//! The Board's tables on both stores: operators, sessions (expiry, logout, revoke), paused queues.

use relay_core::ErrorCode;
use relay_core::board::SESSION_TTL;
use relay_core::ledger::{Actor, Op, TokenHash};
use relay_core::testing::Queue;

use super::{T0, cfg, new_todo, opts};
use crate::store::{BulkResult, Store};

async fn operators_and_sessions(store: Store) {
    let (tok, other) = (TokenHash::of("op-token-a"), TokenHash::of("op-token-b"));
    let o = store.operator_create(T0, "alice", tok).await.unwrap();
    assert_eq!((o.name.as_str(), o.revoked_at), ("alice", None));
    let e = store.operator_create(T0, "alice", other).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    let e = store
        .operator_create(T0, "bad name", other)
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Invalid);
    assert!(!format!("{o:?}").contains(&format!("{:?}", tok.0)));
    store.operator_create(T0, "bob", other).await.unwrap();
    let names: Vec<String> = store
        .operator_list()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.name)
        .collect();
    assert_eq!(names, ["alice", "bob"]);

    // Login finds the operator by its token's hash; an unknown token finds none.
    let found = store.operator_by_token(tok).await.unwrap().unwrap();
    assert_eq!(found.name, "alice");
    assert!(
        store
            .operator_by_token(TokenHash::of("nope"))
            .await
            .unwrap()
            .is_none()
    );

    // A session lives strictly before its expiry.
    let (s1, s2) = (TokenHash::of("session-1"), TokenHash::of("session-2"));
    let s = store.session_create(T0, s1, "alice").await.unwrap();
    assert_eq!(s.expires_at, T0 + SESSION_TTL);
    let live = store.session_get(T0 + 1, s1).await.unwrap().unwrap();
    assert_eq!(live.operator, "alice");
    assert!(
        store
            .session_get(T0 + SESSION_TTL, s1)
            .await
            .unwrap()
            .is_none()
    );
    assert!(store.session_get(T0, s2).await.unwrap().is_none());

    // Logout ends it.
    store.session_delete(s1).await.unwrap();
    assert!(store.session_get(T0 + 1, s1).await.unwrap().is_none());

    // Revoking the operator ends its sessions and its logins, not another's.
    store.session_create(T0, s1, "alice").await.unwrap();
    store.session_create(T0, s2, "bob").await.unwrap();
    let r = store.operator_revoke(T0 + 5, "alice").await.unwrap();
    assert_eq!(r.revoked_at, Some(T0 + 5));
    assert!(store.session_get(T0 + 6, s1).await.unwrap().is_none());
    assert!(store.session_get(T0 + 6, s2).await.unwrap().is_some());
    assert!(store.operator_by_token(tok).await.unwrap().is_none());
    let e = store.operator_revoke(T0 + 6, "alice").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    let e = store.operator_revoke(T0 + 6, "carol").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
}

test_on_both_stores!(
    operators_and_board_sessions_are_stored_hashed_and_end_on_expiry_logout_and_revoke,
    cfg(),
    operators_and_sessions
);

async fn pause(mut store: Store) {
    let e = Actor::endpoint("e");
    store
        .add_todo(T0, "e", new_todo("td_1", "ci"))
        .await
        .unwrap();
    store
        .add_todo(T0 + 1, "e", new_todo("td_2", "docs"))
        .await
        .unwrap();
    let paused = store.pause_queue(T0 + 2, &Actor::cli(), "ci", true).await;
    assert_eq!(paused.unwrap(), ["ci"]);
    // Pausing twice keeps one row.
    let paused = store.pause_queue(T0 + 2, &Actor::cli(), "ci", true).await;
    assert_eq!(paused.unwrap(), ["ci"]);
    let ci = vec!["ci".to_string()];
    let next = store
        .claim_next(T0 + 3, &e, Some(&ci), &opts(60, None))
        .await;
    assert!(next.unwrap().is_none());
    let next = store.claim_next(T0 + 3, &e, None, &opts(60, None)).await;
    assert_eq!(next.unwrap().unwrap().todo.id, "td_2");
    let refused = store
        .pause_queue(T0 + 4, &e, "ci", false)
        .await
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Forbidden);
    let resumed = store.pause_queue(T0 + 4, &Actor::cli(), "ci", false).await;
    assert!(resumed.unwrap().is_empty());
    let next = store.claim_next(T0 + 5, &e, None, &opts(60, None)).await;
    assert_eq!(next.unwrap().unwrap().todo.id, "td_1");
    let listed = store.apply(Op::PausedQueues).await.unwrap();
    assert!(listed.queues().unwrap().is_empty());
}

test_on_both_stores!(
    a_paused_queue_answers_claim_next_empty_on_both_stores,
    cfg(),
    pause
);

fn result(todo_id: &str, applied: bool, note: Option<&str>) -> BulkResult {
    BulkResult {
        todo_id: todo_id.into(),
        applied,
        note: note.map(str::to_string),
    }
}

async fn bulk_actions(store: Store) {
    use crate::store::{Bulk, BulkItem};
    use relay_core::board::{BulkAction, Listed};
    use relay_core::ledger::TodoState;
    // 250 items: more than one INSERT's worth of rows.
    let items: Vec<BulkItem> = (0..250)
        .map(|k| BulkItem {
            todo_id: format!("td_{k:04}"),
            listed: Listed {
                state: TodoState::Failed,
                attempts_total: k % 3,
            },
            applied: None,
            note: None,
        })
        .collect();
    let bulk = Bulk {
        id: "bk_1".into(),
        operator: "alice".into(),
        queue: "q".into(),
        action: BulkAction::Retry,
        filter: "state failed".into(),
        created_at: 0,
        confirmed_at: None,
        finished_at: None,
        items: items.clone(),
    };
    store.bulk_create(T0, bulk).await.unwrap();
    let got = store.bulk_get("bk_1").await.unwrap().unwrap();
    assert_eq!((got.created_at, got.confirmed_at), (T0, None));
    assert_eq!(got.items, items);
    // Unconfirmed: nothing to resume; another operator may not confirm it.
    assert!(store.bulk_open().await.unwrap().is_empty());
    let e = store.bulk_confirm(T0, "bk_1", "mallory").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Forbidden);
    store.bulk_confirm(T0 + 1, "bk_1", "alice").await.unwrap();
    store.bulk_confirm(T0 + 2, "bk_1", "alice").await.unwrap();
    assert_eq!(store.bulk_open().await.unwrap(), ["bk_1"]);
    // A result is recorded once.
    assert!(
        store
            .bulk_record(T0, "bk_1", result("td_0001", true, None))
            .await
            .unwrap()
    );
    assert!(
        !store
            .bulk_record(T0, "bk_1", result("td_0001", false, Some("again")))
            .await
            .unwrap()
    );
    assert!(
        store
            .bulk_record(T0, "bk_1", result("td_0002", false, Some("changed")))
            .await
            .unwrap()
    );
    let got = store.bulk_get("bk_1").await.unwrap().unwrap();
    assert_eq!(got.confirmed_at, Some(T0 + 1));
    assert_eq!(
        (got.items[1].applied, got.items[1].note.as_deref()),
        (Some(true), None)
    );
    assert_eq!(got.items[2].applied, Some(false));
    assert_eq!(got.items[2].note.as_deref(), Some("changed"));
    store.bulk_finish(T0 + 3, "bk_1").await.unwrap();
    assert!(store.bulk_open().await.unwrap().is_empty());
    assert!(store.bulk_get("bk_nope").await.unwrap().is_none());
    let e = store
        .bulk_confirm(T0, "bk_nope", "alice")
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
}

test_on_both_stores!(
    bulk_actions_are_recorded_and_resumable_on_both_stores,
    cfg(),
    bulk_actions
);
