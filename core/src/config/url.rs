//! The narrow URL check the config needs: scheme, userinfo, host, port, path.
//!
//! Not a general URL parser. It accepts `http://` and `https://` URLs with a host, and refuses
//! anything that would send credentials in the clear or in the URL itself.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// A checked source URL. `raw` is the string as written; the other fields are views of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    raw: String,
    /// `"http"` or `"https"`, lower-cased.
    pub scheme: String,
    /// The host as written (IPv6 literals without their brackets), lower-cased.
    pub host: String,
    pub port: Option<u16>,
    /// Everything from the first `/` or `?` after the authority; may be empty.
    pub path: String,
}

impl Url {
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// True when the host is `localhost`, in 127.0.0.0/8, or `::1`.
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.host)
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

fn is_loopback_host(host: &str) -> bool {
    if host == "localhost" || host == "localhost." {
        return true;
    }
    if let Ok(v4) = host.parse::<Ipv4Addr>() {
        return v4.is_loopback();
    }
    host.parse::<Ipv6Addr>().is_ok_and(|v6| v6.is_loopback())
}

/// Checks a source URL: `https`, or `http` to a loopback host; a host; no userinfo; a valid port.
///
/// The error text never repeats the URL, because a URL with userinfo carries a password.
pub fn parse_url(text: &str) -> Result<Url, String> {
    if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("must not contain spaces or control characters".to_string());
    }
    let Some((scheme, rest)) = text.split_once("://") else {
        return Err("is not a URL: write it as https://HOST[:PORT]/PATH".to_string());
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "https" && scheme != "http" {
        return Err(format!(
            "uses the scheme {scheme:?}: only https (or http to a loopback host) is supported"
        ));
    }
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    if path.contains('#') {
        return Err("must not carry a #fragment: remove it".to_string());
    }
    if authority.contains('@') {
        return Err(
            "must not carry userinfo (user:password@): move credentials into headers, \
             with the secret in the source's env_file"
                .to_string(),
        );
    }
    let (host, port) = split_host_port(authority)?;
    let host = host.to_ascii_lowercase();
    let url = Url {
        raw: text.to_string(),
        scheme,
        host,
        port,
        path: path.to_string(),
    };
    if url.scheme == "http" && !url.is_loopback() {
        return Err(format!(
            "uses http to the non-loopback host {}: use https (plain http is only allowed to \
             localhost, 127.0.0.0/8 or ::1)",
            url.host
        ));
    }
    Ok(url)
}

fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), String> {
    let (host, port) = if let Some(after) = authority.strip_prefix('[') {
        let Some((v6, tail)) = after.split_once(']') else {
            return Err("has an IPv6 host without its closing ]".to_string());
        };
        if v6.parse::<Ipv6Addr>().is_err() {
            return Err("has an invalid IPv6 host".to_string());
        }
        let port = match tail {
            "" => None,
            t => Some(t.strip_prefix(':').ok_or("has text after the IPv6 host")?),
        };
        (v6, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("has no host: write it as https://HOST[:PORT]/PATH".to_string());
    }
    if !authority.starts_with('[')
        && !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        return Err("has a host with characters a host name cannot hold".to_string());
    }
    let port = match port {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => Some(n),
            _ => return Err("has a port that is not a number from 1 to 65535".to_string()),
        },
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_https_and_loopback_http() {
        let u = parse_url("https://Switchboard.example.com/mcp/ci-fixer").unwrap();
        assert_eq!(
            (u.scheme.as_str(), u.host.as_str()),
            ("https", "switchboard.example.com")
        );
        assert_eq!((u.port, u.path.as_str()), (None, "/mcp/ci-fixer"));
        for ok in [
            "http://127.0.0.1:8080/mcp/x",
            "http://127.9.9.9/mcp",
            "http://localhost:3000",
            "http://[::1]:8080/mcp",
            "https://[2001:db8::1]/mcp",
            "https://cairn.example.com",
        ] {
            parse_url(ok).expect(ok);
        }
        assert_eq!(parse_url("http://[::1]:8080/mcp").unwrap().port, Some(8080));
    }

    #[test]
    fn userinfo_and_http_url_rejection() {
        let err = parse_url("https://bob:hunter2@sb.example.com/mcp").unwrap_err();
        assert!(
            err.contains("userinfo") && !err.contains("hunter2"),
            "{err}"
        );
        let err = parse_url("http://sb.example.com/mcp").unwrap_err();
        assert!(err.contains("https"), "{err}");
        for bad in [
            "ftp://x.example.com",
            "sb.example.com/mcp",
            "https://",
            "https:///path",
            "https://host:0/",
            "https://host:99999/",
            "https://host:/",
            "https://ho st/",
            "https://[::1/",
            "https://host/#frag",
            "http://128.0.0.1/",
            "http://localhost.example.com/",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
