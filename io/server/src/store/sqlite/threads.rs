//! The SQLite store's threads: one writer that owns the write connection and commits the
//! operations waiting for it as one group, and a few readers, each owning a read connection.
//!
//! An operation reaches a thread over a channel and its caller awaits a oneshot answer, so no
//! operation hops to tokio's blocking pool. The writer takes every operation waiting (at most
//! [`Tuning::batch_max`]), opens one `BEGIN IMMEDIATE`, runs each operation in a `SAVEPOINT` of
//! its own (an operation that fails is rolled back to its savepoint alone and answers its own
//! error; the others keep their writes), and answers every caller only after `COMMIT` returned.
//! The operations of a batch run in the order they arrived, each seeing the writes of those
//! before it, exactly as if each had been its own transaction. A failing `COMMIT` (or SQLite
//! rolling the whole transaction back after an I/O error) answers every operation of the batch
//! with that error: nothing was acknowledged, nothing is half-applied.
//!
//! Readers run one read-only operation each in its own deferred transaction, a WAL snapshot
//! that holds every batch committed before it began and nothing of one in flight.
//!
//! An in-memory database has only its one connection and does no I/O: it runs each operation
//! inline on the caller's task, as a batch of one (the same `commit_batch`), with no thread. The
//! tests on a simulated network (turmoil) need that: their clock runs ahead while a task waits
//! on a real thread, and an answer from one arrives after simulated timeouts. A madsim build
//! (the shell-sim sweep) runs a file database the same way, for the same reason and because
//! madsim refuses to start a thread.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, mpsc};

use relay_core::Error;
use rusqlite::Connection;
use tokio::sync::oneshot;

/// The sizes of the SQLite store's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// At most this many operations share one transaction.
    pub batch_max: usize,
    /// Read connections (each its own thread) beside the writer; a file database only.
    pub readers: usize,
}

impl Default for Tuning {
    /// 64 operations a batch (more callers than a server usually has at once, so a batch takes
    /// everything waiting), and 2 readers (this design's target machine has 2 cores).
    fn default() -> Tuning {
        Tuning {
            batch_max: 64,
            readers: 2,
        }
    }
}

/// What a connection's thread is given.
pub(crate) enum Work {
    /// A transaction's body: in a savepoint of the writer's batch, or a reader's own snapshot.
    Tx(Box<dyn TxJob>),
    /// Runs on the bare connection, outside any transaction (migrations, the write probe,
    /// tests' raw SQL).
    Alone(Box<dyn FnOnce(&mut Connection) + Send>),
}

/// One operation's body and its caller's answer.
pub(crate) trait TxJob: Send {
    /// Runs the body inside the transaction the thread opened; whether it succeeded.
    fn run(&mut self, c: &Connection) -> bool;
    /// Answers the caller: `batch` when the transaction it ran in failed, else its own result.
    fn answer(self: Box<Self>, batch: Option<Error>);
}

struct Body<R, F> {
    f: Option<F>,
    out: Option<Result<R, Error>>,
    reply: oneshot::Sender<Result<R, Error>>,
    what: String,
}

impl<R, F> TxJob for Body<R, F>
where
    R: Send,
    F: FnOnce(&Connection) -> Result<R, Error> + Send,
{
    fn run(&mut self, c: &Connection) -> bool {
        let Some(f) = self.f.take() else {
            return false;
        };
        // A panicking operation answers an error and rolls back alone, as a panic on the
        // blocking pool did; the thread and the rest of the batch go on.
        let out = std::panic::catch_unwind(AssertUnwindSafe(|| f(c))).unwrap_or_else(|_| {
            Err(Error::internal(format!(
                "{}: the SQLite operation panicked",
                self.what
            )))
        });
        let ok = out.is_ok();
        self.out = Some(out);
        ok
    }

    fn answer(self: Box<Self>, batch: Option<Error>) {
        let out = match (batch, self.out) {
            (Some(e), _) => Err(e),
            (None, Some(out)) => out,
            (None, None) => Err(Error::internal(format!(
                "{}: the operation never ran",
                self.what
            ))),
        };
        // A caller that stopped waiting (its future dropped) needs no answer.
        let _ = self.reply.send(out);
    }
}

