//! Bodies of the property tests and fuzz targets, shared so that `cargo test` (proptest, on
//! stable) and `cargo fuzz` (libFuzzer) hammer exactly the same code. Compiled for tests and
//! behind the `testing` feature; never part of a production build.

mod fuzz;
mod ledger_program;
mod model;
pub mod relay;

pub use fuzz::*;
pub use ledger_program::*;
pub use model::*;
