//! Parsing and validating the TOML: tables, keys, drop-ins, with errors that name the file, the
//! table and the key.

use crate::mcp::client::EraChoice;
use crate::time::Millis;
use std::collections::{BTreeMap, BTreeSet};
use toml::{Table, Value};

use super::*;

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum TableKind {
    Queue,
    Cairn,
    Channel,
    Harness,
}

crate::names!(TableKind {
    Queue => "queue", Cairn => "cairn", Channel => "channel", Harness => "harness",
});

impl TableKind {
    pub(super) fn keys(self) -> &'static [&'static str] {
        match self {
            TableKind::Queue => &[
                "url",
                "headers",
                "env_file",
                "queue",
                "lease_ttl",
                "heartbeat_interval",
                "enabled",
                "description",
                "mcp_era",
            ],
            TableKind::Cairn => &[
                "url",
                "headers",
                "env_file",
                "ttl",
                "enabled",
                "description",
            ],
            TableKind::Channel => &[
                "url",
                "headers",
                "env_file",
                "enabled",
                "description",
                "mcp_era",
            ],
            TableKind::Harness => &[
                "command",
                "prompt_file",
                "workdir",
                "env_file",
                "timeout",
                "kill_grace",
                "on_overlap",
                "operating_hours",
                "schedule",
                "triggers",
                "catch_up",
                "keep_runs",
                "enabled",
                "description",
                "lease",
                "success_check",
                "success_check_timeout",
                "success_check_interval",
                "success_check_before",
                "attempt_receipt",
                "non_retryable_exit_codes",
            ],
        }
    }
}

pub(super) const RELAY_ONLY_KEYS: [&str; 6] = [
    "success_check",
    "success_check_timeout",
    "success_check_interval",
    "success_check_before",
    "attempt_receipt",
    "non_retryable_exit_codes",
];

/// True for `^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$`.
pub fn is_valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'-')
}

/// A table as found in one file, before validation.
pub(super) struct Decl<'a> {
    file: &'a str,
    table: &'a Table,
}

