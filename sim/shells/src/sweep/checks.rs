//! The checks after a run, and the trace hash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use relay_core::Millis;
use relay_core::ledger::{Actor, Answer, Attempt, Op, Todo, TokenHash, check_todo};
use relay_server::store::Store;
use sha2::Digest as _;

use super::launcher::lock;
use super::world::{World, list};
use super::{KILL_SLACK, STOP_SLACK, logs};

/// The checks after the run (see the sweep's module doc) and the trace hash; `stopped` is when the daemons were killed (in true time), where a
/// process still running ended.
pub(super) async fn check(
    store: &Store,
    world: &World,
    ids: &[String],
    stopped: Millis,
    violations: &mut Vec<String>,
) -> (u64, usize) {
    let mut hasher = sha2::Sha256::new();
    let todos = match list(store).await {
        Ok(t) => t,
        Err(e) => {
            violations.push(format!("the ledger could not be listed: {e}"));
            return (0, 0);
        }
    };
    let by_id: BTreeMap<&str, &Todo> = todos.iter().map(|t| (t.id.as_str(), t)).collect();
    // No todo lost.
    for id in ids {
        if !by_id.contains_key(id.as_str()) {
            violations.push(format!(
                "{id}: added, acknowledged, and gone from the ledger"
            ));
        }
    }
    let min_offset = *lock(&world.journal).server_offsets.first().unwrap_or(&0);
    let mut expiry_true: BTreeMap<(String, u32), Millis> = BTreeMap::new();
    let mut hashes: Vec<TokenHash> = Vec::new();
    let mut attempts_seen = 0;
    for t in &todos {
        let view = match store
            .apply(Op::GetTodo {
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
                attempts_limit: 10_000,
            })
            .await
        {
            Ok(Answer::View(v)) => v,
            other => {
                violations.push(format!("{}: get_todo answered {other:?}", t.id));
                continue;
            }
        };
        let mut attempts: Vec<Attempt> = view.attempts;
        attempts.reverse();
        attempts_seen += attempts.len();
        if let Err(e) = check_todo(&view.todo, &attempts) {
            violations.push(format!("{}: ledger invariant: {e}", t.id));
        }
        hasher.update(format!("{}:{}:{}", t.id, t.state, t.attempts_total).as_bytes());
        for a in &attempts {
            hasher.update(
                format!(
                    "{}:{}:{:?}:{}:{:?}:{}",
                    a.seq, a.attempt, a.outcome, a.claimed_at, a.ended_at, a.lease_expires_at
                )
                .as_bytes(),
            );
            if let Some(h) = &a.lease_token_hash {
                hashes.push(*h);
            }
            // The latest the lease can have run out, in true time: the server's stamp less
            // the smallest offset its clock ever had (lenient about clock steps).
            let latest = a.lease_expires_at.saturating_add_signed(-min_offset);
            expiry_true.insert((t.id.clone(), a.seq), latest);
            // An open attempt on a todo not claimed, and a close against its lease (died
            // before it ran out, a holder's write after), are check_todo's, above.
        }
    }
    // No process ran past its lease (plus the second the daemon has to stop it).
    let procs = lock(&world.journal).procs.clone();
    let dump = std::env::var_os("RELAY_SHELL_SIM_DUMP").is_some();
    for p in &procs {
        if dump {
            eprintln!("trace: {p:?}");
        }
        hasher.update(format!("{p:?}").as_bytes());
        let Some(limit) = expiry_true.get(&(p.todo.clone(), p.seq)) else {
            if p.todo.starts_with("td_sweep") {
                violations.push(format!(
                    "{} #{}: a {} ran on {} for an attempt the ledger does not have",
                    p.todo, p.seq, p.kind, p.node
                ));
            }
            continue;
        };
        // A process its daemon still ran when the world stopped (its todo canceled a moment
        // before, say, and the daemon not yet told) ended with the daemon: it ran past its
        // lease only if the lease had run out by then.
        let end = p.end.unwrap_or(stopped);
        let stop_by = limit.saturating_add(STOP_SLACK);
        if end > stop_by && p.signaled.is_none_or(|at| at > stop_by) {
            violations.push(format!(
                "{} #{}: the {} on {} ran {} ms past its lease and was not signaled within 1 s of it",
                p.todo,
                p.seq,
                p.kind,
                p.node,
                end.saturating_sub(*limit)
            ));
        } else if end > limit.saturating_add(KILL_SLACK) {
            violations.push(format!(
                "{} #{}: the {} on {} ran {} ms past its lease, beyond the kill grace",
                p.todo,
                p.seq,
                p.kind,
                p.node,
                end.saturating_sub(*limit)
            ));
        }
    }
    // No token in any file or log line.
    let mut texts: Vec<(String, Vec<u8>)> = Vec::new();
    collect_files(world.dir.path(), &mut texts);
    texts.push(("the logs".into(), logs::take()));
    for (name, bytes) in &texts {
        if find(bytes, world.token.as_bytes()) {
            violations.push(format!("the endpoint's bearer token appears in {name}"));
        }
        for word in bytes.split(|b| !(b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')) {
            if word.len() == 22
                && let Ok(w) = std::str::from_utf8(word)
                && hashes.contains(&TokenHash::of(w))
            {
                violations.push(format!("a lease token appears in {name}"));
            }
        }
    }
    let digest = hasher.finalize();
    let trace = u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]));
    (trace, attempts_seen)
}

pub(super) fn find(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir` but the database (whose token hashes are the point) and the env
/// files the operator wrote the bearer into.
pub(super) fn collect_files(dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            collect_files(&p, out);
        } else if !name.starts_with("relay.db")
            && name != "sweep.env"
            && let Ok(bytes) = std::fs::read(&p)
        {
            out.push((p.display().to_string(), bytes));
        }
    }
}