/// Where a store's work goes: the writer, and the readers when the database has them.
pub(crate) struct Threads {
    writer: Writer,
    readers: Option<mpsc::Sender<Work>>,
    /// The checkpointer's channel (a file database's threads only), for tests to checkpoint.
    #[cfg(test)]
    checkpoints: Option<mpsc::SyncSender<Checkpoint>>,
}

/// The WAL's size, in pages, past which a commit asks for a checkpoint (SQLite's own default
/// for its automatic one).
const CHECKPOINT_PAGES: std::ffi::c_int = 1000;

/// What the checkpointer is asked. The writer never checkpoints: SQLite's automatic
/// checkpoint runs inside the commit that crosses its threshold (1 000 pages of WAL), so every
/// operation queued behind that commit waited for the copy and its fsync (a heartbeat's p99
/// with 100 000 leases open was 16 ms against 2.8 ms without, in the scale bench). The
/// checkpointer copies the WAL into the database on a connection of its own, while the writer
/// goes on: SQLite lets a PASSIVE checkpoint run beside a writer.
pub(crate) enum Checkpoint {
    /// A commit left [`CHECKPOINT_PAGES`] or more in the WAL: checkpoint when next free
    /// (signals waiting meanwhile count once).
    Due,
    /// Checkpoint now and answer with SQLite's (WAL frames, frames checkpointed).
    #[cfg(test)]
    Now(oneshot::Sender<Result<(i64, i64), Error>>),
}

enum Writer {
    Thread(mpsc::Sender<Work>),
    /// An in-memory database's one connection, used on the caller's task.
    Inline(Mutex<Connection>),
}

/// Which thread an operation goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum To {
    Writer,
    /// A reader, or the writer when there is none (an in-memory database).
    Reader,
}

fn stopped(what: &str) -> Error {
    Error::internal(format!("{what}: the SQLite store's thread has stopped"))
}

impl Threads {
    /// The one connection of an in-memory database, used inline.
    pub(crate) fn inline(conn: Connection) -> Threads {
        Threads {
            writer: Writer::Inline(Mutex::new(conn)),
            readers: None,
            #[cfg(test)]
            checkpoints: None,
        }
    }

    /// Starts the writer on `writer`, one reader on each of `readers`, and the checkpointer on
    /// `checkpointer` (see [`Checkpoint`]).
    pub(crate) fn start(
        writer: Connection,
        readers: Vec<Connection>,
        checkpointer: Connection,
        tuning: Tuning,
    ) -> Result<Threads, Error> {
        let (ctx, crx) = mpsc::sync_channel(1);
        // SQLite's own automatic checkpoint is this hook's default; ours only asks.
        let due = ctx.clone();
        let mut writer = writer;
        writer
            .wal_hook(Some(
                move |_: &mut rusqlite::hooks::Wal, pages: std::ffi::c_int| {
                    if pages >= CHECKPOINT_PAGES {
                        // Full: one is already waiting, and it covers this commit too.
                        let _ = due.try_send(Checkpoint::Due);
                    }
                    Ok(())
                },
            ))
            .map_err(|e| batch_err("handing the writer's checkpoints to the checkpointer", &e))?;
        std::thread::Builder::new()
            .name("relay-sqlite-checkpointer".into())
            .spawn(move || checkpointer_loop(&checkpointer, &crx))
            .expect("spawn the SQLite checkpointer thread");
        let (wtx, wrx) = mpsc::channel();
        let batch_max = tuning.batch_max.max(1);
        #[cfg(test)]
        let checkpoints = Some(ctx);
        std::thread::Builder::new()
            .name("relay-sqlite-writer".into())
            .spawn(move || writer_loop(writer, &wrx, batch_max))
            .expect("spawn the SQLite writer thread");
        let readers = (!readers.is_empty()).then(|| {
            let (rtx, rrx) = mpsc::channel();
            let rrx = Arc::new(Mutex::new(rrx));
            for (i, conn) in readers.into_iter().enumerate() {
                let rrx = rrx.clone();
                std::thread::Builder::new()
                    .name(format!("relay-sqlite-reader-{i}"))
                    .spawn(move || reader_loop(conn, &rrx))
                    .expect("spawn an SQLite reader thread");
            }
            rtx
        });
        Ok(Threads {
            writer: Writer::Thread(wtx),
            readers,
            #[cfg(test)]
            checkpoints,
        })
    }

