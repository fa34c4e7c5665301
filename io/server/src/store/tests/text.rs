//! One text rule for both stores (relay-core's `bounds` and `ledger::valid_todo_id`): the same
//! input gets the same answer on SQLite and Postgres, NUL and controls included.

use relay_core::ErrorCode;
use relay_core::ledger::{Actor, Report, TodoFilter};
use relay_core::testing::Queue;

use super::{T0, all_attempts, cfg, new_todo, opts};
use crate::store::Store;

/// A summary with NUL, an escape sequence, a bell and a non-BMP character.
const HOSTILE: &str = "ok\u{0}\u{1b}[2J\u{7}\tdone\n🦀";
const CLEANED: &str = "ok[2J\tdone\n🦀";

async fn reports_with_nul_close_their_attempts(mut store: Store) {
    let e1 = Actor::endpoint("e1");
    for (i, verb) in ["complete", "fail", "release"].iter().enumerate() {
        let id = format!("td_{i}");
        store.add_todo(T0, "e1", new_todo(&id, "q")).await.unwrap();
        store.claim(T0, &e1, &id, &opts(30, None)).await.unwrap();
        let report = Report {
            summary: Some(HOSTILE.into()),
            ..Report::default()
        };
        let r = match *verb {
            "complete" => store.complete(T0 + 1, &e1, &id, &report).await,
            "fail" => store.fail(T0 + 1, &e1, &id, &report).await,
            _ => store.release(T0 + 1, &e1, &id, Some(HOSTILE), None).await,
        };
        r.unwrap_or_else(|e| panic!("{verb} with a NUL in its summary: {e}"));
        let (_, attempts) = all_attempts(&store, &id).await;
        assert_eq!(attempts[0].summary.as_deref(), Some(CLEANED), "{verb}");
        assert!(
            attempts[0].summary_truncated,
            "{verb}: the cleaning is flagged"
        );
    }
}

test_on_both_stores!(
    a_summary_with_nul_and_controls_is_cleaned_and_closes_the_attempt,
    cfg(),
    reports_with_nul_close_their_attempts
);

async fn nul_in_ids_and_queue_filters(mut store: Store) {
    let e1 = Actor::endpoint("e1");
    store
        .add_todo(T0, "e1", new_todo("td_1", "q"))
        .await
        .unwrap();
    for id in ["td_1\u{0}", "\u{0}", "td_\u{1b}", "td_🦀"] {
        let code = |r: Result<(), relay_core::Error>| r.unwrap_err().code;
        assert_eq!(
            code(store.get_todo(&e1, id, 5).await.map(|_| ())),
            ErrorCode::NotFound,
            "get_todo {id:?}"
        );
        assert_eq!(
            code(store.claim(T0, &e1, id, &opts(30, None)).await.map(|_| ())),
            ErrorCode::NotFound,
            "claim {id:?}"
        );
        assert_eq!(
            code(
                store
                    .complete(T0, &e1, id, &Report::default())
                    .await
                    .map(|_| ())
            ),
            ErrorCode::NotFound,
            "complete {id:?}"
        );
        assert_eq!(
            code(store.cancel(T0, &Actor::cli(), id).await.map(|_| ())),
            ErrorCode::NotFound,
            "cancel {id:?}"
        );
    }
    let nul_queue = vec!["q\u{0}".to_string()];
    let listed = store
        .list_todos(
            &e1,
            &TodoFilter {
                queues: Some(nul_queue.clone()),
                state: None,
                after: None,
                limit: 10,
            },
        )
        .await
        .unwrap();
    assert!(listed.is_empty());
    let next = store
        .claim_next(T0, &e1, Some(&nul_queue), &opts(30, None))
        .await
        .unwrap();
    assert!(next.is_none());
    // A title, kind or source with NUL is `invalid`, naming the argument.
    for (field, mut n) in [
        ("title", new_todo("td_2", "q")),
        ("kind", new_todo("td_2", "q")),
        ("source", new_todo("td_2", "q")),
    ] {
        match field {
            "title" => n.title = "a\u{0}b".into(),
            "kind" => n.kind = Some("a\u{0}b".into()),
            _ => n.source = Some("a\u{0}b".into()),
        }
        let e = store.add_todo(T0, "e1", n).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid, "{field}");
        assert!(e.message.contains(field), "{field}: {}", e.message);
    }
}

test_on_both_stores!(
    nul_in_an_id_or_queue_filter_answers_not_found_or_empty_on_both_stores,
    cfg(),
    nul_in_ids_and_queue_filters
);
