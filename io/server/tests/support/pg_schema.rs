//! Drops a test's (or a benchmark's) Postgres schema when it ends.
#![allow(dead_code)] // the benchmarks drop theirs now, the tests on drop

/// Drops schema `name` of the database at `url`, now.
pub async fn drop_now(url: &str, name: &str) -> Result<(), tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .await
}

/// Drops schema `name` of the database at `url`. Runs on a thread with a runtime of its own, so
/// that it may be called from `Drop` inside the test's runtime; errors are ignored (the schema
/// is a throwaway).
pub fn drop_schema(url: String, name: String) {
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = rt.block_on(drop_now(&url, &name));
    })
    .join();
}
