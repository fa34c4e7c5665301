//! One seed's world: the server node, the daemon nodes, the operator and the audit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle};
use relay_core::Millis;
use relay_core::ledger::{Actor, Answer, LedgerConfig, NewTodo, Op, Todo, TodoFilter};
use relay_core::time::{SECOND, WallClock};
use relay_server::server::{Server, ServerConfig};
use relay_server::store::{NewEndpoint, Store};
use relay_worker::daemon::{Daemon, DaemonOptions};
use relay_worker::lease::HyperTransport;

use super::clock::{SteppedClock, true_ms};
use super::launcher::{Shared, SimLauncher, lock};
use super::{DAEMONS, ENDPOINT, FAULT_WINDOW, HARNESSES, PORT, QUEUE, TODOS, daemon_ip, server_ip};

/// The state a seed's world shares with its nodes.
pub(super) struct World {
    pub(super) dir: tempfile::TempDir,
    pub(super) db: String,
    pub(super) journal: Shared,
    pub(super) server_clock: SteppedClock,
    pub(super) daemon_clocks: Vec<SteppedClock>,
    pub(super) token: String,
}

pub(super) fn ledger_config() -> LedgerConfig {
    let mut ledger = LedgerConfig::default();
    ledger.backoff.base = 5 * SECOND;
    ledger.backoff.cap = 60 * SECOND;
    ledger
}

pub(super) fn harness_config(url: &str) -> String {
    let mut text = format!(
        "[queue.work]\nurl = \"{url}\"\nenv_file = \"sweep.env\"\n\
         headers = {{ Authorization = \"Bearer ${{RELAY_TOKEN}}\" }}\nqueue = \"{QUEUE}\"\n\
         lease_ttl = \"1m\"\nheartbeat_interval = \"20s\"\n"
    );
    for h in 0..HARNESSES {
        text.push_str(&format!(
            "\n[harness.h{h}]\ncommand = [\"agent\"]\nschedule = \"@every 5s\"\n\
             lease = \"queue.work\"\nsuccess_check = [\"check\"]\n\
             success_check_interval = \"2s\"\nsuccess_check_timeout = \"30s\"\n\
             timeout = \"4m\"\nkeep_runs = 1000\n"
        ));
    }
    text
}

pub(super) async fn setup(dir: tempfile::TempDir) -> World {
    let db = format!("sqlite:{}", dir.path().join("relay.db").display());
    let store = Store::open(&db, ledger_config())
        .await
        .expect("the store opens");
    // The world's RNG, not `relay_server::server::new_bearer_token` (the OS's): a twin run
    // must vend the same token, or the traces differ.
    let mut bytes = [0u8; 24];
    thread_rng().fill(&mut bytes);
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    store
        .endpoint_create(
            true_ms(),
            NewEndpoint::every_tool_on(ENDPOINT, &token, QUEUE),
        )
        .await
        .expect("the endpoint is vended");
    // The daemons reach the server through a loopback sidecar on their own node (see
    // `sidecar`): a harness.toml may name plain http only on loopback.
    let url = format!("http://127.0.0.1:{PORT}/mcp/{ENDPOINT}");
    for i in 0..DAEMONS {
        let d = dir.path().join(format!("daemon-{i}"));
        std::fs::create_dir_all(&d).expect("the daemon's folder");
        std::fs::write(d.join("harness.toml"), harness_config(&url)).expect("config");
        std::fs::write(d.join("sweep.env"), format!("RELAY_TOKEN={token}\n")).expect("env");
    }
    World {
        dir,
        db,
        journal: Shared::default(),
        server_clock: SteppedClock::default(),
        daemon_clocks: (0..DAEMONS).map(|_| SteppedClock::default()).collect(),
        token,
    }
}

pub(super) fn start_server(handle: &Handle, world: &Arc<World>, seed: u64) -> NodeHandle {
    let w = world.clone();
    let starts = Arc::new(AtomicU64::new(0));
    handle
        .create_node()
        .name("server")
        .ip(server_ip())
        .init(move || {
            let (w, starts) = (w.clone(), starts.clone());
            async move {
                let n = starts.fetch_add(1, Ordering::Relaxed);
                let store = Store::open(&w.db, ledger_config())
                    .await
                    .expect("the server opens its store");
                let mut config = ServerConfig::for_listen((server_ip(), PORT).into());
                config.reap_interval = Duration::from_secs(5);
                config.requeue_interval = Duration::from_secs(5);
                // A fresh seed per start: a restarted server must not mint the tokens and
                // session ids of its earlier life again.
                let server = Server::new(
                    store,
                    Arc::new(w.server_clock.clone()),
                    config,
                    Some(seed.wrapping_mul(1_000).wrapping_add(n)),
                );
                let listener = tokio::net::TcpListener::bind(("0.0.0.0", PORT))
                    .await
                    .expect("the server binds");
                let _ = server.serve(listener, std::future::pending()).await;
            }
        })
        .build()
}

