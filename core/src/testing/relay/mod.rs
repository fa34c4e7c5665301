//! Everything a relay test needs to drive [`crate::relay::Relay`] in a few lines, and the
//! bodies of its property tests (each takes the bytes of a program, so a fuzz target can
//! reuse it as it is).

mod driver;
mod program;
mod properties;

pub use driver::*;
pub use program::*;
pub use properties::*;
