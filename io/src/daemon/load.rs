//! Reading a harness.toml, its `harness.d/` drop-ins and the env files its credentials resolve
//! from. Parsing and every rule are `relay_core::config`'s; this only moves bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use relay_core::config::{FileKind, ResolvedConfig, Source, parse, resolve};
use relay_core::relay::{HostFacts, expand_path};

/// A loaded config, with where it came from.
#[derive(Debug)]
pub struct Loaded {
    pub resolved: ResolvedConfig,
    /// The main file's folder (relative paths in the config start there).
    pub config_dir: PathBuf,
    pub dropins: usize,
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read {}: {e}; check the path and its permissions",
            path.display()
        )
    })
}

/// The drop-in files beside `file` (`harness.d/*.toml`), sorted by name.
pub fn dropins(file: &Path) -> Vec<PathBuf> {
    let dir = file.parent().unwrap_or(Path::new(".")).join("harness.d");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    paths
}

/// The facts about this host that turn config paths into absolute ones.
pub fn host_facts(config_dir: &Path, jobs_dir: &Path, host: &str) -> HostFacts {
    HostFacts {
        host: host.to_string(),
        jobs_dir: jobs_dir.display().to_string(),
        config_dir: config_dir.display().to_string(),
        home: std::env::var("HOME").ok(),
    }
}

/// Reads and validates `file` the way the daemon runs it. Errors are the config module's, one
/// per line, each naming the file, table and key.
pub fn load(file: &Path, kind: FileKind) -> Result<Loaded, String> {
    let file = std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf());
    let main = Source::new(file.display().to_string(), read(&file)?);
    let mut sources = Vec::new();
    for p in dropins(&file) {
        sources.push(Source::new(p.display().to_string(), read(&p)?));
    }
    let config = parse(&main, &sources, kind).map_err(|e| e.to_string())?;
    let config_dir = file.parent().unwrap_or(Path::new("/")).to_path_buf();
    let facts = host_facts(&config_dir, &config_dir, "");
    let mut env_files = BTreeMap::new();
    for written in config.env_files() {
        let path = PathBuf::from(expand_path(written, &facts));
        env_files.insert(written.to_string(), read(&path)?);
    }
    let resolved = resolve(&config, &env_files).map_err(|e| e.to_string())?;
    Ok(Loaded {
        resolved,
        config_dir,
        dropins: sources.len(),
    })
}

/// A leased harness's prompt bytes, read from its `prompt_file`.
pub fn prompt(written: Option<&str>, facts: &HostFacts) -> Result<Option<Vec<u8>>, String> {
    let Some(written) = written else {
        return Ok(None);
    };
    let path = PathBuf::from(expand_path(written, facts));
    std::fs::read(&path).map(Some).map_err(|e| {
        format!(
            "cannot read prompt_file {}: {e}; check the path and its permissions",
            path.display()
        )
    })
}
