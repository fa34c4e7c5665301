//! `relay up` as a new user runs it: the dev stack (its Board link logs in once, the samples
//! move, the MCP endpoint answers, SIGTERM ends it with exit 0 while a browser's live stream is
//! open) and the scripted tour (`--until-drained`: a table that names the dead letter and the
//! success check's "not yet" re-runs). Every wait is bounded; none is a sleep.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

mod common;
use common::{Proc, relay, temp_dir};

/// A failure bound, never a sleep: the samples drain in about ten seconds.
const BOUND: Duration = Duration::from_secs(120);

/// One HTTP/1.1 GET over a fresh connection: status, head, body.
fn get(url: &str, cookie: Option<&str>) -> (u16, String, String) {
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut s = TcpStream::connect(host).expect("connect");
    let cookie = cookie.map_or(String::new(), |c| format!("Cookie: {c}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{cookie}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap();
    (status, head.to_string(), body.to_string())
}

/// stdout's lines, read on a thread so that every wait on them is bounded.
fn lines(child: &mut std::process::Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("a piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn line_with(rx: &mpsc::Receiver<String>, what: &str, seen: &mut Vec<String>) -> String {
    loop {
        match rx.recv_timeout(BOUND) {
            Ok(line) => {
                seen.push(line.clone());
                if line.contains(what) {
                    return line;
                }
            }
            Err(e) => panic!(
                "no line with {what:?} ({e}); stdout so far:\n{}",
                seen.join("\n")
            ),
        }
    }
}

#[test]
fn up_runs_the_dev_stack_with_a_one_time_board_link_until_sigterm() {
    let dir = temp_dir("up-dev");
    let run = dir.path().join("run");
    let mut child = Proc(
        relay()
            .args(["up", "--dir"])
            .arg(&run)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start relay up"),
    );
    let rx = lines(&mut child.0);
    let mut seen = Vec::new();
    let board = line_with(&rx, "Board: ", &mut seen);
    let link = board.trim().strip_prefix("Board: ").unwrap().to_string();
    assert!(
        link.starts_with("http://127.0.0.1:") && link.contains("/board/login/link?secret="),
        "{link}"
    );
    let base = link.split("/board/").next().unwrap().to_string();
    let mcp = line_with(&rx, "MCP endpoint: ", &mut seen);
    assert_eq!(
        mcp.trim(),
        format!("MCP endpoint: {base}/mcp/quickstart"),
        "{mcp}"
    );
    // The samples move, through to the dead letter.
    line_with(&rx, "5/5 finished (4 done, 1 dead-lettered", &mut seen);

    // The link logs in once: a session cookie, then the overview shows the sample queue.
    let (status, head, _) = get(&link, None);
    assert_eq!(status, 303, "{head}");
    let cookie = head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_string();
    let (status, _, page) = get(&format!("{base}/board/"), Some(&cookie));
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("samples"), "{page}");
    let (again, _, refused) = get(&link, None);
    assert_eq!(again, 403, "a second use of the link: {refused}");
    assert!(refused.contains("used already"), "{refused}");
    // The token never appears on stdout: only the link's secret, on purpose.
    let env = std::fs::read_to_string(run.join("quickstart.env")).unwrap();
    let token = env.trim().strip_prefix("RELAY_TOKEN=").unwrap();
    assert!(!seen.iter().any(|l| l.contains(token)));
    // The MCP endpoint answers with that token (and refuses without it).
    let mut s = TcpStream::connect(base.strip_prefix("http://").unwrap()).unwrap();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    write!(
        s,
        "POST /mcp/quickstart HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        base.strip_prefix("http://").unwrap(),
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // A browser's live stream stays open across the stop: it must not hold the stop up.
    let mut stream = TcpStream::connect(base.strip_prefix("http://").unwrap()).unwrap();
    write!(
        stream,
        "GET /board/events HTTP/1.1\r\nHost: {}\r\nCookie: {cookie}\r\n\r\n",
        base.strip_prefix("http://").unwrap()
    )
    .unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");

    let pid = child.0.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    line_with(&rx, "stopped", &mut seen);
    // The stream was ended by the server (the last chunk sent), not cut when a grace ran out.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(
        rest.ends_with(b"\r\n0\r\n\r\n"),
        "the Board's live stream was not ended cleanly: {:?}",
        String::from_utf8_lossy(&rest)
    );
    // Exit 0 within the 10 s a user waits for after Ctrl-C (a failure bound on a thread).
    let (tx, done) = mpsc::channel();
    let mut proc = child;
    std::thread::spawn(move || {
        let _ = tx.send(proc.0.wait().map(|s| s.code()));
    });
    let code = done
        .recv_timeout(Duration::from_secs(10))
        .expect("relay up did not exit within 10 s of SIGTERM");
    assert_eq!(code.unwrap(), Some(0), "{}", seen.join("\n"));
    // --dir keeps the files.
    assert!(run.join("relay.db").exists() && run.join("harness.toml").exists());
}

#[test]
fn up_until_drained_prints_a_table_naming_the_dead_letter_and_the_checks_not_yet() {
    let dir = temp_dir("up-tour");
    let mut child = Proc(
        relay()
            .args(["up", "--until-drained", "--dir"])
            .arg(dir.path().join("run"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start relay up --until-drained"),
    );
    let rx = lines(&mut child.0);
    let mut seen = Vec::new();
    line_with(&rx, "files: ", &mut seen);
    let (tx, done) = mpsc::channel();
    let mut proc = child;
    std::thread::spawn(move || {
        let _ = tx.send(proc.0.wait().map(|s| s.code()));
    });
    let code = done.recv_timeout(BOUND).expect("the tour ended");
    assert_eq!(code.unwrap(), Some(0), "{}", seen.join("\n"));
    let text = seen.join("\n");
    let header = seen.iter().find(|l| l.starts_with("todo ")).expect(&text);
    for column in ["outcome", "died", "disposition", "dead letter", "checks"] {
        assert!(header.contains(column), "{header}");
    }
    let billing: Vec<&String> = seen
        .iter()
        .filter(|l| l.starts_with("Port the legacy billing"))
        .collect();
    assert_eq!(billing.len(), 2, "{text}");
    assert!(billing[0].contains("retry_scheduled"), "{text}");
    assert!(billing[1].contains("dead_lettered"), "{text}");
    // The dead letter's reason is one of the ledger's names, not a dash.
    let reason = billing[1]
        .split_whitespace()
        .nth(
            billing[1]
                .split_whitespace()
                .position(|w| w == "dead_lettered")
                .unwrap()
                + 1,
        )
        .unwrap();
    assert!(
        ["attempts_exhausted", "repeated_failure"].contains(&reason),
        "{text}"
    );
    let wait = seen
        .iter()
        .find(|l| l.starts_with("Wait for CI to go green"))
        .expect(&text);
    assert!(wait.contains("3 (2 not yet)"), "{text}");
    let takeover = seen
        .iter()
        .find(|l| l.starts_with("Resume an abandoned") && l.contains("lease_expired"))
        .expect(&text);
    assert!(
        takeover.contains("true") && takeover.contains("requeued"),
        "{text}"
    );
}
