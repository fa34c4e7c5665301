//! End-to-end checks of the `relay` binary's command line contract.

use std::process::Command;

fn relay() -> Command {
    Command::new(env!("CARGO_BIN_EXE_relay"))
}

#[test]
fn unknown_command_is_one_clear_line_on_stderr_and_nonzero() {
    let out = relay().arg("frobnicate").output().expect("run relay");
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).expect("utf-8 stderr");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(
        err.contains("frobnicate") && err.contains("relay --help"),
        "{err}"
    );
}

#[test]
fn help_lists_the_contract_commands() {
    let out = relay().arg("--help").output().expect("run relay");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    for cmd in [
        "serve",
        "endpoint",
        "todo",
        "daemon",
        "up",
        "sim",
        "check-config",
    ] {
        assert!(text.contains(cmd), "help lacks {cmd}: {text}");
    }
}
