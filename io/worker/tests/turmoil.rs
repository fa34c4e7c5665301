//! The real queue server handler and the real lease client over a simulated network (turmoil):
//! the attempt machine on host `client` drives a `LeaseClient` over `HyperTransport` to the
//! `Server` router on host `server`, whose store is SQLite in memory. Processes are simulated
//! (an agent "runs" for a fixed simulated time); every clock (the server's lease expiry, the
//! relay's deadlines and timers) is turmoil's simulated time, so nothing sleeps for real. The
//! seed is fixed: each run is the same run.
//!
//! - a report retried through a blip is accepted exactly once;
//! - a partition longer than the TTL ends in lease loss and no report;
//! - a lost response does not produce a second attempt.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use relay_core::Millis;
use relay_core::config::{Secret, parse_env_file};
use relay_core::ledger::{
    Actor, Answer, Attempt, LedgerConfig, NewTodo, Op, Outcome, TodoState, TodoView, TokenHash,
};
use relay_core::mcp::client::EraChoice;
use relay_core::relay::{
    Command, ExitStatus, Input, LeaseError, Relay, RelayOutcome, ReportVerb, RunOutcome, RunRecord,
    Signal,
};
use relay_core::testing::relay::{is_report, records, settings, t0};
use relay_core::time::WallClock;
use relay_core::time::{Now, SECOND};
use relay_server::server::{Server, ServerConfig};
use relay_server::store::{NewEndpoint, Store};
use relay_worker::lease::{HyperTransport, LeaseClient};
use serde_json::Value;
use tokio::sync::mpsc;

const BEARER: &str = "Bearer sim-bearer-token-0123456789";
const URL: &str = "http://server:8080/mcp/e1";
const TODO: &str = "td_sim";
/// The relay's lease: a minute, with a heartbeat every 20 s.
const TTL: Millis = 60 * SECOND;
/// A wait that never ends within a simulation.
const DAY: Millis = 86_400 * SECOND;
/// Each lease request gives up after this long (the client's own bound, made short).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The server's and the relay's "now": the epoch plus turmoil's simulated elapsed time.
#[derive(Clone, Copy, Debug)]
struct SimClock;

impl WallClock for SimClock {
    fn now(&self) -> Millis {
        let elapsed = turmoil::sim_elapsed().unwrap_or_default().as_millis();
        t0() + u64::try_from(elapsed).unwrap_or(u64::MAX)
    }
}

fn now() -> Millis {
    SimClock.now()
}

fn sleep_ms(ms: Millis) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_millis(ms))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------
// The server host
// ---------------------------------------------------------------------------------------------

/// What reached the server: the tool name of every `tools/call`, with the time it arrived.
#[derive(Clone, Default)]
struct Tap(Arc<Mutex<Vec<(Millis, String)>>>);

impl Tap {
    /// When each `tool` call arrived.
    fn arrivals(&self, tool: &str) -> Vec<Millis> {
        lock(&self.0)
            .iter()
            .filter(|(_, t)| t == tool)
            .map(|(at, _)| *at)
            .collect()
    }
    fn calls(&self, tool: &str) -> usize {
        self.arrivals(tool).len()
    }
    fn reports(&self) -> usize {
        self.calls("complete") + self.calls("fail") + self.calls("release")
    }
}

/// What the server does to the answer of a call, after the handler applied it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// The answer to the first `complete` or `fail` is lost: the server's side of the link
    /// goes dark (one way) as the handler returns, and comes back a second later.
    LoseFirstReportAnswer,
}

