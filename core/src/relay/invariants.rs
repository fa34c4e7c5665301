//! The attempt machine's invariants over what it is told and what it says, one implementation
//! each, checked by the property tests (core/src/testing/relay) and by the simulator (sim/) on
//! every input and command. A [`Monitor`] watches one machine (across restarts, as run ids go on
//! from the journal): it learns each run's
//! lease token from the claim answers it sees, and then holds every command to:
//!
//! - **token_stays_out**: a lease token is shown in no command (a lease call carries its own
//!   run's token as a redacted value, never another run's);
//! - **nothing_after_close**: once a run's final record is written, no command names that run;
//! - **silent_after_lease_loss**: no heartbeat or report goes out for a run whose lease is lost.
//!   The lease is judged from what the server answered, never from the deadline the machine
//!   computes: it runs the lease's ttl from the send time of the claim or heartbeat the server
//!   last accepted, and is lost at that instant or when the server answers a heartbeat or report
//!   with a lease loss (`conflict`, `not_found`). A heartbeat refused once the report is out is
//!   no loss by itself (the report may have closed the attempt): the report's own answer decides,
//!   and no heartbeat may follow it;
//! - **one_outcome_per_claim**: a run records at most one relay outcome, and (at [`finish`],
//!   once the world is healed) every fenced run records exactly one.
//!
//! [`finish`]: Monitor::finish

use std::collections::{BTreeMap, BTreeSet};

use super::{Command, Input, RequestId, RunOutcome};
use crate::time::{Millis, Mono};

/// A broken invariant: its name (as above) and what broke it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breach {
    /// The invariant's name.
    pub invariant: &'static str,
    /// What happened, for a person reading a failed run.
    pub detail: String,
}

/// Watches one machine; see the module doc.
#[derive(Clone, Debug)]
pub struct Monitor {
    /// The lease's ttl, as the machine asks it of the server.
    ttl: Millis,
    /// The monotonic time of the step being watched (its input's).
    now: Mono,
    /// Lease calls sent and not yet answered, by request: the run and the send time.
    sent: BTreeMap<RequestId, (u64, Mono)>,
    /// Each fenced run's lease, as the server's answers tell it.
    leases: BTreeMap<u64, Lease>,
    /// Lease tokens handed to this machine, by run.
    tokens: BTreeMap<u64, String>,
    /// The same tokens, indexed for one pass over a command's text.
    index: TokenIndex,
    /// The text of the command being checked (one buffer, reused).
    text: String,
    closed: BTreeSet<u64>,
    outcomes: BTreeMap<u64, u32>,
}

/// One run's lease, as the server's answers tell it (see the module doc).
#[derive(Clone, Copy, Debug)]
struct Lease {
    until: Mono,
    lost: bool,
    reported: bool,
    /// A heartbeat was refused after the report went out.
    disputed: bool,
}

impl Monitor {
    /// A monitor for a machine that asks for leases of `lease_ttl`.
    pub fn new(lease_ttl: Millis) -> Monitor {
        Monitor {
            ttl: lease_ttl,
            now: Mono::default(),
            sent: BTreeMap::new(),
            leases: BTreeMap::new(),
            tokens: BTreeMap::new(),
            index: TokenIndex::default(),
            text: String::new(),
            closed: BTreeSet::new(),
            outcomes: BTreeMap::new(),
        }
    }

    /// The lease tokens this machine was handed, by run.
    pub fn tokens(&self) -> &BTreeMap<u64, String> {
        &self.tokens
    }

