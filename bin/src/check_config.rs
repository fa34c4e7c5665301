//! `relay check-config FILE [--project]`: parse and validate a harness.toml, its drop-ins, and
//! the env files its credentials resolve from, the way the daemon will load them.

use std::path::PathBuf;
use std::process::ExitCode;

use relay_core::config::FileKind;
use relay_worker::daemon::load::load;

#[derive(clap::Args)]
pub struct Args {
    /// The harness.toml to check; every *.toml in a harness.d/ folder beside it is read too.
    file: PathBuf,
    /// Apply the project-file rules (no [queue.*], [cairn.*] or lease).
    #[arg(long)]
    project: bool,
}

pub fn run(args: Args) -> ExitCode {
    match check(&args) {
        Ok(summary) => {
            {
                out!("{summary}");
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::from(1)
        }
    }
}

fn check(args: &Args) -> Result<String, String> {
    let kind = if args.project {
        FileKind::Project
    } else {
        FileKind::Global
    };
    let loaded = load(&args.file, kind)?;
    let config = &loaded.resolved.config;
    Ok(format!(
        "{}: ok ({} harnesses, {} queue sources, {} cairn sources, {} channel sources, {} drop-ins)",
        args.file.display(),
        config.harnesses.len(),
        config.queues.len(),
        config.cairns.len(),
        config.channels.len(),
        loaded.dropins
    ))
}