/// The SQLite store, an endpoint `e1` with every drain verb and one todo in queue `ci`.
fn ledger(rt: &tokio::runtime::Runtime, max_attempts: u32) -> Store {
    rt.block_on(async {
        let store = Store::open("sqlite::memory:", LedgerConfig::default())
            .await
            .expect("store");
        let token = BEARER.trim_start_matches("Bearer ");
        store
            .endpoint_create(
                t0(),
                NewEndpoint {
                    name: "e1".into(),
                    token_hash: TokenHash::of(token),
                    verbs: ["claim_next", "heartbeat", "complete", "fail", "release"]
                        .map(String::from)
                        .to_vec(),
                    queues: None,
                },
            )
            .await
            .expect("endpoint");
        store
            .apply(Op::AddTodo {
                now: t0(),
                endpoint: "e1".into(),
                new: NewTodo {
                    id: TODO.into(),
                    queue: "ci".into(),
                    title: "CI red on main".into(),
                    max_attempts: Some(max_attempts),
                    ..NewTodo::default()
                },
            })
            .await
            .expect("todo");
        store
    })
}

fn todo_view(rt: &tokio::runtime::Runtime, store: &Store) -> TodoView {
    let get = Op::GetTodo {
        actor: Actor::cli(),
        id: TODO.into(),
        attempts_limit: 100,
    };
    rt.block_on(store.apply(get))
        .and_then(Answer::view)
        .expect("the todo")
}

/// The real router behind a tap that notes each tool call (and applies `fault`), served on
/// turmoil's listener; the reaper and the requeue sweep every 5 s of simulated time.
fn serve(sim: &mut turmoil::Sim<'_>, store: &Store, tap: &Tap, fault: Fault) {
    let (store, tap) = (store.clone(), tap.clone());
    sim.host("server", move || {
        let config = ServerConfig::for_listen(SocketAddr::from(([0, 0, 0, 0], 8080)));
        let server = Server::new(store.clone(), Arc::new(SimClock), config, Some(7));
        let tap = tap.clone();
        let lost = Arc::new(Mutex::new(false));
        let router = server.router().layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let (tap, lost) = (tap.clone(), lost.clone());
                async move { tapped(req, next, &tap, fault, &lost).await }
            },
        ));
        async move {
            let sweeper = server.clone();
            tokio::spawn(async move {
                loop {
                    sleep_ms(5 * SECOND).await;
                    sweeper.reap_once(now()).await.expect("reap");
                    sweeper.requeue_once(now()).await.expect("requeue");
                }
            });
            let listener = turmoil::net::TcpListener::bind("0.0.0.0:8080").await?;
            axum::serve(SimListener(listener), router).await?;
            Ok(())
        }
    });
}

/// Notes the tool of a `tools/call` as it arrives, hands the request on unchanged (the body is
/// buffered to be read; every body here is far below the server's 1 MiB limit), then applies
/// `fault` to the answer.
async fn tapped(req: Request, next: Next, tap: &Tap, fault: Fault, lost: &Mutex<bool>) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let rpc: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let tool = (rpc["method"] == "tools/call").then(|| {
        rpc["params"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    });
    if let Some(t) = &tool {
        lock(&tap.0).push((now(), t.clone()));
    } else if let Some(m) = rpc["method"].as_str() {
        // Other methods are noted by name with a prefix no tool has.
        lock(&tap.0).push((now(), format!("rpc:{m}")));
    }
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let report = matches!(tool.as_deref(), Some("complete" | "fail"));
    if fault == Fault::LoseFirstReportAnswer && report && !std::mem::replace(&mut *lock(lost), true)
    {
        turmoil::partition_oneway("server", "client");
        tokio::spawn(async {
            sleep_ms(SECOND).await;
            turmoil::repair_oneway("server", "client");
        });
    }
    response
}

#[path = "support/sim_listener.rs"]
mod sim_listener;
use sim_listener::SimListener;

// ---------------------------------------------------------------------------------------------
// The client host: the attempt machine, the real lease client, simulated processes
// ---------------------------------------------------------------------------------------------

