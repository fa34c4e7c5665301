//! MCP resources: one per todo an endpoint can see, `relay://todos/<id>`. `resources/list`
//! pages through them in list order with an opaque cursor (keyset paging over
//! `(created_at, id)`, so a page never skips or repeats a todo while others are added);
//! `resources/read` answers the todo's `get_todo` answer as JSON and a short text rendering.
//!
//! Both are `list_todos`' reach: granted with the `list_todos` verb and scoped exactly like
//! `get_todo` (a read is a `get_todo` call, served by [`crate::serve`]), so a foreign or unknown
//! id answers the same `not_found`. Sans-IO like the serving function: the driver applies the
//! operation and hands the answer back.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::Millis;
use crate::error::{Error, ErrorCode};
use crate::grant::Grant;
use crate::ledger::transition::not_found;
use crate::ledger::{Actor, Answer, Op, Todo, TodoFilter, valid_todo_id};
use crate::serve::Served;
use crate::wire::{GetTodoOut, Tool};

/// Where a todo's resource URI starts; the todo id follows.
pub const URI_PREFIX: &str = "relay://todos/";
/// The resources' MIME type.
pub const MIME_JSON: &str = "application/json";
/// Resources one `resources/list` page holds at most.
pub const PAGE: usize = 50;
/// Attempts a read's timeline holds at most (newest first), as `get_todo`'s default.
pub const READ_ATTEMPTS: u32 = crate::wire::ATTEMPTS_LIMIT_DEFAULT;
/// How a cursor starts; what follows is the hex of `created_at:id`.
const CURSOR_TAG: &str = "k1.";

/// A todo's resource URI.
pub fn uri(id: &str) -> String {
    format!("{URI_PREFIX}{id}")
}

/// Whether an endpoint is offered resources at all (`initialize` advertises the capability).
pub fn offered(grant: &Grant) -> bool {
    grant.allows(Tool::ListTodos)
}

fn check_grant(method: &str, grant: &Grant) -> Result<(), Error> {
    if offered(grant) {
        return Ok(());
    }
    Err(Error::forbidden(format!(
        "{method}: todo resources come with the list_todos verb, which this endpoint is not \
         granted; vend an endpoint with it (`relay endpoint create NAME --verbs list_todos,…`)"
    )))
}

