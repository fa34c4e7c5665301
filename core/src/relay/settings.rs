//! From a validated, resolved config to the plain values one relay machine runs on.
//!
//! The shell reads files (the prompt, env files) and knows the host and its directories; every
//! choice about which config value becomes which setting is made here, once.

use super::types::{HarnessSettings, SuccessCheck};
use crate::config::ResolvedConfig;

/// What the shell supplies beside the config: facts about the host and bytes it read.
#[derive(Clone, Debug)]
pub struct HostFacts {
    /// The host name used in claimant labels.
    pub host: String,
    /// The absolute jobs directory; a harness's run files live in `<jobs_dir>/<harness>/`.
    pub jobs_dir: String,
    /// The directory relative paths in the config are taken from (the main file's folder).
    pub config_dir: String,
    /// `$HOME`, for paths written `~/…`; `None` when unknown.
    pub home: Option<String>,
}

/// A path as the config wrote it, made absolute: `~/x` from the home directory, a relative path
/// from the config file's folder, an absolute path unchanged.
pub fn expand_path(written: &str, facts: &HostFacts) -> String {
    if written == "~"
        && let Some(home) = &facts.home
    {
        return home.clone();
    }
    if let (Some(rest), Some(home)) = (written.strip_prefix("~/"), &facts.home) {
        return format!("{}/{rest}", home.trim_end_matches('/'));
    }
    if written.starts_with('/') {
        return written.to_string();
    }
    format!("{}/{written}", facts.config_dir.trim_end_matches('/'))
}

