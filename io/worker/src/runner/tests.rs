//! The runner against real child processes (`sh -c …`). Waits are bounded and wait on events
//! (an input arriving, a line in the log, a file appearing), never on a fixed sleep.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use relay_core::relay::{Command, ExitStatus, Input, ProcessEnv, Signal};
use tokio::sync::mpsc;

use super::*;

/// The longest any single event may take to arrive.
const BOUND: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// Polls `check` until it holds, for at most [`BOUND`].
async fn until(what: &str, mut check: impl FnMut() -> bool) {
    within(what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn daemon() -> Vec<(String, String)> {
    pairs(&[
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("DAEMON_ONLY", "d"),
        ("SHARED", "from-daemon"),
        ("HARNESS_TODO_ID", "from-daemon"),
    ])
}

fn process_env(dir: &Path) -> ProcessEnv {
    ProcessEnv {
        env_file: pairs(&[
            ("SHARED", "from-env-file"),
            ("ENV_FILE_ONLY", "e"),
            ("HARNESS_TODO_ID", "from-env-file"),
        ]),
        relay: vec![
            ("HARNESS_TODO_ID".into(), "td_1".into()),
            (
                "HARNESS_ATTEMPT_SUMMARY_FILE".into(),
                dir.join("jobs/fixer/7.summary").display().to_string(),
            ),
            (
                "HARNESS_USAGE_FILE".into(),
                dir.join("jobs/fixer/7.usage.json").display().to_string(),
            ),
        ],
    }
}

fn agent(dir: &Path, argv: &[&str]) -> AgentSpec {
    AgentSpec {
        run_id: 7,
        argv: argv.iter().map(|s| s.to_string()).collect(),
        stdin: None,
        workdir: dir.display().to_string(),
        env: process_env(dir),
        daemon_env: daemon(),
        summary_file: dir.join("jobs/fixer/7.summary").display().to_string(),
        usage_file: dir.join("jobs/fixer/7.usage.json").display().to_string(),
        run_log: dir.join("jobs/fixer/7.log"),
    }
}

fn sh(dir: &Path, script: &str) -> AgentSpec {
    agent(dir, &["sh", "-c", script])
}

fn check(dir: &Path, script: &str) -> CheckSpec {
    CheckSpec {
        run_id: 7,
        argv: vec!["sh".into(), "-c".into(), script.into()],
        workdir: dir.display().to_string(),
        env: process_env(dir),
        daemon_env: daemon(),
        run_log: dir.join("jobs/fixer/7.log"),
    }
}

/// Writes `text` as what the run log `log` already holds.
fn log_already_holds(log: &Path, text: &str) {
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    std::fs::write(log, text).unwrap();
}

fn log_of(spec_log: &Path) -> String {
    std::fs::read_to_string(spec_log).unwrap_or_default()
}

/// The one input a child's `wait` yields (bounded): an exit, and run 7's.
async fn exit_of_run_7(what: &str, wait: impl std::future::Future<Output = Input>) -> Input {
    let input = within(what, wait).await;
    match &input {
        Input::ProcessExited { run_id, .. } | Input::CheckExited { run_id, .. } => {
            assert_eq!(*run_id, 7);
        }
        other => panic!("unexpected {other:?}"),
    }
    input
}

async fn run_to_exit(spec: AgentSpec) -> (ExitStatus, Option<Vec<u8>>) {
    let agent = spawn_agent(spec).expect("spawn");
    let input = exit_of_run_7("the agent to exit", agent.wait()).await;
    let Input::ProcessExited {
        exit, summary_file, ..
    } = input
    else {
        panic!("an agent ended in {input:?}");
    };
    (exit, summary_file)
}

async fn check_to_exit(spec: CheckSpec) -> (ExitStatus, Vec<u8>) {
    let check = run_check(spec).expect("start the check");
    let input = exit_of_run_7("the check to exit", check.wait()).await;
    let Input::CheckExited {
        exit, output_tail, ..
    } = input
    else {
        panic!("a check ended in {input:?}");
    };
    (exit, output_tail)
}

/// An agent that starts a long sleep in the background and waits for it; the file where it
/// writes the sleep's pid.
fn with_a_grandchild(dir: &Path) -> (AgentSpec, PathBuf) {
    let pidfile = dir.join("grandchild.pid");
    let spec = sh(
        dir,
        &format!("sleep 1000 & echo $! > {}; wait", pidfile.display()),
    );
    (spec, pidfile)
}

/// The grandchild's pid, once the agent has written it.
async fn grandchild_pid(pidfile: &Path) -> i32 {
    until("the grandchild's pid", || {
        std::fs::read_to_string(pidfile).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    std::fs::read_to_string(pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Whether `pid` is gone (or a zombie nobody reaped yet, which runs nothing any more).
fn dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn the_environment_is_exactly_the_layered_one() {
    let dir = tempfile::tempdir().unwrap();
    let spec = agent(dir.path(), &["env"]);
    let log = spec.run_log.clone();
    let (exit, _) = run_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(0));
    let mut got: Vec<String> = log_of(&log).lines().map(str::to_string).collect();
    got.sort();
    let summary = dir.path().join("jobs/fixer/7.summary");
    let mut want = vec![
        "DAEMON_ONLY=d".to_string(),
        "ENV_FILE_ONLY=e".into(),
        format!("HARNESS_ATTEMPT_SUMMARY_FILE={}", summary.display()),
        "HARNESS_TODO_ID=td_1".into(),
        format!(
            "HARNESS_USAGE_FILE={}",
            dir.path().join("jobs/fixer/7.usage.json").display()
        ),
        "PATH=/usr/local/bin:/usr/bin:/bin".into(),
        "SHARED=from-env-file".into(),
    ];
    want.sort();
    assert_eq!(
        got, want,
        "relay variables win, env_file beats the daemon, nothing else leaks in"
    );
}

#[tokio::test]
async fn stdin_workdir_and_both_streams_reach_the_log_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let mut spec = sh(
        dir.path(),
        "pwd; echo out1; echo err1 >&2; cat; echo out2; echo err2 >&2",
    );
    spec.workdir = work.display().to_string();
    spec.stdin = Some(b"the prompt\nline two\n".to_vec());
    let log = spec.run_log.clone();
    let (exit, summary) = run_to_exit(spec).await;
    assert_eq!((exit, summary), (ExitStatus::Code(0), None));
    assert_eq!(
        log_of(&log),
        format!(
            "{}\nout1\nerr1\nthe prompt\nline two\nout2\nerr2\n",
            work.display()
        )
    );
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the run log is private");
}

#[tokio::test]
async fn without_a_prompt_stdin_is_empty_and_the_log_is_appended_to() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(dir.path(), "echo before; cat; echo after");
    let log = spec.run_log.clone();
    log_already_holds(&log, "earlier line\n");
    let (exit, _) = run_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(0));
    assert_eq!(log_of(&log), "earlier line\nbefore\nafter\n");
}

#[tokio::test]
async fn a_large_prompt_to_a_process_that_never_reads_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(dir.path(), "exit 3");
    spec.stdin = Some(vec![b'x'; 1024 * 1024]);
    let (exit, _) = run_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(3));
}

