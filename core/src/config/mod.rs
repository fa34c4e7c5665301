//! The daemon's config (`harness.toml`): model, validation, credential resolution, schedules and
//! operating hours.
//!
//! # Two pure steps
//!
//! The shell reads the main file and every `*.toml` in the `harness.d/` folder beside it (sorted),
//! and calls [`parse`]. The parsed [`Config`] lists the env files it needs
//! ([`Config::env_files`], paths exactly as written); the shell reads them and calls [`resolve`],
//! which substitutes `${NAME}` in source headers and returns a [`ResolvedConfig`]. Both steps
//! collect every error they can, each naming the file, the table and the key, what is wrong and
//! what to do. No error and no `Debug` output ever holds a header value or an env file value.
//!
//! # Tables and keys
//!
//! Names (`<name>`) are 1 to 64 letters, digits, `_` or `-`, starting with a letter or digit. A
//! `<kind>.<name>` is declared once across the main file and its drop-ins. Unknown keys are errors.
//! Durations are strings such as `"30s"`, `"5m"`, `"1h30m"`, `"7d"`, `"500ms"` ([`parse_duration`]).
//! URLs are `https://`, or `http://` to `localhost`, 127.0.0.0/8 or `::1`, without userinfo.
//! Header values may hold `${NAME}` references, resolved only from the same table's `env_file`.
//!
//! - `[queue.<name>]` — a lease source (global file only): `url` (required), `headers`,
//!   `env_file`, `queue`, `lease_ttl` (default 5m, 1m to 1h), `heartbeat_interval` (default
//!   lease_ttl / 3, at most lease_ttl / 2), `enabled` (default true), `description`.
//! - `[cairn.<name>]` — an artifact store for attempt receipts (global file only): `url`,
//!   `headers`, `env_file`, `ttl` (default 7d), `enabled`, `description`.
//! - `[channel.<name>]` — a doorbell listener: `url`, `headers`, `env_file`, `enabled`,
//!   `description`. A queue may share its url.
//! - `[harness.<name>]`:
//!   - `command` (required): the agent's argv, a non-empty array of strings;
//!   - `prompt_file`: bytes fed to the process's stdin; `workdir`; `env_file`: the process env;
//!   - `timeout`: stop the run after this long (unset: no limit); `kill_grace` (default 10s): how
//!     long a stop waits between SIGTERM and SIGKILL;
//!   - `on_overlap`: `"skip"` (default) or `"queue"` (hold one firing until the run ends);
//!   - `operating_hours`: a window string or an array of them (format below); unset: always;
//!   - `schedule`: `"@every <duration>"` (at least 1s, aligned to multiples since the Unix epoch),
//!     `@hourly`, `@daily`, `@midnight`, `@weekly`, `@monthly`, `@yearly`, `@annually`, or a
//!     five-field cron expression evaluated in UTC ([`Schedule`]);
//!   - `triggers`: `["channel.<name>", …]`, each declared;
//!   - `catch_up` (default false; needs `schedule`): at daemon start, fire once when a slot
//!     passed since the harness's newest run ([`Harness::catch_up_slot`]);
//!   - `keep_runs` (default 20, 1 to 10000): run records and logs kept per harness;
//!   - `enabled` (default true), `description`;
//!   - relay keys, global file only: `lease = "queue.<name>"` (needs `schedule` or `triggers`),
//!     `success_check` (non-empty argv, never expanded: no `${NAME}`, no `{placeholder}`),
//!     `success_check_timeout` (default 10m), `success_check_interval` (default 30s, less than
//!     the timeout), `success_check_before` (default false; needs `success_check`),
//!     `attempt_receipt = "cairn.<name>"`. All but `lease` need `lease`.
//!
//! A project file ([`FileKind::Project`]) refuses `[queue.*]`, `[cairn.*]` and `lease`.
//!
//! # Operating hours
//!
//! Each window is `[DAYS] HH:MM-HH:MM [OFFSET]`, for example `"mon-fri 09:00-18:00"`,
//! `"sat,sun 10:00-14:00 +02:00"` or `"fri 22:00-02:00"`: days are `sun`…`sat`, lists and ranges
//! (a range may wrap, `fri-mon`), omitted for every day, and name the day a window starts; the
//! start is inclusive and the end exclusive, `24:00` may end a window, and an end before the start
//! crosses midnight; the offset is `UTC`, `Z` or a fixed `+HH:MM`/`-HH:MM` (default UTC, no
//! daylight saving). An array of windows is their union.
//!
//! # Env files
//!
//! `NAME=value` lines, optionally prefixed `export `; blank lines and `#` comment lines are
//! skipped; a value in matching single or double quotes loses them; nothing else is interpreted.
//! A later line for a name wins. See [`parse_env_file`].
//!
//! # Example
//!
//! The test suite parses this file, so it stays valid:
//!
#![doc = concat!("```toml\n", include_str!("example.toml"), "```")]

