//! Fuzz bodies for the wire and config decoders, and the ones that gather the relay
//! properties into one call per target.

use serde_json::Value;

use crate::error::ErrorCode;
use crate::time::Wall;

use super::relay;

/// The first byte picks the tool, the rest is read as the JSON of its arguments. Decoding never
/// panics, and every refusal is `invalid` and names the tool.
pub fn wire_decode(data: &[u8]) {
    use crate::wire::Tool;
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let tool = Tool::ALL[usize::from(pick) % Tool::ALL.len()];
    let Ok(args) = serde_json::from_slice::<Value>(rest) else {
        return;
    };
    match tool.decode(Some(&args)) {
        Ok(call) => assert_eq!(call.tool(), tool),
        Err(e) => {
            assert_eq!(e.code, ErrorCode::Invalid, "{e}");
            assert!(e.message.starts_with(tool.as_str()), "{e}");
        }
    }
}

/// MCP request decoding in both eras. The first byte picks the transport's headers (none; a
/// legacy session; the headers the client would stamp, with the body stamped too; the stamped
/// headers over the body as it came), the rest is the body. Never panics; a refusal is HTTP 400
/// or 404 with a JSON-RPC error that echoes a request's id; a request served modern names a
/// supported version and frames its answer with `resultType`; and what the client stamps for a
/// request it could send is always served modern.
pub fn mcp_decode(data: &[u8]) {
    use crate::mcp::{self, Era, Message, Method, era};
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let (id, method, params) = match mcp::parse(body) {
        Ok(Message::Request { id, method, params }) => (id, method, params),
        Ok(_) => return,
        Err(f) => {
            assert_eq!(f.status, 400, "{f:?}");
            assert!(f.body()["error"]["message"].is_string());
            return;
        }
    };
    let info = serde_json::json!({"name": "fuzz", "version": "0"});
    let (stamped, stamp_headers) =
        era::stamp(&method, params.clone().unwrap_or(Value::Null), &info);
    let modern_headers = era::Headers::of_pairs(&stamp_headers);
    let (headers, body_params) = match pick % 4 {
        0 => (era::Headers::default(), params.as_ref()),
        1 => (
            era::Headers {
                session: Some("s"),
                protocol_version: Some(era::LEGACY_VERSIONS[0]),
                ..Default::default()
            },
            params.as_ref(),
        ),
        2 => (modern_headers, Some(&stamped)),
        _ => (modern_headers, params.as_ref()),
    };
    let classified = era::classify(&headers, &method, body_params, &id)
        .and_then(|e| Method::of(&method, &e, &id).map(|m| (e, m)));
    match &classified {
        Ok((Era::Modern(env), m)) => {
            assert!(era::MODERN_VERSIONS.contains(&env.version.as_str()));
            let framed = mcp::framed(&classified.as_ref().unwrap().0, *m, serde_json::json!({}));
            assert_eq!(framed["resultType"], "complete");
        }
        Ok((Era::Legacy { .. }, _)) => {}
        Err(f) => {
            assert!(matches!(f.status, 200 | 400 | 404), "{f:?}");
            assert_eq!(f.body()["id"], id, "{f:?}");
            assert!(f.code < 0 && !f.message.is_empty(), "{f:?}");
        }
    }
    // A request the client could send: a known method without surrounding white space, whose
    // named field (if any) is a string.
    let named_ok = match method.as_str() {
        "tools/call" => stamped.get("name").is_some_and(Value::is_string),
        "resources/read" => stamped.get("uri").is_some_and(Value::is_string),
        "tasks/get" | "tasks/update" | "tasks/cancel" => {
            stamped.get("taskId").is_some_and(Value::is_string)
        }
        _ => true,
    };
    if let Some(m) = Method::parse(&method).and_then(Method::task) {
        task_decode(m, params.as_ref());
    }
    if method == "subscriptions/listen" {
        let grant = crate::grant::Grant::all();
        if let Ok(l) = mcp::listen::decode(&grant, params.as_ref()) {
            assert!(l.tasks.len() <= mcp::listen::TASKS_PER_LISTEN);
        }
    }
    let sendable = Method::parse(&method).is_some_and(|m| m.in_era(true)) && named_ok;
    if pick % 4 == 2 && sendable {
        assert!(
            matches!(classified, Ok((Era::Modern(_), _))),
            "a stamped {method} was refused: {classified:?}"
        );
    }
}

/// A task method's params decoded: never panics; a refusal is `invalid` and names the method;
/// a decoded call is of the method asked. What it answers never depends on the task id's text
/// (so a refusal cannot quote it): another id in its place is answered alike.
fn task_decode(m: crate::task::TaskMethod, params: Option<&Value>) {
    use crate::task::TaskCall;
    let decoded = TaskCall::decode(m, params);
    match &decoded {
        Ok(call) => assert_eq!(call.method(), m),
        Err(e) => {
            assert_eq!(e.code, ErrorCode::Invalid, "{e}");
            assert!(e.message.starts_with(m.as_str()), "{e}");
        }
    }
    if let Some(Value::Object(p)) = params
        && p.get("taskId").is_some_and(Value::is_string)
    {
        let mut other = p.clone();
        other.insert("taskId".into(), Value::from("another"));
        let again = TaskCall::decode(m, Some(&Value::Object(other)));
        assert_eq!(
            decoded.as_ref().map(|_| ()).map_err(|e| &e.message),
            again.as_ref().map(|_| ()).map_err(|e| &e.message),
        );
    }
}

// ---- config (relay_core::config) --------------------------------------------------------------
// Property bodies for the config model. Other modules add their own blocks; keep this one apart.

