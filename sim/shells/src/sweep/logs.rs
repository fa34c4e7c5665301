//! The worlds' logs, caught in memory (all of the relay crates' lines, at info) so the token
//! check can read them; a world takes its own after its run.

use std::io::Write;
use std::sync::{Mutex, OnceLock};

static BUF: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();

fn buf() -> &'static Mutex<Vec<u8>> {
    BUF.get_or_init(|| Mutex::new(Vec::new()))
}

struct Sink;

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        buf()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub fn init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_ansi(false)
        .with_writer(|| Sink)
        .try_init();
}

pub fn take() -> Vec<u8> {
    std::mem::take(&mut *buf().lock().unwrap_or_else(|e| e.into_inner()))
}
