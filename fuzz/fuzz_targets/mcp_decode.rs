#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| relay_core::testing::mcp_decode(data));