/// Parses and validates the main file and its drop-ins. `kind` applies to all of them.
pub fn parse(main: &Source, dropins: &[Source], kind: FileKind) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut any_malformed = false;
    let mut files: Vec<(&str, Table)> = Vec::new();
    for src in std::iter::once(main).chain(dropins) {
        match src.text.parse::<Table>() {
            Ok(t) => files.push((src.path.as_str(), t)),
            Err(e) => {
                any_malformed = true;
                errors.push(malformed(&src.path, &src.text, &e));
            }
        }
    }

    let mut decls: BTreeMap<(TableKind, &str), Decl> = BTreeMap::new();
    for (file, top) in &files {
        collect_decls(file, top, kind, &mut decls, &mut errors);
    }

    let declared = |k: TableKind| -> BTreeSet<&str> {
        decls
            .keys()
            .filter(|(dk, _)| *dk == k)
            .map(|(_, n)| *n)
            .collect()
    };
    let refs = Declared {
        queues: declared(TableKind::Queue),
        cairns: declared(TableKind::Cairn),
        channels: declared(TableKind::Channel),
        // A file that failed to parse may hold the declaration a reference needs.
        complete: !any_malformed,
    };

    let mut config = Config::default();
    for ((tk, name), decl) in &decls {
        let name = name.to_string();
        let mut r = Reader::new(
            decl.file,
            format!("{}.{}", tk.as_str(), name),
            decl.table,
            &mut errors,
        );
        r.check_unknown(tk.keys(), *tk);
        match tk {
            TableKind::Queue => {
                if let Some(q) = queue_source(&mut r, name.clone()) {
                    config.queues.insert(name, q);
                }
            }
            TableKind::Cairn => {
                if let Some(c) = cairn_source(&mut r, name.clone()) {
                    config.cairns.insert(name, c);
                }
            }
            TableKind::Channel => {
                if let Some(c) = channel_source(&mut r, name.clone()) {
                    config.channels.insert(name, c);
                }
            }
            TableKind::Harness => {
                if let Some(h) = harness(&mut r, name.clone(), kind, &refs) {
                    config.harnesses.insert(name, h);
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// A TOML syntax error, with line and column but without the source excerpt, which could show
/// a credential written on that line.
pub(super) fn malformed(file: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let position = e
        .span()
        .map(|span| {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|b| **b == b'\n').count() + 1;
            let col = before.iter().rev().take_while(|b| **b != b'\n').count() + 1;
            format!("line {line}, column {col}: ")
        })
        .unwrap_or_default();
    let detail = e.message().lines().next().unwrap_or("").trim();
    ConfigError {
        file: file.to_string(),
        table: None,
        key: None,
        message: format!("{position}not valid TOML ({detail}): fix the syntax at that point"),
    }
}

pub(super) fn collect_decls<'a>(
    file: &'a str,
    top: &'a Table,
    kind: FileKind,
    decls: &mut BTreeMap<(TableKind, &'a str), Decl<'a>>,
    errors: &mut Vec<ConfigError>,
) {
    let top_err = |key: String, message: String| ConfigError {
        file: file.to_string(),
        table: None,
        key: Some(key),
        message,
    };
    for (top_key, value) in top {
        let top_key = &show_key(top_key);
        let Some(tk) = TableKind::parse(top_key) else {
            let kinds = TableKind::ALL.map(TableKind::as_str);
            let message = if value.is_table() {
                let hint = suggest(top_key, &kinds)
                    .map(|s| format!("did you mean [{s}.<name>]? "))
                    .unwrap_or_default();
                format!(
                    "[{top_key}] is not a relay table: {hint}relay reads [queue.<name>], \
                     [cairn.<name>], [channel.<name>] and [harness.<name>]"
                )
            } else {
                format!(
                    "{top_key} is set outside any table: move it under the [queue.<name>], \
                     [cairn.<name>], [channel.<name>] or [harness.<name>] it belongs to"
                )
            };
            errors.push(top_err(top_key.clone(), message));
            continue;
        };
        let kind_str = tk.as_str();
        let Some(named) = value.as_table() else {
            errors.push(top_err(
                top_key.clone(),
                format!(
                    "{kind_str} must hold named tables such as [{kind_str}.main], not a {}",
                    value.type_str()
                ),
            ));
            continue;
        };
        for (name, body) in named {
            let label = format!("{kind_str}.{}", show_key(name));
            let Some(table) = body.as_table() else {
                let message = if body.is_array() {
                    format!("{label} must be a single table: write [{label}], not [[{label}]]")
                } else {
                    format!(
                        "{label} is set directly under [{kind_str}]: tables need a name, write \
                         [{kind_str}.<name>] (e.g. [{kind_str}.main]) and put {} inside it",
                        show_key(name)
                    )
                };
                errors.push(top_err(label, message));
                continue;
            };
            let table_err = |message: String| ConfigError {
                file: file.to_string(),
                table: Some(label.clone()),
                key: None,
                message,
            };
            if !is_valid_name(name) {
                errors.push(table_err(
                    "has an invalid name: use 1 to 64 letters, digits, _ or -, starting with a \
                     letter or digit"
                        .to_string(),
                ));
                continue;
            }
            if kind == FileKind::Project && matches!(tk, TableKind::Queue | TableKind::Cairn) {
                let what = if tk == TableKind::Queue {
                    "lease sources"
                } else {
                    "Cairn sources"
                };
                errors.push(table_err(format!(
                    "cannot be declared in a project harness.toml: {what} belong in the global \
                     harness.toml (or its harness.d/ drop-ins); move [{label}] there"
                )));
                continue;
            }
            if let Some(first) = decls.get(&(tk, name.as_str())) {
                let where_ = if first.file == file {
                    format!("twice in {file}")
                } else {
                    format!("in both {} and {file}", first.file)
                };
                errors.push(table_err(format!(
                    "is declared {where_}: a name may be declared once across the main file and \
                     its drop-ins; remove or rename one"
                )));
                continue;
            }
            decls.insert((tk, name.as_str()), Decl { file, table });
        }
    }
}

/// The names that references may point at.
pub(super) struct Declared<'a> {
    queues: BTreeSet<&'a str>,
    cairns: BTreeSet<&'a str>,
    channels: BTreeSet<&'a str>,
    complete: bool,
}

/// Reads one table's keys, recording an error for each bad one.
pub(super) struct Reader<'a, 'e> {
    file: &'a str,
    table: String,
    t: &'a Table,
    errors: &'e mut Vec<ConfigError>,
}

impl<'a, 'e> Reader<'a, 'e> {
    fn new(file: &'a str, table: String, t: &'a Table, errors: &'e mut Vec<ConfigError>) -> Self {
        Reader {
            file,
            table,
            t,
            errors,
        }
    }

    /// Records an error; `message` must start with the key it names.
    fn err(&mut self, key: &str, message: String) {
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            table: Some(self.table.clone()),
            key: Some(key.to_string()),
            message,
        });
    }

    fn has(&self, key: &str) -> bool {
        self.t.contains_key(key)
    }

    fn wrong_type(&mut self, key: &str, expected: &str, v: &Value) {
        let msg = format!(
            "{key} must be {expected}, not {} {}",
            article(v.type_str()),
            v.type_str()
        );
        self.err(key, msg);
    }

    fn str(&mut self, key: &str) -> Option<&'a str> {
        let v = self.t.get(key)?;
        match v.as_str() {
            Some("") => {
                self.err(
                    key,
                    format!("{key} is empty: give a value or remove the key"),
                );
                None
            }
            Some(s) => Some(s),
            None => {
                self.wrong_type(key, "a string", v);
                None
            }
        }
    }

    fn string(&mut self, key: &str) -> Option<String> {
        self.str(key).map(str::to_string)
    }

    fn bool(&mut self, key: &str) -> Option<bool> {
        let v = self.t.get(key)?;
        let b = v.as_bool();
        if b.is_none() {
            self.wrong_type(key, "true or false", v);
        }
        b
    }

    /// A duration; with `positive`, zero is refused.
    fn duration(&mut self, key: &str, positive: bool) -> Option<Millis> {
        let v = self.t.get(key)?;
        let Some(text) = v.as_str() else {
            self.wrong_type(key, "a duration string such as \"5m\"", v);
            return None;
        };
        match parse_duration(text) {
            Ok(0) if positive => {
                self.err(key, format!("{key} = {text:?} must be more than zero: give a positive duration such as \"30s\""));
                None
            }
            Ok(ms) => Some(ms),
            Err(e) => {
                self.err(key, format!("{key} = {text:?} {e}"));
                None
            }
        }
    }

    /// An array of strings; an element error names `key[i]`.
    fn string_array(&mut self, key: &str, example: &str) -> Option<Vec<String>> {
        let v = self.t.get(key)?;
        let Some(items) = v.as_array() else {
            let msg = format!(
                "{key} must be an array of strings, e.g. {key} = {example}, not {} {}",
                article(v.type_str()),
                v.type_str()
            );
            self.err(key, msg);
            return None;
        };
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            match item.as_str() {
                Some(s) => out.push(s.to_string()),
                None => {
                    ok = false;
                    self.wrong_type(&format!("{key}[{i}]"), "a string", item);
                }
            }
        }
        ok.then_some(out)
    }

    fn check_unknown(&mut self, known: &[&str], tk: TableKind) {
        let unknown: Vec<&String> = self
            .t
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .collect();
        for key in unknown {
            let key = &show_key(key);
            let msg = if tk == TableKind::Harness && key == "harness" {
                "harness is not a key of a harness table: relay runs the argv in command, e.g. \
                 command = [\"claude\", \"-p\"]; replace harness with command"
                    .to_string()
            } else {
                let table = &self.table;
                match suggest(key, known) {
                    Some(s) => format!("{key} is not a key of [{table}]: did you mean {s}?"),
                    None => format!(
                        "{key} is not a key of [{table}]: remove it (the keys are {})",
                        known.join(", ")
                    ),
                }
            };
            self.err(key, msg);
        }
    }
}

