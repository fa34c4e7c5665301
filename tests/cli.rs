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

fn run(args: &[&str]) -> (i32, String, String) {
    let out = relay().args(args).output().expect("run relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

#[test]
fn sim_replays_a_seed_and_prints_its_options_and_counts() {
    let (code, out, err) = run(&["sim", "--seed", "7", "--check-determinism"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("seed 7\n"), "{out}");
    assert!(
        out.contains("faults: ") && out.contains("counts: "),
        "{out}"
    );
    assert!(out.contains("same on a second run"), "{out}");
    let (_, again, _) = run(&["sim", "--seed", "7"]);
    let trace = |s: &str| s.lines().find(|l| l.starts_with("ok: ")).map(str::to_owned);
    assert_eq!(
        trace(&out).map(|l| l.replace(" (same on a second run)", "")),
        trace(&again)
    );
}

#[test]
fn a_caught_mutation_exits_one_with_a_repro_that_replays_it() {
    let (code, out, _) = run(&["sim", "--seeds", "50", "--mutation", "reaper-closes-twice"]);
    assert_eq!(code, 1, "{out}");
    let violation = out
        .lines()
        .find(|l| l.starts_with("VIOLATION (correctness)"))
        .expect(&out);
    let repro = out
        .lines()
        .find_map(|l| l.strip_prefix("repro: relay "))
        .expect(&out);
    let args: Vec<&str> = repro.split(' ').collect();
    let (code, replay, _) = run(&args);
    assert_eq!(code, 1);
    assert!(replay.lines().any(|l| l == violation), "{replay}");
}

#[test]
fn check_config_accepts_a_good_file_and_names_the_key_of_a_bad_one() {
    let dir = std::env::temp_dir().join(format!("relay-cli-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("harness.d")).unwrap();
    let main = dir.join("harness.toml");
    std::fs::write(
        &main,
        "[queue.ci]\nurl = \"http://127.0.0.1:7070/mcp/ci\"\nlease_ttl = \"5m\"\n\n\
         [harness.fixer]\ncommand = [\"./fix.sh\"]\nschedule = \"@every 5m\"\nlease = \"queue.ci\"\n",
    )
    .unwrap();
    let (code, out, err) = run(&["check-config", main.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok (1 harnesses, 1 queue sources"), "{out}");
    std::fs::write(
        dir.join("harness.d/10-bad.toml"),
        "[queue.slow]\nurl = \"http://127.0.0.1:7070/mcp/ci\"\nlease_ttl = \"5m\"\nheartbeat_interval = \"4m\"\n",
    )
    .unwrap();
    let (code, _, err) = run(&["check-config", main.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("heartbeat_interval") && err.contains("queue.slow"),
        "{err}"
    );
    let (code, _, err) = run(&["check-config", main.to_str().unwrap(), "--project"]);
    assert_ne!(code, 0);
    assert!(err.contains("queue.ci"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_saved_plan_replays_the_same_violation_and_a_shrunk_one_the_same_invariant() {
    let path = std::env::temp_dir().join(format!("relay-plan-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let m = ["--mutation", "server-skips-fence"];
    let (code, out, _) = run(&["sim", "--seeds", "50", m[0], m[1], "--save-plan", p]);
    assert_eq!(code, 1, "{out}");
    let violation = out
        .lines()
        .find(|l| l.starts_with("VIOLATION"))
        .expect(&out)
        .to_owned();
    assert!(
        out.contains(&format!("replay: relay sim --plan {p}")),
        "{out}"
    );
    let (code, replay, _) = run(&["sim", "--plan", p]);
    assert_eq!(code, 1, "{replay}");
    assert!(replay.lines().any(|l| l == violation), "{replay}");

    let (code, out, _) = run(&[
        "sim",
        "--seeds",
        "50",
        m[0],
        m[1],
        "--shrink",
        "--save-plan",
        p,
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("shrunk plan: "), "{out}");
    let (code, replay, _) = run(&["sim", "--plan", p]);
    assert_eq!(code, 1, "{replay}");
    assert!(
        replay.contains("VIOLATION (correctness) of stale_fence"),
        "{replay}"
    );

    std::fs::write(&path, "{\"x\": 1}").unwrap();
    let (code, _, err) = run(&["sim", "--plan", p]);
    assert_eq!(code, 2);
    assert!(
        err.contains("not a saved run") && err.lines().count() == 1,
        "{err}"
    );
    std::fs::remove_file(&path).unwrap();
}
