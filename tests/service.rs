//! The service-manager conventions (issue 34): `relay serve` and `relay daemon` tell systemd
//! `READY=1` once they serve and `STOPPING=1` on SIGTERM over `NOTIFY_SOCKET` (a socket path,
//! and an abstract `@name`); the unit files in contrib/systemd pass `systemd-analyze verify`
//! where it is installed; `relay completions` and `relay --version`.

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod common;
use common::{Proc, listening_on, relay, repo, temp_dir};

/// A failure bound on every wait, never a sleep.
const BOUND: Duration = Duration::from_secs(30);

/// The next datagram on the notify socket.
fn recv(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = sock
        .recv(&mut buf)
        .expect("a datagram on NOTIFY_SOCKET within the bound");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn sigterm(child: &std::process::Child) {
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
}

/// The exit code, within the bound.
fn exit_code(child: Proc) -> Option<i32> {
    let (tx, rx) = mpsc::channel();
    let mut child = child;
    std::thread::spawn(move || {
        let _ = tx.send(child.0.wait().map(|s| s.code()));
    });
    rx.recv_timeout(BOUND)
        .expect("the service exited within the bound")
        .unwrap()
}

/// `relay serve` on a SQLite file in `dir`, telling `notify` (a socket path) its state.
fn serve_notifying(dir: &std::path::Path, notify: &std::path::Path) -> Proc {
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    Proc(
        relay()
            .args(["serve", "--listen", "127.0.0.1:0", "--db", &db])
            .env("NOTIFY_SOCKET", notify)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start relay serve"),
    )
}

#[test]
fn serve_notifies_ready_once_listening_and_stopping_on_sigterm() {
    let dir = temp_dir("notify-serve");
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(BOUND)).unwrap();
    let mut child = serve_notifying(dir.path(), &path);
    let addr = listening_on(&mut child.0).expect("the ready line");
    assert_eq!(recv(&sock), "READY=1");
    // Ready means serving.
    let host = addr.strip_prefix("http://").unwrap();
    assert!(std::net::TcpStream::connect(host).is_ok());
    sigterm(&child.0);
    assert_eq!(recv(&sock), "STOPPING=1");
    assert_eq!(exit_code(child), Some(0));
}

/// A stop the moment the server says it is ready is a graceful stop. The signal handlers used
/// to be registered only when the stop future was first polled, after READY: a SIGTERM in
/// between ended the process by the signal's default action, with no STOPPING and no exit code
/// (seen under load in CI). Twenty stops at once after READY, each must be graceful.
#[test]
fn a_sigterm_right_after_ready_is_a_graceful_stop() {
    let dir = temp_dir("notify-early");
    for n in 0..20 {
        let path = dir.path().join(format!("notify-{n}.sock"));
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(BOUND)).unwrap();
        let child = serve_notifying(dir.path(), &path);
        assert_eq!(recv(&sock), "READY=1");
        sigterm(&child.0);
        assert_eq!(recv(&sock), "STOPPING=1", "stop {n}");
        assert_eq!(exit_code(child), Some(0), "stop {n}");
    }
}

#[test]
fn daemon_notifies_ready_and_stopping_over_an_abstract_socket() {
    let dir = temp_dir("notify-daemon");
    let name = format!("relay-test-notify-{}", std::process::id());
    let sock = {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        UnixDatagram::bind_addr(&addr).unwrap()
    };
    sock.set_read_timeout(Some(BOUND)).unwrap();
    let config = dir.path().join("harness.toml");
    std::fs::write(
        &config,
        "[harness.idle]\ncommand = [\"true\"]\nschedule = \"@every 1h\"\n",
    )
    .unwrap();
    let child = Proc(
        relay()
            .arg("daemon")
            .arg("--config")
            .arg(&config)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env("NOTIFY_SOCKET", format!("@{name}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start relay daemon"),
    );
    assert_eq!(recv(&sock), "READY=1");
    // Ready means its control socket answers.
    let out = relay()
        .args(["describe", "--state-dir"])
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    sigterm(&child.0);
    assert_eq!(recv(&sock), "STOPPING=1");
    assert_eq!(exit_code(child), Some(0));
}

#[test]
fn the_unit_files_pass_systemd_analyze_verify() {
    let tool = std::path::Path::new("/usr/bin/systemd-analyze");
    if !tool.exists() {
        eprintln!("SKIPPED: systemd-analyze is not installed (apt-get install systemd)");
        return;
    }
    let dir = temp_dir("units");
    for unit in ["relay-serve.service", "relay-daemon.service"] {
        let text = std::fs::read_to_string(repo().join("contrib/systemd").join(unit)).expect(unit);
        // verify checks that ExecStart's binary exists: point it at the one under test.
        let text = text.replace("/usr/local/bin/relay", common::relay_bin());
        let path = dir.path().join(unit);
        std::fs::write(&path, text).unwrap();
        let out = Command::new(tool)
            .arg("verify")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        // It exits 0 on an unknown key or a bad value and only warns: read the warnings too.
        let about: Vec<&str> = err.lines().filter(|l| l.contains(unit)).collect();
        assert!(out.status.success() && about.is_empty(), "{unit}:\n{err}");
    }
}

#[test]
fn completions_for_bash_zsh_and_fish_and_a_version_with_the_revision() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef relay"),
        ("fish", "complete -c relay"),
    ] {
        let out = relay().args(["completions", shell]).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            out.status.success() && text.contains(marker),
            "{shell}: {text}"
        );
        assert!(text.contains("check-config"), "{shell} lacks a command");
    }
    let out = relay().args(["completions", "tcsh"]).output().unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("bash, zsh, fish"), "{err}");

    let out = relay().arg("--version").output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let version = text.trim();
    assert!(version.starts_with("relay 0."), "{version}");
    // The revision is this checkout's HEAD when git can tell it, else it says there is none.
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(repo())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(rev) if std::env::var_os("RELAY_GIT_REVISION").is_none() => {
            assert!(version.ends_with(&format!("(git {rev})")), "{version}")
        }
        _ => assert!(version.contains('('), "{version}"),
    }
}