#[tokio::test]
async fn the_summary_file_is_read_capped_at_16_kib_and_a_stale_one_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(
        dir.path(),
        r#"head -c 40000 /dev/zero | tr '\0' s > "$HARNESS_ATTEMPT_SUMMARY_FILE""#,
    );
    let (exit, summary) = run_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(0));
    assert_eq!(summary, Some(vec![b's'; 16 * 1024]));

    // A summary file left from before the spawn is not the agent's.
    let spec = sh(dir.path(), "exit 0");
    std::fs::write(&spec.summary_file, "stale").unwrap();
    let (_, summary) = run_to_exit(spec).await;
    assert_eq!(summary, None);

    let spec = sh(
        dir.path(),
        r#"printf '{"summary":"fixed"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE""#,
    );
    let (_, summary) = run_to_exit(spec).await;
    assert_eq!(summary.as_deref(), Some(&br#"{"summary":"fixed"}"#[..]));
}

#[tokio::test]
async fn the_usage_file_is_created_empty_and_private_and_a_stale_one_is_emptied() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(
        dir.path(),
        r#"[ -f "$HARNESS_USAGE_FILE" ] && [ ! -s "$HARNESS_USAGE_FILE" ] || exit 9
           printf '{"cost_usd": 0.5}' > "$HARNESS_USAGE_FILE""#,
    );
    let usage = PathBuf::from(&spec.usage_file);
    std::fs::create_dir_all(usage.parent().unwrap()).unwrap();
    std::fs::write(&usage, r#"{"cost_usd": 99}"#).unwrap();
    let (exit, _) = run_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(0), "the agent found an empty file");
    let mode = std::fs::metadata(&usage).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    assert_eq!(
        read_usage_file(&usage),
        Ok(Some(br#"{"cost_usd": 0.5}"#.to_vec()))
    );
}

#[test]
fn the_usage_file_is_read_bounded_and_only_when_it_is_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("7.usage.json");
    assert_eq!(read_usage_file(&path), Ok(None), "missing: nothing to send");
    std::fs::write(&path, vec![b'x'; 10_000]).unwrap();
    let read = read_usage_file(&path).unwrap().unwrap();
    assert_eq!(
        read.len(),
        relay_core::relay::usage::USAGE_FILE_MAX_BYTES + 1
    );
    // A FIFO in its place is refused at once: opening it does not wait for a writer.
    std::fs::remove_file(&path).unwrap();
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let refused = read_usage_file(&path).unwrap_err();
    assert!(refused.contains("not a regular file"), "{refused}");
    // So is a link, to a file or to a device that never ends.
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    let refused = read_usage_file(&path).unwrap_err();
    assert!(refused.contains("symbolic link"), "{refused}");
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    assert!(read_usage_file(&path).is_err());
}

#[tokio::test]
async fn exit_codes_and_signals_map_to_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        run_to_exit(sh(dir.path(), "exit 42")).await.0,
        ExitStatus::Code(42)
    );
    assert_eq!(
        run_to_exit(sh(dir.path(), "kill -KILL $$")).await.0,
        ExitStatus::Signal(9)
    );
    assert_eq!(
        run_to_exit(sh(dir.path(), "kill -USR1 $$")).await.0,
        ExitStatus::Signal(10)
    );
}