    /// Notes an input, at the machine's monotonic `now`, before the machine handles it (a claim
    /// answer hands over a token and a lease, a heartbeat's answer extends or ends it). Only the
    /// first answer to a request counts: a stale replay hands over nothing new.
    pub fn input(&mut self, now: Mono, input: &Input) {
        self.now = now;
        for lease in self.leases.values_mut() {
            lease.lost |= now >= lease.until;
        }
        let (request, lease_loss) = match input {
            Input::ClaimAnswered { request, claim } => {
                if let Some((run, at)) = self.sent.remove(request)
                    && let Some(token) = &claim.lease_token
                {
                    self.index.insert(run, token.expose());
                    self.tokens.insert(run, token.expose().to_string());
                    let until = at + self.ttl;
                    let lease = Lease {
                        until,
                        lost: now >= until,
                        reported: false,
                        disputed: false,
                    };
                    self.leases.insert(run, lease);
                }
                return;
            }
            Input::HeartbeatOk { request } => {
                if let Some((run, at)) = self.sent.remove(request)
                    && let Some(lease) = self.leases.get_mut(&run)
                    && !lease.lost
                {
                    lease.until = lease.until.max(at + self.ttl);
                }
                return;
            }
            Input::HeartbeatFailed { request, error } => (request, Some(error.is_lease_loss())),
            Input::ReportFailed { request, error } => (request, Some(error.is_lease_loss())),
            Input::ClaimEmpty { request }
            | Input::ClaimFailed { request, .. }
            | Input::ReportAnswered { request, .. } => (request, None),
            _ => return,
        };
        let heartbeat = matches!(input, Input::HeartbeatFailed { .. });
        if let Some((run, _)) = self.sent.remove(request)
            && lease_loss == Some(true)
            && let Some(lease) = self.leases.get_mut(&run)
        {
            if heartbeat && lease.reported {
                lease.disputed = true;
            } else {
                lease.lost = true;
            }
        }
    }

