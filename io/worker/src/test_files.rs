//! What the unit tests that look for secrets in files share.

use std::path::{Path, PathBuf};

/// Every file under `dir`, recursively.
pub(crate) fn all_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(all_files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Asserts that none of `files` holds `token` anywhere in its bytes.
pub(crate) fn assert_none_holds(files: &[PathBuf], token: &str) {
    for f in files {
        let bytes = std::fs::read(f).unwrap();
        assert!(
            !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
            "{} holds the lease token",
            f.display()
        );
    }
}
