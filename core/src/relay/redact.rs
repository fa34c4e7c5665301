//! The credential redactor for summaries, receipts and warnings.
//!
//! Two passes. First, every known secret value (header values, env_file values, the lease
//! token) is replaced wherever it occurs. Then credential-shaped strings are masked, keeping a
//! recognisable prefix so that a reader sees what kind of secret was there:
//!
//! | shape | example | becomes |
//! |---|---|---|
//! | GitHub tokens `ghp_ gho_ ghs_ ghu_ ghr_` + 20 or more letters/digits | `ghp_abc…` | `ghp_[REDACTED]` |
//! | GitHub fine-grained `github_pat_` + 20 or more of `[A-Za-z0-9_]` | | `github_pat_[REDACTED]` |
//! | AWS access key ids `AKIA` / `ASIA` + 16 of `[A-Z0-9]` | | `AKIA[REDACTED]` |
//! | Slack `xoxa- xoxb- xoxe- xoxp- xoxr- xoxs-` + 10 or more of `[A-Za-z0-9-]` | | `xoxb-[REDACTED]` |
//! | API keys `sk-` + 20 or more of `[A-Za-z0-9_-]` (OpenAI, Anthropic) | | `sk-[REDACTED]` |
//! | `Bearer <x>`, `Basic <x>` (any case), `x` of 8 or more token characters | | `Bearer [REDACTED]` |
//! | JWT-looking triples `eyJ….….…` (base64url, 5+ each) | | `[REDACTED]` |
//! | `password=x`, `token: x` … (keys below, `=` or `:`, optional quotes) | | `password=[REDACTED]` |
//!
//! A shape only matches at the start of a word (the character before it is not a letter or a
//! digit), so `task-1234` is not an `sk-` key. Secret values shorter than
//! [`MIN_SECRET_LEN`] bytes are not searched for: masking every `1` or `on` would destroy the
//! text and protect nothing.

/// Known secret values shorter than this are not redacted by value.
pub const MIN_SECRET_LEN: usize = 4;

const MASK: &str = "[REDACTED]";

/// Keys whose `=`/`:` value is masked.
const SECRET_KEYS: [&str; 13] = [
    "password",
    "passwd",
    "pwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "access_key",
    "secret_key",
    "private_key",
    "client_secret",
    "auth",
    "authorization",
];

/// A redactor for one attempt: the generic shapes plus the attempt's own secret values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Redactor {
    /// Longest first, so that a secret containing another is masked whole.
    secrets: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor(<{} secrets>)", self.secrets.len())
    }
}

impl Redactor {
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Redactor {
        let mut secrets: Vec<String> = secrets
            .into_iter()
            .filter(|s| s.len() >= MIN_SECRET_LEN)
            .map(str::to_string)
            .collect();
        secrets.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        secrets.dedup();
        Redactor { secrets }
    }

    pub fn redact(&self, text: &str) -> String {
        let mut text = text.to_string();
        for secret in &self.secrets {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), MASK);
            }
        }
        redact_shapes(&text)
    }
}

fn redact_shapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut prev: Option<char> = None;
    while i < text.len() {
        let rest = &text[i..];
        let at_word_start = prev.is_none_or(|c| !c.is_ascii_alphanumeric());
        if at_word_start && let Some((keep, len)) = match_shape(rest) {
            out.push_str(&rest[..keep]);
            out.push_str(MASK);
            i += len;
            prev = rest[..len].chars().last();
            continue;
        }
        let c = rest.chars().next().unwrap_or_default();
        out.push(c);
        prev = Some(c);
        i += c.len_utf8();
    }
    out
}

