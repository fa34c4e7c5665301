//! `relay doctor`: the rows of `relay_core::relay::doctor` for the lease sources a
//! config binds, from the daemon's own clients or, with no daemon running, from clients made
//! here for the purpose. Either way each source's client opens a session when it has none
//! (initialize, then tools/list) and its tool list is judged the same way.

use std::path::Path;
use std::sync::Arc;

use relay_core::config::{Config, FileKind};
use relay_core::relay::{self, doctor::Row};

use crate::lease::{LeaseClient, Transport};

/// The binding rows of `config`, then each source's rows, in the order given.
pub async fn rows(config: &Config, clients: Vec<(String, Arc<LeaseClient>)>) -> Vec<Row> {
    let mut rows = relay::doctor::binding_rows(config);
    for (name, client) in clients {
        rows.extend(match client.tools_list().await {
            Ok(list) => {
                relay::doctor::source_rows(&name, Ok(&relay::check_capabilities(&list.tools)))
            }
            Err(e) => relay::doctor::source_rows(&name, Err(&e.to_string())),
        });
    }
    rows
}

/// Doctor without a daemon: loads `file` with the daemon's loader (a broken config is the
/// error), makes a lease client for every bound source and asks each.
pub async fn standalone(file: &Path, transport: Arc<dyn Transport>) -> Result<Vec<Row>, String> {
    let loaded = super::load::load(file, FileKind::Global)?;
    let config = &loaded.resolved.config;
    let clients = relay::doctor::bound_sources(config)
        .into_iter()
        .filter_map(|source| {
            let name = source.strip_prefix("queue.")?.to_string();
            let client = LeaseClient::from_config(&loaded.resolved, &name, transport.clone())?;
            Some((source, Arc::new(client)))
        })
        .collect();
    Ok(rows(config, clients).await)
}
