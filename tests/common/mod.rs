//! What the end-to-end tests share: the real `relay` binary, bounded waits, child processes
//! that die with the test, a daemon with its state dir and CLI, and the tools outside Cargo
//! some tests need. Each test binary uses a part of it.
#![allow(dead_code)]

pub mod history;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Reads a child's first stdout line, its ready line `listening on ADDR`: the address, or
/// the line as it was (empty when the child died first).
pub fn listening_on(child: &mut Child) -> Result<String, String> {
    use std::io::BufRead as _;
    let mut first = String::new();
    let _ =
        std::io::BufReader::new(child.stdout.take().expect("a piped stdout")).read_line(&mut first);
    match first.trim().strip_prefix("listening on ") {
        Some(addr) => Ok(addr.to_string()),
        None => Err(first),
    }
}

/// Starts `relay serve --listen LISTEN ARGS` on the store `db` (as `RELAY_DB`), its stderr to
/// `stderr`: the child and its ready line's address (`scheme://host:port`).
pub fn serve(listen: &str, db: &str, args: &[&str], stderr: Stdio) -> (Child, String) {
    let mut child = relay()
        .args(["serve", "--listen", listen])
        .args(args)
        .env("RELAY_DB", db)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start relay serve");
    let base = listening_on(&mut child).unwrap_or_else(|first| panic!("first line: {first:?}"));
    (child, base)
}

/// `relay todo add --endpoint E --queue Q --title T EXTRA` on the store `db`: as `run_db`.
pub fn todo_add(
    db: &str,
    endpoint: &str,
    queue: &str,
    title: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let add = [
        "todo",
        "add",
        "--endpoint",
        endpoint,
        "--queue",
        queue,
        "--title",
        title,
    ];
    run_db(db, &[&add[..], extra].concat())
}

/// A config table `[table]` naming an MCP server at `url`, its bearer token the variable `var`
/// of `env_file`.
pub fn server_table(table: &str, url: &str, env_file: &str, var: &str) -> String {
    format!(
        "\n[{table}]\nurl = \"{url}\"\nenv_file = \"{env_file}\"\n\
         headers = {{ Authorization = \"Bearer ${{{var}}}\" }}\n"
    )
}

/// The lease source `queue.q` the end-to-end configs use: queue `work` at `url`, the bearer
/// token from `token.env`'s `TOKEN`.
pub fn queue_table(url: &str, heartbeat_interval: &str) -> String {
    server_table("queue.q", url, "token.env", "TOKEN")
        + &format!(
            "queue = \"work\"\nlease_ttl = \"1m\"\nheartbeat_interval = \"{heartbeat_interval}\"\n"
        )
}

/// A harness leased on `queue.q`: `agent.sh` checked by `check.sh`, its environment from
/// `agent.env`, then `extra` (its trigger, for one).
pub fn harness_table(name: &str, extra: &str) -> String {
    harness_table_on(name, "queue.q", extra)
}

/// [`harness_table`] leased on the source `lease` (e.g. `queue.ci`).
pub fn harness_table_on(name: &str, lease: &str, extra: &str) -> String {
    format!(
        r#"
[harness.{name}]
command = ["sh", "agent.sh"]
env_file = "agent.env"
lease = "{lease}"
success_check = ["sh", "check.sh"]
success_check_interval = "1s"
kill_grace = "2s"
{extra}
"#
    )
}

/// A JSON-RPC POST to an MCP endpoint at `url` under `token` (and the legacy `session`, if
/// any): the headers the fault tests' clients send, before the body.
pub fn mcp_post(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    session: Option<&str>,
) -> reqwest::RequestBuilder {
    let r = http
        .post(url)
        .bearer_auth(token)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    match session {
        Some(s) => r.header("mcp-session-id", s),
        None => r,
    }
}

/// The real `relay` binary, as a command to add arguments to.
pub fn relay() -> Command {
    Command::new(relay_bin())
}

/// A fresh, empty temp dir named for `tag`, removed when the handle drops (a test that fails
/// leaves nothing behind either: the panic unwinds through the drop).
pub fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("relay-{tag}-"))
        .tempdir()
        .expect("a temp dir")
}

