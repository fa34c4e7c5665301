//! The run journal: what the daemon keeps about leased runs in its state directory, and the lock
//! that keeps a second daemon out of it.
//!
//! # Layout
//!
//! ```text
//! <state>/daemon.lock                      the holding daemon's pid (Journal::lock)
//! <state>/runs/<harness>/<run_id>.json     one run record (RunRecord as JSON), mode 0600
//! <state>/runs/<harness>/last_run_id       the highest run id ever recorded for the harness
//! <jobs>/<harness>/<run_id>.log            the run log (stdout and stderr, check output, warnings)
//! <jobs>/<harness>/<run_id>.relay.json     the context file          (relay_core::relay::run_files)
//! <jobs>/<harness>/<run_id>.summary        the attempt summary file  (relay_core::relay::run_files)
//! ```
//!
//! `<jobs>` is `<state>/jobs` unless [`Journal::open_with_jobs_dir`] says otherwise; it is what
//! `HarnessSettings::jobs_dir` must be set to. Files are written with mode 0600 and directories
//! created with mode 0700. Records are replaced atomically (a temporary file, then a rename), so
//! a crash leaves the previous record or the new one, never half of one.
//!
//! # Run ids
//!
//! Run ids count per harness, as the harness's `Relay` machine hands them out from the
//! `first_run_id` it is built with: [`Journal::next_run_id`] is one past the highest id the
//! harness ever recorded, so ids never repeat across restarts, nor after pruning.
//!
//! # What is never here
//!
//! A run record has no field that can hold a lease token, a summary, a payload or a header
//! value; the journal writes records and nothing else. The one file that holds
//! a todo's payload is the context file, which the runner writes, which [`Journal::reconcile`]
//! removes for interrupted runs and [`Journal::prune`] removes with its run.
//!
//! The journal's calls are plain blocking file operations on small files; an async caller that
//! must not stall runs them with `tokio::task::spawn_blocking` (a `Journal` is cheap to clone).

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use relay_core::config::is_valid_name;
use relay_core::relay::{RunOutcome, RunRecord, reconcile_interrupted, run_files};
use relay_core::time::Wall;

use crate::runner::write_private_atomic;

const LOCK_FILE: &str = "daemon.lock";
const LAST_RUN_ID: &str = "last_run_id";

/// An error of the journal, naming the path and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(
        "{op} {path}: {source}; check that the state directory exists and is writable by the daemon's user"
    )]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the state directory {dir} is in use by another relay daemon (pid {pid}): stop that daemon, \
         or give this one another state directory; if pid {pid} is not a relay daemon, remove {lock}"
    )]
    Locked {
        dir: PathBuf,
        pid: i32,
        lock: PathBuf,
    },
    #[error("the state directory {0} is not valid UTF-8: choose a path that is")]
    NotUtf8(PathBuf),
    #[error("{0:?} is not a harness name (letters, digits, '_' and '-', at most 64)")]
    BadHarness(String),
    #[error("encode run {run_id} of {harness}: {source}")]
    Encode {
        harness: String,
        run_id: u64,
        #[source]
        source: serde_json::Error,
    },
}

fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> JournalError + 'a {
    move |source| JournalError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The paths of one run's files under the jobs directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunPaths {
    pub log: PathBuf,
    pub context_file: PathBuf,
    pub summary_file: PathBuf,
    pub usage_file: PathBuf,
}

/// The run journal of one state directory. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Journal {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state_dir: PathBuf,
    jobs_dir: String,
}

impl Journal {
    /// Opens (creating when missing) the journal in `state_dir`, with its jobs directory at
    /// `<state_dir>/jobs`.
    pub fn open(state_dir: impl AsRef<Path>) -> Result<Journal, JournalError> {
        let state_dir = state_dir.as_ref();
        Journal::open_with_jobs_dir(state_dir, state_dir.join("jobs"))
    }

