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
    /// SQLite on a temp file and, when `RELAY_TEST_POSTGRES` names a server, a fresh Postgres
    /// schema named `<prefix>_<pid>_<n>` (skipped, saying so, unless `RELAY_REQUIRE_POSTGRES=1`).
    pub fn all(prefix: &str) -> Vec<Db> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mut v = vec![Db::sqlite_temp("relay.db")];
        match std::env::var("RELAY_TEST_POSTGRES") {
            Ok(url) if !url.is_empty() => v.push(Db::Postgres {
                url,
                schema: format!(
                    "{prefix}_{}_{}",
                    std::process::id(),
                    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ),
            }),
            _ => {
                assert!(
                    std::env::var("RELAY_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                    "RELAY_REQUIRE_POSTGRES=1 but RELAY_TEST_POSTGRES is unset"
                );
                eprintln!("Postgres: skipped (set RELAY_TEST_POSTGRES=postgres://… to run it)");
            }
        }
        v
    }

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
