//! The `relay` binary: one command line over relay-server, relay-worker, relay-sim and relay-core.
//!
//! Every command has `--help`. Errors go to stderr as one line saying what was wrong and what to
//! do, with a non-zero exit status (2 for a usage error).

/// `println!` for what a command prints: a reader that went away (`relay sim … | head`,
/// `relay events --follow | head`) ends the command quietly with success, as it ends `cat`,
/// instead of a panic or a stream writing into nothing. Defined before the modules that use it.
macro_rules! out {
    () => {
        $crate::stdout_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::stdout_line(format_args!($($arg)*))
    };
}

mod check_config;
mod daemon;
mod logs;
mod notify;
mod operator;
mod serve;
mod sim;
mod up;

use std::process::ExitCode;

/// mimalloc, not the system allocator: see the workspace's Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

/// `relay --version`: the crate's version and the git revision it was built from (build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("RELAY_GIT_REVISION"),
    ")"
);

#[derive(Parser)]
#[command(name = "relay", version = VERSION, about = "Leased work for AI-agent workers")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    #[command(flatten)]
    db: operator::DbOpt,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the deterministic simulator: seeds, faults, invariants after every event.
    Sim(sim::Args),
    /// Validate a harness.toml (and the harness.d/ drop-ins beside it).
    CheckConfig(check_config::Args),
    /// The queue server (MCP Streamable HTTP at /mcp/<endpoint>, /metrics, /healthz).
    Serve(serve::Args),
    /// Vend, list and revoke endpoints.
    Endpoint {
        #[command(subcommand)]
        cmd: operator::EndpointCmd,
    },
    /// Create, list and revoke the operators who may open the Board.
    Operator {
        #[command(subcommand)]
        cmd: operator::OperatorCmd,
    },
    /// Pause, resume and limit queues (claim_next answers empty while nothing may be claimed).
    Queue {
        #[command(subcommand)]
        cmd: operator::QueueCmd,
    },
    /// Add, list, show, retry and cancel todos.
    Todo {
        #[command(subcommand)]
        cmd: operator::TodoCmd,
    },
    /// The supervisor daemon: runs the leased harnesses of a harness.toml.
    Daemon(daemon::DaemonArgs),
    /// Fire a harness of the running daemon now.
    Trigger(daemon::HarnessArgs),
    /// Show a leased harness of the running daemon: its source, session and attempt in flight.
    Describe(daemon::DescribeArgs),
    /// List a harness's runs, newest first (read from the state dir).
    Runs(daemon::RunsArgs),
    /// Check the lease sources and bindings: the running daemon's, or --config's without one.
    Doctor(daemon::DoctorArgs),
    /// Make the running daemon re-read its config and drop-ins (as SIGHUP does); prints what changed.
    Reload(daemon::ReloadArgs),
    /// End a harness's attempt in flight as an operator stop (released); later firings run.
    /// Exit status 0 also when nothing was in flight (the output says so).
    Stop(daemon::HarnessArgs),
    /// The running daemon's events as JSON lines (run_started, relay_claimed, run_finished, …).
    Events(daemon::EventsArgs),
    /// The local dev stack: server, Board, daemon and sample work on embedded SQLite, until
    /// Ctrl-C (`--until-drained`: the scripted tour).
    Up(up::Args),
    /// Print a shell completion script: `relay completions bash > /etc/bash_completion.d/relay`.
    Completions(Completions),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    match cli.command {
        Cmd::Sim(args) => sim::run(args),
        Cmd::CheckConfig(args) => check_config::run(args),
        Cmd::Serve(args) => serve::run(&cli.db, args),
        Cmd::Endpoint { cmd } => operator::endpoint(&cli.db, cmd),
        Cmd::Todo { cmd } => operator::todo(&cli.db, cmd),
        Cmd::Operator { cmd } => operator::operator(&cli.db, cmd),
        Cmd::Queue { cmd } => operator::queue(&cli.db, cmd),
        Cmd::Daemon(args) => daemon::daemon(args),
        Cmd::Trigger(args) => daemon::trigger(args),
        Cmd::Describe(args) => daemon::describe(args),
        Cmd::Runs(args) => daemon::runs(args),
        Cmd::Doctor(args) => daemon::doctor(args),
        Cmd::Reload(args) => daemon::reload(args),
        Cmd::Stop(args) => daemon::stop(args),
        Cmd::Events(args) => daemon::events(args),
        Cmd::Up(args) => up::run(args),
        Cmd::Completions(c) => completions(c.shell),
    }
}

#[derive(clap::Args)]
struct Completions {
    /// The shell to complete for.
    shell: Shell,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// The completion script for `shell`, generated from the same clap definition as `--help`.
fn completions(shell: Shell) -> ExitCode {
    use clap::CommandFactory as _;
    let shell = match shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "relay", &mut script);
    out!("{}", String::from_utf8_lossy(&script).trim_end());
    ExitCode::SUCCESS
}

/// clap's own help and version go to stdout as usual; its errors become one line on stderr.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(2)
        }
        _ => {
            let text = e.render().to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            // A value outside a fixed set: name the set on the same line (clap puts it below).
            let valid = match e.get(clap::error::ContextKind::ValidValue) {
                Some(clap::error::ContextValue::Strings(v)) => {
                    format!("; possible values: {}", v.join(", "))
                }
                _ => String::new(),
            };
            eprintln!(
                "relay: {first}{valid}; run `relay --help` (or `relay <command> --help`) for usage"
            );
            ExitCode::from(2)
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM: the graceful-stop signal of `relay serve` and `relay daemon`.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Registered now, not when the future is first polled: a SIGTERM or SIGINT that arrives in
    // between (a service manager stopping us the moment we said READY) would otherwise take the
    // signal's default action and end the process without its graceful stop.
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    async move {
        tokio::select! {
            () = next(&mut term) => {}
            () = next(&mut int) => {}
        }
    }
}

/// The next delivery of a signal, or never when it could not be registered.
async fn next(s: &mut Option<tokio::signal::unix::Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// One line on stdout (see `out!`).
fn stdout_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        #[allow(clippy::print_stderr)]
        {
            eprintln!("relay: cannot write to stdout: {e}");
        }
        std::process::exit(1);
    }
}
