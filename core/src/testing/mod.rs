//! Bodies of the property tests and fuzz targets, shared so that `cargo test` (proptest, on
//! stable) and `cargo fuzz` (libFuzzer) hammer exactly the same code. Compiled for tests and
//! behind the `testing` feature; never part of a production build.

pub mod config;
mod fuzz;
mod ledger_program;
mod model;
pub mod relay;

pub use fuzz::*;
pub use ledger_program::*;
pub use model::*;

/// An in-memory ledger served as the server serves it: tool calls and task methods through
/// [`crate::serve`], at the time `now` (a test moves it), drawing from a [`SeqDraw`].
pub struct ServingWorld {
    pub ledger: crate::ledger::Ledger,
    pub draw: SeqDraw,
    pub now: crate::Millis,
}

impl Default for ServingWorld {
    fn default() -> ServingWorld {
        ServingWorld {
            ledger: crate::ledger::Ledger::new(crate::ledger::LedgerConfig::default()),
            draw: SeqDraw::default(),
            now: 1_000_000,
        }
    }
}

impl ServingWorld {
    /// Calls `tool` with `args` for `caller`.
    pub fn call(
        &mut self,
        caller: &crate::serve::Caller,
        tool: &str,
        args: serde_json::Value,
    ) -> Result<crate::serve::Served, crate::Error> {
        let params = serde_json::json!({"name": tool, "arguments": args});
        let (tool, args) = crate::serve::tool_of(&params).map_err(crate::Error::invalid)?;
        let ledger = &mut self.ledger;
        crate::serve::serve(tool, args, caller.clone(), self.now, &mut self.draw, |op| {
            ledger.apply(op)
        })
    }

    /// Calls the task method `method` with `params` for `caller`.
    pub fn task(
        &mut self,
        caller: &crate::serve::Caller,
        method: crate::task::TaskMethod,
        params: serde_json::Value,
    ) -> Result<crate::serve::TaskServed, crate::Error> {
        let call = crate::task::TaskCall::decode(method, Some(&params))?;
        let (mut serving, step) = crate::serve::TaskServing::start(call, caller.clone(), self.now);
        let ledger = &mut self.ledger;
        crate::serve::drive(&mut serving, step, &mut self.draw, |op| ledger.apply(op))
    }
}

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
