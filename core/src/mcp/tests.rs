use serde_json::{Value, json};

use super::era::{self, Envelope, Headers, MODERN, Probe};
use super::*;
use crate::grant::Grant;

fn modern_params(extra: Value) -> Value {
    let mut p = json!({"_meta": {
        era::META_VERSION: MODERN,
        era::META_CAPABILITIES: {},
    }});
    if let Value::Object(e) = extra {
        p.as_object_mut().unwrap().extend(e);
    }
    p
}

fn headers<'a>(method: &'a str, name: Option<&'a str>) -> Headers<'a> {
    Headers {
        session: None,
        protocol_version: Some(MODERN),
        method: Some(method),
        name,
    }
}

fn code(r: Result<Era, Fault>) -> (u16, i64) {
    let f = r.expect_err("refused");
    assert_eq!(f.body()["error"]["code"], json!(f.code));
    (f.status, f.code)
}

#[test]
fn the_body_decides_the_era_and_the_headers_must_agree() {
    let id = json!(7);
    let p = modern_params(json!({"name": "claim_next"}));
    let era = era::classify(
        &headers("tools/call", Some("claim_next")),
        "tools/call",
        Some(&p),
        &id,
    );
    assert!(matches!(era, Ok(Era::Modern(Envelope { ref version, .. })) if version == MODERN));

    // Headers checked against the body: missing, other method, other name.
    let h = Headers {
        protocol_version: None,
        ..headers("tools/call", Some("claim_next"))
    };
    assert_eq!(
        code(era::classify(&h, "tools/call", Some(&p), &id)),
        (400, HEADER_MISMATCH)
    );
    let h = headers("tools/list", Some("claim_next"));
    assert_eq!(
        code(era::classify(&h, "tools/call", Some(&p), &id)),
        (400, HEADER_MISMATCH)
    );
    let h = headers("tools/call", Some("complete"));
    assert_eq!(
        code(era::classify(&h, "tools/call", Some(&p), &id)),
        (400, HEADER_MISMATCH)
    );
    let h = headers("tools/call", None);
    assert_eq!(
        code(era::classify(&h, "tools/call", Some(&p), &id)),
        (400, HEADER_MISMATCH)
    );
    // Surrounding white space is not a mismatch; a base64 sentinel is decoded first.
    let h = headers("tools/call", Some("  claim_next "));
    assert!(era::classify(&h, "tools/call", Some(&p), &id).is_ok());
    let enc = era::encode_header_value("ünïcode");
    assert!(enc.starts_with("=?base64?"));
    let p2 = modern_params(json!({"name": "ünïcode"}));
    let h = headers("tools/call", Some(&enc));
    assert!(era::classify(&h, "tools/call", Some(&p2), &id).is_ok());
    let h = headers("tools/call", Some("=?base64?!!!?="));
    assert_eq!(
        code(era::classify(&h, "tools/call", Some(&p2), &id)),
        (400, HEADER_MISMATCH)
    );
}

#[test]
fn the_envelope_is_checked_before_the_headers_and_the_version_last() {
    let id = json!("a");
    let h = headers("server/discover", None);
    // A modern header without an envelope, an envelope without capabilities, a bad version type.
    assert_eq!(
        code(era::classify(&h, "server/discover", None, &id)),
        (400, INVALID_PARAMS)
    );
    let p = json!({"_meta": {era::META_VERSION: MODERN}});
    assert_eq!(
        code(era::classify(&h, "server/discover", Some(&p), &id)),
        (400, INVALID_PARAMS)
    );
    let p = json!({"_meta": {era::META_VERSION: 5, era::META_CAPABILITIES: {}}});
    assert_eq!(
        code(era::classify(&h, "server/discover", Some(&p), &id)),
        (400, INVALID_PARAMS)
    );
    // The header disagrees with an unsupported version: the mismatch is what is reported.
    let p = json!({"_meta": {era::META_VERSION: "v999.0.0", era::META_CAPABILITIES: {}}});
    assert_eq!(
        code(era::classify(&h, "server/discover", Some(&p), &id)),
        (400, HEADER_MISMATCH)
    );
    // Both say the unsupported version: -32022 naming what is supported and echoing the request.
    let h = Headers {
        protocol_version: Some("v999.0.0"),
        ..h
    };
    let f = era::classify(&h, "server/discover", Some(&p), &id).unwrap_err();
    assert_eq!((f.status, f.code), (400, UNSUPPORTED_VERSION));
    assert_eq!(
        f.data,
        Some(json!({"supported": [MODERN], "requested": "v999.0.0"}))
    );
    assert_eq!(f.body()["id"], id);
}

