//! Real MCP clients against the real `relay serve`: the official Python SDK in both MCP eras
//! (tests/python/test_mcp_sdk.py), the official TypeScript SDKs (v2 in the 2026-07-28 era, v1 in
//! the legacy era, and the Tasks extension client on v2: tests/typescript/), and the official
//! conformance suite in each era with its committed lists of expected failures
//! (tests/conformance/). They need tools outside Cargo:
//! `pip install -r tests/python/requirements.txt`, `(cd tests/typescript && npm ci)` and
//! `(cd tests/conformance && npm ci)` (`.ci/mcp.sh` does all three). Without them these tests say so and pass, unless
//! `RELAY_REQUIRE_MCP_CLIENTS=1` (CI sets it), which makes a missing tool a failure.

use std::process::Command;

mod common;
use common::{available, repo};

fn run(script: &str) {
    let out = Command::new("bash")
        .arg(repo().join(script))
        .env("RELAY_BIN", env!("CARGO_BIN_EXE_relay"))
        .output()
        .expect("bash runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    eprintln!("{text}");
}

#[test]
fn the_official_python_sdk_drives_the_server() {
    let present = Command::new("python3")
        .args(["-c", "import mcp, pytest"])
        .output()
        .is_ok_and(|o| o.status.success());
    if available(
        "the Python MCP SDK",
        present,
        "pip install -r tests/python/requirements.txt",
    ) {
        run("tests/python/run.sh");
    }
}

#[test]
fn the_official_typescript_sdks_drive_the_server() {
    let modules = repo().join("tests/typescript/node_modules/@modelcontextprotocol");
    let present = ["client", "ext-tasks"]
        .iter()
        .all(|p| modules.join(p).exists())
        && Command::new("node")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if available(
        "the TypeScript MCP SDKs",
        present,
        "(cd tests/typescript && npm ci)",
    ) {
        run("tests/typescript/run.sh");
    }
}

#[test]
fn the_conformance_suite_fails_only_where_expected() {
    let present = repo()
        .join("tests/conformance/node_modules/.bin/conformance")
        .exists();
    if available(
        "the MCP conformance suite",
        present,
        "(cd tests/conformance && npm ci)",
    ) {
        run("tests/conformance/run.sh");
    }
}