/// The settings of a leased harness, or `None` when `harness` is not a leased harness of the
/// config. `prompt` is the content of its `prompt_file`, read by the shell.
///
/// Choices: an unset `workdir` is the config file's folder; `secrets` holds the resolved header
/// values of the lease source and of the receipt's Cairn source (the redactor adds the harness's
/// env_file values itself).
pub fn harness_settings(
    resolved: &ResolvedConfig,
    harness: &str,
    facts: &HostFacts,
    prompt: Option<Vec<u8>>,
) -> Option<HarnessSettings> {
    let config = &resolved.config;
    let h = config.harnesses.get(harness)?;
    let relay = h.relay.as_ref()?;
    let source = config.queues.get(&relay.lease)?;
    let lease_ref = relay.lease_ref();
    let mut secrets: Vec<String> = resolved
        .headers(&lease_ref)
        .into_iter()
        .flat_map(|m| m.values().map(|s| s.expose().to_string()))
        .collect();
    if let Some(cairn) = &relay.attempt_receipt {
        let cairn_ref = crate::config::SourceRef {
            kind: crate::config::SourceKind::Cairn,
            name: cairn.clone(),
        };
        secrets.extend(
            resolved
                .headers(&cairn_ref)
                .into_iter()
                .flat_map(|m| m.values().map(|s| s.expose().to_string())),
        );
    }
    secrets.retain(|s| !s.is_empty());
    secrets.sort();
    secrets.dedup();
    let env_file = h
        .env_file
        .as_deref()
        .and_then(|p| resolved.env_file(p))
        .map(|vars| {
            vars.iter()
                .map(|(k, v)| (k.to_string(), v.expose().to_string()))
                .collect()
        })
        .unwrap_or_default();
    Some(HarnessSettings {
        harness: h.name.clone(),
        host: facts.host.clone(),
        lease: lease_ref.to_string(),
        queue: source.queue.clone(),
        lease_ttl: source.lease_ttl,
        heartbeat_interval: source.heartbeat_interval,
        argv: h.command.clone(),
        prompt,
        workdir: h
            .workdir
            .as_deref()
            .map(|w| expand_path(w, facts))
            .unwrap_or_else(|| facts.config_dir.clone()),
        timeout: h.timeout,
        kill_grace: h.kill_grace,
        on_overlap: h.on_overlap,
        enabled: h.enabled,
        lease_enabled: source.enabled,
        success_check: relay.success_check.as_ref().map(|argv| SuccessCheck {
            argv: argv.clone(),
            timeout: relay.success_check_timeout,
            interval: relay.success_check_interval,
            before: relay.success_check_before,
        }),
        attempt_receipt: relay.attempt_receipt.as_ref().map(|c| format!("cairn.{c}")),
        jobs_dir: facts.jobs_dir.clone(),
        secrets,
        env_file,
        non_retryable_exit_codes: relay.non_retryable_exit_codes.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigFile, FileKind, parse, resolve};
    use std::collections::BTreeMap;

    fn facts() -> HostFacts {
        HostFacts {
            host: "box".into(),
            jobs_dir: "/state/jobs".into(),
            config_dir: "/etc/relay".into(),
            home: Some("/home/op".into()),
        }
    }

    const CONFIG: &str = r#"
[queue.ci]
url = "http://127.0.0.1:7411/mcp/ci"
env_file = "ci.env"
headers = { Authorization = "Bearer ${TOKEN}" }
queue = "fixes"
lease_ttl = "2m"

[cairn.main]
url = "http://127.0.0.1:9000"
env_file = "cairn.env"
headers = { Authorization = "Bearer ${CAIRN}" }

[harness.fixer]
command = ["sh", "agent.sh"]
workdir = "~/src"
env_file = "agent.env"
schedule = "@every 1m"
lease = "queue.ci"
success_check = ["./check.sh"]
success_check_interval = "5s"
attempt_receipt = "cairn.main"

[harness.plain]
command = ["true"]
schedule = "@every 1m"
"#;

    fn resolved() -> ResolvedConfig {
        let config = parse(
            &ConfigFile::new("/etc/relay/harness.toml", CONFIG),
            &[],
            FileKind::Global,
        )
        .expect("config parses");
        let files: BTreeMap<String, String> = [
            ("ci.env", "TOKEN=queue-secret\n"),
            ("cairn.env", "CAIRN=cairn-secret\n"),
            ("agent.env", "API_KEY=agent-secret\n"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        resolve(&config, &files).expect("config resolves")
    }

    #[test]
    fn a_leased_harness_gets_its_source_and_secrets() {
        let s = harness_settings(&resolved(), "fixer", &facts(), Some(b"go".to_vec())).unwrap();
        assert_eq!(s.lease, "queue.ci");
        assert_eq!(s.queue.as_deref(), Some("fixes"));
        assert_eq!(s.lease_ttl, 2 * crate::time::MINUTE);
        assert_eq!(s.heartbeat_interval, 40 * crate::time::SECOND);
        assert_eq!(s.workdir, "/home/op/src");
        assert_eq!(s.attempt_receipt.as_deref(), Some("cairn.main"));
        assert_eq!(
            s.secrets,
            vec![
                "Bearer cairn-secret".to_string(),
                "Bearer queue-secret".into()
            ]
        );
        assert_eq!(s.env_file, vec![("API_KEY".into(), "agent-secret".into())]);
        let check = s.success_check.unwrap();
        assert_eq!(check.argv, vec!["./check.sh".to_string()]);
        assert_eq!(check.interval, 5 * crate::time::SECOND);
        // No secret reaches Debug output.
        let s = harness_settings(&resolved(), "fixer", &facts(), None).unwrap();
        let debug = format!("{s:?}");
        for secret in ["queue-secret", "cairn-secret", "agent-secret"] {
            assert!(!debug.contains(secret), "{debug}");
        }
    }

    #[test]
    fn unleased_and_unknown_harnesses_have_no_settings() {
        assert!(harness_settings(&resolved(), "plain", &facts(), None).is_none());
        assert!(harness_settings(&resolved(), "nope", &facts(), None).is_none());
    }

    #[test]
    fn paths_expand_from_home_and_the_config_folder() {
        let f = facts();
        assert_eq!(expand_path("~/a", &f), "/home/op/a");
        assert_eq!(expand_path("~", &f), "/home/op");
        assert_eq!(expand_path("/abs", &f), "/abs");
        assert_eq!(expand_path("rel/x", &f), "/etc/relay/rel/x");
        let no_home = HostFacts { home: None, ..f };
        assert_eq!(expand_path("~/a", &no_home), "/etc/relay/~/a");
    }
}