/// A key from the file as it can be printed on one line: quoted and escaped when it holds
/// spaces, control characters or nothing at all.
pub(super) fn show_key(key: &str) -> String {
    if !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_graphic() || (c.is_alphanumeric() && !c.is_ascii()))
    {
        key.to_string()
    } else {
        format!("{key:?}")
    }
}

pub(super) fn article(type_str: &str) -> &'static str {
    if type_str.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// The closest known word within a small edit distance, to catch typos.
pub(super) fn suggest<'k>(word: &str, known: &[&'k str]) -> Option<&'k str> {
    let limit = (word.len() / 3).max(1);
    known
        .iter()
        .map(|k| (edit_distance(word, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, k)| k)
}

pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

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

/// Reads a `kind.<name>` reference and checks it is declared; returns the name.
pub(super) fn reference(
    r: &mut Reader,
    key: &str,
    kind: &str,
    declared: &BTreeSet<&str>,
    complete: bool,
) -> Option<String> {
    let text = r.str(key)?;
    reference_to(r, key, text, kind, declared, complete)
}

/// Checks that `text`, the value of `key`, is `kind.<name>` with `<name>` declared.
pub(super) fn reference_to(
    r: &mut Reader,
    key: &str,
    text: &str,
    kind: &str,
    declared: &BTreeSet<&str>,
    complete: bool,
) -> Option<String> {
    let shown = format!("{key} = {text:?}");
    let Some(name) = text.strip_prefix(kind).and_then(|t| t.strip_prefix('.')) else {
        r.err(
            key,
            format!("{shown} must name a table as \"{kind}.<name>\", e.g. \"{kind}.main\""),
        );
        return None;
    };
    if !declared.contains(name) {
        if complete {
            let have = if declared.is_empty() {
                format!("no [{kind}.*] table is declared")
            } else {
                let list: Vec<String> = declared.iter().map(|n| format!("{kind}.{n}")).collect();
                format!("declared: {}", list.join(", "))
            };
            r.err(key, format!("{shown} names no declared [{kind}.{name}] table ({have}): declare it or fix the name"));
        }
        return None;
    }
    Some(name.to_string())
}