#[tokio::test]
async fn term_is_ignored_by_a_trapping_process_and_kill_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(
        dir.path(),
        "trap '' TERM; echo ready; while :; do sleep 0.1; done",
    );
    let log = spec.run_log.clone();
    let agent = spawn_agent(spec).expect("spawn");
    let group = agent.process().group();
    assert_eq!(group.pgid(), i32::try_from(agent.process().pid()).unwrap());
    let mut wait = Box::pin(agent.wait());
    until("the trap to be set", || log_of(&log).contains("ready")).await;

    group.signal(Signal::Term).unwrap();
    // The grace period: the process is still there after TERM.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut wait)
            .await
            .is_err(),
        "a process that traps TERM survives it"
    );
    group.signal(Signal::Kill).unwrap();
    match within("the kill", wait).await {
        Input::ProcessExited { exit, .. } => assert_eq!(exit, ExitStatus::Signal(9)),
        other => panic!("unexpected {other:?}"),
    }
    assert!(group.is_reaped());
    // Signalling a reaped group is a no-op, not an error.
    group.signal(Signal::Kill).unwrap();
}

#[tokio::test]
async fn a_grandchild_dies_with_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let (spec, pidfile) = with_a_grandchild(dir.path());
    let agent = spawn_agent(spec).expect("spawn");
    let group = agent.process().group();
    let wait = agent.wait();
    let grandchild = grandchild_pid(&pidfile).await;
    assert!(!dead(grandchild));
    group.signal(Signal::Term).unwrap();
    match within("the agent to exit", wait).await {
        Input::ProcessExited { exit, .. } => assert_eq!(exit, ExitStatus::Signal(15)),
        other => panic!("unexpected {other:?}"),
    }
    until("the grandchild to die", || dead(grandchild)).await;
}

#[tokio::test]
async fn dropping_the_waiter_kills_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let (spec, pidfile) = with_a_grandchild(dir.path());
    let agent = spawn_agent(spec).expect("spawn");
    let pid = i32::try_from(agent.process().pid()).unwrap();
    let grandchild = grandchild_pid(&pidfile).await;
    drop(agent);
    until("the agent and its grandchild to die", || {
        dead(pid) && dead(grandchild)
    })
    .await;
}

