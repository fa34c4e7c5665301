//! The server's Prometheus metrics (OpenMetrics text at `GET /metrics`).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use relay_core::ledger::{Disposition, Outcome};

type Labels = Vec<(String, String)>;

pub(crate) struct Metrics {
    registry: Registry,
    pub(crate) todos: Family<Labels, Gauge>,
    /// What each queue's kept todos spent: dollars, and tokens by direction.
    spent_cost: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    spent_tokens: Family<Labels, Gauge>,
    /// The limited queues' limits, and the waiting todos they hold back.
    queue_limits: Family<Labels, Gauge>,
    held_back: Family<Labels, Gauge>,
    pub(crate) attempts_closed: Family<Labels, Counter>,
    pub(crate) dead_letters: Family<Labels, Counter>,
    pub(crate) claim_latency: Histogram,
    pub(crate) heartbeats: Counter,
    pub(crate) tool_calls: Family<Labels, Counter>,
    pub(crate) doorbell_rings: Counter,
    pub(crate) sessions: Gauge,
    pub(crate) connections_refused: Counter,
    store_timeouts: Counter,
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("relay");
        let todos = Family::<Labels, Gauge>::default();
        registry.register(
            "todos",
            "Todos in the store by state, counted when scraped",
            todos.clone(),
        );
        let spent_cost = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "spent_cost_usd",
            "What the todos kept in each queue spent, in US dollars, summed when scraped",
            spent_cost.clone(),
        );
        let spent_tokens = Family::<Labels, Gauge>::default();
        registry.register(
            "spent_tokens",
            "Tokens the todos kept in each queue spent, by direction (input, output)",
            spent_tokens.clone(),
        );
        let queue_limits = Family::<Labels, Gauge>::default();
        registry.register(
            "queue_limit",
            "Each queue's flow limits (max_claimed, max_claimed_per_key, claims_per_minute), \
             read when scraped",
            queue_limits.clone(),
        );
        let held_back = Family::<Labels, Gauge>::default();
        registry.register(
            "queue_held_back",
            "Waiting todos a queue's flow limits hold back now, counted when scraped",
            held_back.clone(),
        );
        let attempts_closed = Family::<Labels, Counter>::default();
        registry.register(
            "attempts_closed",
            "Attempts this server closed, by outcome and disposition",
            attempts_closed.clone(),
        );
        let dead_letters = Family::<Labels, Counter>::default();
        registry.register(
            "dead_letters",
            "Todos this server made dead letters, by dead_letter_reason",
            dead_letters.clone(),
        );
        // 0.5 ms to ~4 s: an SQLite claim is well under a millisecond, a remote Postgres one a
        // few; the tail shows lock waits.
        let claim_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register(
            "claim_latency_seconds",
            "Time a claim or claim_next spent in the store",
            claim_latency.clone(),
        );
        let heartbeats = Counter::default();
        registry.register("heartbeats", "Heartbeats accepted", heartbeats.clone());
        let tool_calls = Family::<Labels, Counter>::default();
        registry.register(
            "tool_calls",
            "tools/call requests by tool and result (ok or the error code)",
            tool_calls.clone(),
        );
        let doorbell_rings = Counter::default();
        registry.register(
            "doorbell_rings",
            "notifications/todo_ready sent on session streams",
            doorbell_rings.clone(),
        );
        let sessions = Gauge::default();
        registry.register("sessions", "Live MCP sessions", sessions.clone());
        let connections_refused = Counter::default();
        registry.register(
            "connections_refused",
            "Connections refused at the maximum of open connections",
            connections_refused.clone(),
        );
        let store_timeouts = Counter::default();
        registry.register(
            "store_timeouts",
            "MCP requests and Board pages answered 503 because the store did not answer within the answer timeout",
            store_timeouts.clone(),
        );
        Metrics {
            registry,
            todos,
            spent_cost,
            spent_tokens,
            queue_limits,
            held_back,
            attempts_closed,
            dead_letters,
            claim_latency,
            heartbeats,
            tool_calls,
            doorbell_rings,
            sessions,
            connections_refused,
            store_timeouts,
        }
    }

    /// A request answered 503 for want of the store's answer.
    pub(crate) fn store_timeout(&self) {
        self.store_timeouts.inc();
    }

    pub(crate) fn closed(&self, outcome: Outcome, disposition: Disposition) {
        self.attempts_closed
            .get_or_create(&vec![
                ("outcome".to_string(), outcome.as_str().to_string()),
                ("disposition".to_string(), disposition.as_str().to_string()),
            ])
            .inc();
    }

    /// A todo became a dead letter (`reason` as `dead_letter_reason` spells it).
    pub(crate) fn dead_letter(&self, reason: &str) {
        self.dead_letters
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    pub(crate) fn tool_call(&self, tool: &str, result: &str) {
        self.tool_calls
            .get_or_create(&vec![
                ("tool".to_string(), tool.to_string()),
                ("result".to_string(), result.to_string()),
            ])
            .inc();
    }

    /// A queue's spend, as `spend_by_queue` sums it.
    pub(crate) fn set_spent(&self, queue: &str, u: &relay_core::ledger::Usage) {
        let q = ("queue".to_string(), queue.to_string());
        self.spent_cost
            .get_or_create(&vec![q.clone()])
            .set(relay_core::ledger::cost_usd(u.cost_micros));
        for (dir, n) in [("input", u.input_tokens), ("output", u.output_tokens)] {
            self.spent_tokens
                .get_or_create(&vec![q.clone(), ("direction".to_string(), dir.to_string())])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The limited queues' limits and held-back todos (a queue whose limits were lifted since the
    /// last scrape drops out).
    pub(crate) fn set_flow(&self, lines: &[relay_core::ledger::flow::QueueLine]) {
        self.queue_limits.clear();
        self.held_back.clear();
        for l in lines.iter().filter(|l| !l.limits.is_empty()) {
            let q = ("queue".to_string(), l.queue.clone());
            for (name, v) in l.limits.each() {
                if let Some(n) = v {
                    self.queue_limits
                        .get_or_create(&vec![q.clone(), ("limit".to_string(), name.to_string())])
                        .set(i64::from(n));
                }
            }
            self.held_back
                .get_or_create(&vec![q])
                .set(i64::try_from(l.held_back).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn set_todos(&self, state: &str, n: u64) {
        self.todos
            .get_or_create(&vec![("state".to_string(), state.to_string())])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