    /// Has the checkpointer checkpoint now; SQLite's (WAL frames, frames checkpointed), or
    /// `None` for a database without a checkpointer (in memory, or run inline).
    #[cfg(test)]
    pub(crate) async fn checkpoint(&self) -> Result<Option<(i64, i64)>, Error> {
        let Some(c) = &self.checkpoints else {
            return Ok(None);
        };
        let what = "a WAL checkpoint";
        let (reply, answer) = oneshot::channel();
        c.send(Checkpoint::Now(reply)).map_err(|_| stopped(what))?;
        answer.await.map_err(|_| stopped(what))?.map(Some)
    }

    /// Hands `work` to the thread `to` names, or runs it here on an inline connection.
    fn submit(&self, to: To, work: Work) -> Result<(), ()> {
        match (to, &self.readers, &self.writer) {
            (To::Reader, Some(r), _) | (_, _, Writer::Thread(r)) => r.send(work).map_err(drop),
            (_, _, Writer::Inline(conn)) => {
                let mut c = conn.lock().unwrap_or_else(|e| e.into_inner());
                match work {
                    Work::Alone(f) => f(&mut c),
                    Work::Tx(job) => {
                        // A batch of one leaves nothing to carry.
                        let mut carry = VecDeque::new();
                        commit_batch(&c, vec![job], &mut carry);
                    }
                }
                Ok(())
            }
        }
    }

    /// Runs `f` as one transaction's body on the thread `to` names; its answer after commit.
    pub(crate) async fn tx<R: Send + 'static>(
        &self,
        to: To,
        what: String,
        f: impl FnOnce(&Connection) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        let (reply, answer) = oneshot::channel();
        let job = Body {
            f: Some(f),
            out: None,
            reply,
            what: what.clone(),
        };
        self.submit(to, Work::Tx(Box::new(job)))
            .map_err(|()| stopped(&what))?;
        answer.await.map_err(|_| stopped(&what))?
    }

    /// Runs `f` on the bare connection of the thread `to` names, between batches.
    pub(crate) async fn alone<R: Send + 'static>(
        &self,
        to: To,
        what: &str,
        f: impl FnOnce(&mut Connection) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        let (reply, answer) = oneshot::channel();
        let work = Work::Alone(Box::new(move |c| {
            let out = std::panic::catch_unwind(AssertUnwindSafe(|| f(c)))
                .unwrap_or_else(|_| Err(Error::internal("the SQLite work panicked")));
            let _ = reply.send(out);
        }));
        self.submit(to, work).map_err(|()| stopped(what))?;
        answer.await.map_err(|_| stopped(what))?
    }
}

fn writer_loop(mut conn: Connection, rx: &mpsc::Receiver<Work>, batch_max: usize) {
    // Work taken from the channel but not yet run, oldest first: an `Alone` that ended a batch,
    // or the operations after one that lost the batch's transaction.
    let mut carry: VecDeque<Work> = VecDeque::new();
    loop {
        let first = match carry.pop_front() {
            Some(w) => w,
            None => match rx.recv() {
                Ok(w) => w,
                Err(_) => return, // every store handle is gone
            },
        };
        let first = match first {
            Work::Alone(f) => {
                f(&mut conn);
                continue;
            }
            Work::Tx(job) => job,
        };
        let mut batch = vec![first];
        while batch.len() < batch_max {
            match carry.pop_front().or_else(|| rx.try_recv().ok()) {
                Some(Work::Tx(job)) => batch.push(job),
                Some(alone) => {
                    carry.push_front(alone);
                    break;
                }
                None => break,
            }
        }
        commit_batch(&conn, batch, &mut carry);
    }
}

