//! Stamps the git revision into `relay --version` (`RELAY_GIT_REVISION`). Without git or a
//! repository (a source tarball) it says so instead of failing the build; a packager may set
//! `RELAY_GIT_REVISION` to what the tarball was cut from.

// A build script speaks to Cargo on stdout.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=RELAY_GIT_REVISION");
    let revision = match std::env::var("RELAY_GIT_REVISION") {
        Ok(r) if !r.trim().is_empty() => r.trim().to_string(),
        _ => match git(&["rev-parse", "--short=12", "HEAD"]) {
            Some(rev) => format!("git {rev}"),
            None => "no git revision".to_string(),
        },
    };
    println!("cargo:rustc-env=RELAY_GIT_REVISION={revision}");
    // Build again when HEAD moves: HEAD itself (a checkout), the branch it names (a commit),
    // and packed-refs (where a branch may live instead). Git's paths may be relative to here.
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let at = |p: String| -> PathBuf {
        let p = Path::new(&p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            here.join(p)
        }
    };
    // Only files that exist: Cargo reruns a build script on every build while a path it
    // watches is missing (a fresh clone has no packed-refs, a packed branch no ref file).
    let mut watch = Vec::new();
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).map(at) {
        watch.push(dir.join("HEAD"));
    }
    if let Some(common) = git(&["rev-parse", "--git-common-dir"]).map(at) {
        watch.push(common.join("packed-refs"));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(common.join(branch));
        }
    }
    watch.retain(|p| p.exists());
    for path in &watch {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    if watch.is_empty() {
        // No repository: nothing to watch but this script itself.
        println!("cargo:rerun-if-changed=build.rs");
    }
}
