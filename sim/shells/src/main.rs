//! The shell-sim sweep. See `sweep/`; a normal build has only this stub.

#[cfg(madsim)]
mod sweep;

#[cfg(madsim)]
fn main() -> std::process::ExitCode {
    sweep::main()
}

#[cfg(not(madsim))]
fn main() {
    eprintln!(
        "relay-shell-sim runs only in a madsim build: \
         RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/madsim cargo run -p relay-shell-sim -- --seeds 100"
    );
    std::process::exit(2);
}
