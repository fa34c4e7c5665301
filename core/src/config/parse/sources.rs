//! The source tables, `[queue.<name>]`, `[cairn.<name>]` and `[channel.<name>]`: the address
//! they share (`url`, `headers`, `env_file`, `mcp_era`) and each kind's own keys.

use std::collections::BTreeMap;

use toml::Value;

use super::{Reader, show_key};
use crate::config::{
    CairnSource, ChannelSource, DEFAULT_CAIRN_TTL, DEFAULT_LEASE_TTL, HeaderTemplate,
    MAX_LEASE_TTL, MIN_LEASE_TTL, QueueSource, SourceAddress, format_duration, parse_url,
};
use crate::mcp::client::EraChoice;

pub(super) fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// `url`, `headers` and `env_file`, shared by every source kind.
pub(super) fn endpoint(r: &mut Reader) -> Option<SourceAddress> {
    let env_file = r.string("env_file");
    let mut headers = BTreeMap::new();
    if let Some(v) = r.t.get("headers") {
        match v.as_table() {
            None => r.wrong_type(
                "headers",
                "a table of strings, e.g. headers = { Authorization = \"Bearer ${TOKEN}\" }",
                v,
            ),
            Some(t) => {
                for (name, value) in t {
                    let key = format!("headers.{}", show_key(name));
                    if !is_header_name(name) {
                        r.err(&key, format!("{key} is not a valid header name: use letters, digits and - (e.g. Authorization)"));
                        continue;
                    }
                    let Some(text) = value.as_str() else {
                        r.wrong_type(&key, "a string", value);
                        continue;
                    };
                    match HeaderTemplate::parse(text) {
                        Err(e) => r.err(&key, format!("{key} {e}")),
                        Ok(tpl) => {
                            if env_file.is_none()
                                && !r.has("env_file")
                                && let Some(var) = tpl.vars().next()
                            {
                                let table = r.table.clone();
                                r.err(&key, format!(
                                    "{key} refers to ${{{var}}} but [{table}] has no env_file: set env_file \
                                     to the file that defines {var} (headers resolve only from their \
                                     own table's env_file)"
                                ));
                            }
                            headers.insert(name.clone(), tpl);
                        }
                    }
                }
            }
        }
    }
    let url = match r.t.get("url") {
        None => {
            r.err(
                "url",
                "url is missing: set url = \"https://HOST/PATH\"".to_string(),
            );
            None
        }
        Some(v) => match v.as_str() {
            None => {
                r.wrong_type("url", "a string", v);
                None
            }
            Some(text) => match parse_url(text) {
                Ok(u) => Some(u),
                Err(e) => {
                    r.err("url", format!("url {e}"));
                    None
                }
            },
        },
    };
    let mcp_era = mcp_era(r);
    Some(SourceAddress {
        url: url?,
        headers,
        env_file,
        mcp_era: mcp_era?,
    })
}

/// `mcp_era` (queue and channel sources; the cairn table refuses the key as unknown).
fn mcp_era(r: &mut Reader) -> Option<EraChoice> {
    let Some(text) = r.str("mcp_era") else {
        return (!r.has("mcp_era")).then_some(EraChoice::Auto);
    };
    let choice = EraChoice::parse(text);
    if choice.is_none() {
        r.err(
            "mcp_era",
            format!(
                "mcp_era = {text:?} is not an MCP era: write \"auto\" (probe server/discover, \
                 fall back to initialize; the default), \"modern\" (2026-07-28 only) or \
                 \"legacy\" (initialize only)"
            ),
        );
    }
    choice
}

pub(super) fn queue_source(r: &mut Reader, name: String) -> Option<QueueSource> {
    let endpoint = endpoint(r);
    let queue = r.string("queue");
    let ttl = match r.duration("lease_ttl", true) {
        Some(ttl) if !(MIN_LEASE_TTL..=MAX_LEASE_TTL).contains(&ttl) => {
            let text =
                r.t.get("lease_ttl")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
            r.err(
                "lease_ttl",
                format!(
                    "lease_ttl = {text:?} must be between 1m and 1h: choose a lease in that range"
                ),
            );
            None
        }
        Some(ttl) => Some(ttl),
        None if r.has("lease_ttl") => None,
        None => Some(DEFAULT_LEASE_TTL),
    };
    let heartbeat = r.duration("heartbeat_interval", true);
    if let (Some(ttl), Some(hb)) = (ttl, heartbeat)
        && hb.saturating_mul(2) > ttl
    {
        let written =
            r.t.get("heartbeat_interval")
                .and_then(Value::as_str)
                .unwrap_or_default();
        let ttl_how = if r.has("lease_ttl") {
            ""
        } else {
            " (lease_ttl defaults to 5m)"
        };
        r.err(
            "heartbeat_interval",
            format!(
                "heartbeat_interval = {written:?} must be at most lease_ttl / 2 ({}){ttl_how}: \
                 lower heartbeat_interval or raise lease_ttl",
                format_duration(ttl / 2)
            ),
        );
    }
    let enabled = r.bool("enabled").unwrap_or(true);
    let description = r.string("description");
    let lease_ttl = ttl.unwrap_or(DEFAULT_LEASE_TTL);
    Some(QueueSource {
        name,
        declared_in: r.file.to_string(),
        address: endpoint?,
        queue,
        lease_ttl,
        heartbeat_interval: heartbeat.unwrap_or(lease_ttl / 3),
        enabled,
        description,
    })
}

pub(super) fn cairn_source(r: &mut Reader, name: String) -> Option<CairnSource> {
    let endpoint = endpoint(r);
    let ttl = r.duration("ttl", true).unwrap_or(DEFAULT_CAIRN_TTL);
    let enabled = r.bool("enabled").unwrap_or(true);
    let description = r.string("description");
    Some(CairnSource {
        name,
        declared_in: r.file.to_string(),
        address: endpoint?,
        ttl,
        enabled,
        description,
    })
}

pub(super) fn channel_source(r: &mut Reader, name: String) -> Option<ChannelSource> {
    let endpoint = endpoint(r);
    let enabled = r.bool("enabled").unwrap_or(true);
    let description = r.string("description");
    Some(ChannelSource {
        name,
        declared_in: r.file.to_string(),
        address: endpoint?,
        enabled,
        description,
    })
}