/// Checkpoints the WAL when asked (see [`Checkpoint`]); ends with the store's last handle.
fn checkpointer_loop(conn: &Connection, rx: &mpsc::Receiver<Checkpoint>) {
    let run = || -> Result<(i64, i64), Error> {
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
        })
        .map_err(|e| batch_err("checkpointing the WAL", &e))
    };
    while let Ok(asked) = rx.recv() {
        match asked {
            Checkpoint::Due => {
                if let Err(e) = run() {
                    // The next commit asks again; meanwhile the WAL grows, nothing is lost.
                    tracing::warn!(error = %e, "a WAL checkpoint failed");
                }
            }
            #[cfg(test)]
            Checkpoint::Now(reply) => {
                let _ = reply.send(run());
            }
        }
    }
}

/// Runs a statement without values through the connection's statement cache.
fn exec(c: &Connection, sql: &str) -> rusqlite::Result<()> {
    c.prepare_cached(sql)?.execute([]).map(drop)
}

fn batch_err(what: &str, e: &rusqlite::Error) -> Error {
    let busy = matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == rusqlite::ErrorCode::DatabaseBusy);
    let why = if busy {
        "the database stayed locked past the busy timeout; retry"
    } else {
        "the SQLite store failed"
    };
    Error::internal(format!("{what}: {why}: {e}"))
}

/// One group commit: `batch` in one transaction, each in a savepoint; answers after COMMIT.
fn commit_batch(c: &Connection, batch: Vec<Box<dyn TxJob>>, carry: &mut VecDeque<Work>) {
    if let Err(e) = exec(c, "BEGIN IMMEDIATE") {
        let err = batch_err("beginning a write transaction", &e);
        for job in batch {
            job.answer(Some(err.clone()));
        }
        return;
    }
    let mut ran: Vec<Box<dyn TxJob>> = Vec::with_capacity(batch.len());
    let mut rest = batch.into_iter();
    while let Some(mut job) = rest.next() {
        let lost = |c: &Connection, e: Error, ran: Vec<Box<dyn TxJob>>| {
            if !c.is_autocommit() {
                let _ = exec(c, "ROLLBACK");
            }
            for j in ran {
                j.answer(Some(e.clone()));
            }
        };
        if let Err(e) = exec(c, "SAVEPOINT op") {
            ran.push(job);
            lost(c, batch_err("opening an operation's savepoint", &e), ran);
            carry.extend(rest.map(Work::Tx));
            return;
        }
        let ok = job.run(c);
        if c.is_autocommit() {
            // SQLite rolled the whole transaction back (an I/O or full-disk error): the
            // batch's earlier operations went with it. This one answers its own error.
            let e = Error::internal(
                "the SQLite store rolled back a write transaction after an error; retry",
            );
            lost(c, e, ran);
            job.answer(None);
            for j in rest.rev() {
                carry.push_front(Work::Tx(j));
            }
            return;
        }
        let end = if ok {
            exec(c, "RELEASE op")
        } else {
            exec(c, "ROLLBACK TO op").and_then(|()| exec(c, "RELEASE op"))
        };
        ran.push(job);
        if let Err(e) = end {
            lost(c, batch_err("closing an operation's savepoint", &e), ran);
            for j in rest.rev() {
                carry.push_front(Work::Tx(j));
            }
            return;
        }
    }
    match exec(c, "COMMIT") {
        Ok(()) => {
            for job in ran {
                job.answer(None);
            }
        }
        Err(e) => {
            let err = batch_err("committing a write transaction", &e);
            if !c.is_autocommit() {
                let _ = exec(c, "ROLLBACK");
            }
            for job in ran {
                job.answer(Some(err.clone()));
            }
        }
    }
}

