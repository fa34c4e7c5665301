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

/// What a test's calls draw, in sequence: todo ids `td_1`, `td_2` …, fence tokens `tok-N` and
/// task secrets (N in hex), from one counter.
#[derive(Default)]
pub struct SeqDraw(pub u32);

impl crate::serve::Draw for SeqDraw {
    fn todo_id(&mut self) -> Result<String, crate::Error> {
        self.0 += 1;
        Ok(format!("td_{}", self.0))
    }
    fn lease_token(&mut self) -> Result<crate::wire::LeaseToken, crate::Error> {
        self.0 += 1;
        Ok(crate::wire::LeaseToken::new(format!("tok-{}", self.0)))
    }
    fn task_secret(&mut self) -> Result<String, crate::Error> {
        self.0 += 1;
        Ok(format!("{:040x}", self.0))
    }
}
