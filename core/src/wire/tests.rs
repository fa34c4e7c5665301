use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use super::*;
use crate::error::ErrorCode;
use crate::ledger::{Actor, ClaimOpts, Ledger, LedgerConfig, NewTodo, Report};
use crate::testing::Queue;

#[test]
fn the_tools_list_document() {
    insta::assert_json_snapshot!(tools_list(&Tool::ALL));
}

#[test]
fn every_tool_schema_is_a_closed_object() {
    for t in Tool::ALL {
        let s = t.input_schema();
        assert_eq!(s["type"], "object", "{}", t.as_str());
        assert_eq!(s["additionalProperties"], false, "{}", t.as_str());
        assert!(s["properties"].is_object(), "{}", t.as_str());
    }
}

/// A value of the declared type for each property, so that a call with every declared
/// argument can be built from the schema alone.
fn sample(prop: &Value) -> Value {
    match prop["type"].as_str() {
        Some("string") if prop["format"] == "date-time" => json!("2026-12-04T09:30:00Z"),
        Some("string") => json!("x"),
        Some("integer") => json!(prop["minimum"].as_u64().unwrap_or(1)),
        Some("boolean") => json!(true),
        Some("number") => json!(1.5),
        // A declared object (usage, budget) with each of its own properties.
        Some("object") if prop["properties"].is_object() => Value::Object(
            prop["properties"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, p)| (k.clone(), sample(p)))
                .collect(),
        ),
        Some("object") => json!({"k": 1}),
        _ if prop.get("oneOf").is_some() => prop["oneOf"][0]["const"].clone(),
        _ => json!({"any": "json"}),
    }
}

#[test]
fn the_schema_declares_exactly_what_the_decoder_accepts() {
    for t in Tool::ALL {
        let schema = t.input_schema();
        let props = schema["properties"].as_object().unwrap();
        let full: Map<String, Value> = props.iter().map(|(k, p)| (k.clone(), sample(p))).collect();
        t.decode(Some(&Value::Object(full.clone())))
            .unwrap_or_else(|e| panic!("{}: every declared argument must decode: {e}", t.as_str()));
        let required: Vec<&str> = schema["required"]
            .as_array()
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for r in &required {
            let mut missing = full.clone();
            missing.remove(*r);
            let e = t.decode(Some(&Value::Object(missing))).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains(r), "{}: {e}", t.as_str());
        }
        let mut extra = full.clone();
        extra.insert("surprise".into(), json!(1));
        let e = t.decode(Some(&Value::Object(extra))).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(
            e.message.contains("surprise") && e.message.contains(t.as_str()),
            "{e}"
        );
    }
}

#[test]
fn out_of_range_and_wrong_types_are_invalid_naming_the_argument() {
    let cases = [
        (
            Tool::ClaimNext,
            json!({"lease_ttl_seconds": 0}),
            "lease_ttl_seconds",
        ),
        (
            Tool::ClaimNext,
            json!({"lease_ttl_seconds": 86_401}),
            "lease_ttl_seconds",
        ),
        (
            Tool::Heartbeat,
            json!({"id": "a", "lease_ttl_seconds": -5}),
            "lease_ttl_seconds",
        ),
        (
            Tool::GetTodo,
            json!({"id": "a", "attempts_limit": 101}),
            "attempts_limit",
        ),
        (Tool::ListTodos, json!({"limit": 501}), "limit"),
        (Tool::ListTodos, json!({"state": "lost"}), "lost"),
        (
            Tool::AddTodo,
            json!({"queue": "q", "title": "t", "max_attempts": 0}),
            "max_attempts",
        ),
        (Tool::Complete, json!({"id": "a", "result": [1]}), "map"),
        (Tool::Claim, json!({"id": 7}), "string"),
    ];
    for (tool, args, needle) in cases {
        let e = tool.decode(Some(&args)).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid, "{args}");
        assert!(e.message.contains(needle), "{args}: {e}");
    }
    let e = Tool::ClaimNext.decode(Some(&json!([1, 2]))).unwrap_err();
    assert!(e.message.contains("object"), "{e}");
    // Absent arguments read as an empty object.
    assert_eq!(
        Tool::ClaimNext.decode(None).unwrap(),
        ToolCall::ClaimNext(ClaimNextArgs::default())
    );
}

#[test]
fn get_todo_is_implied_by_list_todos_and_release_never_is() {
    let granted: BTreeSet<Tool> = [Tool::ClaimNext, Tool::ListTodos].into();
    assert_eq!(
        tools_for(&granted),
        vec![Tool::ClaimNext, Tool::GetTodo, Tool::ListTodos]
    );
    let all_but_release: BTreeSet<Tool> = Tool::ALL
        .into_iter()
        .filter(|t| *t != Tool::Release)
        .collect();
    assert!(!tools_for(&all_but_release).contains(&Tool::Release));
}

/// A ledger holding `td_1` of endpoint `e` (queue `ci`), and when it was added.
fn one_todo() -> (Ledger, u64) {
    let mut l = Ledger::new(LedgerConfig::default());
    let t0 = 1_790_000_000_000;
    l.add_todo(
        t0,
        "e",
        NewTodo {
            id: "td_1".into(),
            queue: "ci".into(),
            title: "fix".into(),
            ..NewTodo::default()
        },
    )
    .unwrap();
    (l, t0)
}

