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

    /// The database a benchmark's arguments name with `--db URL` (or `--db=URL`; every other
    /// argument is passed over, cargo's `--bench` among them): SQLite on `file` in a temp dir
    /// when there is none, `sqlite:PATH` that file, `postgres://…` a schema `{prefix}_{pid}` of
    /// its own. Exits with a usage line on anything else.
    pub fn for_bench(args: impl IntoIterator<Item = String>, file: &str, prefix: &str) -> Db {
        let mut args = args.into_iter();
        let mut url = None;
        while let Some(a) = args.next() {
            match a.strip_prefix("--db=") {
                Some(u) => url = Some(u.to_string()),
                None if a == "--db" => url = args.next(),
                None => {}
            }
        }
        match url.as_deref() {
            None => Db::sqlite_temp(file),
            Some(u) if u.starts_with("sqlite:") && u != "sqlite::memory:" => Db::Sqlite {
                _dir: tempfile::tempdir().expect("a temp dir"),
                path: u["sqlite:".len()..].into(),
            },
            Some(u) if u.starts_with("postgres://") || u.starts_with("postgresql://") => {
                Db::Postgres {
                    url: u.to_string(),
                    schema: format!("{prefix}_{}", std::process::id()),
                }
            }
            Some(_) => {
                eprintln!(
                    "--db: leave it out for SQLite on a temp file, or give sqlite:PATH (a file) or postgres://…"
                );
                std::process::exit(2);
            }
        }
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