/// The first `${NAME}` or `{placeholder}` in `s`, if any.
pub(super) fn find_placeholder(s: &str) -> Option<&str> {
    if let Some(at) = s.find("${") {
        let end = s[at..].find('}').map_or(s.len(), |e| at + e + 1);
        return Some(&s[at..end]);
    }
    let bytes = s.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b != b'{' {
            continue;
        }
        let ident = bytes[i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_' || **c == b'.')
            .count();
        if bytes.get(i + 1 + ident) == Some(&b'}') {
            return Some(&s[i..i + ident + 2]);
        }
    }
    None
}

pub(super) fn harness(
    r: &mut Reader,
    name: String,
    kind: FileKind,
    refs: &Declared,
) -> Option<Harness> {
    const ARGV_EXAMPLE: &str = "[\"claude\", \"-p\"]";
    let command = match r.string_array("command", ARGV_EXAMPLE) {
        None if !r.has("command") => {
            r.err("command", format!("command is missing: set command to the agent's argv, e.g. command = {ARGV_EXAMPLE}"));
            None
        }
        None => None,
        Some(argv) if argv.is_empty() => {
            r.err(
                "command",
                format!(
                    "command = [] is empty: give the agent's argv, e.g. command = {ARGV_EXAMPLE}"
                ),
            );
            None
        }
        Some(argv) if argv[0].is_empty() => {
            r.err(
                "command[0]",
                "command[0] is empty: the first element is the program to run".to_string(),
            );
            None
        }
        Some(argv) => Some(argv),
    };
    let prompt_file = r.string("prompt_file");
    let workdir = r.string("workdir");
    let env_file = r.string("env_file");
    let timeout = r.duration("timeout", true);
    let kill_grace = r.duration("kill_grace", true).unwrap_or(DEFAULT_KILL_GRACE);
    let on_overlap = match r.str("on_overlap") {
        None => OnOverlap::Skip,
        Some("skip") => OnOverlap::Skip,
        Some("queue") => OnOverlap::Queue,
        Some(other) => {
            r.err(
                "on_overlap",
                format!("on_overlap = {other:?} must be \"skip\" or \"queue\""),
            );
            OnOverlap::Skip
        }
    };
    let operating_hours = operating_hours(r);
    let schedule = r
        .str("schedule")
        .and_then(|text| match Schedule::parse(text) {
            Ok(s) => Some(s),
            Err(e) => {
                r.err("schedule", format!("schedule = {text:?} {e}"));
                None
            }
        });
    let mut triggers = Vec::new();
    if let Some(list) = r.string_array("triggers", "[\"channel.main\"]") {
        if list.is_empty() {
            r.err("triggers", "triggers = [] is empty: list channels such as [\"channel.main\"], or remove triggers".to_string());
        }
        for (i, text) in list.iter().enumerate() {
            let key = format!("triggers[{i}]");
            if let Some(ch) = reference_to(r, &key, text, "channel", &refs.channels, refs.complete)
            {
                if triggers.contains(&ch) {
                    r.err(
                        &key,
                        format!("{key} repeats channel.{ch}: list each channel once"),
                    );
                } else {
                    triggers.push(ch);
                }
            }
        }
    }
    let catch_up = r.bool("catch_up").unwrap_or(false);
    // Without a schedule there is no slot to miss: the key would be accepted and ignored.
    if catch_up && !r.t.contains_key("schedule") {
        r.err(
            "catch_up",
            "catch_up = true needs a schedule: it fires once at start when a schedule slot was \
             missed while the daemon was down; add schedule = \"@every …\" or remove catch_up"
                .to_string(),
        );
    }
    let keep_runs = match r.t.get("keep_runs") {
        None => DEFAULT_KEEP_RUNS,
        Some(v) => match v.as_integer() {
            Some(n) if (1..=i64::from(MAX_KEEP_RUNS)).contains(&n) => n as u32,
            Some(n) => {
                r.err(
                    "keep_runs",
                    format!("keep_runs = {n} must be between 1 and {MAX_KEEP_RUNS}"),
                );
                DEFAULT_KEEP_RUNS
            }
            None => {
                r.wrong_type("keep_runs", "a whole number", v);
                DEFAULT_KEEP_RUNS
            }
        },
    };
    let enabled = r.bool("enabled").unwrap_or(true);
    let description = r.string("description");
    let relay = harness_relay(r, kind, refs);

    Some(Harness {
        name,
        declared_in: r.file.to_string(),
        command: command?,
        prompt_file,
        workdir,
        env_file,
        timeout,
        kill_grace,
        on_overlap,
        operating_hours,
        schedule,
        triggers,
        catch_up,
        keep_runs,
        enabled,
        description,
        relay,
    })
}

