//! Parsing and validating the TOML: tables, keys, drop-ins, with errors that name the file, the
//! table and the key.
//!
//! Here: the files read into declared tables, and the [`Reader`] of one table's keys. Each kind
//! of table is read beside it: the sources in `sources`, the harness in `harness`.

use crate::time::Millis;
use std::collections::{BTreeMap, BTreeSet};
use toml::{Table, Value};

use super::*;

mod harness;
mod sources;

use harness::harness;
use sources::{cairn_source, channel_source, queue_source};

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

crate::names! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub(super) enum TableKind {
        Queue => "queue",
        Cairn => "cairn",
        Channel => "channel",
        Harness => "harness",
    }
}

/// A harness table's keys. The last six describe an attempt, so only a harness with a lease may
/// set them ([`RELAY_ONLY_KEYS`]).
const HARNESS_KEYS: [&str; 21] = [
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
];

/// The harness keys that describe an attempt (see [`HARNESS_KEYS`]).
pub(super) const RELAY_ONLY_KEYS: &[&str] = HARNESS_KEYS.split_at(21 - 6).1;

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
            TableKind::Harness => &HARNESS_KEYS,
        }
    }
}

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
pub fn parse(
    main: &ConfigFile,
    dropins: &[ConfigFile],
    kind: FileKind,
) -> Result<Config, ConfigErrors> {
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
