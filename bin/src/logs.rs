//! Logs of the long-running commands: stderr, filtered by `RELAY_LOG` (else `default`), text
//! without colour codes or JSON lines. Never a token: the code that logs never holds one.
//!
//! Under systemd (`JOURNAL_STREAM` set: stderr goes to the journal) text lines carry no
//! timestamp: journald stamps every line itself, and a second stamp only widens each line.

pub fn init(default: &str, json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("RELAY_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let journal = std::env::var_os("JOURNAL_STREAM").is_some();
    let _ = if json {
        builder.json().try_init()
    } else if journal {
        builder.with_ansi(false).without_time().try_init()
    } else {
        builder.with_ansi(false).try_init()
    };
}
