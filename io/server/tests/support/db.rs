//! One database to run a store on: SQLite on a file, or a Postgres schema of its own (shared by
//! `hostile_store.rs` and the benchmarks, which also reach the same rows with raw SQL).
#![allow(dead_code)] // each user takes a part

use relay_core::ledger::LedgerConfig;
use relay_server::store::{PgStore, Store};

pub enum Db {
    Sqlite {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
    },
    Postgres {
        url: String,
        schema: String,
    },
}

impl Db {
    /// SQLite on `file` in a fresh temp dir.
    pub fn sqlite_temp(file: &str) -> Db {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join(file);
        Db::Sqlite { _dir: dir, path }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Db::Sqlite { .. } => "sqlite",
            Db::Postgres { .. } => "postgres",
        }
    }

    pub fn sqlite_url(path: &std::path::Path) -> String {
        format!("sqlite:{}", path.display())
    }

    /// Opens the store as a test driving time by hand needs it: on Postgres the operations
    /// read the caller's clock (a `ManualClock`), not the database's.
    pub async fn open_manual(&self, cfg: LedgerConfig) -> Store {
        match self.open(cfg).await {
            Store::Postgres(p) => {
                Store::Postgres(p.with_clock(relay_server::store::PgClock::Caller))
            }
            s => s,
        }
    }

    pub async fn open(&self, cfg: LedgerConfig) -> Store {
        match self {
            Db::Sqlite { path, .. } => Store::open(&Db::sqlite_url(path), cfg)
                .await
                .expect("open the store"),
            Db::Postgres { url, schema } => Store::Postgres(
                PgStore::open_in_schema(url, schema, cfg)
                    .await
                    .expect("open the store"),
            ),
        }
    }
}
