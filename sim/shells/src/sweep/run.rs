//! One seed's run: the world starts, the operator and the fault plan run side by side, the
//! faults heal, every todo must finish, then the nodes stop and the history is checked.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::runtime::{Handle, NodeHandle};
use relay_core::ledger::finished;
use relay_server::store::Store;

use super::checks::check;
use super::clock::true_ms;
use super::faults::{faults, heal};
use super::launcher::lock;
use super::world::{audit, ledger_config, list, operator, setup, start_daemon, start_server};
use super::{DAEMONS, SETTLE, SeedResult};

pub(super) async fn run(seed: u64, canary: bool, dir: tempfile::TempDir) -> SeedResult {
    relay_worker::daemon::canary::set(canary);
    let handle = Handle::current();
    let world = Arc::new(setup(dir).await);
    lock(&world.journal).server_offsets.insert(0);
    let server = start_server(&handle, &world, seed);
    let daemons: Vec<NodeHandle> = (0..DAEMONS)
        .map(|i| start_daemon(&handle, &world, i, seed))
        .collect();
    let operator_store = Store::open(&world.db, ledger_config())
        .await
        .expect("the operator opens the store");
    let start = true_ms();

    // The operator and the fault plan run side by side for the fault window.
    let added = Arc::new(Mutex::new(Vec::new()));
    let op = tokio::spawn(operator(
        operator_store.clone(),
        world.clone(),
        added.clone(),
    ));
    let auditor = tokio::spawn(audit(operator_store.clone(), world.journal.clone()));
    faults(&handle, &world, server.id(), &daemons).await;
    let _ = op.await;
    heal(server.id(), &daemons);

    // Liveness: every todo finishes once the faults are healed.
    let ids: Vec<String> = added.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let settle_until = tokio::time::Instant::now() + SETTLE;
    let mut live = false;
    while tokio::time::Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_secs(10)).await;
        if let Ok(todos) = list(&operator_store).await
            && todos.iter().filter(|t| ids.contains(&t.id)).all(finished)
        {
            live = true;
            break;
        }
    }
    auditor.abort();
    // Stop the daemons and the server before reading: no write lands during the checks. A
    // process still running ends here, with its daemon.
    let stopped = true_ms();
    for d in &daemons {
        handle.kill(d.id());
    }
    handle.kill(server.id());
    let sim_ms = true_ms().saturating_sub(start);
    let mut violations = Vec::new();
    if !live {
        violations.push(format!(
            "liveness: not every todo finished within {} min of the heal",
            SETTLE.as_secs() / 60
        ));
    }
    violations.append(&mut lock(&world.journal).violations);
    let (trace, attempts) = check(&operator_store, &world, &ids, stopped, &mut violations).await;
    let j = lock(&world.journal);
    SeedResult {
        trace,
        violations,
        sim_ms,
        procs: j.procs.len(),
        attempts,
        faults: j.faults.len(),
    }
}
