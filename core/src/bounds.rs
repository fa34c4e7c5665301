//! Size and shape bounds on the text an attempt carries: summary, claimant, artifact.
//!
//! One place for these rules: the ledger applies them to what reporters send, and the relay
//! machine applies the same ones to what it is about to send.

use crate::error::Error;

/// Summaries are stored up to this many bytes (a reporter's prose never loses its verdict).
pub const SUMMARY_MAX_BYTES: usize = 2048;
/// Claimant labels are stored up to this many bytes.
pub const CLAIMANT_MAX_BYTES: usize = 128;
/// Artifact handles longer than this are rejected.
pub const ARTIFACT_MAX_BYTES: usize = 512;

/// The longest prefix of `s` that is at most `max` bytes and ends on a char boundary.
pub fn cut_at_char_boundary(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Whether prose (a summary) may keep `c`: every character but the control characters
/// (Unicode `Cc`: NUL and the other C0 controls, DEL, the C1 controls), of which tab and newline
/// are kept. Non-BMP characters are ordinary characters. NUL is the one Postgres `text` cannot
/// hold; the other controls are refused alike so that both stores keep the same text.
pub fn prose_char(c: char) -> bool {
    !c.is_control() || c == '\n' || c == '\t'
}

/// A summary made storable (truncate, never reject): characters [`prose_char`] refuses are
/// removed, then the text is cut to [`SUMMARY_MAX_BYTES`] at the last whole character. The flag
/// is `true` when the stored text differs from what was sent (cut, cleaned, or both).
pub fn bound_summary(s: &str) -> (String, bool) {
    let clean: std::borrow::Cow<'_, str> = if s.chars().all(prose_char) {
        s.into()
    } else {
        s.chars()
            .filter(|c| prose_char(*c))
            .collect::<String>()
            .into()
    };
    let cut = cut_at_char_boundary(&clean, SUMMARY_MAX_BYTES);
    (cut.to_string(), cut.len() < s.len())
}

/// A claimant label with control characters removed, cut to [`CLAIMANT_MAX_BYTES`]; `None` when
/// nothing printable is left.
pub fn bound_claimant(s: &str) -> Option<String> {
    let clean: String = s.chars().filter(|c| !c.is_control()).collect();
    let cut = cut_at_char_boundary(&clean, CLAIMANT_MAX_BYTES);
    (!cut.is_empty()).then(|| cut.to_string())
}

/// Why an artifact handle is not acceptable, or `Ok` when it is an `mcp://cairn/<id>` handle
/// (`id` of ASCII letters, digits, `_` and `-`) or an `https://` URL with a host, without
/// credentials, whitespace or control characters, of at most [`ARTIFACT_MAX_BYTES`] bytes.
pub fn check_artifact(s: &str) -> Result<(), String> {
    if s.len() > ARTIFACT_MAX_BYTES {
        return Err(format!(
            "is {} bytes; handles are at most {ARTIFACT_MAX_BYTES} bytes",
            s.len()
        ));
    }
    if let Some(id) = s.strip_prefix("mcp://cairn/") {
        let ok = !id.is_empty()
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        return if ok {
            Ok(())
        } else {
            Err("is an mcp://cairn/ handle whose id is not 1+ letters, digits, '_' or '-'".into())
        };
    }
    let Some(rest) = s.strip_prefix("https://") else {
        return Err("must be an mcp://cairn/<id> handle or an https:// URL".into());
    };
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace or control characters".into());
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') {
        return Err("carries credentials (user@host); remove them from the URL".into());
    }
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    if host.is_empty() {
        return Err("is an https:// URL without a host".into());
    }
    Ok(())
}

/// [`check_artifact`] as the ledger's `invalid` error, naming the operation and the todo.
pub fn validate_artifact(op: &str, todo_id: &str, artifact: &str) -> Result<(), Error> {
    check_artifact(artifact).map_err(|why| {
        Error::invalid(format!(
            "{op} {todo_id}: artifact {why}; send a valid handle or omit artifact"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_is_cut_on_a_char_boundary_and_flagged() {
        let s = "é".repeat(1500); // 3000 bytes
        let (cut, truncated) = bound_summary(&s);
        assert!(truncated);
        assert_eq!(cut.len(), 2048);
        assert!(cut.chars().all(|c| c == 'é'));
        let (same, truncated) = bound_summary("short");
        assert_eq!((same.as_str(), truncated), ("short", false));
        // A 3-byte char straddling the limit is dropped whole.
        let s = format!("{}€", "a".repeat(2047));
        assert_eq!(bound_summary(&s).0.len(), 2047);
    }

    #[test]
    fn claimant_loses_control_characters_and_is_capped() {
        assert_eq!(bound_claimant("run\u{7}-1\n").as_deref(), Some("run-1"));
        assert_eq!(bound_claimant("\n\t"), None);
        assert_eq!(bound_claimant(&"x".repeat(300)).map(|s| s.len()), Some(128));
    }

    #[test]
    fn artifact_shapes() {
        for ok in [
            "mcp://cairn/Ab12Cd34",
            "https://example.com/a/b?c=d",
            "https://[::1]:8443/x",
        ] {
            assert_eq!(check_artifact(ok), Ok(()), "{ok}");
        }
        for bad in [
            "file:///etc/passwd",
            "http://example.com",
            "mcp://cairn/",
            "mcp://cairn/a/b",
            "https://user:pw@example.com/",
            "https:///path",
            "https://exa mple.com",
        ] {
            assert!(check_artifact(bad).is_err(), "{bad}");
        }
        let long = format!("https://e.com/{}", "a".repeat(600));
        assert!(check_artifact(&long).unwrap_err().contains("512"));
    }
}