mod diff;
mod duration;
mod hours;
mod parse;
mod schedule;
mod secrets;
mod url;

#[cfg(test)]
mod tests;

pub use diff::{Changes, ConfigDiff, diff};
pub use duration::{DurationError, format_duration, parse_duration};
pub use hours::{OperatingHours, within_hours};
pub use parse::{is_valid_name, parse};
pub use schedule::{Cron, Schedule};
pub use secrets::{EnvVars, HeaderTemplate, Secret, parse_env_file};
pub use url::{Url, parse_url};

use crate::time::{DAY, HOUR, MINUTE, Millis, SECOND, Wall};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

pub const DEFAULT_LEASE_TTL: Millis = 5 * MINUTE;
pub const MIN_LEASE_TTL: Millis = MINUTE;
pub const MAX_LEASE_TTL: Millis = HOUR;
pub const DEFAULT_CAIRN_TTL: Millis = 7 * DAY;
pub const DEFAULT_KILL_GRACE: Millis = 10 * SECOND;
pub const DEFAULT_KEEP_RUNS: u32 = 20;
pub const MAX_KEEP_RUNS: u32 = 10_000;
pub const DEFAULT_SUCCESS_CHECK_TIMEOUT: Millis = 10 * MINUTE;
pub const DEFAULT_SUCCESS_CHECK_INTERVAL: Millis = 30 * SECOND;

/// The text of one config file, and the path to name it by in errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    pub path: String,
    pub text: String,
}

impl ConfigFile {
    pub fn new(path: impl Into<String>, text: impl Into<String>) -> ConfigFile {
        ConfigFile {
            path: path.into(),
            text: text.into(),
        }
    }
}

/// Which rules apply: the daemon's global file, or a project's own `harness.toml`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Global,
    Project,
}

/// One problem in the config. `Display` gives the full line: `FILE: [TABLE] MESSAGE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The config file, as the shell named it in [`ConfigFile::path`].
    pub file: String,
    /// `queue.ci`, `harness.fixer`; `None` for file-level problems.
    pub table: Option<String>,
    /// The offending key (`heartbeat_interval`, `headers.Authorization`, `success_check[1]`);
    /// `None` when the table itself is the problem or the TOML is malformed.
    pub key: Option<String>,
    /// What was wrong and what to do, starting with the key when there is one.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.table {
            Some(t) => write!(f, "{}: [{}] {}", self.file, t, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// Every problem found, in a stable order. `Display` prints one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

crate::names! {
    /// The three kinds of remote source a config declares.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub enum SourceKind {
        Queue => "queue",
        Cairn => "cairn",
        Channel => "channel",
    }
}

/// A reference to a source table, shown as `queue.ci`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SourceRef {
    pub kind: SourceKind,
    pub name: String,
}

impl fmt::Display for SourceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.kind.as_str(), self.name)
    }
}

/// Where a source is reached and with which headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceAddress {
    pub url: Url,
    /// Header name to template; `Debug` shows only the variable names.
    pub headers: BTreeMap<String, HeaderTemplate>,
    /// The only file `${NAME}` in `headers` resolves from, as written.
    pub env_file: Option<String>,
    /// `mcp_era` of a queue or channel source: probe (`auto`) or force an MCP era.
    pub mcp_era: crate::mcp::client::EraChoice,
}

/// A `[queue.<name>]` lease source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSource {
    pub name: String,
    pub declared_in: String,
    pub address: SourceAddress,
    /// Restricts claims to one queue; `None` claims from every granted queue.
    pub queue: Option<String>,
    pub lease_ttl: Millis,
    pub heartbeat_interval: Millis,
    pub enabled: bool,
    pub description: Option<String>,
}

/// A `[cairn.<name>]` artifact store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CairnSource {
    pub name: String,
    pub declared_in: String,
    pub address: SourceAddress,
    pub ttl: Millis,
    pub enabled: bool,
    pub description: Option<String>,
}

/// A `[channel.<name>]` doorbell listener source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelSource {
    pub name: String,
    pub declared_in: String,
    pub address: SourceAddress,
    pub enabled: bool,
    pub description: Option<String>,
}

/// What to do with a firing while a run of the same harness is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnOverlap {
    #[default]
    Skip,
    Queue,
}