/// `Some((kept prefix length, matched length))` when a credential shape starts `s`.
fn match_shape(s: &str) -> Option<(usize, usize)> {
    let b = s.as_bytes();
    let run = |from: usize, ok: &dyn Fn(u8) -> bool| {
        b[from.min(b.len())..]
            .iter()
            .take_while(|&&c| ok(c))
            .count()
    };
    let alnum = |c: u8| c.is_ascii_alphanumeric();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let dashed = |c: u8| c.is_ascii_alphanumeric() || c == b'-';
    let b64url = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'-';

    for p in ["ghp_", "gho_", "ghs_", "ghu_", "ghr_"] {
        if s.starts_with(p) && run(p.len(), &alnum) >= 20 {
            return Some((p.len(), p.len() + run(p.len(), &alnum)));
        }
    }
    if s.starts_with("github_pat_") && run(11, &word) >= 20 {
        return Some((11, 11 + run(11, &word)));
    }
    if (s.starts_with("AKIA") || s.starts_with("ASIA"))
        && run(4, &|c: u8| c.is_ascii_uppercase() || c.is_ascii_digit()) >= 16
    {
        return Some((4, 20));
    }
    for p in ["xoxa-", "xoxb-", "xoxe-", "xoxp-", "xoxr-", "xoxs-"] {
        if s.starts_with(p) && run(p.len(), &dashed) >= 10 {
            return Some((p.len(), p.len() + run(p.len(), &dashed)));
        }
    }
    if s.starts_with("sk-") && run(3, &b64url) >= 20 {
        return Some((3, 3 + run(3, &b64url)));
    }
    for scheme in ["bearer", "basic"] {
        let n = scheme.len();
        if b.len() > n + 1 && b[..n].eq_ignore_ascii_case(scheme.as_bytes()) && b[n] == b' ' {
            let spaces = run(n, &|c| c == b' ');
            let token = |c: u8| c.is_ascii_alphanumeric() || b"-._~+/=".contains(&c);
            let len = run(n + spaces, &token);
            if len >= 8 {
                return Some((n + spaces, n + spaces + len));
            }
        }
    }
    if s.starts_with("eyJ") {
        let first = run(0, &b64url);
        if first >= 5 && b.get(first) == Some(&b'.') {
            let second = run(first + 1, &b64url);
            let end2 = first + 1 + second;
            if second >= 5 && b.get(end2) == Some(&b'.') {
                let third = run(end2 + 1, &b64url);
                if third >= 5 {
                    return Some((0, end2 + 1 + third));
                }
            }
        }
    }
    secret_pair(s)
}

/// `password=x`, `"token": "x"`, `api_key : x` … : keep the key and separator, mask the value.
fn secret_pair(s: &str) -> Option<(usize, usize)> {
    let b = s.as_bytes();
    let key_len = SECRET_KEYS
        .iter()
        .filter(|k| b.len() > k.len() && b[..k.len()].eq_ignore_ascii_case(k.as_bytes()))
        .map(|k| k.len())
        .max()?;
    // The key must end the word: `tokens=` and `tokenizer:` are not credentials.
    if b[key_len].is_ascii_alphanumeric() || b[key_len] == b'_' {
        return None;
    }
    let mut i = key_len;
    let skip = |i: &mut usize, set: &[u8]| {
        while *i < b.len() && set.contains(&b[*i]) {
            *i += 1;
        }
    };
    skip(&mut i, b"\"'");
    skip(&mut i, b" ");
    if i >= b.len() || !(b[i] == b'=' || b[i] == b':') {
        return None;
    }
    i += 1;
    skip(&mut i, b" ");
    skip(&mut i, b"\"'");
    let start = i;
    while i < b.len() && !(b[i].is_ascii_whitespace() || b"\"'&,;".contains(&b[i])) {
        i += 1;
    }
    let value = &s[start..i];
    // `Authorization: Bearer x` is left to the Bearer shape, which masks the token itself.
    let scheme = ["bearer", "basic"]
        .iter()
        .any(|w| value.eq_ignore_ascii_case(w));
    if value.is_empty() || value.starts_with(MASK) || scheme {
        return None;
    }
    Some((start, i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> String {
        Redactor::new(["hunter2-secret-value"]).redact(s)
    }

    #[test]
    fn shapes_are_masked_with_their_prefix() {
        let gh = format!("ghp_{}", "a1B2".repeat(9));
        assert_eq!(
            r(&format!("token {gh} leaked")),
            "token ghp_[REDACTED] leaked"
        );
        assert_eq!(
            r("github_pat_11ABCDEFG0123456789_abcdefghijklmnop"),
            "github_pat_[REDACTED]"
        );
        assert_eq!(r("id AKIAIOSFODNN7EXAMPLE."), "id AKIA[REDACTED].");
        assert_eq!(r("xoxb-1234567890-abcdef"), "xoxb-[REDACTED]");
        assert_eq!(r("key sk-proj-abcdefghijklmnopqrstuv"), "key sk-[REDACTED]");
        assert_eq!(
            r("Authorization: Bearer abc.def-123456"),
            "Authorization: Bearer [REDACTED]"
        );
        assert_eq!(
            r("jwt eyJhbGciOi.eyJzdWIiOi.SflKxwRJSM end"),
            "jwt [REDACTED] end"
        );
        assert_eq!(r("password=hunter22&user=x"), "password=[REDACTED]&user=x");
        assert_eq!(
            r(r#"{"api_key": "abc123"}"#),
            r#"{"api_key": "[REDACTED]"}"#
        );
        assert_eq!(r("GITHUB_TOKEN=abc123"), "GITHUB_TOKEN=[REDACTED]");
    }

    #[test]
    fn known_values_and_ordinary_text() {
        assert_eq!(r("x hunter2-secret-value y"), "x [REDACTED] y");
        for plain in [
            "task-1234 passed",
            "tokens: 5",
            "ask-me",
            "the tokenizer: fine",
            "é ü",
        ] {
            assert_eq!(r(plain), plain);
        }
        // Too short to search for by value.
        assert_eq!(Redactor::new(["on"]).redact("on and on"), "on and on");
    }
}