/// A list of process exit codes (0 to 255), default empty.
fn exit_codes(r: &mut Reader, key: &str) -> Vec<i32> {
    let Some(v) = r.t.get(key) else {
        return Vec::new();
    };
    let codes: Option<Vec<i32>> = v.as_array().and_then(|items| {
        items
            .iter()
            .map(|i| i.as_integer().and_then(|n| i32::try_from(n).ok()))
            .collect()
    });
    match codes {
        Some(c) if c.iter().all(|n| (0..=255).contains(n)) => c,
        Some(_) => {
            r.err(
                key,
                format!("{key} holds exit codes from 0 to 255, e.g. {key} = [3, 78]"),
            );
            Vec::new()
        }
        None => {
            let v = v.clone();
            r.wrong_type(key, "an array of whole numbers (exit codes)", &v);
            Vec::new()
        }
    }
}

pub(super) fn operating_hours(r: &mut Reader) -> Option<OperatingHours> {
    let v = r.t.get("operating_hours")?;
    let windows: Vec<&str> = if let Some(s) = v.as_str() {
        vec![s]
    } else if let Some(items) = v.as_array() {
        if items.is_empty() {
            r.err("operating_hours", "operating_hours = [] has no window: list windows such as \"mon-fri 09:00-18:00\", or remove the key".to_string());
            return None;
        }
        let strs: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
        if strs.len() != items.len() {
            r.wrong_type("operating_hours", "a window string or an array of them", v);
            return None;
        }
        strs
    } else {
        r.wrong_type(
            "operating_hours",
            "a window string such as \"mon-fri 09:00-18:00\" or an array of them",
            v,
        );
        return None;
    };
    match OperatingHours::parse(&windows) {
        Ok(h) => Some(h),
        Err((i, e)) => {
            let key = if v.is_array() {
                format!("operating_hours[{i}]")
            } else {
                "operating_hours".to_string()
            };
            r.err(
                &key,
                format!("{key} = {:?} {e} (a window is [DAYS] HH:MM-HH:MM [OFFSET], e.g. \"mon-fri 09:00-18:00 +02:00\")", windows[i]),
            );
            None
        }
    }
}

