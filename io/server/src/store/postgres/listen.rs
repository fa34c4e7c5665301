//! The doorbell's LISTEN side: a dedicated connection that hears which todos became pending.

use relay_core::Error;

use super::encode::pg_err;

/// The channel of the doorbell's NOTIFY (see migration 0007).
pub const READY_CHANNEL: &str = "relay_todo_ready";

/// Notices a listener buffers; past it they are dropped (the doorbell scan covers them).
const READY_BUFFER: usize = 4096;

/// "A todo became claimable": what the doorbell's NOTIFY carries (no title or payload).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ready {
    pub id: String,
    pub endpoint: String,
    pub queue: String,
    /// 0 for a fresh todo; more for one that ran before.
    pub attempts_total: u32,
}

impl Ready {
    /// A payload of migration 0007's trigger, when it is of `schema` (before the schema is
    /// known, none is).
    fn parse(payload: &str, schema: Option<&str>) -> Option<Ready> {
        let v: serde_json::Value = serde_json::from_str(payload).ok()?;
        if v["schema"].as_str()? != schema? {
            return None;
        }
        Some(Ready {
            id: v["id"].as_str()?.to_string(),
            endpoint: v["endpoint"].as_str()?.to_string(),
            queue: v["queue"].as_str()?.to_string(),
            attempts_total: u32::try_from(v["attempts_total"].as_u64()?).ok()?,
        })
    }
}

/// The doorbell's LISTEN connection (see [`PgStore::listen_ready`]); dropping it closes it.
///
/// [`PgStore::listen_ready`]: super::PgStore::listen_ready
pub struct ReadyListener {
    _client: tokio_postgres::Client,
    rx: tokio::sync::mpsc::Receiver<Ready>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadyListener {
    /// The next notice; `None` once the connection is lost.
    pub async fn recv(&mut self) -> Option<Ready> {
        self.rx.recv().await
    }
}

impl Drop for ReadyListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What `PgStore::listen_ready` runs: connects with `pg` (the
/// store's settings, outside its pool), hands the notices of the connection's schema to the
/// listener, and LISTENs.
pub(super) async fn listen_ready(pg: &tokio_postgres::Config) -> Result<ReadyListener, Error> {
    let op = "doorbell listen";
    // Named, so that an operator can tell it from the pool's connections.
    let mut pg = pg.clone();
    pg.application_name("relay doorbell");
    let (client, mut conn) = pg
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| pg_err(op, "", &e))?;
    let (tx, rx) = tokio::sync::mpsc::channel(READY_BUFFER);
    let schema = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
    let mine = schema.clone();
    let task = tokio::spawn(async move {
        use futures_util::StreamExt as _;
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            let tokio_postgres::AsyncMessage::Notification(n) = m else {
                continue;
            };
            if n.channel() != READY_CHANNEL {
                continue;
            }
            let Some(ready) = Ready::parse(n.payload(), mine.get().map(String::as_str)) else {
                continue;
            };
            // A full buffer drops the notice: the doorbell scan rings for it instead.
            let _ = tx.try_send(ready);
        }
    });
    let current: String = client
        .query_one("SELECT current_schema()", &[])
        .await
        .map_err(|e| pg_err(op, "", &e))?
        .get(0);
    let _ = schema.set(current);
    client
        .batch_execute(&format!("LISTEN {READY_CHANNEL}"))
        .await
        .map_err(|e| pg_err(op, "", &e))?;
    Ok(ReadyListener {
        _client: client,
        rx,
        task,
    })
}