/// Runs `relay ARGS` with `RELAY_DB=db`: exit code, stdout, stderr (both must be UTF-8).
pub fn run_db(db: &str, args: &[&str]) -> (i32, String, String) {
    let out = relay()
        .args(args)
        .env("RELAY_DB", db)
        .output()
        .expect("run relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

pub fn relay_bin() -> &'static str {
    env!("CARGO_BIN_EXE_relay")
}

/// Polls `f` until it returns `Some`, at most `bound`.
pub fn wait_for<T>(what: &str, bound: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < bound, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The content of a one-line file an agent writes with `echo … > file`, once the line is whole
/// (the shell creates the file before the line is in it).
pub fn line_in(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|t| t.ends_with('\n'))
}

/// A child process killed when the test ends, whatever happens.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Daemon {
    pub proc: Option<Proc>,
    pub config: PathBuf,
    pub state: PathBuf,
    pub log: PathBuf,
    pub extra: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl Daemon {
    pub fn start(dir: &Path, config: &Path) -> Daemon {
        Daemon::start_with(dir, config, &[])
    }

    pub fn start_with(dir: &Path, config: &Path, extra: &[&str]) -> Daemon {
        Daemon::start_env(dir, config, extra, &[])
    }

    /// A daemon with `env` set in its environment.
    pub fn start_env(dir: &Path, config: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let state = dir.join("state");
        let log = dir.join("daemon.log");
        let mut d = Daemon {
            proc: None,
            config: config.to_path_buf(),
            state,
            log,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        d.spawn();
        d
    }

    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("daemon log");
        let child = Command::new(relay_bin())
            .arg("daemon")
            .arg("--config")
            .arg(&self.config)
            .arg("--state-dir")
            .arg(&self.state)
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RELAY_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start relay daemon");
        self.proc = Some(Proc(child));
    }

    /// Waits (within a minute) for the daemon to end by itself, e.g. at its
    /// `RELAY_TEST_KILL_AT` step; its exit status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let p = self.proc.as_mut().expect("the daemon runs");
        let status = wait_for("the daemon to exit", Duration::from_secs(60), || {
            p.0.try_wait().expect("the daemon's status")
        });
        self.proc = None;
        status
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    pub fn cli(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(relay_bin())
            .args(args)
            .arg("--state-dir")
            .arg(&self.state)
            .output()
            .expect("run relay");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// The harness's newest closed run of a todo, once its record is written.
    pub fn closed_run(&self, harness: &str, todo: &str) -> Value {
        wait_for("the closed run", Duration::from_secs(30), || {
            self.runs(harness)
                .into_iter()
                .find(|r| r["todo_id"] == todo && r["outcome"] != "running")
        })
    }

    /// The lease deadline `relay describe` shows for the harness's attempt in flight, in ms.
    pub fn lease_deadline(&self, harness: &str) -> u64 {
        let (ok, out) = self.cli(&["describe", harness, "--json"]);
        assert!(ok, "{out}");
        let described: Value = serde_json::from_str(&out).expect("json");
        described[0]["relay"]["attempt"]["lease_deadline"]
            .as_str()
            .and_then(relay_core::time::parse_rfc3339)
            .unwrap_or_else(|| panic!("no lease deadline in {described}"))
    }

    /// The harness's run records, newest first.
    pub fn runs(&self, harness: &str) -> Vec<Value> {
        self.cli_array(&["runs", harness, "--json", "--limit", "1000"])
    }

    /// A `--json` command's answer, a JSON array; the command must succeed.
    pub fn cli_array(&self, args: &[&str]) -> Vec<Value> {
        let (ok, out) = self.cli(args);
        assert!(ok, "{out}");
        serde_json::from_str::<Value>(&out)
            .expect("json")
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    pub fn stop(&mut self) {
        if let Some(p) = self.proc.take() {
            let pid = p.0.id().to_string();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            let mut p = p;
            let _ = p.0.wait();
        }
    }
}

/// Every file under `dir`, recursively.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Whether a tool from outside Cargo is there; a missing one fails the test only when CI
/// requires it (`RELAY_REQUIRE_MCP_CLIENTS=1`), else the test says so and passes.
pub fn available(what: &str, present: bool, install: &str) -> bool {
    if present {
        return true;
    }
    assert!(
        std::env::var("RELAY_REQUIRE_MCP_CLIENTS").as_deref() != Ok("1"),
        "{what} is not installed and RELAY_REQUIRE_MCP_CLIENTS=1: run {install}"
    );
    eprintln!("SKIPPED: {what} is not installed; run {install} to include this test");
    false
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// libfaketime's preload library, from Debian's `libfaketime` (which `.ci/run` installs).
pub fn libfaketime() -> Option<PathBuf> {
    let lib = std::fs::read_dir("/usr/lib")
        .ok()?
        .flatten()
        .map(|e| e.path().join("faketime/libfaketime.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketime.so.1")])
        .find(|p| p.exists());
    if lib.is_none() {
        assert!(
            std::env::var("RELAY_REQUIRE_FAKETIME").as_deref() != Ok("1"),
            "libfaketime is not installed and RELAY_REQUIRE_FAKETIME=1: apt-get install libfaketime"
        );
        eprintln!("SKIPPED: libfaketime is not installed (apt-get install libfaketime)");
    }
    lib
}
