//! The run record writer: records written in order, off the actor, the newest of each run.

use super::*;

/// How many queued run records [`record_writer`] takes at once, at most.
const RECORD_BATCH: usize = 64;

/// What the record writer is asked to do.
pub(crate) enum RecordJob {
    /// Write this record (and after a closing one prune the harness to this many runs).
    Write(RunRecord, usize),
    /// Answer once every record sent before it is on disk: `Err` when the newest of them for
    /// this run (harness, run id) could not be written. The spawn waits for it.
    Flush {
        run: (String, u64),
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// The one task that writes run records, in the order the machines wrote them (a run's
/// records replace one another), each synced to disk, off the actor; after a run's closing
/// record it prunes the harness to its `keep_runs`. It takes every job waiting (up to
/// [`RECORD_BATCH`]) in one trip to the blocking pool, and of a run's records among them
/// writes only the newest: the older ones were already replaced in memory, and writing them
/// would only replace them on disk a file and an fsync later. Under a burst of short attempts,
/// a firing's and a claim's records are often both superseded by the closing one. The flushes
/// among the jobs are answered after the batch is written: what a spawn waits for.
pub(super) fn record_writer(
    journal: Journal,
) -> (
    mpsc::UnboundedSender<RecordJob>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<RecordJob>();
    let task = tokio::spawn(async move {
        let mut waiting = Vec::new();
        while rx.recv_many(&mut waiting, RECORD_BATCH).await > 0 {
            let mut writes = Vec::new();
            let mut flushes = Vec::new();
            for job in waiting.drain(..) {
                match job {
                    RecordJob::Write(record, keep) => writes.push((record, keep)),
                    RecordJob::Flush { run, done } => flushes.push((run, done)),
                }
            }
            let batch = newest_per_run(writes);
            let journal = journal.clone();
            let failed = tokio::task::spawn_blocking(move || {
                let mut failed = std::collections::HashMap::new();
                for (record, keep) in batch {
                    if let Err(e) = journal.write_record(&record) {
                        tracing::error!(harness = %record.harness, run_id = record.run_id, error = %e, "run record not written");
                        failed.insert((record.harness.clone(), record.run_id), e.to_string());
                    }
                    if record.outcome != RunOutcome::Running
                        && let Err(e) = journal.prune(&record.harness, keep)
                    {
                        tracing::warn!(harness = %record.harness, error = %e, "old runs not pruned");
                    }
                }
                failed
            })
            .await;
            let failed = failed.unwrap_or_else(|_| {
                tracing::error!("the run record writer failed");
                std::collections::HashMap::new()
            });
            for (run, done) in flushes {
                let _ = done.send(match failed.get(&run) {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                });
            }
        }
    });
    (tx, task)
}

/// Of `records` (oldest first), the newest of each run, in the order of those newest ones.
fn newest_per_run<T>(records: Vec<(RunRecord, T)>) -> Vec<(RunRecord, T)> {
    let mut seen = std::collections::HashSet::new();
    let mut newest: Vec<_> = records
        .into_iter()
        .rev()
        .filter(|(r, _)| seen.insert((r.harness.clone(), r.run_id)))
        .collect();
    newest.reverse();
    newest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::tests::record;

    fn runs(records: &[(RunRecord, usize)]) -> Vec<(&str, u64, RunOutcome)> {
        records
            .iter()
            .map(|(r, _)| (r.harness.as_str(), r.run_id, r.outcome))
            .collect()
    }

    #[test]
    fn only_the_newest_record_of_each_run_is_written() {
        let waiting = vec![
            (record("a", 1, RunOutcome::Running), 1),
            (record("b", 1, RunOutcome::Running), 2),
            (record("a", 1, RunOutcome::Running), 3),
            (record("a", 2, RunOutcome::Running), 4),
            (record("a", 1, RunOutcome::Success), 5),
        ];
        let batch = newest_per_run(waiting);
        assert_eq!(
            runs(&batch),
            [
                ("b", 1, RunOutcome::Running),
                ("a", 2, RunOutcome::Running),
                ("a", 1, RunOutcome::Success),
            ]
        );
        assert_eq!(batch.iter().map(|(_, k)| *k).collect::<Vec<_>>(), [2, 4, 5]);
    }

    /// Records queued before the writer runs: each run ends on disk as its newest record, and the
    /// closing one prunes.
    #[tokio::test(flavor = "current_thread")]
    async fn the_record_writer_leaves_each_run_at_its_newest_record() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let (tx, task) = record_writer(journal.clone());
        for (run_id, outcome) in [
            (1, RunOutcome::Success),
            (2, RunOutcome::Running),
            (3, RunOutcome::Running),
            (2, RunOutcome::Running),
            (3, RunOutcome::Failed),
        ] {
            tx.send(RecordJob::Write(record("a", run_id, outcome), 2))
                .unwrap();
        }
        drop(tx);
        task.await.unwrap();
        let on_disk = |run_id| journal.record("a", run_id).unwrap().map(|r| r.outcome);
        // keep_runs 2 after run 3 closed: run 1, the oldest, is pruned.
        assert_eq!(on_disk(1), None);
        assert_eq!(on_disk(2), Some(RunOutcome::Running));
        assert_eq!(on_disk(3), Some(RunOutcome::Failed));
    }

    /// What the spawn waits for: a flush answers once the records sent before it are on disk,
    /// and says so when its run's record could not be written (here: a directory stands where
    /// the record's file goes, which stops root too).
    #[tokio::test]
    async fn a_flush_answers_after_the_records_before_it_and_names_a_record_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let blocked = dir.path().join("runs").join("a").join("4.json");
        std::fs::create_dir_all(blocked.join("in-the-way")).unwrap();
        let (tx, task) = record_writer(journal.clone());
        let flush = |run_id| {
            let (done, answer) = oneshot::channel();
            let run = ("a".to_string(), run_id);
            tx.send(RecordJob::Flush { run, done }).unwrap();
            answer
        };
        tx.send(RecordJob::Write(record("a", 2, RunOutcome::Running), 9))
            .unwrap();
        let two = flush(2);
        tx.send(RecordJob::Write(record("a", 4, RunOutcome::Running), 9))
            .unwrap();
        let four = flush(4);
        assert_eq!(two.await.unwrap(), Ok(()));
        // Answered, so on disk: read back at once.
        let on_disk = journal.record("a", 2).unwrap().map(|r| r.outcome);
        assert_eq!(on_disk, Some(RunOutcome::Running));
        let refused = four.await.unwrap().unwrap_err();
        assert!(refused.contains("4.json"), "{refused}");
        drop(tx);
        task.await.unwrap();
    }
}
