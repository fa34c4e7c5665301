//! Drops a test's Postgres schema when the test ends (the harness's, and `hostile_store.rs`'s
//! backends).

/// Drops schema `name` of the database at `url`. Runs on a thread with a runtime of its own, so
/// that it may be called from `Drop` inside the test's runtime; errors are ignored (the schema
/// is a throwaway).
pub fn drop_schema(url: String, name: String) {
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            if let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                let _ = client
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .await;
            }
        });
    })
    .join();
}