/// How the simulated agent behaves, and what happens to the network around the attempt.
struct Script {
    /// The agent exits with this code after this long, unless signalled first.
    agent_exit: i32,
    agent_runs: Millis,
    /// Called with every command before the driver carries it out (fault injection).
    on_command: Box<dyn FnMut(&Command)>,
    /// How long the driver keeps listening after the run is recorded closed, so that any
    /// late lease call would still be sent and counted.
    linger: Millis,
    /// The lease client's `mcp_era` (`Auto` finds the modern era on our server).
    era: EraChoice,
}

/// Everything the machine asked for and was told, with the simulated time.
#[derive(Clone, Default)]
struct Trace(Arc<Mutex<TraceState>>);

#[derive(Default)]
struct TraceState {
    commands: Vec<(Millis, Command)>,
    inputs: Vec<(Millis, Input)>,
}

impl Trace {
    fn commands(&self) -> Vec<Command> {
        lock(&self.0)
            .commands
            .iter()
            .map(|(_, c)| c.clone())
            .collect()
    }
    /// When the first command `pick` selects was issued.
    fn first(&self, pick: fn(&Command) -> bool) -> Option<Millis> {
        lock(&self.0)
            .commands
            .iter()
            .find(|(_, c)| pick(c))
            .map(|(at, _)| *at)
    }
    fn inputs(&self) -> Vec<Input> {
        lock(&self.0)
            .inputs
            .iter()
            .map(|(_, i)| i.clone())
            .collect()
    }
    /// The run's last record.
    fn last_record(&self) -> RunRecord {
        records(&self.commands())
            .last()
            .map(|r| (*r).clone())
            .expect("a run record")
    }
    fn reports_sent(&self) -> Vec<ReportVerb> {
        self.commands()
            .iter()
            .filter_map(|c| match c {
                Command::SendReport { verb, .. } => Some(*verb),
                _ => None,
            })
            .collect()
    }
}

/// The harness the machine runs: the testing settings, with a one-minute lease on queue `ci`
/// and the header value among its secrets.
fn harness() -> relay_core::relay::HarnessSettings {
    let mut s = settings();
    s.queue = Some("ci".into());
    s.lease_ttl = TTL;
    s.heartbeat_interval = 20 * SECOND;
    s.secrets = vec![BEARER.into()];
    s
}

fn secret(value: &str) -> Secret {
    let vars = parse_env_file(&format!("V={value}")).expect("env line");
    vars.iter().next().expect("one var").1.clone()
}

