//! relay-sim: the deterministic discrete-event simulator.
//!
//! It drives the real relay-core machines (the ledger as the queue server, relay machines as
//! workers) over a simulated network and clock that inject faults, and checks invariants after
//! every event. It never uses async, threads, wall-clock time or unseeded randomness: the same
//! seed gives the same run, byte for byte.
//!
//! This crate is filled in by the simulator work; today it only re-exports core.

pub use relay_core as core;