    /// Opens the journal with the run files in `jobs_dir`.
    pub fn open_with_jobs_dir(
        state_dir: impl AsRef<Path>,
        jobs_dir: impl AsRef<Path>,
    ) -> Result<Journal, JournalError> {
        let state_dir = state_dir.as_ref().to_path_buf();
        let jobs = jobs_dir.as_ref();
        let jobs_dir = jobs
            .to_str()
            .ok_or_else(|| JournalError::NotUtf8(jobs.to_path_buf()))?
            .to_string();
        for dir in [state_dir.join("runs"), jobs.to_path_buf()] {
            crate::runner::create_dirs(&dir).map_err(io_err("create", &dir))?;
        }
        Ok(Journal {
            inner: Arc::new(Inner {
                state_dir,
                jobs_dir,
            }),
        })
    }

    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// The jobs directory, as `HarnessSettings::jobs_dir` takes it.
    pub fn jobs_dir(&self) -> &str {
        &self.inner.jobs_dir
    }

    fn runs_dir(&self, harness: &str) -> Result<PathBuf, JournalError> {
        if !is_valid_name(harness) {
            return Err(JournalError::BadHarness(harness.to_string()));
        }
        Ok(self.inner.state_dir.join("runs").join(harness))
    }

    fn record_path(&self, harness: &str, run_id: u64) -> Result<PathBuf, JournalError> {
        Ok(self.runs_dir(harness)?.join(format!("{run_id}.json")))
    }

    /// The run's log, context, summary and usage files: the last three as
    /// [`relay_core::relay::run_files`] names them, the log beside them as `<run_id>.log`.
    pub fn run_paths(&self, harness: &str, run_id: u64) -> RunPaths {
        let files = run_files(&self.inner.jobs_dir, harness, run_id);
        let context_file = PathBuf::from(files.context_file);
        let log = context_file.with_file_name(format!("{run_id}.log"));
        RunPaths {
            log,
            context_file,
            summary_file: PathBuf::from(files.summary_file),
            usage_file: PathBuf::from(files.usage_file),
        }
    }

    /// The run log's path.
    pub fn run_log(&self, harness: &str, run_id: u64) -> PathBuf {
        self.run_paths(harness, run_id).log
    }

    /// Writes (or replaces) a run record atomically, mode 0600 (`Command::WriteRunRecord`).
    pub fn write_record(&self, record: &RunRecord) -> Result<(), JournalError> {
        let path = self.record_path(&record.harness, record.run_id)?;
        let mut bytes =
            serde_json::to_vec_pretty(record).map_err(|source| JournalError::Encode {
                harness: record.harness.clone(),
                run_id: record.run_id,
                source,
            })?;
        bytes.push(b'\n');
        write_private_atomic(&path, &bytes).map_err(io_err("write the run record", &path))?;
        self.raise_last_run_id(&record.harness, record.run_id)
    }

    /// [`Journal::write_record`] on tokio's blocking pool, for a caller that must not stall.
    pub async fn write_record_async(&self, record: RunRecord) -> Result<(), JournalError> {
        let journal = self.clone();
        tokio::task::spawn_blocking(move || journal.write_record(&record))
            .await
            .map_err(|e| JournalError::Io {
                op: "write the run record",
                path: self.inner.state_dir.join("runs"),
                source: std::io::Error::other(e),
            })?
    }

    fn last_run_id_path(&self, harness: &str) -> Result<PathBuf, JournalError> {
        Ok(self.runs_dir(harness)?.join(LAST_RUN_ID))
    }