/// The drive loop of `relay/mod.rs`: handle an input, drain the commands, sleep until the next
/// deadline. Lease calls run on tasks of their own through the real client and post their
/// inputs back; the agent is a task that posts its exit. Returns when the run has been recorded
/// closed for `script.linger`.
async fn drive(mut script: Script, trace: Trace) -> turmoil::Result {
    let transport =
        HyperTransport::with_dialer(|host, port| turmoil::net::TcpStream::connect((host, port)));
    let client = Arc::new(
        LeaseClient::new(
            "queue.ci",
            URL,
            vec![("Authorization".to_string(), secret(BEARER))],
            Arc::new(transport),
        )
        .with_timeout(REQUEST_TIMEOUT)
        .with_era(script.era),
    );
    let mut relay = Relay::new(harness(), 42, 1);
    let (tx, mut rx) = mpsc::unbounded_channel::<Input>();
    let caps = client.initialize().await.map_err(|e| e.to_string())?;
    tx.send(Input::CapabilitiesKnown(caps))?;
    tx.send(Input::Firing {
        trigger: "test".into(),
        within_hours: true,
    })?;
    let mut agent: Option<tokio::task::JoinHandle<()>> = None;
    let mut closed_at: Option<Millis> = None;
    loop {
        let input = {
            // The relay reads the world's one clock as both of its own (`Now::agreeing`).
            let deadline = relay.poll_timeout().map(|(at, _)| at.ms());
            let linger_end = closed_at.map(|at| at + script.linger);
            let wake = deadline.into_iter().chain(linger_end).min();
            let wait = wake.map(|at| at.saturating_sub(now()));
            tokio::select! {
                input = rx.recv() => input.ok_or("the input channel closed")?,
                () = sleep_ms(wait.unwrap_or(DAY)), if wait.is_some() => {
                    if linger_end.is_some_and(|end| now() >= end) {
                        break;
                    }
                    Input::TimerFired
                }
            }
        };
        let at = now();
        lock(&trace.0).inputs.push((at, input.clone()));
        relay
            .handle_input(Now::agreeing(at), input)
            .map_err(|e| format!("{e:?}"))?;
        while let Some(cmd) = relay.poll_command() {
            (script.on_command)(&cmd);
            lock(&trace.0).commands.push((at, cmd.clone()));
            match cmd {
                Command::SendClaimNext { .. }
                | Command::SendHeartbeat { .. }
                | Command::SendReport { .. } => {
                    let (client, tx) = (client.clone(), tx.clone());
                    tokio::spawn(async move {
                        let out = client.execute(&cmd).await.expect("a lease call");
                        for input in out.inputs() {
                            let _ = tx.send(input);
                        }
                    });
                }
                Command::Spawn { run_id, .. } => {
                    tx.send(Input::ProcessSpawned { run_id })?;
                    let (tx, runs, code) = (tx.clone(), script.agent_runs, script.agent_exit);
                    agent = Some(tokio::spawn(async move {
                        sleep_ms(runs).await;
                        let _ = tx.send(Input::ProcessExited {
                            run_id,
                            exit: ExitStatus::Code(code),
                            summary_file: None,
                        });
                    }));
                }
                Command::Signal { run_id, signal } => {
                    // The agent dies at once; a second signal finds it gone.
                    if let Some(task) = agent.take() {
                        task.abort();
                        let number = if signal == Signal::Term { 15 } else { 9 };
                        tx.send(Input::ProcessExited {
                            run_id,
                            exit: ExitStatus::Signal(number),
                            summary_file: None,
                        })?;
                    }
                }
                Command::RunCheck { run_id, .. } => tx.send(Input::CheckExited {
                    run_id,
                    exit: ExitStatus::Code(0),
                    output_tail: Vec::new(),
                })?,
                Command::WriteRunRecord { record } if record.relay_outcome.is_some() => {
                    closed_at = Some(at);
                }
                // Context files, records, events and warnings are kept in the trace only.
                _ => {}
            }
        }
    }
    // The network is whole again: had the machine sent anything late, it would have arrived.
    client.tools_list().await.map_err(|e| e.to_string())?;
    Ok(())
}

/// A simulation with a fixed seed, 10 ms ticks and room for a few simulated minutes.
fn sim<'a>() -> turmoil::Sim<'a> {
    turmoil::Builder::new()
        .rng_seed(7)
        .tick_duration(Duration::from_millis(10))
        .simulation_duration(Duration::from_secs(600))
        .build()
}

/// Runs `script` against the real server with `fault`; answers the trace, the todo with its
/// attempts, and the tool calls the server saw.
fn run(script: Script, fault: Fault, max_attempts: u32) -> (Trace, TodoView, Tap) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = ledger(&rt, max_attempts);
    let tap = Tap::default();
    let trace = Trace::default();
    let mut sim = sim();
    serve(&mut sim, &store, &tap, fault);
    let t = trace.clone();
    sim.client("client", drive(script, t));
    sim.run().expect("the simulation");
    let view = todo_view(&rt, &store);
    (trace, view, tap)
}

fn only_attempt(view: &TodoView) -> &Attempt {
    assert_eq!(view.attempts_total, 1, "one attempt: {:#?}", view.attempts);
    assert_eq!(view.attempts.len(), 1, "{:#?}", view.attempts);
    &view.attempts[0]
}

fn transport_failures(trace: &Trace, of: fn(&Input) -> Option<&LeaseError>) -> usize {
    trace
        .inputs()
        .iter()
        .filter_map(of)
        .filter(|e| **e == LeaseError::Transport)
        .count()
}

