//! Harness configs for tests: a file's text parsed as the daemon parses its global file, and the
//! small fleets the doorbell rules are written against.

use crate::config::{Config, ConfigFile, FileKind, parse};

/// `text` parsed as the global `harness.toml` (no project files). Panics with the parse error.
pub fn config(text: &str) -> Config {
    parse(
        &ConfigFile::new("harness.toml", text),
        &[],
        FileKind::Global,
    )
    .unwrap_or_else(|e| panic!("the test's config does not parse: {e:?}"))
}

/// The text of a config in which the harness `fixer`, rung by `[channel.bell]` (listening at
/// `bell_url`), claims from `[queue.ci]` (at `queue_url`, the todo queue `ci-failures`), and
/// `[queue.all]` (at `queue_url`, every granted queue) is bound to nothing. Append tables to it
/// for more.
pub fn rung_fixer(bell_url: &str, queue_url: &str) -> String {
    format!(
        r#"
[channel.bell]
url = "{bell_url}"
[queue.ci]
url = "{queue_url}"
queue = "ci-failures"
[queue.all]
url = "{queue_url}"
[harness.fixer]
command = ["true"]
triggers = ["channel.bell"]
lease = "queue.ci"
"#
    )
}