#[tokio::test]
async fn spawn_errors_name_the_program_the_path_and_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let err = spawn_agent(agent(dir.path(), &["no-such-agent-xyz"])).unwrap_err();
    assert!(
        err.message.contains("no-such-agent-xyz") && err.message.contains("PATH"),
        "{err}"
    );
    match Input::from(err) {
        Input::SpawnFailed { run_id, .. } => assert_eq!(run_id, 7),
        other => panic!("unexpected {other:?}"),
    }

    let err = spawn_agent(agent(dir.path(), &["./missing.sh"])).unwrap_err();
    let path = dir.path().join("./missing.sh");
    assert!(
        err.message.contains(&path.display().to_string()) && err.message.contains("No such file"),
        "{err}"
    );

    std::fs::write(dir.path().join("noexec.sh"), "#!/bin/sh\n").unwrap();
    let err = spawn_agent(agent(dir.path(), &["./noexec.sh"])).unwrap_err();
    assert!(err.message.contains("Permission denied"), "{err}");

    let mut spec = sh(dir.path(), "true");
    spec.workdir = dir.path().join("gone").display().to_string();
    let err = spawn_agent(spec).unwrap_err();
    assert!(
        err.message.contains("workdir") && err.message.contains("gone"),
        "{err}"
    );

    let err = spawn_agent(agent(dir.path(), &[])).unwrap_err();
    assert!(err.message.contains("argv is empty"), "{err}");

    let mut spec = agent(dir.path(), &["env"]);
    spec.daemon_env.retain(|(k, _)| k != "PATH");
    let err = spawn_agent(spec).unwrap_err();
    assert!(err.message.contains("PATH is not set"), "{err}");
}

#[tokio::test]
async fn the_check_writes_under_a_delimiter_and_keeps_a_tail() {
    let dir = tempfile::tempdir().unwrap();
    let spec = check(dir.path(), "echo one; echo two >&2; echo three; exit 4");
    let log = spec.run_log.clone();
    log_already_holds(&log, "agent output\n");
    let (exit, tail) = check_to_exit(spec).await;
    assert_eq!(exit, ExitStatus::Code(4));
    assert_eq!(tail, b"one\ntwo\nthree\n");
    assert_eq!(
        log_of(&log),
        "agent output\n--- success check: sh (run 7) ---\none\ntwo\nthree\n--- success check: exit 4 ---\n"
    );

    let (exit, tail) = check_to_exit(check(
        dir.path(),
        "head -c 10000 /dev/zero | tr '\\0' a; echo; echo END",
    ))
    .await;
    assert_eq!(exit, ExitStatus::Code(0));
    assert_eq!(tail.len(), CHECK_TAIL_BYTES);
    assert!(tail.ends_with(b"a\nEND\n"));
    assert!(
        log_of(&log).contains(&format!("{}\nEND\n", "a".repeat(10000))),
        "the log has all of it"
    );
}

#[tokio::test]
async fn the_check_sees_its_environment_and_workdir() {
    let dir = tempfile::tempdir().unwrap();
    let (exit, tail) = check_to_exit(check(
        dir.path(),
        "pwd; echo $HARNESS_TODO_ID $SHARED $DAEMON_ONLY; cat",
    ))
    .await;
    assert_eq!(exit, ExitStatus::Code(0));
    assert_eq!(
        String::from_utf8(tail).unwrap(),
        format!("{}\ntd_1 from-env-file d\n", dir.path().display())
    );
}

#[tokio::test]
async fn what_a_check_leaves_running_does_not_hold_it_up() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("left.pid");
    let (exit, tail) = check_to_exit(check(
        dir.path(),
        &format!("sleep 1000 & echo $! > {}; echo done", pidfile.display()),
    ))
    .await;
    assert_eq!(exit, ExitStatus::Code(0));
    assert_eq!(tail, b"done\n");
    let left: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    until("the check's leftover to die", || dead(left)).await;
}

