//! The fault plan: partitions, clogs, latency, kills and restarts, clock steps; then the heal.

use std::sync::atomic::Ordering;
use std::time::Duration;

use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle};

use super::FAULT_WINDOW;
use super::launcher::lock;
use super::world::World;

/// The fault plan: one fault at a time, each healed before the next, for the fault window.
pub(super) async fn faults(
    handle: &Handle,
    world: &World,
    server: madsim::task::NodeId,
    daemons: &[NodeHandle],
) {
    let net = NetSim::current();
    let end = tokio::time::Instant::now() + FAULT_WINDOW;
    while tokio::time::Instant::now() < end {
        let mut rng = thread_rng();
        let gap = Duration::from_millis(rng.gen_range(1_000..60_000));
        let hold = Duration::from_millis(rng.gen_range(500..150_000));
        let d = rng.gen_range(0..daemons.len());
        let daemon = daemons[d].id();
        let kind = rng.gen_range(0..7);
        drop(rng);
        tokio::time::sleep(gap).await;
        let what = match kind {
            0 => {
                net.clog_link(daemon, server);
                net.clog_link(server, daemon);
                tokio::time::sleep(hold).await;
                net.unclog_link(daemon, server);
                net.unclog_link(server, daemon);
                format!("partition daemon-{d} from the server for {hold:?}")
            }
            1 => {
                net.clog_node(server);
                tokio::time::sleep(hold).await;
                net.unclog_node(server);
                format!("clog the server for {hold:?}")
            }
            2 => {
                net.update_config(|c| {
                    c.send_latency = Duration::from_millis(20)..Duration::from_millis(50);
                });
                tokio::time::sleep(hold).await;
                net.update_config(|c| {
                    c.send_latency = Duration::from_millis(1)..Duration::from_millis(10);
                });
                format!("slow network for {hold:?}")
            }
            3 => {
                handle.kill(server);
                tokio::time::sleep(hold.min(Duration::from_secs(20))).await;
                handle.restart(server);
                format!(
                    "kill the server, restart after {:?}",
                    hold.min(Duration::from_secs(20))
                )
            }
            4 => {
                handle.kill(daemon);
                tokio::time::sleep(hold).await;
                handle.restart(daemon);
                format!("kill daemon-{d}, restart after {hold:?}")
            }
            5 => {
                let step = thread_rng().gen_range(-30_000i64..30_000);
                world.server_clock.offset.store(step, Ordering::Relaxed);
                lock(&world.journal).server_offsets.insert(step);
                format!("step the server's wall clock to {step:+} ms")
            }
            _ => {
                let step = thread_rng().gen_range(-3_600_000i64..3_600_000);
                world.daemon_clocks[d].offset.store(step, Ordering::Relaxed);
                format!("step daemon-{d}'s wall clock to {step:+} ms")
            }
        };
        lock(&world.journal).faults.push(what);
    }
}

/// Ends every fault: links and nodes unclogged, latency back to normal, every node running.
/// (A killed node is restarted by the plan itself before the next fault; restarting a running
/// one is not needed.) Clocks keep their steps: they are not faults to heal.
pub(super) fn heal(server: madsim::task::NodeId, daemons: &[NodeHandle]) {
    let net = NetSim::current();
    net.unclog_node(server);
    for d in daemons {
        net.unclog_node(d.id());
        net.unclog_link(d.id(), server);
        net.unclog_link(server, d.id());
    }
    net.update_config(|c| {
        c.send_latency = Duration::from_millis(1)..Duration::from_millis(10);
    });
}