#[test]
fn claim_answers_have_the_contract_shape() {
    assert_eq!(
        serde_json::to_value(ClaimOut::empty()).unwrap(),
        json!({"empty": true})
    );
    let (mut l, t0) = one_todo();
    let actor = Actor::endpoint("e");
    let opts = ClaimOpts {
        ttl: 300_000,
        ..ClaimOpts::default()
    };
    let first = l.claim(t0, &actor, "td_1", &opts).unwrap();
    let out =
        serde_json::to_value(ClaimOut::claimed(&first, Some(LeaseToken::new("T0K")))).unwrap();
    assert_eq!(out["empty"], false);
    assert_eq!(out["attempt_seq"], 1);
    assert_eq!(out["attempts_total"], 1);
    assert_eq!(out["lease_token"], "T0K");
    assert_eq!(out["prior_attempts"], json!([]));
    assert_eq!(out["todo"]["state"], "claimed");
    assert_eq!(out["todo"]["lease_expires_at"], "2026-09-21T14:18:20Z");
    l.fail(
        t0 + 1000,
        &actor,
        "td_1",
        &Report {
            summary: Some("tests still red".into()),
            ..Report::default()
        },
    )
    .unwrap();
    let view = l.get_todo(&actor, "td_1", 20).unwrap();
    let got = serde_json::to_value(GetTodoOut::from(&view)).unwrap();
    assert_eq!(got["todo"]["dead_letter"], false);
    assert!(got["todo"]["next_retry_at"].is_string());
    assert!(got["todo"].as_object().unwrap().contains_key("result"));
    assert_eq!(got["attempts"][0]["outcome"], "failed");
    assert_eq!(got["attempts"][0]["died"], false);
    assert_eq!(got["attempts"][0]["summary"], "tests still red");
    // Unfenced claims carry no lease_token key at all.
    let second = l.claim(t0 + 100_000_000, &actor, "td_1", &opts).unwrap();
    let out = serde_json::to_value(ClaimOut::claimed(&second, None)).unwrap();
    assert!(out.get("lease_token").is_none());
    assert_eq!(out["prior_attempts"][0]["seq"], 1);
    // And the answers read back (the lease client decodes them).
    let back: ClaimOut = serde_json::from_value(out).unwrap();
    assert_eq!(back.attempt_seq, Some(2));
}

#[test]
fn a_lease_token_never_shows_in_debug_output() {
    let args = HeartbeatArgs {
        usage: None,
        id: "td_1".into(),
        lease_ttl_seconds: None,
        lease_token: Some(LeaseToken::new("s3cr3t-T")),
    };
    let shown = format!("{args:?} {:?}", ToolCall::Heartbeat(args.clone()));
    assert!(!shown.contains("s3cr3t-T"), "{shown}");
    assert!(shown.contains("<redacted>"));
}

#[test]
fn errors_and_results_have_the_contract_shape() {
    let e = crate::Error::conflict("nope");
    let r = call_result(serde_json::to_value(ErrorOut::from(&e)).unwrap(), true);
    assert_eq!(r["isError"], true);
    assert_eq!(
        r["structuredContent"],
        json!({"error": {"code": "conflict", "message": "nope"}})
    );
    let text: Value = serde_json::from_str(r["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(text, r["structuredContent"]);
}

mod properties {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn arbitrary_bytes_decode_to_a_call_or_a_named_invalid(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            crate::testing::wire_decode(&data);
        }

        #[test]
        fn arbitrary_json_objects_decode_to_a_call_or_a_named_invalid(
            pick in any::<u8>(),
            keys in proptest::collection::vec("(id|queue|title|limit|lease_ttl_seconds|lease_token|summary|state|[a-z]{1,6})", 0..5),
            vals in proptest::collection::vec(prop_oneof![Just("1".to_string()), Just("\"x\"".to_string()), Just("null".to_string()), Just("-3".to_string()), Just("{}".to_string()), Just("[true]".to_string())], 0..5),
        ) {
            let body: Vec<String> = keys.iter().zip(vals.iter()).map(|(k, v)| format!("\"{k}\": {v}")).collect();
            let mut data = vec![pick];
            data.extend(format!("{{{}}}", body.join(",")).into_bytes());
            crate::testing::wire_decode(&data);
        }
    }
}

#[test]
fn a_claim_answer_decodes_into_what_the_relay_machine_takes() {
    use crate::relay::{ClaimAnswer, decode_claim};
    let (mut l, t0) = one_todo();
    let actor = Actor::endpoint("e");
    let opts = ClaimOpts {
        ttl: 60_000,
        ..ClaimOpts::default()
    };
    l.claim(t0, &actor, "td_1", &opts).unwrap();
    let c = l.claim(t0 + 60_000, &actor, "td_1", &opts).unwrap(); // a takeover
    let wire = serde_json::to_string(&ClaimOut::claimed(&c, Some(LeaseToken::new("tok")))).unwrap();
    let back: serde_json::Value = serde_json::from_str(&wire).unwrap();
    let Ok(ClaimAnswer::Claimed(claimed)) = decode_claim(&back) else {
        panic!("did not decode: {wire}")
    };
    assert_eq!(
        (
            claimed.todo_id.as_str(),
            claimed.attempt,
            claimed.attempt_seq
        ),
        ("td_1", 2, 2)
    );
    assert_eq!(
        claimed.lease_token.as_ref().map(LeaseToken::expose),
        Some("tok")
    );
    assert_eq!(claimed.prior_attempts.len(), 1);
    assert_eq!(
        claimed.prior_attempts[0].outcome.as_deref(),
        Some("lease_expired")
    );
    assert_eq!(claimed.prior_attempts[0].died, Some(true));
    assert_eq!(claimed.todo["title"], "fix");
    let empty = serde_json::to_value(ClaimOut::empty()).unwrap();
    assert_eq!(decode_claim(&empty), Ok(ClaimAnswer::Empty));
}
