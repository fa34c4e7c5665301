//! `relay check-config FILE [--project]`: parse and validate a harness.toml, its drop-ins, and
//! the env files its credentials resolve from, the way the daemon will load them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use relay_core::config::{FileKind, Source, parse, resolve};

#[derive(clap::Args)]
pub struct Args {
    /// The harness.toml to check; every *.toml in a harness.d/ folder beside it is read too.
    file: PathBuf,
    /// Apply the project-file rules (no [queue.*], [cairn.*] or lease).
    #[arg(long)]
    project: bool,
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// The drop-in files beside `file`, sorted by name.
pub fn dropins(file: &Path) -> Result<Vec<PathBuf>, String> {
    let dir = file.parent().unwrap_or(Path::new(".")).join("harness.d");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    Ok(paths)
}

pub fn run(args: Args) -> ExitCode {
    match check(&args) {
        Ok(summary) => {
            #[allow(clippy::print_stdout)]
            {
                println!("{summary}");
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
    let main = Source::new(args.file.display().to_string(), read(&args.file)?);
    let mut sources = Vec::new();
    for p in dropins(&args.file)? {
        sources.push(Source::new(p.display().to_string(), read(&p)?));
    }
    let kind = if args.project {
        FileKind::Project
    } else {
        FileKind::Global
    };
    let config = parse(&main, &sources, kind).map_err(|e| e.to_string())?;
    let base = args.file.parent().unwrap_or(Path::new("."));
    let mut env_files = BTreeMap::new();
    for written in config.env_files() {
        let path = expand(base, written);
        env_files.insert(written.to_string(), read(&path)?);
    }
    resolve(&config, &env_files).map_err(|e| e.to_string())?;
    Ok(format!(
        "{}: ok ({} harnesses, {} queue sources, {} cairn sources, {} channel sources, {} drop-ins)",
        args.file.display(),
        config.harnesses.len(),
        config.queues.len(),
        config.cairns.len(),
        config.channels.len(),
        sources.len()
    ))
}

/// An env_file path as written: `~/` is the home folder, a relative path is beside the config.
fn expand(base: &Path, written: &str) -> PathBuf {
    if let Some(rest) = written.strip_prefix("~/")
        && let Some(home) = std::env::var_os("HOME")
    {
        return PathBuf::from(home).join(rest);
    }
    base.join(written)
}