pub(super) fn start_daemon(handle: &Handle, world: &Arc<World>, i: usize, seed: u64) -> NodeHandle {
    let w = world.clone();
    let starts = Arc::new(AtomicU64::new(0));
    handle
        .create_node()
        .name(format!("daemon-{i}"))
        .ip(daemon_ip(i))
        .init(move || {
            let (w, starts) = (w.clone(), starts.clone());
            async move {
                let n = starts.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(sidecar());
                let dir = w.dir.path().join(format!("daemon-{i}"));
                let opts = DaemonOptions {
                    config: dir.join("harness.toml"),
                    state_dir: dir.join("state"),
                    host: format!("daemon-{i}"),
                    clock: Arc::new(w.daemon_clocks[i].clone()),
                    transport: Arc::new(HyperTransport::new()),
                    daemon_env: vec![("PATH".into(), "/usr/bin:/bin".into())],
                    seed: seed ^ (i as u64) << 32 ^ n << 48,
                    launcher: Arc::new(SimLauncher {
                        node: format!("daemon-{i}"),
                        journal: w.journal.clone(),
                    }),
                };
                match Daemon::start(opts).await {
                    Ok((daemon, _handle)) => daemon.run().await,
                    Err(e) => panic!("daemon-{i} did not start: {e}"),
                }
            }
        })
        .build()
}

/// A daemon node's loopback tunnel to the server (as an SSH tunnel or a local proxy would be):
/// each connection to 127.0.0.1:PORT on the node is copied to the server's address across the
/// simulated network, so partitions and clogs between the two nodes cut it.
pub(super) async fn sidecar() {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", PORT))
        .await
        .expect("the sidecar binds");
    while let Ok((mut local, _)) = listener.accept().await {
        tokio::spawn(async move {
            if let Ok(mut remote) = tokio::net::TcpStream::connect((server_ip(), PORT)).await {
                let _ = tokio::io::copy_bidirectional(&mut local, &mut remote).await;
            }
        });
    }
}

pub(super) async fn list(store: &Store) -> Result<Vec<Todo>, relay_core::Error> {
    let a = store
        .apply(Op::ListTodos {
            actor: Actor::operator("sweep"),
            filter: TodoFilter {
                limit: 10_000,
                ..TodoFilter::default()
            },
        })
        .await?;
    match a {
        Answer::Todos(t) => Ok(t),
        other => Err(relay_core::Error::internal(format!(
            "list answered {other:?}"
        ))),
    }
}

/// Adds [`TODOS`] todos over the fault window, cancels one now and then and retries dead
/// letters, straight on the store file (the server finds them with its pending scan).
pub(super) async fn operator(store: Store, world: Arc<World>, added: Arc<Mutex<Vec<String>>>) {
    let mut n = 0;
    let end = tokio::time::Instant::now() + FAULT_WINDOW;
    while tokio::time::Instant::now() < end {
        let pause = Duration::from_millis(thread_rng().gen_range(5_000..90_000));
        tokio::time::sleep(pause).await;
        let now = world.server_clock.now();
        let roll: u32 = thread_rng().gen_range(0..100);
        if n < TODOS && roll < 60 {
            n += 1;
            let max_attempts = thread_rng().gen_range(1..5);
            add(&store, now, n, max_attempts, &added).await;
            continue;
        }
        let Ok(todos) = list(&store).await else {
            continue;
        };
        if todos.is_empty() {
            continue;
        }
        let t = &todos[thread_rng().gen_range(0..todos.len())];
        let op = if roll < 75 {
            Op::Cancel {
                now,
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
            }
        } else if t.dead_letter() {
            Op::Retry {
                now,
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
            }
        } else {
            continue;
        };
        // Refusals (canceling a finished todo) are part of the game.
        let _ = store.apply(op).await;
    }
    // Whatever was not added yet is added now, so every seed works all of them.
    while n < TODOS {
        n += 1;
        add(&store, world.server_clock.now(), n, 3, &added).await;
    }
}

/// Adds todo number `n`, noting its id once the store acknowledged it.
pub(super) async fn add(
    store: &Store,
    now: Millis,
    n: usize,
    max_attempts: u32,
    added: &Mutex<Vec<String>>,
) {
    let id = format!("td_sweep{n:02}");
    let op = Op::AddTodo {
        now,
        endpoint: ENDPOINT.into(),
        new: NewTodo {
            id: id.clone(),
            queue: QUEUE.into(),
            title: format!("simulated todo {n}"),
            max_attempts: Some(max_attempts),
            ..NewTodo::default()
        },
    };
    if store.apply(op).await.is_ok() {
        added.lock().unwrap_or_else(|e| e.into_inner()).push(id);
    }
}

/// Reads every attempt every 20 s (simulated) while the world runs: a closed attempt must
/// never change again (closed exactly once; a late event is kept beside it, powerless).
pub(super) async fn audit(store: Store, journal: Shared) {
    let mut closed: BTreeMap<(String, u32), String> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_secs(20)).await;
        let Ok(todos) = list(&store).await else {
            continue;
        };
        for t in todos {
            let Ok(Answer::View(view)) = store
                .apply(Op::GetTodo {
                    actor: Actor::operator("sweep"),
                    id: t.id.clone(),
                    attempts_limit: 10_000,
                })
                .await
            else {
                continue;
            };
            for a in view.attempts.iter().filter(|a| !a.is_open()) {
                let now = format!(
                    "{:?} at {:?} by {:?}, summary {:?}",
                    a.outcome, a.ended_at, a.closed_by, a.summary
                );
                let key = (t.id.clone(), a.seq);
                match closed.get(&key) {
                    Some(was) if *was != now => lock(&journal).violations.push(format!(
                        "{} #{}: a closed attempt changed: {was} became {now}",
                        t.id, a.seq
                    )),
                    Some(_) => {}
                    None => {
                        closed.insert(key, now);
                    }
                }
            }
        }
    }
}