#[test]
fn a_request_mixing_the_eras_is_refused_and_legacy_requests_pass_through() {
    let id = json!(1);
    let p = modern_params(json!({}));
    let h = Headers {
        session: Some("abc"),
        ..headers("tools/list", None)
    };
    assert_eq!(
        code(era::classify(&h, "tools/list", Some(&p), &id)),
        (400, INVALID_REQUEST)
    );
    let legacy = Headers {
        session: Some("abc"),
        protocol_version: Some("2025-06-18"),
        ..Headers::default()
    };
    assert_eq!(
        era::classify(&legacy, "tools/list", None, &id),
        Ok(Era::Legacy {
            session: Some("abc".into())
        })
    );
    let old = Headers {
        protocol_version: Some("2024-11-05"),
        ..legacy
    };
    assert_eq!(
        code(era::classify(&old, "tools/list", None, &id)),
        (400, INVALID_REQUEST)
    );
}

#[test]
fn what_the_client_stamps_the_server_accepts() {
    let info = json!({"name": "relay", "version": "0"});
    for (method, params) in [
        ("server/discover", json!(null)),
        ("tools/list", json!({})),
        (
            "tools/call",
            json!({"name": "heartbeat", "arguments": {"id": "td_1"}}),
        ),
        ("resources/read", json!({"uri": "relay://queues/ci ü"})),
    ] {
        let (params, hs) = era::stamp(method, params, &info);
        let h = Headers::of_pairs(&hs);
        let era = era::classify(&h, method, Some(&params), &json!(1)).expect(method);
        assert!(era.is_modern(), "{method}");
    }
}

#[test]
fn methods_belong_to_their_era() {
    let modern = Era::Modern(Envelope {
        version: MODERN.into(),
        capabilities: Default::default(),
        client_info: None,
    });
    let legacy = Era::Legacy { session: None };
    assert_eq!(
        Method::of("server/discover", &modern, &json!(1)),
        Ok(Method::Discover)
    );
    let f = Method::of("initialize", &modern, &json!(1)).unwrap_err();
    assert_eq!((f.status, f.code), (404, METHOD_NOT_FOUND));
    let f = Method::of("ping", &modern, &json!(1)).unwrap_err();
    assert_eq!((f.status, f.code), (404, METHOD_NOT_FOUND));
    // The Tasks extension's removed methods carry no name: method-not-found, not a mismatch.
    let p = modern_params(json!({"taskId": "t"}));
    let h = headers("tasks/list", None);
    let era_of = era::classify(&h, "tasks/list", Some(&p), &json!(1)).unwrap();
    assert_eq!(
        Method::of("tasks/list", &era_of, &json!(1))
            .unwrap_err()
            .status,
        404
    );
    let h = headers("tasks/get", None);
    assert_eq!(
        code(era::classify(&h, "tasks/get", Some(&p), &json!(1))),
        (400, HEADER_MISMATCH)
    );
    let f = Method::of("server/discover", &legacy, &json!(1)).unwrap_err();
    assert_eq!((f.status, f.code), (200, METHOD_NOT_FOUND));
    assert_eq!(Method::of("ping", &legacy, &json!(1)), Ok(Method::Ping));

    // Modern results are framed; legacy ones left alone.
    let r = framed(&modern, Method::ToolsList, json!({"tools": []}));
    assert_eq!(r["resultType"], "complete");
    assert_eq!(r["cacheScope"], "private");
    assert!(r["ttlMs"].is_u64());
    assert_eq!(r["_meta"][era::META_SERVER_INFO]["name"], "relay");
    assert_eq!(
        framed(&legacy, Method::ToolsList, json!({"tools": []})),
        json!({"tools": []})
    );
    let f = resource_not_found(&modern, json!(1), Some("relay://todos/x"), "nope");
    assert_eq!(
        (f.code, f.data),
        (INVALID_PARAMS, Some(json!({"uri": "relay://todos/x"})))
    );
    assert_eq!(
        resource_not_found(&legacy, json!(1), None, "nope").code,
        RESOURCE_NOT_FOUND
    );
}

