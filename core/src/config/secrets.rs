//! Credentials: header templates with `${NAME}` references, env files, and the redacting
//! [`Secret`] that holds a resolved value.
//!
//! Nothing here ever formats a value into an error or a `Debug` string: errors name the file,
//! the line, the header or the variable, never what they hold.

use std::collections::BTreeMap;
use std::fmt;

/// A value that must not be shown: a resolved header or an env file value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A header value as written: literal text and `${NAME}` references, in order.
#[derive(Clone, PartialEq, Eq)]
pub struct HeaderTemplate {
    parts: Vec<Part>,
}

#[derive(Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Var(String),
}

impl HeaderTemplate {
    /// Splits `text` into literals and `${NAME}` references (`NAME` = a letter or `_`, then
    /// letters, digits or `_`). A `$` not followed by `{` is literal; there is no escape syntax.
    pub fn parse(text: &str) -> Result<HeaderTemplate, String> {
        if text.contains(['\r', '\n', '\0']) {
            return Err("contains a line break or NUL, which a header value cannot hold".into());
        }
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find("${") {
            if at > 0 {
                parts.push(Part::Literal(rest[..at].to_string()));
            }
            let after = &rest[at + 2..];
            let Some(close) = after.find('}') else {
                return Err("has a ${ without its closing }: write ${NAME}".into());
            };
            let name = &after[..close];
            if !is_env_name(name) {
                return Err(format!(
                    "has the reference ${{{}}}, which is not a variable name: use letters, digits \
                     and _, not starting with a digit",
                    name.escape_debug()
                ));
            }
            parts.push(Part::Var(name.to_string()));
            rest = &after[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_string()));
        }
        Ok(HeaderTemplate { parts })
    }

    /// The variables this value refers to, in order of appearance.
    pub fn vars(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Var(v) => Some(v.as_str()),
            Part::Literal(_) => None,
        })
    }

    /// Substitutes every reference from `vars`; on failure returns the first missing name.
    pub fn resolve(&self, vars: &EnvVars) -> Result<Secret, String> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Literal(s) => out.push_str(s),
                Part::Var(v) => out.push_str(vars.get(v).ok_or_else(|| v.clone())?),
            }
        }
        Ok(Secret(out))
    }
}

impl fmt::Debug for HeaderTemplate {
    // Literal text may itself be a credential written inline, so only the names are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderTemplate")
            .field("vars", &self.vars().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

pub(crate) fn is_env_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// The variables of one env file. `Debug` shows the names only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EnvVars(BTreeMap<String, Secret>);

impl EnvVars {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(Secret::expose)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Secret)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for EnvVars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// Parses an env file: `NAME=value` lines, optionally prefixed `export `, `#` comment lines and
/// blank lines. A value wrapped in matching single or double quotes loses them; nothing else is
/// interpreted (no escapes, no `${}` expansion, no inline comments). A later line for the same
/// name wins, as in a shell. Errors carry 1-based line numbers and never the line's text.
pub fn parse_env_file(text: &str) -> Result<EnvVars, Vec<(usize, String)>> {
    let mut vars = BTreeMap::new();
    let mut errors = Vec::new();
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").map_or(line, str::trim_start);
        let Some((name, value)) = line.split_once('=') else {
            errors.push((i + 1, "is not NAME=value".to_string()));
            continue;
        };
        let name = name.trim_end();
        if !is_env_name(name) {
            errors.push((
                i + 1,
                "has a name that is not a variable name (letters, digits and _, not starting \
                 with a digit)"
                    .to_string(),
            ));
            continue;
        }
        let value = value.trim_start();
        let unquoted = match value.as_bytes().first() {
            Some(&q @ (b'"' | b'\'')) => {
                if value.len() >= 2 && value.as_bytes()[value.len() - 1] == q {
                    &value[1..value.len() - 1]
                } else {
                    errors.push((
                        i + 1,
                        format!(
                            "has a value opened with {} but not closed with it",
                            q as char
                        ),
                    ));
                    continue;
                }
            }
            _ => value,
        };
        vars.insert(name.to_string(), Secret(unquoted.to_string()));
    }
    if errors.is_empty() {
        Ok(EnvVars(vars))
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_format() {
        let text =
            "\u{feff}# tokens\n\nexport A=1\nB = \"two words\"\nC='x=y'\r\nD=\nE=\"\"\nA=3\n";
        let vars = parse_env_file(text).unwrap();
        assert_eq!(vars.get("A"), Some("3"));
        assert_eq!(vars.get("B"), Some("two words"));
        assert_eq!(vars.get("C"), Some("x=y"));
        assert_eq!(vars.get("D"), Some(""));
        assert_eq!(vars.get("E"), Some(""));
        assert_eq!(format!("{vars:?}"), r#"{"A", "B", "C", "D", "E"}"#);

        let errs =
            parse_env_file("OK=1\nno equals sign s3cret\n1X=s3cret\nQ=\"s3cret\n").unwrap_err();
        assert_eq!(errs.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert!(errs.iter().all(|(_, m)| !m.contains("s3cret")));
    }

    #[test]
    fn header_templates() {
        let t = HeaderTemplate::parse("Bearer ${TOKEN} and $plain ${_B2}").unwrap();
        assert_eq!(t.vars().collect::<Vec<_>>(), vec!["TOKEN", "_B2"]);
        let vars = parse_env_file("TOKEN=abc\n_B2=def").unwrap();
        assert_eq!(
            t.resolve(&vars).unwrap().expose(),
            "Bearer abc and $plain def"
        );
        assert_eq!(t.resolve(&EnvVars::default()).unwrap_err(), "TOKEN");
        assert!(!format!("{t:?}").contains("Bearer"));
        assert_eq!(format!("{:?}", t.resolve(&vars).unwrap()), "<redacted>");
        for bad in ["${", "x ${TOKEN", "${}", "${1A}", "${A-B}", "a\r\nb"] {
            assert!(HeaderTemplate::parse(bad).is_err(), "{bad}");
        }
    }
}