/// The cursor that resumes listing after `t`. Opaque to clients: only this module reads it.
fn cursor_after(t: &Todo) -> String {
    let key = format!("{}:{}", t.created_at, t.id);
    let mut out = String::from(CURSOR_TAG);
    for b in key.bytes() {
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn bad_cursor() -> Error {
    Error::invalid(
        "resources/list: params.cursor is not a cursor this server gave; pass the nextCursor of \
         the previous page as it is, or omit cursor to start from the first page",
    )
}

fn parse_cursor(c: &str) -> Result<(Millis, String), Error> {
    let hex = c.strip_prefix(CURSOR_TAG).ok_or_else(bad_cursor)?;
    if hex.len() % 2 != 0 || hex.len() > 200 {
        return Err(bad_cursor());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("x"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| bad_cursor())?;
    let key = String::from_utf8(bytes).map_err(|_| bad_cursor())?;
    let (at, id) = key.split_once(':').ok_or_else(bad_cursor)?;
    let at: Millis = at.parse().map_err(|_| bad_cursor())?;
    if !valid_todo_id(id) {
        return Err(bad_cursor());
    }
    Ok((at, id.to_string()))
}

/// `resources/list`: the operation that reads one page (one todo more than a page, to know
/// whether another follows) for `endpoint` under `grant`.
pub fn list(endpoint: &str, grant: &Grant, params: Option<&Value>) -> Result<Op, Error> {
    check_grant("resources/list", grant)?;
    let after = match params.and_then(|p| p.get("cursor")) {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) => Some(parse_cursor(c)?),
        Some(_) => return Err(bad_cursor()),
    };
    Ok(Op::ListTodos {
        actor: Actor::endpoint(endpoint),
        filter: TodoFilter {
            queues: grant.scope(Tool::ListTodos, None)?,
            state: None,
            after,
            limit: PAGE + 1,
        },
    })
}

/// `resources/list`'s result from the page's answer: a resource per todo, and `nextCursor`
/// when another page follows.
pub fn listed(answer: Result<Answer, Error>) -> Result<Value, Error> {
    let mut todos = answer?.todos()?;
    let more = todos.len() > PAGE;
    todos.truncate(PAGE);
    let resources: Vec<Value> = todos
        .iter()
        .map(|t| {
            json!({
                "uri": uri(&t.id),
                "name": t.title,
                "title": t.title,
                "description": format!("todo {} in queue {}, {}", t.id, t.queue, t.state),
                "mimeType": MIME_JSON,
            })
        })
        .collect();
    let mut out = json!({ "resources": resources });
    if more && let Some(last) = todos.last() {
        out["nextCursor"] = json!(cursor_after(last));
    }
    Ok(out)
}

/// `resources/read`: the todo id of `params.uri`, and the `get_todo` arguments the read stands
/// for (the driver serves them as a `get_todo` call).
pub fn read(grant: &Grant, params: Option<&Value>) -> Result<(String, Value), Error> {
    check_grant("resources/read", grant)?;
    let bad = |what: &str| {
        Error::invalid(format!(
            "resources/read: params.uri {what}; pass a URI from resources/list, \
             {URI_PREFIX}<todo id>"
        ))
    };
    let uri = match params.and_then(|p| p.get("uri")) {
        Some(Value::String(u)) => u,
        Some(_) => return Err(bad("must be a string")),
        None => return Err(bad("is missing")),
    };
    let Some(id) = uri.strip_prefix(URI_PREFIX) else {
        return Err(bad("is not a todo resource"));
    };
    if !valid_todo_id(id) {
        return Err(bad(
            "does not end in a todo id (1 to 64 letters, digits, '_' or '-')",
        ));
    }
    let args = json!({ "id": id, "attempts_limit": READ_ATTEMPTS });
    Ok((id.to_string(), args))
}

/// `resources/read`'s result from the `get_todo` call's answer: the answer as JSON, and a short
/// text rendering of it. A todo the endpoint cannot see is `not_found`, named as a read.
pub fn read_result(id: &str, served: Result<Served, Error>) -> Result<Value, Error> {
    let served = served.map_err(|e| {
        if e.code == ErrorCode::NotFound {
            not_found("resources/read", id)
        } else {
            e
        }
    })?;
    let view: GetTodoOut = serde_json::from_value(served.answer.clone())
        .map_err(|e| Error::internal(format!("resources/read: decoding get_todo: {e}")))?;
    let json_text = serde_json::to_string(&served.answer)
        .map_err(|e| Error::internal(format!("resources/read: encoding: {e}")))?;
    let uri = uri(id);
    Ok(json!({
        "contents": [
            {"uri": uri, "mimeType": MIME_JSON, "text": json_text},
            {"uri": uri, "mimeType": "text/plain", "text": render(&view)},
        ]
    }))
}

/// The short text rendering: the todo's line, then one line per attempt, newest first. Worker
/// text (titles, summaries) has its controls made visible, so a line stays a line.
fn render(v: &GetTodoOut) -> String {
    let esc = crate::limits::escape_text;
    let t = &v.todo.todo;
    let mut out = format!(
        "todo {} \"{}\": {}{} in queue {}, attempt {}/{}, {} attempt(s) ever\n",
        t.id,
        esc(&t.title),
        t.state,
        if t.dead_letter { " (dead letter)" } else { "" },
        t.queue,
        t.attempt,
        t.max_attempts,
        v.attempts_total,
    );
    for a in &v.attempts {
        let _ = write!(
            out,
            "#{} attempt {}: {}{}",
            a.seq,
            a.attempt,
            a.outcome.as_deref().unwrap_or("open"),
            if a.died { " (died)" } else { "" },
        );
        if let Some(d) = &a.disposition {
            let _ = write!(out, ", {d}");
        }
        if let Some(by) = &a.closed_by {
            let _ = write!(out, ", closed by {by}");
        }
        if let Some(s) = &a.summary {
            let _ = write!(out, ": {}", esc(s));
        }
        out.push('\n');
    }
    if let Some(why) = &v.attention {
        let _ = writeln!(out, "attention: {}", esc(why));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Ledger, LedgerConfig, NewTodo};

    const T0: Millis = 1_790_000_000_000;

    fn grant(verbs: &[&str], queues: Option<&[&str]>) -> Grant {
        let verbs: Vec<String> = verbs.iter().map(|v| v.to_string()).collect();
        Grant::new(
            &verbs,
            queues.map(|qs| qs.iter().map(|q| q.to_string()).collect()),
        )
    }

    fn add(l: &mut Ledger, at: Millis, id: &str, queue: &str) {
        let new = NewTodo {
            id: id.into(),
            queue: queue.into(),
            title: format!("title of {id}"),
            ..NewTodo::default()
        };
        l.apply(Op::AddTodo {
            now: at,
            endpoint: "e1".into(),
            new,
        })
        .unwrap();
    }

    #[test]
    fn paging_lists_every_visible_todo_exactly_once_in_order() {
        let mut l = Ledger::new(LedgerConfig::default());
        // Ties on created_at, so that the id breaks them; a foreign queue that must not show.
        for i in 0..(2 * PAGE + 3) {
            let q = if i % 7 == 3 { "other" } else { "q" };
            add(&mut l, T0 + (i as Millis / 4), &format!("td_{i:03}"), q);
        }
        let g = grant(&["list_todos"], Some(&["q"]));
        let (mut seen, mut cursor, mut pages) = (Vec::new(), None::<String>, 0);
        loop {
            let params = cursor.as_ref().map(|c| json!({ "cursor": c }));
            let op = list("e1", &g, params.as_ref()).unwrap();
            let page = listed(l.apply(op)).unwrap();
            pages += 1;
            for r in page["resources"].as_array().unwrap() {
                seen.push(r["uri"].as_str().unwrap().to_string());
                assert_eq!(r["mimeType"], MIME_JSON);
            }
            match page.get("nextCursor") {
                Some(c) => cursor = Some(c.as_str().unwrap().to_string()),
                None => break,
            }
        }
        let want: Vec<String> = l
            .todos()
            .filter(|t| t.queue == "q")
            .map(|t| uri(&t.id))
            .collect();
        assert_eq!(seen, want);
        assert_eq!(pages, want.len().div_ceil(PAGE));
    }

    #[test]
    fn a_bad_cursor_or_uri_is_invalid_and_names_the_field() {
        let g = grant(&["list_todos"], None);
        for c in [json!("x"), json!("k1.zz"), json!("k1.3a"), json!(7)] {
            let e = list("e1", &g, Some(&json!({ "cursor": c }))).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains("params.cursor"), "{}", e.message);
        }
        for u in [
            json!("https://x/td_1"),
            json!("relay://todos/a/b"),
            json!(1),
        ] {
            let e = read(&g, Some(&json!({ "uri": u }))).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains("params.uri"), "{}", e.message);
        }
        assert_eq!(read(&g, None).unwrap_err().code, ErrorCode::Invalid);
    }

    #[test]
    fn resources_come_with_list_todos_only() {
        let g = grant(&["claim_next", "get_todo"], None);
        assert!(!offered(&g));
        assert_eq!(list("e1", &g, None).unwrap_err().code, ErrorCode::Forbidden);
        let p = json!({ "uri": uri("td_1") });
        assert_eq!(read(&g, Some(&p)).unwrap_err().code, ErrorCode::Forbidden);
        assert!(offered(&grant(&["list_todos"], None)));
    }

    #[test]
    fn a_cursor_round_trips_its_key() {
        let mut l = Ledger::new(LedgerConfig::default());
        add(&mut l, T0, "td_a-1", "q");
        let t = l.todos().next().unwrap().clone();
        assert_eq!(
            parse_cursor(&cursor_after(&t)).unwrap(),
            (T0, "td_a-1".to_string())
        );
    }
}