    fn read_last_run_id(&self, harness: &str) -> Result<u64, JournalError> {
        let path = self.last_run_id_path(harness)?;
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(text.trim().parse().unwrap_or_else(|_| {
                tracing::warn!(path = %path.display(), "unreadable run id high-water mark; using the records");
                0
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(io_err("read", &path)(e)),
        }
    }

    fn raise_last_run_id(&self, harness: &str, run_id: u64) -> Result<(), JournalError> {
        if self.read_last_run_id(harness)? >= run_id {
            return Ok(());
        }
        let path = self.last_run_id_path(harness)?;
        write_private_atomic(&path, format!("{run_id}\n").as_bytes())
            .map_err(io_err("write the run id high-water mark", &path))
    }

    /// The run id to start the harness's machine with: one past the highest it ever recorded
    /// (its records, and the high-water mark that survives pruning), 1 for a new harness.
    pub fn next_run_id(&self, harness: &str) -> Result<u64, JournalError> {
        let recorded = self.run_ids(harness)?.last().copied().unwrap_or(0);
        Ok(recorded.max(self.read_last_run_id(harness)?) + 1)
    }

    /// The run ids that have a record, oldest first.
    fn run_ids(&self, harness: &str) -> Result<Vec<u64>, JournalError> {
        let dir = self.runs_dir(harness)?;
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", &dir)(e)),
        };
        let mut ids = BTreeSet::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list", &dir))?;
            if let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u64>().ok())
            {
                ids.insert(id);
            }
        }
        Ok(ids.into_iter().collect())
    }

    /// Reads one record; `None` when it is missing or not a record (the latter is logged).
    pub fn record(&self, harness: &str, run_id: u64) -> Result<Option<RunRecord>, JournalError> {
        let path = self.record_path(harness, run_id)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("read the run record", &path)(e)),
        };
        match serde_json::from_slice(&bytes) {
            Ok(record) => Ok(Some(record)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "skipping a run record that does not parse");
                Ok(None)
            }
        }
    }

    /// The harness's newest `limit` records, newest first.
    pub fn records(&self, harness: &str, limit: usize) -> Result<Vec<RunRecord>, JournalError> {
        let mut out = Vec::new();
        for id in self.run_ids(harness)?.into_iter().rev() {
            if out.len() >= limit {
                break;
            }
            if let Some(record) = self.record(harness, id)? {
                out.push(record);
            }
        }
        Ok(out)
    }

    /// The harnesses that have a runs directory.
    pub fn harnesses(&self) -> Result<Vec<String>, JournalError> {
        let dir = self.inner.state_dir.join("runs");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(io_err("list", &dir))? {
            let entry = entry.map_err(io_err("list", &dir))?;
            if let Some(name) = entry.file_name().to_str()
                && is_valid_name(name)
                && entry.file_type().is_ok_and(|t| t.is_dir())
            {
                names.push(name.to_string());
            }
        }
        names.sort();
        Ok(names)
    }

    /// Keeps the harness's newest `keep_runs` runs and deletes the older ones: record, run log,
    /// context file and summary file. A record still `running` is never deleted. Run files left
    /// in the jobs directory without a record and older than every kept run go too. Returns the
    /// pruned run ids, oldest first.
    pub fn prune(&self, harness: &str, keep_runs: usize) -> Result<Vec<u64>, JournalError> {
        let ids = self.run_ids(harness)?;
        let cut = ids.len().saturating_sub(keep_runs);
        let mut kept: BTreeSet<u64> = ids[cut..].iter().copied().collect();
        let mut pruned = Vec::new();
        for &id in &ids[..cut] {
            if self
                .record(harness, id)?
                .is_some_and(|r| r.outcome == RunOutcome::Running)
            {
                kept.insert(id);
                continue;
            }
            let record = self.record_path(harness, id)?;
            remove_if_present(&record)?;
            let paths = self.run_paths(harness, id);
            for path in [
                &paths.log,
                &paths.context_file,
                &paths.summary_file,
                &paths.usage_file,
            ] {
                remove_if_present(path)?;
            }
            pruned.push(id);
        }
        // Orphans: files of ids older than anything kept and without a record (run files, and
        // temporary files a crash left in either directory).
        let below = kept.first().copied().unwrap_or(u64::MAX);
        let jobs = Path::new(&self.inner.jobs_dir).join(harness);
        for (dir, temporary_only) in [(jobs, false), (self.runs_dir(harness)?, true)] {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                if temporary_only && !name.starts_with('.') {
                    continue;
                }
                if let Some(id) = run_id_of_file(name)
                    && id < below
                    && !kept.contains(&id)
                {
                    remove_if_present(&entry.path())?;
                }
            }
        }
        Ok(pruned)
    }

    /// After a restart: every record left `running` becomes `interrupted` through
    /// [`reconcile_interrupted`] and is written back, and its context file is removed. Nothing
    /// else happens: no lease call, no other file. Returns the reconciled records. Call it
    /// once, holding [`Journal::lock`], before any machine starts.
    pub fn reconcile(&self, now: Wall) -> Result<Vec<RunRecord>, JournalError> {
        let mut reconciled = Vec::new();
        for harness in self.harnesses()? {
            for id in self.run_ids(&harness)? {
                let Some(record) = self.record(&harness, id)? else {
                    continue;
                };
                if record.outcome != RunOutcome::Running {
                    continue;
                }
                let record = reconcile_interrupted(record, now);
                self.write_record(&record)?;
                remove_if_present(&self.run_paths(&harness, id).context_file)?;
                tracing::info!(
                    harness,
                    run_id = id,
                    "run left running by an earlier daemon recorded interrupted"
                );
                reconciled.push(record);
            }
        }
        Ok(reconciled)
    }

    /// Takes the state directory for this daemon: `<state>/daemon.lock`, holding our pid, made
    /// exclusively (written beside it, then hard-linked into place, so it is never seen empty).
    /// A lock whose pid is not alive is stale and is replaced; a live one is refused with
    /// [`JournalError::Locked`]. The lock is released when the returned value is dropped.
    pub fn lock(&self) -> Result<DaemonLock, JournalError> {
        let dir = &self.inner.state_dir;
        let lock = dir.join(LOCK_FILE);
        let pid = std::process::id();
        let tmp = dir.join(format!(".{LOCK_FILE}.{pid}"));
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io_err("create", &tmp))?;
            f.write_all(format!("{pid}\n").as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(io_err("write", &tmp))?;
        }
        let taken = (|| {
            for _ in 0..2 {
                match std::fs::hard_link(&tmp, &lock) {
                    Ok(()) => return Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(io_err("create the lock", &lock)(e)),
                }
                let holder = std::fs::read_to_string(&lock)
                    .ok()
                    .and_then(|t| t.trim().parse::<i32>().ok());
                match holder {
                    Some(holder) if holder_alive(holder, &lock) => {
                        return Err(JournalError::Locked {
                            dir: dir.clone(),
                            pid: holder,
                            lock: lock.clone(),
                        });
                    }
                    _ => {
                        tracing::warn!(lock = %lock.display(), ?holder, "removing a stale daemon lock");
                        remove_if_present(&lock)?;
                    }
                }
            }
            Err(JournalError::Io {
                op: "create the lock",
                path: lock.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "another daemon took it at the same time",
                ),
            })
        })();
        let _ = std::fs::remove_file(&tmp);
        taken?;
        held_locks().insert(lock.clone());
        Ok(DaemonLock { path: lock, pid })
    }
}

