//! What a reload changes: the running config against the one just loaded, table by table.
//!
//! The daemon acts on the answer: added harnesses start; a removed harness, or
//! one whose attempt runs on a removed lease source, is aborted ([`ConfigDiff::aborts`]); every
//! kept harness gets its new settings, which wait for an attempt in flight
//! (`relay::Relay::reconfigure`); a lease source whose url, headers or credentials changed gets
//! a fresh session ([`ConfigDiff::new_sessions`]). A table that only moved to another file, or
//! whose `description` changed, is unchanged: neither changes what runs.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Endpoint, Harness, ResolvedConfig, SourceKind, SourceRef};

/// The names one kind of table gained, lost and changed, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }

    fn of<T>(
        old: &BTreeMap<String, T>,
        new: &BTreeMap<String, T>,
        name: impl Fn(&str) -> String,
        mut same: impl FnMut(&str, &T, &T) -> bool,
    ) -> Changes {
        let mut c = Changes::default();
        for (n, o) in old {
            match new.get(n) {
                None => c.removed.push(name(n)),
                Some(v) if !same(n, o, v) => c.changed.push(name(n)),
                Some(_) => {}
            }
        }
        c.added = new
            .keys()
            .filter(|n| !old.contains_key(*n))
            .map(|n| name(n))
            .collect();
        c
    }
}

/// Harnesses by bare name; sources as references (`queue.ci`, `cairn.main`, `channel.bell`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ConfigDiff {
    pub harnesses: Changes,
    pub queues: Changes,
    /// Kept lease sources whose url, headers or resolved credentials changed: each needs a new
    /// session. Also listed in `queues.changed`.
    pub new_sessions: Vec<String>,
    pub cairns: Changes,
    pub channels: Changes,
}

impl ConfigDiff {
    pub fn is_empty(&self) -> bool {
        self.harnesses.is_empty()
            && self.queues.is_empty()
            && self.cairns.is_empty()
            && self.channels.is_empty()
    }

    /// Whether a reload ends the attempt of `harness` that runs on the lease source `lease`
    /// (`queue.<name>`, as the attempt's settings name it) as `StopReason::HarnessRemoved`: the
    /// harness is gone, or that source is. Any other change lets the attempt run on.
    pub fn aborts(&self, harness: &str, lease: &str) -> bool {
        self.harnesses.removed.iter().any(|h| h == harness)
            || self.queues.removed.iter().any(|q| q == lease)
    }
}

fn source_ref(kind: SourceKind, name: &str) -> SourceRef {
    SourceRef {
        kind,
        name: name.to_string(),
    }
}

/// The same url, header templates, env file and resolved header values.
fn same_session(
    old: &ResolvedConfig,
    new: &ResolvedConfig,
    r: &SourceRef,
    o: &Endpoint,
    n: &Endpoint,
) -> bool {
    o == n && old.headers(r) == new.headers(r)
}

/// The same table as far as running goes: everything but where it was declared and its
/// description.
fn same_harness(old: &ResolvedConfig, new: &ResolvedConfig, o: &Harness, n: &Harness) -> bool {
    let strip = |h: &Harness| Harness {
        declared_in: String::new(),
        description: None,
        ..h.clone()
    };
    let env = |c: &ResolvedConfig, h: &Harness| {
        h.env_file.as_deref().and_then(|p| c.env_file(p)).cloned()
    };
    strip(o) == strip(n) && env(old, o) == env(new, n)
}

/// Compares the running config with the one a reload loaded.
pub fn diff(old: &ResolvedConfig, new: &ResolvedConfig) -> ConfigDiff {
    let (oc, nc) = (&old.config, &new.config);
    let harnesses = Changes::of(&oc.harnesses, &nc.harnesses, str::to_string, |_, o, n| {
        same_harness(old, new, o, n)
    });
    let queue_ref = |n: &str| source_ref(SourceKind::Queue, n);
    let mut new_sessions = Vec::new();
    let queues = Changes::of(
        &oc.queues,
        &nc.queues,
        |n| queue_ref(n).to_string(),
        |name, o, n| {
            let session = same_session(old, new, &queue_ref(name), &o.endpoint, &n.endpoint);
            if !session {
                new_sessions.push(queue_ref(name).to_string());
            }
            session
                && (
                    o.queue.as_ref(),
                    o.lease_ttl,
                    o.heartbeat_interval,
                    o.enabled,
                ) == (
                    n.queue.as_ref(),
                    n.lease_ttl,
                    n.heartbeat_interval,
                    n.enabled,
                )
        },
    );
    let cairns = Changes::of(
        &oc.cairns,
        &nc.cairns,
        |n| source_ref(SourceKind::Cairn, n).to_string(),
        |name, o, n| {
            let r = source_ref(SourceKind::Cairn, name);
            same_session(old, new, &r, &o.endpoint, &n.endpoint)
                && (o.ttl, o.enabled) == (n.ttl, n.enabled)
        },
    );
    let channels = Changes::of(
        &oc.channels,
        &nc.channels,
        |n| source_ref(SourceKind::Channel, n).to_string(),
        |name, o, n| {
            let r = source_ref(SourceKind::Channel, name);
            same_session(old, new, &r, &o.endpoint, &n.endpoint) && o.enabled == n.enabled
        },
    );
    ConfigDiff {
        harnesses,
        queues,
        new_sessions,
        cairns,
        channels,
    }
}