fn report_failure(i: &Input) -> Option<&LeaseError> {
    match i {
        Input::ReportFailed { error, .. } => Some(error),
        _ => None,
    }
}

fn heartbeat_failure(i: &Input) -> Option<&LeaseError> {
    match i {
        Input::HeartbeatFailed { error, .. } => Some(error),
        _ => None,
    }
}

/// Cuts client and server apart when the first report goes out; heals `blip` later.
fn blip_on_first_report(blip: Millis) -> Box<dyn FnMut(&Command)> {
    let mut done = false;
    Box::new(move |c| {
        if matches!(c, Command::SendReport { .. }) && !std::mem::replace(&mut done, true) {
            turmoil::partition("client", "server");
            tokio::spawn(async move {
                sleep_ms(blip).await;
                turmoil::repair("client", "server");
            });
        }
    })
}

/// An agent exiting `agent_exit` whose first report goes out into a 20 s partition: the run,
/// and the reports sent, asserted retried and all `verb`.
fn through_a_blip(
    agent_exit: i32,
    verb: ReportVerb,
    era: EraChoice,
) -> (Trace, TodoView, Tap, Vec<ReportVerb>) {
    let script = Script {
        agent_exit,
        agent_runs: 30 * SECOND,
        on_command: blip_on_first_report(20 * SECOND),
        linger: 30 * SECOND,
        era,
    };
    let (trace, view, tap) = run(script, Fault::None, 3);
    let sent = trace.reports_sent();
    assert!(sent.len() >= 2, "the report was retried: {sent:?}");
    assert!(sent.iter().all(|v| *v == verb), "{sent:?}");
    (trace, view, tap, sent)
}

// ---------------------------------------------------------------------------------------------
// The scenarios
// ---------------------------------------------------------------------------------------------

/// The agent succeeds; its `complete` goes out into a 20 s partition. Every try times out
/// (nothing reaches the server), the machine retries on its ReportRetry backoff, and the first
/// try after the heal is accepted: the server sees one `complete`, the ledger one attempt
/// closed `completed`, the relay records `completed`.
#[test]
fn a_completion_retried_through_a_blip_is_accepted_exactly_once() {
    completion_through_a_blip(EraChoice::Auto);
}

/// The same with the lease client forced to the legacy era: the same calls, in a session.
#[test]
fn a_completion_retried_through_a_blip_is_accepted_exactly_once_in_the_legacy_era() {
    completion_through_a_blip(EraChoice::Legacy);
}

fn completion_through_a_blip(era: EraChoice) {
    let (trace, view, tap, sent) = through_a_blip(0, ReportVerb::Complete, era);
    // Our server speaks the modern era: the probe finds it, and no session is made; forced
    // legacy, the client initializes and never probes.
    let modern = era == EraChoice::Auto;
    assert_eq!(tap.calls("rpc:server/discover"), usize::from(modern));
    assert_eq!(tap.calls("rpc:initialize"), usize::from(!modern));
    assert_eq!(tap.calls("rpc:subscriptions/listen"), 0);
    assert_eq!(
        transport_failures(&trace, report_failure),
        sent.len() - 1,
        "every try but the last failed on the transport"
    );
    assert_eq!(
        tap.calls("complete"),
        1,
        "only the try after the heal arrived"
    );
    assert_eq!(tap.reports(), 1);
    let first_sent = trace.first(is_report).expect("a report");
    assert!(tap.arrivals("complete")[0] >= first_sent + 20 * SECOND);

    let a = only_attempt(&view);
    assert_eq!(a.outcome, Some(Outcome::Completed));
    assert_eq!(view.todo.state, TodoState::Done);

    let record = trace.last_record();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Completed));
    assert_eq!(record.outcome, RunOutcome::Success);
}