/// A `[harness.<name>]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Harness {
    pub name: String,
    pub declared_in: String,
    pub command: Vec<String>,
    pub prompt_file: Option<String>,
    pub workdir: Option<String>,
    pub env_file: Option<String>,
    pub timeout: Option<Millis>,
    pub kill_grace: Millis,
    pub on_overlap: OnOverlap,
    /// `None`: no restriction.
    pub operating_hours: Option<OperatingHours>,
    pub schedule: Option<Schedule>,
    /// Channel names (without the `channel.` prefix), each declared.
    pub triggers: Vec<String>,
    pub catch_up: bool,
    pub keep_runs: u32,
    pub enabled: bool,
    pub description: Option<String>,
    /// Set exactly when the harness has `lease`.
    pub relay: Option<HarnessRelay>,
}

impl Harness {
    /// The trigger `catch_up`, at daemon start: the first schedule slot after the harness's newest
    /// run (`last_run_started`, from its run record) that is not after `now`, which the daemon
    /// fires once (trigger `catch_up`). `None` without `catch_up`, without a schedule, when no
    /// slot fell in between, or when the harness never ran (it owes no slot it was never
    /// scheduled for).
    pub fn catch_up_slot(&self, last_run_started: Option<Wall>, now: Wall) -> Option<Wall> {
        if !self.catch_up {
            return None;
        }
        self.schedule.as_ref()?.missed_since(last_run_started?, now)
    }

    /// Whether a firing at wall time `now` falls within the operating hours (always, without).
    pub fn within_hours(&self, now: Wall) -> bool {
        within_hours(self.operating_hours.as_ref(), now)
    }

    /// The schedule's next firing strictly after wall time `now`; `None` without a schedule.
    pub fn next_fire(&self, now: Wall) -> Option<Wall> {
        self.schedule.as_ref().map(|s| s.next_after(now))
    }
}

/// The relay keys of a leased harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarnessRelay {
    /// The `[queue.<name>]` name (without `queue.`); declared.
    pub lease: String,
    pub success_check: Option<Vec<String>>,
    pub success_check_timeout: Millis,
    pub success_check_interval: Millis,
    pub success_check_before: bool,
    /// The `[cairn.<name>]` name (without `cairn.`); declared.
    pub attempt_receipt: Option<String>,
    /// Exit codes of the agent or the check after which a failure is reported not retryable.
    pub non_retryable_exit_codes: Vec<i32>,
}

impl HarnessRelay {
    /// The lease as written in config and run records: `queue.<name>`.
    pub fn lease_ref(&self) -> SourceRef {
        SourceRef {
            kind: SourceKind::Queue,
            name: self.lease.clone(),
        }
    }
}

/// A validated config. Header values are still templates; see [`resolve`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    pub queues: BTreeMap<String, QueueSource>,
    pub cairns: BTreeMap<String, CairnSource>,
    pub channels: BTreeMap<String, ChannelSource>,
    pub harnesses: BTreeMap<String, Harness>,
}

impl Config {
    /// Every source with its address and the file that declared it.
    pub fn sources(&self) -> impl Iterator<Item = (SourceRef, &SourceAddress, &str)> {
        let r = |kind, name: &String| SourceRef {
            kind,
            name: name.clone(),
        };
        let q = self
            .queues
            .iter()
            .map(move |(n, s)| (r(SourceKind::Queue, n), &s.address, s.declared_in.as_str()));
        let c = self
            .cairns
            .iter()
            .map(move |(n, s)| (r(SourceKind::Cairn, n), &s.address, s.declared_in.as_str()));
        let ch = self.channels.iter().map(move |(n, s)| {
            (
                r(SourceKind::Channel, n),
                &s.address,
                s.declared_in.as_str(),
            )
        });
        q.chain(c).chain(ch)
    }

    /// Every `env_file` of a source or a harness, as written. The shell reads each and passes
    /// the contents to [`resolve`] under the same key.
    pub fn env_files(&self) -> BTreeSet<&str> {
        self.sources()
            .filter_map(|(_, e, _)| e.env_file.as_deref())
            .chain(
                self.harnesses
                    .values()
                    .filter_map(|h| h.env_file.as_deref()),
            )
            .collect()
    }
}

/// A config whose headers are resolved and whose env files are parsed.
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    pub config: Config,
    headers: BTreeMap<SourceRef, BTreeMap<String, Secret>>,
    env: BTreeMap<String, EnvVars>,
}