    /// Holds one command, as it leaves the machine, to the invariants.
    pub fn command(&mut self, cmd: &Command) -> Result<(), Breach> {
        let run = cmd.run_id();
        if self.closed.contains(&run) {
            return breach(
                "nothing_after_close",
                format!("a command after run {run} closed: {cmd:?}"),
            );
        }
        // The token's own `Debug` is redacted, so not even a lease call shows one as text.
        show_into(cmd, &mut self.text);
        let own = self.tokens.get(&run);
        if let Some(t) = self.index.find(self.text.as_bytes(), &self.tokens) {
            let whose = if own == Some(t) {
                "its own"
            } else {
                "another run's"
            };
            return breach(
                "token_stays_out",
                format!("run {run} shows {whose} lease token in {}", what(cmd)),
            );
        }
        match cmd {
            Command::SendClaimNext { request, .. } => {
                self.sent.insert(*request, (run, self.now));
            }
            Command::SendHeartbeat { lease_token, .. }
            | Command::SendReport { lease_token, .. }
                if own.map(String::as_str) != Some(lease_token.expose()) =>
            {
                return breach(
                    "token_stays_out",
                    format!("run {run} presents a token that is not its own"),
                );
            }
            Command::SendHeartbeat { request, .. } | Command::SendReport { request, .. } => {
                let now = self.now.ms();
                let Some(lease) = self.leases.get_mut(&run).filter(|l| !l.lost) else {
                    return breach(
                        "silent_after_lease_loss",
                        format!(
                            "at {now}, run {run} sends a {} after its lease was lost",
                            what(cmd)
                        ),
                    );
                };
                if matches!(cmd, Command::SendReport { .. }) {
                    lease.reported = true;
                } else if lease.disputed {
                    return breach(
                        "silent_after_lease_loss",
                        format!(
                            "at {now}, run {run} heartbeats after one was refused during its report"
                        ),
                    );
                }
                self.sent.insert(*request, (run, self.now));
            }
            Command::WriteRunRecord { record } => {
                if record.relay_outcome.is_some() {
                    let n = self.outcomes.entry(run).or_default();
                    *n += 1;
                    if *n > 1 {
                        return breach(
                            "one_outcome_per_claim",
                            format!("run {run} recorded {n} relay outcomes"),
                        );
                    }
                }
                if record.outcome != RunOutcome::Running {
                    self.closed.insert(run);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Once the world is healed and the machine idle: every fenced run recorded one outcome.
    pub fn finish(&self) -> Result<(), Breach> {
        match self
            .tokens
            .keys()
            .find(|r| self.outcomes.get(r) != Some(&1))
        {
            Some(run) => breach(
                "one_outcome_per_claim",
                format!("fenced run {run} ended without a relay outcome"),
            ),
            None => Ok(()),
        }
    }
}

/// The tokens a monitor knows, grouped by first byte and sorted: a command's text is searched
/// (memmem) only for what every token of a group starts with, and where that occurs the window
/// is looked up by binary search, one lookup per distinct length. A long run with hundreds of
/// claims costs no more per command than a short one.
#[derive(Clone, Debug, Default)]
struct TokenIndex {
    by_first: BTreeMap<u8, Starting>,
    /// The run of an empty token, which every text holds.
    empty: Option<u64>,
}

/// The tokens of one first byte: the prefix they all share (and its searcher), their lengths,
/// and (bytes, run) in byte order.
#[derive(Clone, Debug)]
struct Starting {
    shared: memchr::memmem::Finder<'static>,
    lens: BTreeSet<usize>,
    tokens: Vec<(Vec<u8>, u64)>,
}

impl TokenIndex {
    fn insert(&mut self, run: u64, token: &str) {
        let bytes = token.as_bytes().to_vec();
        let Some(&first) = bytes.first() else {
            self.empty.get_or_insert(run);
            return;
        };
        let group = self.by_first.entry(first).or_insert_with(|| Starting {
            shared: memchr::memmem::Finder::new(&bytes).into_owned(),
            lens: BTreeSet::new(),
            tokens: Vec::new(),
        });
        let shared = group.shared.needle();
        let common = shared
            .iter()
            .zip(&bytes)
            .take_while(|(a, b)| a == b)
            .count();
        if common < shared.len() {
            group.shared = memchr::memmem::Finder::new(&bytes[..common]).into_owned();
        }
        group.lens.insert(bytes.len());
        let at = group.tokens.partition_point(|e| e.0 < bytes);
        group.tokens.insert(at, (bytes, run));
    }

    /// A token of `tokens` that occurs in `text`.
    fn find<'t>(&self, text: &[u8], tokens: &'t BTreeMap<u64, String>) -> Option<&'t String> {
        if let Some(run) = self.empty {
            return tokens.get(&run);
        }
        for group in self.by_first.values() {
            // Every occurrence, overlapping ones too: tokens "aab" and "aac" share "aa", and
            // "aaab" holds "aab" at the second "aa", which a non-overlapping search skips.
            let mut from = 0;
            while let Some(found) = group.shared.find(&text[from..]) {
                let at = from + found;
                from = at + 1;
                let rest = &text[at..];
                for &len in group.lens.range(..=rest.len()) {
                    let window = &rest[..len];
                    if let Ok(i) = group
                        .tokens
                        .binary_search_by(|e| e.0.as_slice().cmp(window))
                    {
                        return tokens.get(&group.tokens[i].1);
                    }
                }
            }
        }
        None
    }
}

fn breach(invariant: &'static str, detail: String) -> Result<(), Breach> {
    Err(Breach { invariant, detail })
}

/// Everything a command would carry out of the machine, as text: its `Debug`, and the bytes,
/// environment, JSON and report result that `Debug` may abbreviate or redact.
pub fn shown(c: &Command) -> String {
    let mut text = String::new();
    show_into(c, &mut text);
    text
}

/// [`shown`], written into `text` (cleared first), so that a monitor reuses one buffer.
fn show_into(c: &Command, text: &mut String) {
    use std::fmt::Write as _;
    text.clear();
    match c {
        // Its `Debug` would spell every byte as a number; the bytes as text are what it shows.
        Command::WriteContextFile {
            run_id,
            path,
            bytes,
        } => {
            let _ = write!(text, "WriteContextFile {run_id} {path:?} ");
            text.push_str(&String::from_utf8_lossy(bytes));
            return;
        }
        _ => {
            let _ = write!(text, "{c:?}");
        }
    }
    match c {
        Command::Spawn { env, .. } | Command::RunCheck { env, .. } => {
            for (k, v) in env.merged([]) {
                let _ = write!(text, " {k}={v}");
            }
        }
        Command::WriteRunRecord { record } => {
            text.push_str(&serde_json::to_string(record).unwrap_or_default());
        }
        Command::Emit { event } => {
            text.push_str(&serde_json::to_string(event).unwrap_or_default());
        }
        Command::UploadReceipt { markdown, .. } => text.push_str(markdown),
        Command::SendReport { result, .. } => text.push_str(&result.to_string()),
        _ => {}
    }
}

/// What a command writes, in words, for a breach's detail.
fn what(cmd: &Command) -> &'static str {
    match cmd {
        Command::WriteContextFile { .. } => "the context file",
        Command::Spawn { .. } => "the process's argv or environment",
        Command::RunCheck { .. } => "the check's argv or environment",
        Command::WriteRunRecord { .. } => "a run record",
        Command::UploadReceipt { .. } => "a receipt",
        Command::Emit { .. } => "an event",
        Command::WarnRunLog { .. } => "the run log",
        _ => "a command",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::RunRecord;
    use crate::testing::relay::{Trace, decode_relay_program, run_relay_program};

    /// A program's trace with a fenced run that closed, and that run's id.
    fn closed_fenced_run() -> (Trace, u64) {
        for seed in 0..2_000u32 {
            let bytes: Vec<u8> = (0..64u32)
                .map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) as u8)
                .collect();
            let Ok(trace) = run_relay_program(&decode_relay_program(&bytes)) else {
                continue;
            };
            let closed = trace
                .steps
                .iter()
                .flat_map(|s| &s.commands)
                .find_map(|c| match c {
                    Command::WriteRunRecord { record }
                        if record.relay_outcome.is_some()
                            && trace.tokens.contains_key(&record.run_id) =>
                    {
                        Some(record.run_id)
                    }
                    _ => None,
                });
            if let Some(run) = closed {
                return (trace, run);
            }
        }
        panic!("no program of the first 2 000 closed a fenced run");
    }