#[tokio::test]
async fn kill_check_kills_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let spec = check(dir.path(), "echo started; sleep 1000");
    let log = spec.run_log.clone();
    let c = run_check(spec).expect("start");
    let group = c.process().group();
    let (tx, mut rx) = mpsc::unbounded_channel();
    c.deliver(move |input| {
        let _ = tx.send(input);
    });
    until("the check to start", || log_of(&log).contains("started")).await;
    group.kill().unwrap();
    match within("the killed check", rx.recv()).await {
        Some(Input::CheckExited {
            exit, output_tail, ..
        }) => {
            assert_eq!(exit, ExitStatus::Signal(9));
            assert_eq!(output_tail, b"started\n");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(log_of(&log).ends_with("--- success check: killed by signal 9 ---\n"));
}

#[tokio::test]
async fn a_check_that_cannot_start_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = check(dir.path(), "");
    spec.argv = vec!["/nonexistent/green.sh".into()];
    let err = run_check(spec).unwrap_err();
    assert!(
        err.message.contains("/nonexistent/green.sh") && err.message.contains("No such file"),
        "{err}"
    );
    match Input::from(err) {
        Input::CheckFailedToStart { run_id, error } => {
            assert_eq!(run_id, 7);
            assert!(error.contains("success check"));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn specs_come_from_the_machines_commands() {
    let env = ProcessEnv {
        env_file: vec![],
        relay: vec![],
    };
    let spawn = Command::Spawn {
        run_id: 3,
        argv: vec!["agent".into()],
        stdin: Some(b"p".to_vec()),
        workdir: "/w".into(),
        env: env.clone(),
        context_file: "/j/h/3.relay.json".into(),
        summary_file: "/j/h/3.summary".into(),
        usage_file: "/j/h/3.usage.json".into(),
    };
    let spec = AgentSpec::from_command(spawn, vec![], PathBuf::from("/j/h/3.log")).unwrap();
    assert_eq!(
        (
            spec.run_id,
            spec.summary_file.as_str(),
            spec.usage_file.as_str(),
            spec.stdin.as_deref()
        ),
        (3, "/j/h/3.summary", "/j/h/3.usage.json", Some(&b"p"[..]))
    );
    let run_check = Command::RunCheck {
        run_id: 3,
        argv: vec!["c".into()],
        workdir: "/w".into(),
        env,
    };
    let spec = CheckSpec::from_command(run_check, vec![], PathBuf::from("/j/h/3.log")).unwrap();
    assert_eq!(spec.argv, ["c"]);
    let other = Command::KillCheck { run_id: 3 };
    assert!(AgentSpec::from_command(other, vec![], PathBuf::new()).is_none());
}

#[tokio::test]
async fn the_context_file_is_private_from_creation_and_replaced_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs/fixer/7.relay.json");
    write_context_file(&path, b"{\"version\":1}\n".to_vec())
        .await
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"{\"version\":1}\n");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(path.parent().unwrap()), 0o700);

    // An earlier file that others could read is replaced, not rewritten in place.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    write_context_file(&path, b"{\"version\":2}\n".to_vec())
        .await
        .unwrap();
    assert_eq!(mode(&path), 0o600);
    assert_eq!(std::fs::read(&path).unwrap(), b"{\"version\":2}\n");
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "no temporary file is left: {leftovers:?}"
    );

    let err = write_context_file("/proc/nope/x.relay.json", vec![])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("/proc/nope/x.relay.json"), "{err}");
}

#[tokio::test]
async fn warnings_are_appended_as_relay_lines() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("jobs/fixer/7.log");
    warn_run_log(&log, "dropped the artifact").await.unwrap();
    warn_run_log(&log, "two\nlines").await.unwrap();
    assert_eq!(
        log_of(&log),
        "relay: warning: dropped the artifact\nrelay: warning: two\nrelay: warning: lines\n"
    );
}