/// The same blip around a `fail` (the agent exits 1): accepted once, the todo waits for its
/// retry, the relay records `failed`.
#[test]
fn a_failure_retried_through_a_blip_is_accepted_exactly_once() {
    let (trace, view, tap, _) = through_a_blip(1, ReportVerb::Fail, EraChoice::Auto);
    assert_eq!(tap.calls("fail"), 1);
    assert_eq!(tap.reports(), 1);

    let a = only_attempt(&view);
    assert_eq!(a.outcome, Some(Outcome::Failed));
    assert!(matches!(
        view.todo.state,
        TodoState::Failed | TodoState::Pending
    ));

    let record = trace.last_record();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Failed));
    assert_eq!(record.outcome, RunOutcome::Failed);
}

/// 10 s into a long agent run the client is cut off for two TTLs. Heartbeats time out; the
/// relay's own deadline (last good heartbeat + TTL) fires, the agent is stopped, and no report
/// is ever sent — the server sees none, even after the heal, and its reaper closes the
/// attempt `reaped`. The relay records `lease_lost`.
#[test]
fn a_partition_longer_than_the_ttl_ends_in_lease_loss_and_no_report() {
    let mut cut = false;
    let script = Script {
        agent_exit: 0,
        agent_runs: 10 * TTL,
        on_command: Box::new(move |c| {
            if matches!(c, Command::Spawn { .. }) && !std::mem::replace(&mut cut, true) {
                tokio::spawn(async {
                    sleep_ms(10 * SECOND).await;
                    turmoil::partition("client", "server");
                    sleep_ms(2 * TTL).await;
                    turmoil::repair("client", "server");
                });
            }
        }),
        // Past the heal, and then some: a report sent late would arrive.
        linger: 2 * TTL,
        era: EraChoice::Auto,
    };
    let (trace, view, tap) = run(script, Fault::None, 3);

    let stopped = trace
        .first(|c| {
            matches!(
                c,
                Command::Signal {
                    signal: Signal::Term,
                    ..
                }
            )
        })
        .expect("the agent was stopped");
    assert!(trace.reports_sent().is_empty(), "no report was sent");
    assert_eq!(tap.reports(), 0, "no report reached the server");
    assert!(
        transport_failures(&trace, heartbeat_failure) >= 1,
        "heartbeats failed in the partition"
    );

    let record = trace.last_record();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::LeaseLost));

    let a = only_attempt(&view);
    assert!(
        stopped <= a.lease_expires_at,
        "the relay stopped the agent by its own deadline, before the server's lease expired"
    );
    assert_eq!(
        a.outcome,
        Some(Outcome::Reaped),
        "the server's reaper closed it"
    );
    assert_eq!(view.todo.state, TodoState::Pending);
}

/// The server applies the first `complete` but its answer is lost (the server's side of the
/// link goes dark for a second as the handler returns). The client times out and retries; the
/// retry is answered as a replay of the fenced report. The server saw two `complete` calls,
/// the ledger holds one attempt, closed `completed`, and the relay records `completed`.
#[test]
fn a_lost_report_answer_does_not_produce_a_second_attempt() {
    let script = Script {
        agent_exit: 0,
        agent_runs: 30 * SECOND,
        on_command: Box::new(|_| {}),
        linger: 30 * SECOND,
        era: EraChoice::Legacy,
    };
    let (trace, view, tap) = run(script, Fault::LoseFirstReportAnswer, 3);

    assert_eq!(trace.reports_sent().len(), 2, "one report, one retry");
    assert_eq!(transport_failures(&trace, report_failure), 1);
    assert_eq!(tap.calls("complete"), 2, "both reached the server");
    assert_eq!(tap.calls("claim_next"), 1);

    let a = only_attempt(&view);
    assert_eq!(a.outcome, Some(Outcome::Completed));
    assert_eq!(
        a.ended_at,
        Some(tap.arrivals("complete")[0]),
        "the first call closed the attempt; the retry changed nothing"
    );
    assert_eq!(view.todo.state, TodoState::Done);

    let record = trace.last_record();
    assert_eq!(record.relay_outcome, Some(RelayOutcome::Completed));
}
