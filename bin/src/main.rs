//! The `relay` binary: one command line over relay-io and relay-core.
//!
//! The commands of the contract (`serve`, `daemon`, `up`, `todo`, `endpoint`, `sim`, …) are wired
//! here as the parts they drive land; until then a command that is not built says so and exits 2.

use std::process::ExitCode;

const COMMANDS: &[&str] = &[
    "serve",
    "endpoint",
    "todo",
    "daemon",
    "trigger",
    "describe",
    "runs",
    "doctor",
    "check-config",
    "up",
    "sim",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("--help" | "-h" | "help") => {
            #[allow(clippy::print_stdout)]
            {
                println!("relay {}", env!("CARGO_PKG_VERSION"));
                println!("usage: relay <command> [options]");
                println!("commands: {}", COMMANDS.join(", "));
            }
            ExitCode::SUCCESS
        }
        Some("--version" | "-V") => {
            #[allow(clippy::print_stdout)]
            {
                println!("relay {}", env!("CARGO_PKG_VERSION"));
            }
            ExitCode::SUCCESS
        }
        Some(cmd) if COMMANDS.contains(&cmd) => {
            eprintln!(
                "relay: `{cmd}` is not built yet in this version; see README.md for what works today"
            );
            ExitCode::from(2)
        }
        Some(other) => {
            eprintln!(
                "relay: unknown command `{other}`; run `relay --help` for the list of commands"
            );
            ExitCode::from(2)
        }
    }
}
