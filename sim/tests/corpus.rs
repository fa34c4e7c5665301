//! Replays every committed fuzz input (fuzz/corpus/<target>/*) through its target's body, so
//! that `cargo test` on stable keeps every input a fuzzer ever saved (crashes included, once
//! fixed) passing.

use std::path::Path;

fn replay(target: &str, body: impl Fn(&[u8]) -> Result<(), String>) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    for f in &files {
        let data = std::fs::read(f).expect("read corpus file");
        if let Err(e) = body(&data) {
            panic!("{target}: {} fails: {e}", f.display());
        }
    }
    files.len()
}

#[test]
fn every_committed_fuzz_input_passes() {
    use relay_core::testing as t;
    let counts = [
        ("ledger_ops", replay("ledger_ops", t::ledger_ops)),
        (
            "relay_transitions",
            replay("relay_transitions", t::relay_transitions),
        ),
        (
            "sim_scenario",
            replay("sim_scenario", relay_sim::fuzz_scenario),
        ),
        (
            "wire_decode",
            replay("wire_decode", |d| {
                t::wire_decode(d);
                Ok(())
            }),
        ),
        (
            "config_parse",
            replay("config_parse", |d| {
                t::config_parse(d);
                Ok(())
            }),
        ),
        (
            "summary_compose",
            replay("summary_compose", t::summary_compose),
        ),
    ];
    for (target, n) in counts {
        assert!(n > 0, "{target} has no committed corpus");
    }
}