/// Parsing arbitrary text as a main file, as a drop-in, and as both, under both file kinds, never
/// panics; every error is one non-empty line that names its key or table, or says the TOML is
/// malformed. A config that parses also resolves (against env files holding the same text) and
/// evaluates its schedules and hours without panicking, under the same rule for errors.
pub fn config_parse_never_panics(text: &str) {
    use crate::config::{ConfigError, ConfigFile, FileKind, parse, resolve};
    use std::collections::BTreeMap;

    fn check(e: &ConfigError) {
        let shown = e.to_string();
        assert!(!e.message.trim().is_empty(), "empty error message: {e:?}");
        assert!(!shown.contains('\n'), "error spans lines: {shown}");
        let names_key = e.key.as_deref().is_some_and(|k| e.message.contains(k));
        let names_table = e
            .table
            .as_deref()
            .is_some_and(|t| shown.contains(&format!("[{t}]")));
        let malformed =
            e.key.is_none() && e.table.is_none() && e.message.contains("not valid TOML");
        assert!(
            names_key || names_table || malformed,
            "error names no key: {shown}"
        );
    }

    let main = ConfigFile::new("harness.toml", text);
    let empty = ConfigFile::new("harness.toml", "");
    let dropin = ConfigFile::new("harness.d/10-x.toml", text);
    for kind in [FileKind::Global, FileKind::Project] {
        let runs = [
            parse(&main, &[], kind),
            parse(&empty, std::slice::from_ref(&dropin), kind),
            parse(&main, std::slice::from_ref(&dropin), kind),
        ];
        for run in runs {
            match run {
                Err(errors) => {
                    assert!(!errors.0.is_empty(), "Err without errors");
                    errors.0.iter().for_each(check);
                }
                Ok(config) => {
                    for h in config.harnesses.values() {
                        for now in [0, 1_790_000_000_000, u64::MAX].map(Wall::from_ms) {
                            if let Some(s) = &h.schedule {
                                let next = s.next_after(now);
                                let never = next.ms() == u64::MAX;
                                assert!(next > now || never, "schedule went back");
                            }
                            if let Some(hours) = &h.operating_hours {
                                let _ = hours.contains(now);
                            }
                        }
                    }
                    let none = BTreeMap::new();
                    let same: BTreeMap<String, String> = config
                        .env_files()
                        .into_iter()
                        .map(|p| (p.to_string(), text.to_string()))
                        .collect();
                    for files in [&none, &same] {
                        if let Err(errors) = resolve(&config, files) {
                            errors.0.iter().for_each(check);
                        }
                    }
                }
            }
        }
    }
}
// ---- end config -------------------------------------------------------------------------------

/// `relay_transitions`: arbitrary input programs into the attempt machine; every property of
/// the machine holds (admission first, silence after loss, nothing after close, the token only
/// in lease calls, one outcome per claim).
pub fn relay_transitions(bytes: &[u8]) -> Result<(), String> {
    relay::relay_admission_before_lease_calls(bytes)?;
    relay::relay_silent_after_lease_loss(bytes)?;
    relay::relay_nothing_after_close(bytes)?;
    relay::relay_token_stays_in_lease_calls(bytes)?;
    relay::relay_one_outcome_per_claim(bytes)?;
    relay::relay_wall_clock_moves_no_deadline(bytes)
}

/// `config_parse`: arbitrary bytes (as lossy UTF-8) as harness.toml.
pub fn config_parse(bytes: &[u8]) {
    config_parse_never_panics(&String::from_utf8_lossy(bytes));
}

/// `summary_compose`: arbitrary agent text, check output and secret into the attempt summary.
/// It is valid UTF-8 of at most 2048 bytes, starts with the daemon's first line, and carries
/// no secret value.
pub fn summary_compose(bytes: &[u8]) -> Result<(), String> {
    use crate::relay::Redactor;
    use crate::relay::summary::{
        AgentOutcome, AgentRun, CheckRunSummary, compose_summary, first_line,
    };
    let mut parts = bytes.splitn(3, |b| *b == 0xff);
    let agent = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let check = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let seed = parts.next().unwrap_or_default();
    // The secret is shaped so that it can never occur in the daemon-authored first line.
    let secret: String = std::iter::once('Z')
        .chain(
            seed.iter()
                .chain(&[7u8; 4])
                .take(12)
                .map(|b| char::from(b'a' + b % 26)),
        )
        .chain(std::iter::once('Q'))
        .collect();
    let planted_agent = format!("{agent}{secret}");
    let n = |i: usize| u32::from(seed.get(i).copied().unwrap_or(1));
    let first = first_line(
        n(0) % 9 + 1,
        n(1) % 9 + 1,
        AgentRun {
            outcome: AgentOutcome::Failed,
            exit: n(2) as i32 - 128,
            duration: u64::from(n(3)) * 7_919,
        },
        (n(4) % 2 == 0).then(|| CheckRunSummary {
            exit: n(5) as i32,
            duration: u64::from(n(6)) * 1_000,
        }),
    );
    let redactor = Redactor::new([secret.as_str()]);
    let with_check = (!check.is_empty()).then_some(check.as_str());
    let s = compose_summary(&first, Some(&planted_agent), with_check, &redactor);
    if s.len() > crate::bounds::SUMMARY_MAX_BYTES {
        return Err(format!("summary of {} bytes", s.len()));
    }
    if !s.starts_with(&first) {
        return Err(format!("the first line was not kept: {s:?}"));
    }
    if s.contains(&secret) {
        return Err("the secret survived redaction".into());
    }
    Ok(())
}