/// The lock files this process holds: a lock that names our own pid is ours only when it is
/// listed here; otherwise an earlier daemon that had the same pid (a container's pid 1) left it.
fn held_locks() -> std::sync::MutexGuard<'static, BTreeSet<PathBuf>> {
    static HELD: std::sync::Mutex<BTreeSet<PathBuf>> = std::sync::Mutex::new(BTreeSet::new());
    HELD.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the daemon named in a lock file still holds it.
fn holder_alive(holder: i32, lock: &Path) -> bool {
    if u32::try_from(holder).ok() == Some(std::process::id()) {
        return held_locks().contains(lock);
    }
    pid_alive(holder)
}

/// Whether a process with this pid exists (one we may not signal exists too).
fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    matches!(kill(Pid::from_raw(pid), None), Ok(()) | Err(Errno::EPERM))
}

/// The run id a file belongs to: `<run_id>.<anything>`, or `.<run_id>.<anything>` for the
/// temporary file of an atomic write that a crash left behind.
fn run_id_of_file(name: &str) -> Option<u64> {
    let name = name.strip_prefix('.').unwrap_or(name);
    let (id, rest) = name.split_once('.')?;
    if rest.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok()
}

fn remove_if_present(path: &Path) -> Result<(), JournalError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("remove", path)(e)),
    }
}

/// The held state-directory lock; dropping it removes the lock file (when it is still ours).
#[derive(Debug)]
pub struct DaemonLock {
    path: PathBuf,
    pid: u32,
}

