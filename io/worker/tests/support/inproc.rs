//! The whole system in one process for tests and benchmarks: the queue server on its own
//! runtime (a thread of its own, so its tasks never count as the daemon's), SQLite in a temp
//! dir, an endpoint, and a daemon config of `workers` leased harnesses whose agent is `argv`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use relay_core::ledger::{Answer, LedgerConfig, NewTodo, Op, TodoState, TokenHash};
use relay_core::time::WallClock;
use relay_server::server::{Server, ServerConfig, new_bearer_token};
use relay_server::store::{NewEndpoint, Store};
use relay_worker::clock::SystemClock;
use relay_worker::daemon::{Daemon, DaemonHandle, DaemonOptions};

pub struct System {
    pub dir: tempfile::TempDir,
    pub store: Store,
    pub url: String,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const VERBS: [&str; 6] = [
    "claim_next",
    "heartbeat",
    "complete",
    "fail",
    "release",
    "list_todos",
];

impl System {
    /// Starts the server on a thread with its own runtime; blocks until it listens.
    pub fn start() -> System {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = format!("sqlite:{}", dir.path().join("relay.db").display());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("server runtime");
            rt.block_on(async move {
                let store = Store::open(&db, LedgerConfig::default())
                    .await
                    .expect("store");
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                let addr = listener.local_addr().expect("addr");
                let clock = Arc::new(SystemClock);
                let server =
                    Server::new(store.clone(), clock, ServerConfig::for_listen(addr), None);
                ready_tx
                    .send((store, format!("http://{addr}")))
                    .expect("ready");
                let stopped = tokio::task::spawn_blocking(move || {
                    let _ = stop_rx.recv();
                });
                let _ = server
                    .serve(listener, async move {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        let (store, url) = ready_rx.recv().expect("the server starts");
        System {
            dir,
            store,
            url,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Vends the endpoint `work` and writes a config of `workers` harnesses running `argv`.
    pub async fn config(&self, workers: usize, argv: &[&str], extra: &str) -> PathBuf {
        let token = new_bearer_token().expect("token");
        self.store
            .endpoint_create(
                SystemClock.now(),
                NewEndpoint {
                    name: "work".into(),
                    token_hash: TokenHash::of(&token),
                    verbs: VERBS.map(String::from).to_vec(),
                    queues: None,
                },
            )
            .await
            .expect("endpoint");
        std::fs::write(self.path().join("token.env"), format!("TOKEN={token}\n")).expect("env");
        let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
        let mut text = format!(
            "[queue.q]\nurl = \"{}/mcp/work\"\nenv_file = \"token.env\"\n\
             headers = {{ Authorization = \"Bearer ${{TOKEN}}\" }}\nqueue = \"work\"\n",
            self.url
        );
        for n in 0..workers {
            text.push_str(&format!(
                "\n[harness.w{n}]\ncommand = [{}]\nlease = \"queue.q\"\nkeep_runs = 10000\n{extra}\n",
                argv.join(", ")
            ));
        }
        let path = self.path().join("harness.toml");
        std::fs::write(&path, text).expect("config");
        path
    }

    pub async fn daemon(&self, config: &Path) -> (Daemon, DaemonHandle) {
        self.daemon_with(config, Arc::new(relay_worker::runner::Processes))
            .await
    }

    /// A daemon whose agents and checks `launcher` starts.
    pub async fn daemon_with(
        &self,
        config: &Path,
        launcher: Arc<dyn relay_worker::runner::Launcher>,
    ) -> (Daemon, DaemonHandle) {
        let transport = relay_worker::lease::ReqwestTransport::new().expect("http client");
        Daemon::start(DaemonOptions {
            config: config.to_path_buf(),
            state_dir: self.path().join("state"),
            host: "test".into(),
            clock: Arc::new(SystemClock),
            transport: Arc::new(transport),
            daemon_env: std::env::vars().collect(),
            launcher,
            seed: 7,
        })
        .await
        .expect("the daemon starts")
    }

    pub async fn add(&self, n: usize) -> Vec<String> {
        let mut ids = Vec::new();
        for _ in 0..n {
            let todo = self
                .store
                .apply(Op::AddTodo {
                    now: SystemClock.now(),
                    endpoint: "work".into(),
                    new: NewTodo {
                        id: relay_server::server::new_todo_id().expect("id"),
                        queue: "work".into(),
                        title: "t".into(),
                        kind: None,
                        source: None,
                        payload: None,
                        work_order: None,
                        max_attempts: Some(3),
                        assignee: None,
                        ..NewTodo::default()
                    },
                })
                .await
                .and_then(Answer::todo)
                .expect("add");
            ids.push(todo.id);
        }
        ids
    }

    /// Whether the running daemon lists `harnesses` harnesses and every one's source session is
    /// verified (`describe` answers `supported`).
    pub async fn sessions_verified(&self, harnesses: usize) -> bool {
        let answer = relay_worker::daemon::control::request(
            &self.path().join("state"),
            &relay_worker::daemon::control::Request::Describe { harness: None },
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("describe");
        answer["harnesses"].as_array().is_some_and(|h| {
            h.len() == harnesses && h.iter().all(|h| h["source"]["session"] == "supported")
        })
    }

    /// How many todos are done.
    pub async fn done(&self) -> usize {
        // A count, not a list: a bench polls this while it measures, and decoding every done
        // todo took a tenth of the machine's CPU then.
        let counts = self.store.count_by_state().await.expect("count");
        counts
            .iter()
            .find(|(state, _)| state == TodoState::Done.as_str())
            .map_or(0, |(_, n)| usize::try_from(*n).expect("a count"))
    }
}

impl Drop for System {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