fn reader_loop(mut conn: Connection, rx: &Mutex<mpsc::Receiver<Work>>) {
    loop {
        // One reader waits on the channel at a time; the others wait for the lock.
        let work = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(w) => w,
                Err(_) => return,
            }
        };
        match work {
            Work::Alone(f) => f(&mut conn),
            Work::Tx(mut job) => {
                if let Err(e) = exec(&conn, "BEGIN DEFERRED") {
                    job.answer(Some(batch_err("beginning a read transaction", &e)));
                    continue;
                }
                let ok = job.run(&conn);
                // Nothing was written: committing or rolling back ends the snapshot alike.
                let end = if conn.is_autocommit() {
                    Ok(())
                } else if ok {
                    exec(&conn, "COMMIT")
                } else {
                    exec(&conn, "ROLLBACK")
                };
                job.answer(
                    end.err()
                        .map(|e| batch_err("ending a read transaction", &e)),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt as _;

    use super::*;

    fn insert(c: &Connection, n: i64) -> Result<(), Error> {
        c.execute("INSERT INTO t (n) VALUES (?1)", [n])
            .map(drop)
            .map_err(|e| Error::internal(e.to_string()))
    }

    /// Four operations queued while the writer is busy share its next batch: the one that
    /// fails after writing and the one that panics roll back alone and answer their own
    /// errors; the other two keep their writes and answer `Ok`.
    #[test]
    fn a_failing_operation_in_a_batch_rolls_back_alone() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (n INTEGER NOT NULL)")
            .unwrap();
        let checkpointer = Connection::open_in_memory().unwrap();
        let threads = Threads::start(conn, Vec::new(), checkpointer, Tuning::default()).unwrap();
        rt.block_on(async {
            // The writer waits on `hold` until the four are queued behind it.
            let (release, hold) = std::sync::mpsc::channel::<()>();
            let busy = threads.alone(To::Writer, "hold", move |_| {
                hold.recv().map_err(|e| Error::internal(e.to_string()))
            });
            let mut busy = std::pin::pin!(busy);
            assert!(busy.as_mut().now_or_never().is_none());
            let a = threads.tx(To::Writer, "a".into(), |c| insert(c, 1));
            let b = threads.tx(To::Writer, "b".into(), |c| {
                insert(c, 2)?;
                Err::<(), _>(Error::conflict("b refuses"))
            });
            let p = threads.tx(To::Writer, "p".into(), |c| {
                insert(c, 4)?;
                panic!("p panics")
            });
            let d = threads.tx(To::Writer, "d".into(), |c| insert(c, 3));
            let (mut a, mut b, mut p, mut d) = (
                std::pin::pin!(a),
                std::pin::pin!(b),
                std::pin::pin!(p),
                std::pin::pin!(d),
            );
            assert!(a.as_mut().now_or_never().is_none());
            assert!(b.as_mut().now_or_never().is_none());
            assert!(p.as_mut().now_or_never().is_none());
            assert!(d.as_mut().now_or_never().is_none());
            release.send(()).unwrap();
            busy.await.unwrap();
            assert_eq!(a.await, Ok(()));
            let b = b.await.unwrap_err();
            assert_eq!(b, Error::conflict("b refuses"));
            let p: Result<(), Error> = p.await;
            assert!(p.unwrap_err().to_string().contains("panicked"));
            assert_eq!(d.await, Ok(()));
            let rows = threads
                .tx(To::Reader, "read".into(), |c| {
                    let mut st = c.prepare("SELECT n FROM t ORDER BY n").unwrap();
                    let rows = st.query_map([], |r| r.get::<_, i64>(0)).unwrap();
                    Ok(rows.map(Result::unwrap).collect::<Vec<_>>())
                })
                .await
                .unwrap();
            assert_eq!(rows, vec![1, 3]);
        });
    }
}