impl DaemonLock {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DaemonLock {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            == Some(self.pid);
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(lock = %self.path.display(), error = %e, "cannot remove the daemon lock");
        }
        held_locks().remove(&self.path);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::fs::PermissionsExt;

    use relay_core::relay::{Capabilities, Command, RelayOutcome};
    use relay_core::testing::relay::{Driver, claimed, settings, t0};

    use super::*;
    use crate::test_files::{all_files, assert_none_holds};

    const TOKEN: &str = "lease-T0K3N-q3vZw-planted";

    /// A leased run's record, as the machine writes it.
    pub(crate) fn record(harness: &str, run_id: u64, outcome: RunOutcome) -> RunRecord {
        RunRecord {
            harness: harness.into(),
            run_id,
            trigger: "channel.sb".into(),
            outcome,
            skipped_reason: None,
            claim_error: None,
            started_at: "2026-09-22T12:00:00.000Z".into(),
            ended_at: None,
            exit_code: None,
            lease: "queue.ci".into(),
            todo_id: Some("td_1".into()),
            attempt: Some(2),
            relay_outcome: None,
            check_exit: None,
            artifact: None,
        }
    }

    /// Creates the run's log, context, summary and usage files.
    fn plant_files(j: &Journal, harness: &str, run_id: u64) -> RunPaths {
        let paths = j.run_paths(harness, run_id);
        for p in [
            &paths.log,
            &paths.context_file,
            &paths.summary_file,
            &paths.usage_file,
        ] {
            crate::runner::create_dirs(p.parent().unwrap()).unwrap();
            std::fs::write(p, "x").unwrap();
        }
        paths
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_record_round_trips_privately() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let mut r = record("fixer", 7, RunOutcome::Cancelled);
        r.relay_outcome = Some(RelayOutcome::LeaseLost);
        r.check_exit = Some(1);
        j.write_record(&r).unwrap();
        assert_eq!(j.record("fixer", 7).unwrap(), Some(r.clone()));
        let path = dir.path().join("runs/fixer/7.json");
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.path().join("runs/fixer")), 0o700);
        // Rewriting replaces it.
        r.outcome = RunOutcome::Failed;
        j.write_record(&r).unwrap();
        assert_eq!(j.records("fixer", 10).unwrap(), [r]);
        assert_eq!(j.record("fixer", 8).unwrap(), None);
        assert!(matches!(
            j.write_record(&record("../etc", 1, RunOutcome::Running)),
            Err(JournalError::BadHarness(_))
        ));
    }

    #[test]
    fn records_are_listed_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        for id in [3, 11, 1, 2, 10] {
            j.write_record(&record("fixer", id, RunOutcome::Success))
                .unwrap();
        }
        j.write_record(&record("other", 50, RunOutcome::Success))
            .unwrap();
        // Not records: ignored.
        std::fs::write(dir.path().join("runs/fixer/notes.txt"), "x").unwrap();
        std::fs::write(dir.path().join("runs/fixer/12.json"), "{ broken").unwrap();
        let ids = |n| -> Vec<u64> {
            j.records("fixer", n)
                .unwrap()
                .iter()
                .map(|r| r.run_id)
                .collect()
        };
        assert_eq!(ids(10), [11, 10, 3, 2, 1]);
        assert_eq!(ids(2), [11, 10]);
        assert_eq!(j.records("nobody", 5).unwrap(), []);
        assert_eq!(j.harnesses().unwrap(), ["fixer", "other"]);
        assert_eq!(j.jobs_dir(), dir.path().join("jobs").to_str().unwrap());
    }

    #[test]
    fn prune_keeps_exactly_the_newest_runs_and_removes_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let mut planted = Vec::new();
        for id in 1..=6 {
            j.write_record(&record("fixer", id, RunOutcome::Failed))
                .unwrap();
            planted.push(plant_files(&j, "fixer", id));
        }
        // A log left without a record by an older daemon, and temporary files a crash left.
        let orphan = j.run_log("fixer", 0);
        std::fs::write(&orphan, "x").unwrap();
        let tmp_context = orphan.with_file_name(".2.relay.json.tmp.99.0");
        std::fs::write(&tmp_context, "x").unwrap();
        let tmp_record = dir.path().join("runs/fixer/.3.json.tmp.99.1");
        std::fs::write(&tmp_record, "x").unwrap();
        // Another harness is not touched.
        j.write_record(&record("other", 1, RunOutcome::Failed))
            .unwrap();
        let other = plant_files(&j, "other", 1);

        assert_eq!(j.prune("fixer", 2).unwrap(), [1, 2, 3, 4]);
        let kept: Vec<u64> = j
            .records("fixer", 10)
            .unwrap()
            .iter()
            .map(|r| r.run_id)
            .collect();
        assert_eq!(kept, [6, 5]);
        for (i, paths) in planted.iter().enumerate() {
            let alive = i >= 4;
            for p in [
                &paths.log,
                &paths.context_file,
                &paths.summary_file,
                &paths.usage_file,
            ] {
                assert_eq!(p.exists(), alive, "{}", p.display());
            }
        }
        assert!(!orphan.exists() && !tmp_context.exists() && !tmp_record.exists());
        assert!(dir.path().join("runs/fixer/last_run_id").exists());
        assert!(other.log.exists() && j.record("other", 1).unwrap().is_some());
        assert!(
            j.prune("fixer", 2).unwrap().is_empty(),
            "nothing more to prune"
        );

        // A run still in flight is never pruned.
        j.write_record(&record("fixer", 7, RunOutcome::Running))
            .unwrap();
        assert_eq!(j.prune("fixer", 0).unwrap(), [5, 6]);
        assert_eq!(j.records("fixer", 10).unwrap().len(), 1);
    }

    #[tokio::test]
    async fn run_ids_continue_across_restarts_and_pruning() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        assert_eq!(j.next_run_id("fixer").unwrap(), 1);
        for id in 1..=3 {
            j.write_record(&record("fixer", id, RunOutcome::Success))
                .unwrap();
        }
        drop(j);
        let j = Journal::open(dir.path()).unwrap();
        assert_eq!(j.next_run_id("fixer").unwrap(), 4);
        assert_eq!(j.next_run_id("other").unwrap(), 1, "ids count per harness");
        j.prune("fixer", 0).unwrap();
        assert_eq!(j.records("fixer", 10).unwrap(), []);
        let j = Journal::open(dir.path()).unwrap();
        assert_eq!(
            j.next_run_id("fixer").unwrap(),
            4,
            "pruning never recycles an id"
        );
        // An older record rewritten late does not lower the mark.
        j.write_record_async(record("fixer", 2, RunOutcome::Success))
            .await
            .unwrap();
        assert_eq!(j.next_run_id("fixer").unwrap(), 4);
    }

    #[test]
    fn reconcile_interrupts_running_records_only_and_drops_their_context_files() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let mut done = record("fixer", 1, RunOutcome::Success);
        done.relay_outcome = Some(RelayOutcome::Completed);
        j.write_record(&done).unwrap();
        let done_files = plant_files(&j, "fixer", 1);
        j.write_record(&record("fixer", 2, RunOutcome::Running))
            .unwrap();
        let running_files = plant_files(&j, "fixer", 2);
        j.write_record(&record("other", 9, RunOutcome::Running))
            .unwrap();

        let now = Wall::from_ms(t0() + 60_000);
        let reconciled = j.reconcile(now).unwrap();
        let want_fixer = reconcile_interrupted(record("fixer", 2, RunOutcome::Running), now);
        let want_other = reconcile_interrupted(record("other", 9, RunOutcome::Running), now);
        assert_eq!(reconciled, [want_fixer.clone(), want_other.clone()]);
        assert_eq!(want_fixer.outcome, RunOutcome::Interrupted);
        assert_eq!(want_fixer.relay_outcome, None, "no outcome is invented");
        assert_eq!(j.record("fixer", 2).unwrap(), Some(want_fixer));
        assert_eq!(j.record("other", 9).unwrap(), Some(want_other));
        assert_eq!(j.record("fixer", 1).unwrap(), Some(done));
        assert!(!running_files.context_file.exists());
        assert!(running_files.log.exists(), "the log stays for the operator");
        assert!(done_files.context_file.exists());
        assert_eq!(j.reconcile(now).unwrap(), [], "a second pass finds nothing");
    }

    #[tokio::test]
    async fn no_file_holds_the_lease_token() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let _lock = j.lock().unwrap();
        let mut s = settings();
        s.jobs_dir = j.jobs_dir().to_string();
        let first = j.next_run_id("fixer").unwrap();
        let mut d = Driver::new_with(s, Capabilities::full(true), first, t0());
        let mut cmds = d.start(claimed("td_1", 2, 5, Some(TOKEN)));
        cmds.extend(d.exit(0, Some(br#"{"summary": "done"}"#)));
        cmds.extend(d.report_ok(false));
        // A second attempt, left running when the daemon "crashes".
        cmds.extend(d.start(claimed("td_2", 1, 5, Some(TOKEN))));
        assert!(
            cmds.iter()
                .any(|c| matches!(c, Command::SendHeartbeat { .. })
                    || matches!(c, Command::SendReport { .. })),
            "the token was in play"
        );
        let mut records = 0;
        for c in cmds {
            match c {
                Command::WriteRunRecord { record } => {
                    j.write_record(&record).unwrap();
                    records += 1;
                }
                Command::WriteContextFile { path, bytes, .. } => {
                    crate::runner::write_context_file(&path, bytes)
                        .await
                        .unwrap();
                }
                Command::WarnRunLog { run_id, text } => {
                    crate::runner::warn_run_log(j.run_log("fixer", run_id), &text)
                        .await
                        .unwrap();
                }
                _ => {}
            }
        }
        assert!(records >= 3);
        let context = j.run_paths("fixer", first).context_file;
        assert!(context.exists(), "the context file was written");
        assert_eq!(mode(&context), 0o600);
        assert_eq!(j.reconcile(Wall::from_ms(t0())).unwrap().len(), 1);
        assert_eq!(
            j.records("fixer", 1).unwrap()[0].outcome,
            RunOutcome::Interrupted
        );

        let files = all_files(dir.path());
        assert!(files.len() >= 4, "{files:?}");
        assert_none_holds(&files, TOKEN);
        assert_eq!(j.next_run_id("fixer").unwrap(), first + 2);
    }

    #[test]
    fn the_lock_refuses_a_second_holder() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let lock = j.lock().unwrap();
        let held = std::fs::read_to_string(lock.path()).unwrap();
        assert_eq!(held.trim(), std::process::id().to_string());
        let err = Journal::open(dir.path()).unwrap().lock().unwrap_err();
        match &err {
            JournalError::Locked { dir: d, pid, .. } => {
                assert_eq!(d, dir.path());
                assert_eq!(u32::try_from(*pid).unwrap(), std::process::id());
            }
            other => panic!("unexpected {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains(&dir.path().display().to_string()) && text.contains("pid"));
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists(), "released on drop");
        let again = j.lock().unwrap();
        drop(again);
    }

    #[test]
    fn a_live_foreign_holder_is_refused_and_a_dead_one_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let lock_path = dir.path().join(LOCK_FILE);

        // Another live process holds it.
        let mut other = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let other_pid = i32::try_from(other.id()).unwrap();
        std::fs::write(&lock_path, format!("{other_pid}\n")).unwrap();
        match j.lock() {
            Err(JournalError::Locked { pid, .. }) => assert_eq!(pid, other_pid),
            other => panic!("unexpected {other:?}"),
        }
        other.kill().unwrap();
        other.wait().unwrap();

        // Its holder is gone: the lock is stale and taken over.
        let lock = j.lock().unwrap();
        assert_eq!(
            std::fs::read_to_string(&lock_path).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(lock);

        // A lock naming our own pid that this process does not hold (a container's pid 1
        // restarted) is stale too; so is one that does not name a pid.
        std::fs::write(&lock_path, format!("{}\n", std::process::id())).unwrap();
        drop(j.lock().unwrap());
        std::fs::write(&lock_path, "").unwrap();
        drop(j.lock().unwrap());
    }
}
