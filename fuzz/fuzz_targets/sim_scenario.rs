#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| relay_sim::fuzz_scenario(data).unwrap());
