//! The run's files: the private context file, warnings in the run log, the log's tail.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use relay_core::relay::usage::USAGE_FILE_MAX_BYTES;

use super::RunnerError;

/// Mode of every file the daemon writes for a run: the owner's only.
pub(crate) const FILE_MODE: u32 = 0o600;
/// Mode of the directories it creates for them.
pub(crate) const DIR_MODE: u32 = 0o700;

/// How far back [`run_log_tail`] reads at most, whatever the line count.
pub const TAIL_MAX_BYTES: usize = 1024 * 1024;

/// Creates `dir` and its missing parents with mode 0700.
pub(crate) fn create_dirs(dir: &Path) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)
}

/// Creates the parent directory of `path` when it is missing.
pub(crate) fn create_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => create_dirs(parent),
        _ => Ok(()),
    }
}

/// Opens `path` for appending, creating it (mode 0600) and its directory when missing.
pub(crate) fn open_append(path: &Path) -> std::io::Result<File> {
    create_parent(path)?;
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(FILE_MODE)
        .open(path)
}

/// Writes `bytes` to `path` whole or not at all: a temporary file beside it, created with mode
/// 0600 (so the content is never readable by others, even for an instant), synced, then renamed
/// over `path`. Parent directories are created with mode 0700.
pub(crate) fn write_private_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_private(path, bytes, true)
}

/// [`write_private_atomic`], with the fsync only when `durable`: a file that need not survive a
/// power loss (the context file lives exactly as long as its attempt's process) skips it.
pub(crate) fn write_private(path: &Path, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    create_parent(path)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.tmp.{}.{}",
        name.unwrap_or_default(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

async fn blocking<T: Send + 'static>(
    op: &'static str,
    path: PathBuf,
    f: impl FnOnce(&Path) -> std::io::Result<T> + Send + 'static,
) -> Result<T, RunnerError> {
    let p = path.clone();
    match tokio::task::spawn_blocking(move || f(&p)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(RunnerError::Io { op, path, source }),
        Err(source) => Err(RunnerError::Join { op, path, source }),
    }
}

/// `WriteContextFile`: writes the context file with mode 0600 from its creation (it holds the
/// todo's payload), replacing any earlier file atomically, and creates its directory.
pub async fn write_context_file(path: impl AsRef<Path>, bytes: Vec<u8>) -> Result<(), RunnerError> {
    let path = path.as_ref().to_path_buf();
    blocking("write the context file", path, move |p| {
        write_private_atomic(p, &bytes)
    })
    .await
}

/// [`write_context_file`] without a blocking-pool hop and without an fsync, for a caller that
/// must have the file in place before its next step (the daemon's actor starts the check or the
/// agent that reads it right after; the file is a few KiB). The rename still makes it appear
/// whole; it is not synced because it matters only while its attempt's process runs, and a
/// power loss ends that attempt anyway.
pub fn write_context_file_now(path: impl AsRef<Path>, bytes: &[u8]) -> Result<(), RunnerError> {
    let path = path.as_ref();
    write_private(path, bytes, false).map_err(|source| RunnerError::Io {
        op: "write the context file",
        path: path.to_path_buf(),
        source,
    })
}

/// Reads an attempt's usage file (`HARNESS_USAGE_FILE`) for the daemon, before a heartbeat or
/// report: at most [`USAGE_FILE_MAX_BYTES`] + 1 bytes (the one more tells a longer file from a
/// full one), `Ok(None)` when there is no file. Synchronous and bounded: the file is opened
/// without blocking (a FIFO planted there cannot hang the caller) and without following a
/// symbolic link, and read only when it is a regular file. The error says what is wrong with
/// the file, never what it holds.
pub fn read_usage_file(path: &Path) -> Result<Option<Vec<u8>>, String> {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ELOOP as i32) => {
            return Err("is a symbolic link, not a file".into());
        }
        Err(e) => return Err(e.to_string()),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("is not a regular file".into());
    }
    let mut bytes = Vec::new();
    let limit = u64::try_from(USAGE_FILE_MAX_BYTES + 1).unwrap_or(u64::MAX);
    file.take(limit)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(Some(bytes))
}

/// `WarnRunLog`: appends `relay: warning: <text>` to the run log, one such line per line of
/// `text`, creating the log when missing.
pub async fn warn_run_log(path: impl AsRef<Path>, text: &str) -> Result<(), RunnerError> {
    let path = path.as_ref().to_path_buf();
    let mut lines = String::new();
    for line in text.lines() {
        lines.push_str("relay: warning: ");
        lines.push_str(line);
        lines.push('\n');
    }
    if lines.is_empty() {
        lines.push_str("relay: warning:\n");
    }
    blocking("append a warning to the run log", path, move |p| {
        open_append(p)?.write_all(lines.as_bytes())
    })
    .await
}

/// The last `lines` lines of the run log (for a receipt, 200), read backwards from its end in
/// blocks: memory stays bounded by the lines asked for and by [`TAIL_MAX_BYTES`], whatever the
/// log's size. A missing log has no lines.
pub async fn run_log_tail(path: impl AsRef<Path>, lines: usize) -> Result<Vec<u8>, RunnerError> {
    let path = path.as_ref().to_path_buf();
    blocking("read the run log", path, move |p| match File::open(p) {
        Ok(f) => tail_lines(f, lines, TAIL_MAX_BYTES),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    })
    .await
}

/// The last `lines` lines of `f`, at most `max` bytes of them.
pub(crate) fn tail_lines(mut f: File, lines: usize, max: usize) -> std::io::Result<Vec<u8>> {
    const BLOCK: u64 = 64 * 1024;
    if lines == 0 {
        return Ok(Vec::new());
    }
    let mut pos = f.seek(SeekFrom::End(0))?;
    // The file's last `buf.len()` bytes.
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // A newline that ends the file ends the last line; it starts no new one.
        let body = buf.strip_suffix(b"\n").unwrap_or(&buf);
        let mut cut = None;
        let mut found = 0;
        for (i, b) in body.iter().enumerate().rev() {
            if *b == b'\n' {
                found += 1;
                if found == lines {
                    cut = Some(i + 1);
                    break;
                }
            }
        }
        if let Some(cut) = cut {
            buf.drain(..cut);
            return Ok(buf);
        }
        if pos == 0 {
            return Ok(buf);
        }
        if buf.len() >= max {
            let excess = buf.len() - max;
            buf.drain(..excess);
            return Ok(buf);
        }
        let step = BLOCK.min(pos);
        pos -= step;
        f.seek(SeekFrom::Start(pos))?;
        let mut block = vec![0; usize::try_from(step).unwrap_or(usize::MAX)];
        f.read_exact(&mut block)?;
        block.extend_from_slice(&buf);
        buf = block;
    }
}
