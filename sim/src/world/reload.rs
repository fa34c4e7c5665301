//! The reload fault: a host's config file changes (a new heartbeat interval and schedule) and
//! its daemon reloads it by the daemon's rules. `relay_core::fleet::plan_reload` decides what
//! stops and what stays, the machine's `reconfigure` keeps an attempt in flight on the settings
//! it started with until it settles, and `Timetable::reschedule` starts a changed schedule
//! again. A host that is down reads the new config when it restarts.

use relay_core::config::{ConfigDiff, Schedule};
use relay_core::fleet::plan_reload;
use relay_core::relay::{Reconfigured, StopReason};

use super::*;

impl World {
    pub(super) fn reload(&mut self, r: usize, config: HostConfig) {
        let before = self.settings(r);
        self.hosts[r].config = config;
        let after = self.settings(r);
        // The schedule, on the host's wall clock: a changed one starts again from now.
        let wall = self.hosts[r].wall.read(self.now);
        let next = self.timetables[r].next();
        let every = Schedule::Every(config.fire_every);
        self.timetables[r].reschedule(Some(every), wall);
        if let Some(first) = self.timetables[r].next().filter(|n| Some(*n) != next) {
            self.count("reload_rescheduled");
            self.hosts[r].tick_gen += 1;
            let generation = self.hosts[r].tick_gen;
            let at = self.hosts[r].wall.when(first).max(self.now + 1);
            self.schedule(
                at,
                Ev::Tick {
                    relay: r,
                    generation,
                },
            );
        }
        let Some(relay) = self.hosts[r].relay.as_ref() else {
            return;
        };
        let name = before.harness.clone();
        let members = [(name.clone(), relay.settings().lease.clone())];
        let mut diff = ConfigDiff::default();
        if before != after {
            diff.harnesses.changed.push(name.clone());
        }
        let plan = plan_reload(&members, &[name], &diff);
        for _ in &plan.stop {
            let reason = StopReason::HarnessRemoved;
            self.feed(r, Input::StopRequested { reason });
        }
        for _ in &plan.keep {
            let Some(relay) = self.hosts[r].relay.as_mut() else {
                return;
            };
            match relay.reconfigure(after.clone()) {
                Reconfigured::AfterRun { .. } => {
                    self.count("reload_waits");
                    self.hosts[r].reload_waiting = true;
                }
                Reconfigured::Now => self.count("reload_applied"),
                Reconfigured::Unchanged => {}
            }
            self.drain(r);
        }
    }

    /// After the machine's commands: a reload's settings wait only for the attempt that started
    /// under the old ones. Between attempts the machine runs on the config the host reads now.
    pub(super) fn check_reloaded(&mut self, r: usize) {
        let h = &self.hosts[r];
        let Some(relay) = h.relay.as_ref() else {
            return;
        };
        let current = relay.settings().heartbeat_interval == h.config.heartbeat_interval;
        if h.reload_waiting && current {
            self.hosts[r].reload_waiting = false;
            self.count("reload_settled");
        } else if !current && !relay.in_flight() {
            let detail = format!(
                "relay {r} is idle on heartbeat_interval {} while its config says {}",
                relay.settings().heartbeat_interval,
                h.config.heartbeat_interval
            );
            self.violate(Kind::Correctness, "reload_applies", detail);
        }
    }
}