#[test]
fn messages_are_shape_checked() {
    assert!(matches!(
        parse(b"\xff"),
        Err(Fault {
            code: PARSE_ERROR,
            ..
        })
    ));
    assert!(matches!(
        parse(b"[]"),
        Err(Fault {
            code: INVALID_REQUEST,
            ..
        })
    ));
    let f = parse(br#"{"jsonrpc":"2.0","id":3,"method":"x","params":[1]}"#).unwrap_err();
    assert_eq!((f.code, f.id), (INVALID_REQUEST, json!(3)));
    assert!(matches!(
        parse(br#"{"jsonrpc":"2.0","method":"notifications/cancelled"}"#),
        Ok(Message::Notification { .. })
    ));
    assert_eq!(
        parse(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#),
        Ok(Message::Response)
    );
}

#[test]
fn the_probe_falls_back_on_anything_but_a_shared_version() {
    assert_eq!(
        era::probe(Ok(&json!({"supportedVersions": [MODERN]}))),
        Probe::Modern
    );
    assert_eq!(
        era::probe(Ok(&json!({"supportedVersions": ["2099-01-01"]}))),
        Probe::Legacy
    );
    assert_eq!(era::probe(Ok(&json!({}))), Probe::Legacy);
    assert_eq!(era::probe(Err(METHOD_NOT_FOUND)), Probe::Legacy);
}

#[test]
fn a_listen_names_granted_queues_only() {
    let grant = Grant::new(&["claim_next".into()], Some(vec!["ci".into()]));
    let p = json!({"notifications": {"resourceSubscriptions": ["relay://queues/ci"], "toolsListChanged": true}});
    let l = listen::decode(&grant, Some(&p)).unwrap();
    assert_eq!(l.queues.iter().collect::<Vec<_>>(), ["ci"]);
    let ack = listen::acknowledged(&json!(4), &l);
    assert_eq!(
        ack["params"]["notifications"],
        json!({"resourceSubscriptions": ["relay://queues/ci"]})
    );
    assert_eq!(ack["params"]["_meta"][era::META_SUBSCRIPTION], json!(4));
    let other = json!({"notifications": {"resourceSubscriptions": ["relay://queues/prod"]}});
    assert_eq!(
        listen::decode(&grant, Some(&other)).unwrap_err().code,
        crate::ErrorCode::Forbidden
    );
    let todo = json!({"notifications": {"resourceSubscriptions": ["relay://todos/td_1"]}});
    assert_eq!(
        listen::decode(&grant, Some(&todo)).unwrap_err().code,
        crate::ErrorCode::Invalid
    );
    assert_eq!(
        listen::decode(&grant, None).unwrap_err().code,
        crate::ErrorCode::Invalid
    );
    let reader = Grant::new(&["list_todos".into()], None);
    assert_eq!(
        listen::decode(&reader, Some(&p)).unwrap_err().code,
        crate::ErrorCode::Forbidden
    );
}

#[test]
fn a_listen_watches_task_ids_of_a_task_shape_and_an_adder_may_listen_for_them_only() {
    let id = format!("td_1.{}", "a".repeat(crate::ledger::TASK_SECRET_HEX));
    let adder = Grant::new(&["add_todo".into()], None);
    let p = json!({"notifications": {"taskIds": [id, id, "not-a-task"]}});
    let l = listen::decode(&adder, Some(&p)).unwrap();
    // Shaped ids once each; one that cannot name a task is simply not watched.
    assert_eq!(
        l.tasks.iter().map(|t| t.expose()).collect::<Vec<_>>(),
        [id.as_str()]
    );
    assert!(l.queues.is_empty());
    let ack = listen::acknowledged(&json!(9), &l);
    assert_eq!(ack["params"]["notifications"]["taskIds"], json!([id]));
    // A notification is the task as tasks/get answers it, tagged with the listen.
    let task = json!({"taskId": id, "status": "working", "lastUpdatedAt": "t1"});
    let note = listen::task_status(&json!(9), &task);
    assert_eq!(note["method"], listen::TASK_STATUS);
    assert_eq!(note["params"]["status"], "working");
    assert_eq!(note["params"]["_meta"][era::META_SUBSCRIPTION], json!(9));
    // A watcher's looks: the first is news, the same again is not, a move is; a terminal
    // status is the last news; a store that did not answer is looked at again, a task not
    // found is not.
    let mut w = listen::Watched::new(l.tasks[0].clone());
    assert_eq!(w.look(Ok(task.clone())).news, Some(task.clone()));
    let again = w.look(Ok(task.clone()));
    assert_eq!((again.news, again.keep), (None, true));
    let later = json!({"taskId": id, "status": "working", "lastUpdatedAt": "t2"});
    assert_eq!(w.look(Ok(later.clone())).news, Some(later));
    let stalled = w.look(Err(crate::ErrorCode::Internal));
    assert_eq!((stalled.news, stalled.keep), (None, true));
    let done = json!({"taskId": id, "status": "completed", "lastUpdatedAt": "t3"});
    let last = w.look(Ok(done.clone()));
    assert_eq!((last.news, last.keep), (Some(done), false));
    let gone = listen::Watched::new(l.tasks[0].clone()).look(Err(crate::ErrorCode::NotFound));
    assert_eq!((gone.news, gone.keep), (None, false));
    // An adder may not ring queues; too many ids, or ids that are not strings, are refused.
    let queues =
        json!({"notifications": {"taskIds": [id], "resourceSubscriptions": ["relay://queues/ci"]}});
    assert_eq!(
        listen::decode(&adder, Some(&queues)).unwrap_err().code,
        crate::ErrorCode::Forbidden
    );
    let many: Vec<String> = (0..=listen::TASKS_PER_LISTEN).map(|_| id.clone()).collect();
    for bad in [json!(many), json!([7]), json!("td_1")] {
        let p = json!({"notifications": {"taskIds": bad}});
        let e = listen::decode(&adder, Some(&p)).unwrap_err();
        assert_eq!(e.code, crate::ErrorCode::Invalid, "{bad}");
        assert!(e.message.contains("taskIds"), "{}", e.message);
    }
    assert!(listen::asks_tasks(Some(&p)));
    assert!(!listen::asks_tasks(Some(&json!({"notifications": {}}))));
}

proptest::proptest! {
    /// The fuzz body over arbitrary bytes, and over requests shaped like either era's.
    #[test]
    fn decoding_either_era_never_panics(pick: u8, data: Vec<u8>) {
        let mut input = vec![pick];
        input.extend(data);
        crate::testing::mcp_decode(&input);
    }

    #[test]
    fn decoding_shaped_requests_holds_the_rules(
        pick: u8,
        method in proptest::sample::select(vec![
            "server/discover", "tools/list", "tools/call", "resources/read", "resources/list",
            "subscriptions/listen", "initialize", "ping", "nope",
        ]),
        name in "[ -~]{0,12}",
        meta in proptest::option::of(proptest::sample::select(vec![
            json!({}), json!({"io.modelcontextprotocol/protocolVersion": MODERN}),
            json!({"io.modelcontextprotocol/protocolVersion": MODERN,
                   "io.modelcontextprotocol/clientCapabilities": {}}),
            json!({"io.modelcontextprotocol/protocolVersion": "2099-01-01",
                   "io.modelcontextprotocol/clientCapabilities": {}}),
        ])),
    ) {
        let mut params = json!({"name": name, "uri": name});
        if let Some(m) = meta {
            params["_meta"] = m;
        }
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let mut input = vec![pick];
        input.extend(body.to_string().into_bytes());
        crate::testing::mcp_decode(&input);
    }
}

#[test]
fn answerless_and_bodiless_messages_take_their_era_from_the_session_and_version() {
    let modern = Headers {
        protocol_version: Some(MODERN),
        ..Headers::default()
    };
    let legacy = Headers {
        session: Some("s"),
        protocol_version: Some("2025-06-18"),
        ..Headers::default()
    };
    assert!(era::notification_is_modern(&modern, None));
    assert!(era::notification_is_modern(
        &Headers::default(),
        Some(&modern_params(json!({})))
    ));
    assert!(!era::notification_is_modern(&legacy, None));
    assert!(!era::notification_is_modern(&Headers::default(), None));
    assert!(era::bodiless_is_modern(&modern));
    assert!(!era::bodiless_is_modern(&legacy));
    let both = Headers {
        session: Some("s"),
        ..modern
    };
    assert!(
        !era::bodiless_is_modern(&both),
        "a session keeps the legacy era"
    );
}