#[tokio::test]
async fn the_log_tail_is_the_last_lines() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("7.log");
    assert_eq!(
        run_log_tail(&log, 200).await.unwrap(),
        b"",
        "no log, no lines"
    );

    let text: String = (0..50_000).map(|i| format!("line {i}\n")).collect();
    std::fs::write(&log, &text).unwrap();
    let tail = run_log_tail(&log, 200).await.unwrap();
    let want: String = (49_800..50_000).map(|i| format!("line {i}\n")).collect();
    assert_eq!(String::from_utf8(tail).unwrap(), want);

    std::fs::write(&log, "a\nb\nc").unwrap();
    assert_eq!(run_log_tail(&log, 2).await.unwrap(), b"b\nc");
    assert_eq!(run_log_tail(&log, 10).await.unwrap(), b"a\nb\nc");
    assert_eq!(run_log_tail(&log, 0).await.unwrap(), b"");

    // One enormous line: the tail stops at the byte bound.
    let big = vec![b'x'; 300_000];
    std::fs::write(&log, &big).unwrap();
    let f = std::fs::File::open(&log).unwrap();
    assert_eq!(files::tail_lines(f, 5, 100_000).unwrap().len(), 100_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_runs_leave_no_task_behind() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = tokio::runtime::Handle::current().metrics();
    let baseline = metrics.num_alive_tasks();
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..100u64 {
        let mut spec = sh(dir.path(), "echo hi; echo oops >&2; exit 1");
        spec.run_id = i;
        spec.stdin = Some(b"prompt".to_vec());
        spec.run_log = dir.path().join(format!("jobs/fixer/{i}.log"));
        spec.summary_file = dir
            .path()
            .join(format!("jobs/fixer/{i}.summary"))
            .display()
            .to_string();
        let agent = spawn_agent(spec).expect("spawn");
        let agent_tx = tx.clone();
        agent.deliver(move |input| {
            let _ = agent_tx.send(input);
        });
        if i % 2 == 0 {
            let mut spec = check(dir.path(), "echo checked");
            spec.run_id = i;
            let c = run_check(spec).expect("check");
            let check_tx = tx.clone();
            c.deliver(move |input| {
                let _ = check_tx.send(input);
            });
        }
    }
    drop(tx);
    let mut exits = 0;
    let mut checks = 0;
    while let Some(input) = within("the inputs", rx.recv()).await {
        match input {
            Input::ProcessExited { exit, .. } => {
                assert_eq!(exit, ExitStatus::Code(1));
                exits += 1;
            }
            Input::CheckExited { exit, .. } => {
                assert_eq!(exit, ExitStatus::Code(0));
                checks += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((exits, checks), (100, 50));
    until("the task count to return to its baseline", || {
        metrics.num_alive_tasks() == baseline
    })
    .await;
}

/// One whole attempt of a real machine against real processes: the context file, the agent
/// (which dumps its environment and the context file into the log), the check, the report.
/// No byte of the lease token reaches a file or a process environment.
#[tokio::test]
async fn a_real_attempt_keeps_the_token_out_of_files_and_processes() {
    use relay_core::relay::{Capabilities, ReportVerb};
    use relay_core::testing::relay::{Driver, claimed, settings, t0, with_check};
    use relay_core::time::MINUTE;

    const TOKEN: &str = "fence-T0K3N-9f8e7d-planted";
    let dir = tempfile::tempdir().unwrap();
    let mut s = with_check(settings(), 10 * MINUTE, 30_000);
    s.workdir = dir.path().display().to_string();
    s.jobs_dir = dir.path().join("jobs").display().to_string();
    s.argv = vec![
        "sh".into(),
        "-c".into(),
        r#"env; cat "$HARNESS_RELAY_FILE"; cat; printf '{"summary":"agent says done"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE""#.into(),
    ];
    if let Some(check) = &mut s.success_check {
        check.argv = vec!["sh".into(), "-c".into(), "env; echo green".into()];
    }
    let log = dir.path().join("jobs/fixer/1.log");
    let mut d = Driver::new_with(s, Capabilities::full(true), 1, t0());

    let mut pending = d.claim(claimed("td_1", 2, 5, Some(TOKEN)));
    let mut report = None;
    let mut steps = 0;
    while let Some(cmd) = (!pending.is_empty()).then(|| pending.remove(0)) {
        steps += 1;
        assert!(steps < 100, "the attempt did not settle");
        match cmd {
            Command::WriteContextFile { path, bytes, .. } => {
                write_context_file(&path, bytes).await.unwrap();
            }
            cmd @ Command::Spawn { .. } => {
                let spec = AgentSpec::from_command(cmd, daemon(), log.clone()).unwrap();
                let agent = spawn_agent(spec).expect("spawn");
                pending.extend(d.input(Input::ProcessSpawned { run_id: 1 }));
                let exited = within("the agent", agent.wait()).await;
                pending.extend(d.input(exited));
            }
            cmd @ Command::RunCheck { .. } => {
                let spec = CheckSpec::from_command(cmd, daemon(), log.clone()).unwrap();
                let exited = within("the check", run_check(spec).expect("check").wait()).await;
                pending.extend(d.input(exited));
            }
            Command::WarnRunLog { text, .. } => warn_run_log(&log, &text).await.unwrap(),
            Command::SendReport {
                verb,
                summary,
                lease_token,
                ..
            } => {
                assert_eq!(
                    lease_token.expose(),
                    TOKEN,
                    "the report carries it, in memory"
                );
                report = Some((verb, summary));
            }
            _ => {}
        }
    }
    let (verb, summary) = report.expect("a report");
    assert_eq!(verb, ReportVerb::Complete);
    assert!(
        summary.contains("agent says done") && summary.contains("green"),
        "{summary}"
    );

    let text = log_of(&log);
    assert!(
        text.contains("HARNESS_TODO_ID=td_1"),
        "the agent's environment is in the log"
    );
    assert!(text.contains("\"todo\""), "the context file is in the log");
    assert!(text.contains("--- success check: sh (run 1) ---"));
    assert!(
        text.contains("HARNESS_AGENT_EXIT=0"),
        "the check's environment is in the log"
    );
    assert!(
        text.contains("Fix the CI failure"),
        "the prompt reached stdin"
    );
    let files = crate::test_files::all_files(dir.path());
    assert!(files.len() >= 3, "{files:?}");
    crate::test_files::assert_none_holds(&files, TOKEN);
}