impl ResolvedConfig {
    /// The resolved headers of a source (an empty map when it has none).
    pub fn headers(&self, source: &SourceRef) -> Option<&BTreeMap<String, Secret>> {
        self.headers.get(source)
    }

    /// The parsed contents of an env file, keyed by the path as written.
    pub fn env_file(&self, path: &str) -> Option<&EnvVars> {
        self.env.get(path)
    }

    /// Every resolved header value and every env file value, for the redactor: deduplicated,
    /// longest first (so a value is masked before any shorter value inside it), empty values
    /// left out because they cannot be masked.
    pub fn secret_values(&self) -> Vec<&str> {
        let all: BTreeSet<&str> = self
            .headers
            .values()
            .flat_map(|h| h.values().map(Secret::expose))
            .chain(
                self.env
                    .values()
                    .flat_map(|v| v.iter().map(|(_, s)| s.expose())),
            )
            .filter(|s| !s.is_empty())
            .collect();
        let mut out: Vec<&str> = all.into_iter().collect();
        out.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Resolution
// ---------------------------------------------------------------------------------------------

/// Parses the env files (`env_files`: path as written to contents) and resolves every source
/// header's `${NAME}` from that source's own env file. Every path in [`Config::env_files`] must
/// be present. Errors name the file, table, header and variable, never a value.
pub fn resolve(
    config: &Config,
    env_files: &BTreeMap<String, String>,
) -> Result<ResolvedConfig, ConfigErrors> {
    let mut errors = Vec::new();
    let mut env = BTreeMap::new();
    // Files that could not be used; their headers are not checked again variable by variable.
    let mut failed = BTreeSet::new();
    // Each env file is reported once, against the first table (in config order) that uses it.
    let users = config
        .sources()
        .filter_map(|(r, e, file)| e.env_file.as_deref().map(|p| (p, file, r.to_string())))
        .chain(config.harnesses.values().filter_map(|h| {
            h.env_file
                .as_deref()
                .map(|p| (p, h.declared_in.as_str(), format!("harness.{}", h.name)))
        }));
    for (path, file, table) in users {
        if env.contains_key(path) {
            continue;
        }
        let err = |message: String| ConfigError {
            file: file.to_string(),
            table: Some(table.clone()),
            key: Some("env_file".to_string()),
            message,
        };
        let Some(text) = env_files.get(path) else {
            errors.push(err(format!(
                "env_file = {path:?} was not read: make sure the file exists and is readable"
            )));
            failed.insert(path);
            env.insert(path.to_string(), EnvVars::default());
            continue;
        };
        match parse_env_file(text) {
            Ok(vars) => {
                env.insert(path.to_string(), vars);
            }
            Err(lines) => {
                for (line, what) in lines {
                    errors.push(err(format!(
                        "env_file = {path:?}: line {line} {what}: fix that line (lines are NAME=value, \
                         # comments or blank)"
                    )));
                }
                failed.insert(path);
                env.insert(path.to_string(), EnvVars::default());
            }
        }
    }

    let empty = EnvVars::default();
    let mut headers = BTreeMap::new();
    for (source, endpoint, file) in config.sources() {
        if endpoint
            .env_file
            .as_deref()
            .is_some_and(|p| failed.contains(p))
        {
            continue;
        }
        let vars = endpoint
            .env_file
            .as_deref()
            .and_then(|p| env.get(p))
            .unwrap_or(&empty);
        let mut resolved = BTreeMap::new();
        for (name, tpl) in &endpoint.headers {
            let key = format!("headers.{name}");
            match tpl.resolve(vars) {
                Ok(v) if v.expose().contains(|c: char| c.is_control() && c != '\t') => {
                    errors.push(ConfigError {
                        file: file.to_string(),
                        table: Some(source.to_string()),
                        key: Some(key.clone()),
                        message: format!("{key} resolves to a value with a control character: fix the variable in the env_file"),
                    });
                }
                Ok(v) => {
                    resolved.insert(name.clone(), v);
                }
                Err(var) => {
                    let path = endpoint.env_file.as_deref().unwrap_or_default();
                    errors.push(ConfigError {
                        file: file.to_string(),
                        table: Some(source.to_string()),
                        key: Some(key.clone()),
                        message: format!(
                            "{key} refers to ${{{var}}}, which env_file {path:?} does not set: add a \
                             {var}=… line to that file"
                        ),
                    });
                }
            }
        }
        headers.insert(source, resolved);
    }
    if errors.is_empty() {
        Ok(ResolvedConfig {
            config: config.clone(),
            headers,
            env,
        })
    } else {
        Err(ConfigErrors(errors))
    }
}