    /// Feeds the trace, with `extra` commands after its last step, to a monitor.
    fn watch(trace: &Trace, extra: &[Command]) -> Result<Monitor, Breach> {
        let mut m = Monitor::new(trace.settings.lease_ttl);
        for step in &trace.steps {
            m.input(step.now, &step.input);
            for c in &step.commands {
                m.command(c)?;
            }
        }
        for c in extra {
            m.command(c)?;
        }
        Ok(m)
    }

    fn final_record(trace: &Trace, run: u64) -> Command {
        let mut records = trace.steps.iter().flat_map(|s| &s.commands);
        records
            .rfind(|c| matches!(c, Command::WriteRunRecord { record } if record.run_id == run))
            .cloned()
            .unwrap_or_else(|| panic!("run {run} has no record"))
    }

    #[test]
    fn a_real_trace_keeps_every_invariant() {
        let (trace, _) = closed_fenced_run();
        let m = watch(&trace, &[]).expect("the real machine keeps them");
        assert_eq!(m.tokens(), &trace.tokens);
    }

    #[test]
    fn each_invariant_fires_when_broken() {
        let (trace, run) = closed_fenced_run();
        let token = trace.tokens[&run].clone();
        let leak = Command::WarnRunLog {
            run_id: run + 1_000,
            text: format!("the agent printed {token}"),
        };
        let after_close = Command::WarnRunLog {
            run_id: run,
            text: "late".into(),
        };
        let again = final_record(&trace, run);
        let cases = [
            (leak, "token_stays_out"),
            (after_close, "nothing_after_close"),
            (again, "nothing_after_close"),
        ];
        for (cmd, invariant) in cases {
            let b = watch(&trace, &[cmd]).expect_err(invariant);
            assert_eq!(b.invariant, invariant, "{b:?}");
        }
        let mut second = Monitor::new(trace.settings.lease_ttl);
        let Command::WriteRunRecord { record } = final_record(&trace, run) else {
            unreachable!()
        };
        let running = Command::WriteRunRecord {
            record: RunRecord {
                outcome: RunOutcome::Running,
                ..record
            },
        };
        second.command(&running).expect("a first outcome");
        let b = second.command(&running).expect_err("a second outcome");
        assert_eq!(b.invariant, "one_outcome_per_claim");
        let mut unfinished = watch(&trace, &[]).expect("holds");
        unfinished.tokens.insert(run + 1_000, "tok".into());
        assert_eq!(
            unfinished
                .finish()
                .expect_err("an open fenced run")
                .invariant,
            "one_outcome_per_claim"
        );
    }

