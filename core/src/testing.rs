//! placeholder

// ---- config (relay_core::config) --------------------------------------------------------------
// Property bodies for the config model. Other modules add their own blocks; keep this one apart.

/// Parsing arbitrary text as a main file, as a drop-in, and as both, under both file kinds, never
/// panics; every error is one non-empty line that names its key or table, or says the TOML is
/// malformed. A config that parses also resolves (against env files holding the same text) and
/// evaluates its schedules and hours without panicking, under the same rule for errors.
pub fn config_parse_never_panics(text: &str) {
    use crate::config::{ConfigError, FileKind, Source, parse, resolve};
    use std::collections::BTreeMap;

    fn check(e: &ConfigError) {
        let shown = e.to_string();
        assert!(!e.message.trim().is_empty(), "empty error message: {e:?}");
        assert!(!shown.contains('\n'), "error spans lines: {shown}");
        let names_key = e.key.as_deref().is_some_and(|k| e.message.contains(k));
        let names_table = e
            .table
            .as_deref()
            .is_some_and(|t| shown.contains(&format!("[{t}]")));
        let malformed =
            e.key.is_none() && e.table.is_none() && e.message.contains("not valid TOML");
        assert!(
            names_key || names_table || malformed,
            "error names no key: {shown}"
        );
    }

    let main = Source::new("harness.toml", text);
    let empty = Source::new("harness.toml", "");
    let dropin = Source::new("harness.d/10-x.toml", text);
    for kind in [FileKind::Global, FileKind::Project] {
        let runs = [
            parse(&main, &[], kind),
            parse(&empty, std::slice::from_ref(&dropin), kind),
            parse(&main, std::slice::from_ref(&dropin), kind),
        ];
        for run in runs {
            match run {
                Err(errors) => {
                    assert!(!errors.0.is_empty(), "Err without errors");
                    errors.0.iter().for_each(check);
                }
                Ok(config) => {
                    for h in config.harnesses.values() {
                        for now in [0, 1_790_000_000_000, u64::MAX] {
                            if let Some(s) = &h.schedule {
                                let next = s.next_after(now);
                                assert!(next > now || next == u64::MAX, "schedule went back");
                            }
                            if let Some(hours) = &h.operating_hours {
                                let _ = hours.contains(now);
                            }
                        }
                    }
                    let none = BTreeMap::new();
                    let same: BTreeMap<String, String> = config
                        .env_files()
                        .into_iter()
                        .map(|p| (p.to_string(), text.to_string()))
                        .collect();
                    for files in [&none, &same] {
                        if let Err(errors) = resolve(&config, files) {
                            errors.0.iter().for_each(check);
                        }
                    }
                }
            }
        }
    }
}
// ---- end config -------------------------------------------------------------------------------
