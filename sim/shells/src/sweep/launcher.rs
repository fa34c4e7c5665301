//! The processes: a launcher that stands in for fork and exec behind the daemon's `Launcher`,
//! and the journal of what each process did and when.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::rand::{Rng, thread_rng};
use relay_core::Millis;
use relay_core::relay::{ExitStatus, Input, Signal};
use relay_worker::runner::{
    AgentSpec, CheckSpec, Control, Launched, Launcher, RunnerError, StartError,
};

use super::clock::true_ms;

/// What one simulated process did.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct ProcRecord {
    pub(super) node: String,
    pub(super) kind: &'static str,
    pub(super) todo: String,
    pub(super) seq: u32,
    pub(super) start: Millis,
    /// The first signal the daemon sent it.
    pub(super) signaled: Option<Millis>,
    pub(super) end: Option<Millis>,
    pub(super) exit: Option<String>,
}

/// Everything a seed's world records for the checks and the trace.
#[derive(Default)]
pub(super) struct Journal {
    pub(super) procs: Vec<ProcRecord>,
    /// Every offset a server clock has had (so the checks can map its stamps to true time).
    pub(super) server_offsets: BTreeSet<i64>,
    pub(super) faults: Vec<String>,
    /// Found while the world ran (the auditor's).
    pub(super) violations: Vec<String>,
}

pub(super) type Shared = Arc<Mutex<Journal>>;

pub(super) fn lock(j: &Shared) -> std::sync::MutexGuard<'_, Journal> {
    j.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The processes of one daemon node, modelled: an agent works for a while and exits 0 or 1,
/// or hangs until killed; some ignore SIGTERM. A check answers from the agent's exit, now and
/// then "not yet" (75) first. Every draw comes from madsim's seeded generator.
pub(super) struct SimLauncher {
    pub(super) node: String,
    pub(super) journal: Shared,
}

pub(super) fn env_var(spec_env: &relay_core::relay::ProcessEnv, name: &str) -> String {
    spec_env
        .relay
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// A simulated process's handle: signals reach its wait loop, and the first is noted.
pub(super) struct SimControl {
    pub(super) tx: tokio::sync::mpsc::UnboundedSender<Signal>,
    pub(super) journal: Shared,
    pub(super) index: usize,
}

impl Control for SimControl {
    fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        let now = true_ms();
        if let Some(p) = lock(&self.journal).procs.get_mut(self.index) {
            p.signaled.get_or_insert(now);
        }
        let _ = self.tx.send(signal);
        Ok(())
    }
}

/// Notes the process's end when its wait ends or is dropped (the daemon aborted it, or its
/// node was killed: a crashed machine takes its children with it).
pub(super) struct EndGuard {
    pub(super) journal: Shared,
    pub(super) index: usize,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        let now = true_ms();
        let mut j = lock(&self.journal);
        if let Some(p) = j.procs.get_mut(self.index)
            && p.end.is_none()
        {
            p.end = Some(now);
            p.exit = Some("dropped".into());
        }
    }
}

/// Which of a run's processes a launch stands for.
#[derive(Clone, Copy, Debug)]
enum Proc {
    Agent { run_id: u64 },
    Check { run_id: u64 },
}

impl Proc {
    fn kind(self) -> &'static str {
        match self {
            Proc::Agent { .. } => "agent",
            Proc::Check { .. } => "check",
        }
    }

    /// What the daemon hears when it ends with `exit`.
    fn exited(self, exit: ExitStatus) -> Input {
        match self {
            Proc::Agent { run_id } => Input::ProcessExited {
                run_id,
                exit,
                summary_file: Some(br#"{"summary":"simulated work"}"#.to_vec()),
            },
            Proc::Check { run_id } => Input::CheckExited {
                run_id,
                exit,
                output_tail: Vec::new(),
            },
        }
    }
}

impl SimLauncher {
    fn start(
        &self,
        proc: Proc,
        env: &relay_core::relay::ProcessEnv,
        work: Duration,
        ignores_term: bool,
        exit: ExitStatus,
    ) -> Launched {
        let index = {
            let mut j = lock(&self.journal);
            j.procs.push(ProcRecord {
                node: self.node.clone(),
                kind: proc.kind(),
                todo: env_var(env, "HARNESS_TODO_ID"),
                seq: env_var(env, "HARNESS_ATTEMPT_SEQ").parse().unwrap_or(0),
                start: true_ms(),
                signaled: None,
                end: None,
                exit: None,
            });
            j.procs.len() - 1
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let guard = EndGuard {
            journal: self.journal.clone(),
            index,
        };
        let wait = Box::pin(async move {
            let guard = guard;
            let mut deadline = tokio::time::Instant::now() + work;
            let mut exit = exit;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => break,
                    s = rx.recv() => match s {
                        Some(Signal::Kill) | None => { exit = ExitStatus::Signal(9); break; }
                        Some(_) if ignores_term => {}
                        Some(_) => {
                            // A graceful stop: gone within half a second.
                            exit = ExitStatus::Signal(15);
                            deadline = deadline.min(tokio::time::Instant::now() + Duration::from_millis(500));
                        }
                    },
                }
            }
            {
                let mut j = lock(&guard.journal);
                if let Some(p) = j.procs.get_mut(guard.index) {
                    p.end = Some(true_ms());
                    p.exit = Some(format!("{exit:?}"));
                }
            }
            proc.exited(exit)
        });
        Launched {
            control: Arc::new(SimControl {
                tx,
                journal: self.journal.clone(),
                index,
            }),
            wait,
        }
    }
}

impl Launcher for SimLauncher {
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError> {
        let mut rng = thread_rng();
        let roll: u32 = rng.gen_range(0..100);
        let work = Duration::from_millis(rng.gen_range(2_000..150_000));
        let ignores_term = rng.gen_range(0..100) < 25;
        let (exit, work) = match roll {
            0..60 => (ExitStatus::Code(0), work),
            60..88 => (ExitStatus::Code(1), work),
            // Hangs: only its timeout or a lost lease ends it.
            _ => (ExitStatus::Code(0), Duration::from_secs(24 * 3600)),
        };
        let proc = Proc::Agent {
            run_id: spec.run_id,
        };
        Ok(self.start(proc, &spec.env, work, ignores_term, exit))
    }

    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError> {
        let mut rng = thread_rng();
        let agent_ok = env_var(&spec.env, "HARNESS_AGENT_EXIT") == "0";
        let exit = match rng.gen_range(0..100) {
            0..20 => ExitStatus::Code(75),
            _ if agent_ok => ExitStatus::Code(0),
            _ => ExitStatus::Code(1),
        };
        let work = Duration::from_millis(rng.gen_range(50..3_000));
        let proc = Proc::Check {
            run_id: spec.run_id,
        };
        Ok(self.start(proc, &spec.env, work, false, exit))
    }
}
