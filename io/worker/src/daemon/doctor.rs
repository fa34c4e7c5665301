//! `relay doctor`: the rows of `relay_core::relay::doctor` for the lease sources a
//! config binds, from the daemon's own clients or, with no daemon running, from clients made
//! here for the purpose. Either way each source's client opens its link when it has none (the
//! era's probe, initialize in the legacy era, then tools/list), its tool list is judged the same
//! way, and a row says which era the source speaks.

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
                let mut rows =
                    relay::doctor::source_rows(&name, Ok(&relay::check_capabilities(&list.tools)));
                if let Some(era) = client.era() {
                    rows.push(relay::doctor::era_row(&name, &era));
                }
                rows
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
