//! Reading a harness.toml, its `harness.d/` drop-ins and the env files its credentials resolve
//! from. Parsing and every rule are `relay_core::config`'s; this only moves bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use relay_core::config::{ConfigFile, FileKind, ResolvedConfig, parse, resolve};
use relay_core::relay::{HarnessSettings, HostFacts, expand_path, harness_settings};

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
    let main = ConfigFile::new(file.display().to_string(), read(&file)?);
    let mut dropin_files = Vec::new();
    for p in dropins(&file) {
        dropin_files.push(ConfigFile::new(p.display().to_string(), read(&p)?));
    }
    let config = parse(&main, &dropin_files, kind).map_err(|e| e.to_string())?;
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
        dropins: dropin_files.len(),
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

/// A config as the daemon runs it: loaded and validated ([`load`]), every leased harness's
/// prompt read and its settings made. Start and reload both go through [`prepare`], so a reload
/// is validated exactly like a start.
#[derive(Debug)]
pub struct Prepared {
    pub resolved: ResolvedConfig,
    pub config_dir: PathBuf,
    pub dropins: usize,
    /// The settings of each leased harness, by name.
    pub settings: BTreeMap<String, HarnessSettings>,
}

/// Loads `file` (global rules) and makes the settings of its leased harnesses, with run files
/// under `jobs_dir` and `host` in claimant labels. A harness without `lease` is logged and left
/// out. Any error (a config error naming file, table and key; an unreadable env file or prompt)
/// refuses the whole config.
pub fn prepare(file: &Path, jobs_dir: &Path, host: &str) -> Result<Prepared, String> {
    let loaded = load(file, FileKind::Global)?;
    let facts = host_facts(&loaded.config_dir, jobs_dir, host);
    let mut settings = BTreeMap::new();
    for h in loaded.resolved.config.harnesses.values() {
        if h.relay.is_none() {
            tracing::warn!(harness = %h.name, "harness has no lease: relay runs leased harnesses only; it is not started");
            continue;
        }
        let bytes = prompt(h.prompt_file.as_deref(), &facts)?;
        if let Some(s) = harness_settings(&loaded.resolved, &h.name, &facts, bytes) {
            settings.insert(h.name.clone(), s);
        }
    }
    Ok(Prepared {
        resolved: loaded.resolved,
        config_dir: loaded.config_dir,
        dropins: loaded.dropins,
        settings,
    })
}