pub(super) fn harness_relay(
    r: &mut Reader,
    kind: FileKind,
    refs: &Declared,
) -> Option<HarnessRelay> {
    if !r.has("lease") {
        for key in RELAY_ONLY_KEYS {
            if r.has(key) {
                r.err(key, format!(
                    "{key} describes an attempt, so it needs lease: set lease = \"queue.<name>\" \
                     or remove {key}"
                ));
            }
        }
        return None;
    }
    let project = kind == FileKind::Project;
    let lease = if project {
        r.err(
            "lease",
            "lease is not allowed in a project harness.toml: project harnesses are \
                        never triggered; declare this harness in the global harness.toml"
                .to_string(),
        );
        None
    } else {
        let lease = reference(r, "lease", "queue", &refs.queues, refs.complete);
        if !r.has("schedule") && !r.has("triggers") {
            let written = r.t.get("lease").and_then(Value::as_str).unwrap_or_default();
            r.err("lease", format!(
                "lease = {written:?} requires a triggered harness (one with schedule or triggers): \
                 add schedule or triggers, or remove lease"
            ));
        }
        lease
    };

    let success_check = match r.string_array("success_check", "[\"./scripts/checks-green.sh\"]") {
        Some(argv) if argv.is_empty() => {
            r.err(
                "success_check",
                "success_check = [] is empty: give the check's argv, or remove success_check"
                    .to_string(),
            );
            None
        }
        Some(argv) => {
            let mut ok = true;
            for (i, arg) in argv.iter().enumerate() {
                if let Some(p) = find_placeholder(arg) {
                    ok = false;
                    r.err(&format!("success_check[{i}]"), format!(
                        "success_check[{i}] contains {p}, but the check runs exactly as written and \
                         is never expanded: read the HARNESS_* variables and the harness env_file \
                         from the check's environment instead"
                    ));
                }
            }
            if argv[0].is_empty() {
                ok = false;
                r.err(
                    "success_check[0]",
                    "success_check[0] is empty: the first element is the program to run"
                        .to_string(),
                );
            }
            ok.then_some(argv)
        }
        None => None,
    };
    let timeout = r.duration("success_check_timeout", true);
    let interval = r.duration("success_check_interval", true);
    if let (Some(t), Some(i)) = (
        timeout.or((!r.has("success_check_timeout")).then_some(DEFAULT_SUCCESS_CHECK_TIMEOUT)),
        interval.or((!r.has("success_check_interval")).then_some(DEFAULT_SUCCESS_CHECK_INTERVAL)),
    ) && i >= t
    {
        let shown = |key: &str, v: Millis| match r.t.get(key).and_then(Value::as_str) {
            Some(text) => format!("{key} = {text:?}"),
            None => format!("{key} (default {})", format_duration(v)),
        };
        let msg = format!(
            "{} must be less than {}: lower success_check_interval or raise success_check_timeout",
            shown("success_check_interval", i),
            shown("success_check_timeout", t)
        );
        r.err("success_check_interval", msg);
    }
    let before = r.bool("success_check_before").unwrap_or(false);
    if before && !r.has("success_check") {
        r.err("success_check_before", "success_check_before = true needs success_check: set success_check or remove success_check_before".to_string());
    }
    let attempt_receipt = if project {
        None
    } else if r.has("attempt_receipt") {
        reference(r, "attempt_receipt", "cairn", &refs.cairns, refs.complete)
    } else {
        None
    };
    let non_retryable_exit_codes = exit_codes(r, "non_retryable_exit_codes");
    Some(HarnessRelay {
        non_retryable_exit_codes,
        lease: lease?,
        success_check,
        success_check_timeout: timeout.unwrap_or(DEFAULT_SUCCESS_CHECK_TIMEOUT),
        success_check_interval: interval.unwrap_or(DEFAULT_SUCCESS_CHECK_INTERVAL),
        success_check_before: before,
        attempt_receipt,
    })
}
