//! `relay doctor`: what is wrong with the lease sources and their bindings, as rows.
//! The daemon asks each source for its tools/list; everything decided about the answer is here.

use serde::Serialize;

use super::capabilities::Capabilities;
use crate::config::Config;

crate::names! {
    /// How bad a row is. A `Fail` means firings of the harnesses bound to the source are skipped.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Level {
        Ok => "ok",
        Notice => "notice",
        Warn => "warn",
        Fail => "fail",
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Row {
    pub level: Level,
    /// `queue.<name>` or `harness.<name>`.
    pub subject: String,
    pub message: String,
}

/// The rows for one lease source, from its tools/list verdict or the error that kept the
/// daemon from getting one.
pub fn source_rows(source: &str, answer: Result<&Capabilities, &str>) -> Vec<Row> {
    let row = |level, message: String| Row {
        level,
        subject: source.to_string(),
        message,
    };
    let caps = match answer {
        Ok(caps) => caps,
        Err(error) => {
            return vec![row(
                Level::Fail,
                format!(
                    "tools/list failed: {error}; check the url, the token and that the server runs"
                ),
            )];
        }
    };
    let mut rows = Vec::new();
    if !caps.missing_verbs.is_empty() {
        rows.push(row(
            Level::Fail,
            format!(
                "missing {}: grant these verbs to the endpoint",
                caps.missing_verbs.join(", ")
            ),
        ));
    }
    let arguments: Vec<&str> = caps
        .missing
        .iter()
        .filter(|m| m.contains('.'))
        .map(String::as_str)
        .collect();
    if !arguments.is_empty() {
        rows.push(row(
            Level::Fail,
            format!(
                "the server does not declare {}: relay needs a queue server with attempt history \
                 and fenced leases (docs/daemon.md: \"Against any queue server\"); upgrade the server",
                arguments.join(", ")
            ),
        ));
    }
    if !caps.release_advertised {
        rows.push(row(
            Level::Notice,
            "release is not advertised: aborted attempts are reported with fail instead".into(),
        ));
    }
    if !caps.asks() {
        rows.push(row(
            Level::Notice,
            "request_input is not offered: an agent's question (needs_input) is reported with \
             fail, reason needs_input_unsupported; grant request_input to ask a person"
                .into(),
        ));
    }
    if rows.is_empty() {
        rows.push(row(Level::Ok, "supported".into()));
    }
    rows
}

/// The row saying which MCP era a source speaks (`era` as the lease client describes its link,
/// e.g. `MCP 2026-07-28 (modern era, no session)`), shown once its tools/list was answered.
pub fn era_row(source: &str, era: &str) -> Row {
    Row {
        level: Level::Ok,
        subject: source.to_string(),
        message: format!("speaks {era}"),
    }
}

/// The lease sources (`queue.<name>`) that a leased harness of `config` binds, sorted: the ones
/// doctor asks for their tools/list, with or without a running daemon.
pub fn bound_sources(config: &Config) -> Vec<String> {
    let set: std::collections::BTreeSet<String> = config
        .harnesses
        .values()
        .filter_map(|h| h.relay.as_ref())
        .filter(|r| config.queues.contains_key(&r.lease))
        .map(|r| r.lease_ref().to_string())
        .collect();
    set.into_iter().collect()
}

/// Warnings about how harnesses bind their sources: a harness rung by a channel on one url but
/// claiming on a lease source at another cannot claim what its doorbell announces.
pub fn binding_rows(config: &Config) -> Vec<Row> {
    let mut rows = Vec::new();
    for h in config.harnesses.values() {
        let Some(relay) = &h.relay else { continue };
        let Some(queue) = config.queues.get(&relay.lease) else {
            continue;
        };
        for channel in &h.triggers {
            let Some(ch) = config.channels.get(channel) else {
                continue;
            };
            if ch.address.url != queue.address.url {
                rows.push(Row {
                    level: Level::Warn,
                    subject: format!("harness.{}", h.name),
                    message: format!(
                        "triggered by channel.{channel} ({}) but leases from queue.{} ({}): a \
                         doorbell for one endpoint cannot be claimed on another; point both at \
                         the same url",
                        ch.address.url.as_str(),
                        queue.name,
                        queue.address.url.as_str()
                    ),
                });
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::relay::check_capabilities;
    use crate::testing::relay::tools_list;

    #[test]
    fn a_read_only_endpoint_names_every_missing_verb() {
        let caps = check_capabilities(&tools_list(&[("list_todos", &["queue"])]));
        let rows = source_rows("queue.ci", Ok(&caps));
        assert_eq!(rows[0].level, Level::Fail);
        assert!(
            rows[0]
                .message
                .contains("claim_next, heartbeat, complete, fail"),
            "{rows:?}"
        );
        assert!(rows.iter().any(|r| r.level == Level::Notice));
    }

    #[test]
    fn an_old_server_fails_naming_each_argument() {
        let caps = check_capabilities(&tools_list(&[
            ("claim_next", &["queue"]),
            ("heartbeat", &["id"]),
            ("complete", &["id", "summary", "artifact", "lease_token"]),
            ("fail", &["id", "summary", "artifact", "lease_token"]),
        ]));
        let rows = source_rows("queue.ci", Ok(&caps));
        let fail = rows
            .iter()
            .find(|r| r.message.contains("attempt history"))
            .unwrap();
        for arg in [
            "claim_next.require_fence",
            "claim_next.claimant",
            "heartbeat.lease_token",
        ] {
            assert!(fail.message.contains(arg), "{fail:?}");
        }
    }

    #[test]
    fn a_full_server_is_one_ok_row() {
        let mut caps = Capabilities::full(true);
        let (verb, args) = crate::relay::table::OPTIONAL_VERBS[0];
        let asked: BTreeSet<String> = args.iter().map(|a| a.to_string()).collect();
        caps.declared.insert(verb.to_string(), asked);
        let rows = source_rows("queue.ci", Ok(&caps));
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].level, Level::Ok);
        // Without request_input the daemon still works; doctor says what a question becomes.
        let rows = source_rows("queue.ci", Ok(&Capabilities::full(true)));
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].level, Level::Notice);
        assert!(
            rows[0].message.contains("needs_input_unsupported"),
            "{rows:?}"
        );
        let rows = source_rows("queue.ci", Err("connection refused"));
        assert_eq!(rows[0].level, Level::Fail);
        let era = era_row("queue.ci", "MCP 2026-07-28 (modern era, no session)");
        assert_eq!(era.level, Level::Ok);
        assert_eq!(
            era.message,
            "speaks MCP 2026-07-28 (modern era, no session)"
        );
    }

    #[test]
    fn a_channel_on_another_url_warns() {
        use crate::testing::config::{config, rung_fixer};
        let apart = config(&rung_fixer(
            "http://127.0.0.1:1/mcp/a",
            "http://127.0.0.1:1/mcp/b",
        ));
        let rows = binding_rows(&apart);
        assert_eq!(bound_sources(&apart), ["queue.ci"]);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].level, Level::Warn);
        let same = config(&rung_fixer(
            "http://127.0.0.1:1/mcp/a",
            "http://127.0.0.1:1/mcp/a",
        ));
        assert!(binding_rows(&same).is_empty());
    }
}