    /// A lease call once the lease ran out by the server's answers (the machine's own deadline
    /// is not asked): the trace cut before a run's first lease call, a timer a ttl later, then
    /// that call.
    #[test]
    fn a_lease_call_after_the_granted_lease_ran_out_is_a_breach() {
        let (trace, _) = closed_fenced_run();
        let ttl = trace.settings.lease_ttl;
        let (k, call) = trace
            .steps
            .iter()
            .enumerate()
            .find_map(|(k, s)| {
                let call = s.commands.iter().find(|c| {
                    matches!(
                        c,
                        Command::SendHeartbeat { .. } | Command::SendReport { .. }
                    )
                });
                call.map(|c| (k, c.clone()))
            })
            .expect("a lease call");
        let mut m = Monitor::new(ttl);
        for step in &trace.steps[..k] {
            m.input(step.now, &step.input);
            for c in &step.commands {
                m.command(c).expect("the real machine keeps them");
            }
        }
        let mut late = m.clone();
        late.input(trace.steps[k].now + ttl, &Input::TimerFired);
        let b = late.command(&call).expect_err("the lease ran out");
        assert_eq!(b.invariant, "silent_after_lease_loss", "{b:?}");
        // The same call while the lease runs is fine.
        m.input(trace.steps[k].now, &trace.steps[k].input);
        m.command(&call).expect("within the lease");
    }

    /// The index finds exactly what a substring search for each token finds, at the start, the
    /// end and inside a text, for tokens of several lengths (including ones that overlap).
    #[test]
    fn the_token_index_finds_what_a_substring_search_finds() {
        let tokens: BTreeMap<u64, String> = [
            (1, "tok-00ff00ff00ff00ff"),
            (2, "tok-0123456789abcdef"),
            (3, "abc"),
            (4, "zzzzzz"),
        ]
        .into_iter()
        .map(|(r, t)| (r, t.to_string()))
        .collect();
        let mut index = TokenIndex::default();
        for (r, t) in &tokens {
            index.insert(*r, t);
        }
        let mut rng = crate::mix::SplitMix64::new(7);
        let alphabet = b"abcz0f-tok";
        for n in 0..3_000 {
            let len = (rng.next_u64() % 60) as usize;
            let mut text: Vec<u8> = (0..len)
                .map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize])
                .collect();
            if n % 3 == 0 {
                let t = tokens[&(rng.next_u64() % 4 + 1)].as_bytes();
                let at = (rng.next_u64() as usize) % (text.len() + 1);
                text.splice(at..at, t.iter().copied());
            }
            let text = String::from_utf8(text).expect("ascii");
            let naive = tokens.values().any(|t| text.contains(t.as_str()));
            let found = index.find(text.as_bytes(), &tokens);
            assert_eq!(found.is_some(), naive, "{text:?}");
            if let Some(t) = found {
                assert!(text.contains(t.as_str()), "{text:?} does not hold {t:?}");
            }
        }
        // Occurrences of a group's shared prefix that overlap: "aab" sits at the second "aa".
        let overlapping: BTreeMap<u64, String> = [(1, "aab"), (2, "aac")]
            .into_iter()
            .map(|(r, t)| (r, t.to_string()))
            .collect();
        let mut index = TokenIndex::default();
        for (r, t) in &overlapping {
            index.insert(*r, t);
        }
        assert_eq!(index.find(b"aaab", &overlapping), Some(&"aab".to_string()));
        // An empty token is in every text, as `contains` says.
        let empty: BTreeMap<u64, String> = [(9, String::new())].into_iter().collect();
        let mut index = TokenIndex::default();
        index.insert(9, "");
        assert_eq!(index.find(b"", &empty), Some(&String::new()));
    }
}
