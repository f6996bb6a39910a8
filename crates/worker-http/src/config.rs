//! The `[http]` section of `airlock.toml`.

use std::time::Duration;

use crate::egress::{EgressPolicy, HostPattern, PatternError};

/// Whether special-purpose addresses (loopback, private, link-local, CGNAT, multicast,
/// ...) are refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrivateAddresses {
    /// Refused unless an `allow` entry names that exact `host:port` (the default).
    #[default]
    Deny,
    /// Treated like any other address (still subject to `allow`/`deny`). For workers
    /// that exist to reach an internal network; it also opens cloud metadata endpoints
    /// such as `169.254.169.254`, so pair it with a `deny` entry for them.
    Allow,
}

/// The `[http]` section: where the http tools may connect, and their limits.
///
/// Egress semantics:
/// - `deny` wins over everything: a request whose host (as written in the URL) or any
///   of its resolved addresses matches a `deny` pattern is refused.
/// - An empty `allow` means "the public internet": any host whose every address is an
///   ordinary public address. A non-empty `allow` admits only the hosts it matches (by
///   name, or by every resolved address for address/CIDR entries).
/// - Special-purpose addresses (loopback, private-use, link-local incl.
///   `169.254.169.254`, CGNAT, multicast, unspecified, documentation, ... in IPv4 and
///   IPv6, including IPv4-mapped, NAT64 and 6to4 forms of them) are refused unless an
///   `allow` entry names that exact `host:port` (or `address:port`), e.g.
///   `"127.0.0.1:18080"`, or `private_addresses = "allow"`.
/// - Every address a name resolves to is checked; one refused address refuses the
///   request. The connection goes to the checked addresses, never to a second lookup.
///
/// Patterns: `example.com` (that name), `*.example.com` (every name below it, not
/// `example.com` itself), `*` (every host), `1.2.3.4`, `::1` or `[::1]` (that address),
/// `10.0.0.0/8` or `fd00::/8` (a network), each optionally with `:port`
/// (`example.com:8443`, `[::1]:8080`; not for networks).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Host patterns that may be reached; empty = any public host.
    pub allow: Vec<String>,
    /// Host patterns that may never be reached; wins over `allow`.
    pub deny: Vec<String>,
    /// `"deny"` (default) or `"allow"`: see [`PrivateAddresses`].
    pub private_addresses: PrivateAddresses,
    /// Time to establish one TCP connection (default 10 000 ms).
    pub connect_timeout_ms: u64,
    /// Time for a whole call, all redirects and the body included (default 30 000 ms);
    /// the upper bound of `timeout_seconds`.
    pub timeout_ms: u64,
    /// Most bytes of a response body returned (after gzip decoding), and most bytes read
    /// from the wire (default 5 MiB); the upper bound of `max_response_bytes`. A gzip body
    /// is decoded only up to this size, so a decompression bomb costs at most this much.
    pub max_response_bytes: u64,
    /// Largest request body `http_request` sends (default 1 MiB).
    pub max_request_body_bytes: u64,
    /// Redirects followed at most, each one re-checked (default 5).
    pub max_redirects: u32,
    /// The `User-Agent` of every request; callers cannot set their own.
    pub user_agent: String,
    /// Default `max_length` (characters) of one `fetch_url` page (default 20 000).
    pub fetch_default_length: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            deny: Vec::new(),
            private_addresses: PrivateAddresses::Deny,
            connect_timeout_ms: 10_000,
            timeout_ms: 30_000,
            max_response_bytes: 5 * 1024 * 1024,
            max_request_body_bytes: 1024 * 1024,
            max_redirects: 5,
            user_agent: concat!("Airlock/", env!("CARGO_PKG_VERSION"), " (+tool call)").to_owned(),
            fetch_default_length: 20_000,
        }
    }
}

/// A malformed `[http]` section.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    // The pattern error is in the message, so it is not also the `source()`: a printed
    // chain would show it twice.
    #[error("[http] {list}: invalid host pattern {pattern:?}: {error}")]
    Pattern {
        list: &'static str,
        pattern: String,
        error: PatternError,
    },
    #[error("[http] {0} must be greater than 0")]
    Zero(&'static str),
    #[error("[http] user_agent must be a non-empty printable ASCII header value")]
    UserAgent,
    #[error("cannot build the tls configuration: {0}")]
    Tls(String),
}

/// A validated configuration, shared by the tools.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub policy: EgressPolicy,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    pub max_response_bytes: u64,
    pub max_request_body_bytes: u64,
    pub max_redirects: u32,
    pub user_agent: http::HeaderValue,
    pub fetch_default_length: u64,
}

fn patterns(list: &'static str, raw: &[String]) -> Result<Vec<HostPattern>, ConfigError> {
    raw.iter()
        .map(|p| {
            HostPattern::parse(p).map_err(|error| ConfigError::Pattern {
                list,
                pattern: p.clone(),
                error,
            })
        })
        .collect()
}

impl HttpConfig {
    pub(crate) fn validate(&self) -> Result<Settings, ConfigError> {
        for (key, value) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("timeout_ms", self.timeout_ms),
            ("max_response_bytes", self.max_response_bytes),
            ("fetch_default_length", self.fetch_default_length),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(key));
            }
        }
        let user_agent = http::HeaderValue::from_str(&self.user_agent)
            .ok()
            .filter(|v| !v.is_empty() && v.to_str().is_ok())
            .ok_or(ConfigError::UserAgent)?;
        Ok(Settings {
            policy: EgressPolicy::new(
                patterns("allow", &self.allow)?,
                patterns("deny", &self.deny)?,
                self.private_addresses,
            ),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            timeout: Duration::from_millis(self.timeout_ms),
            max_response_bytes: self.max_response_bytes,
            max_request_body_bytes: self.max_request_body_bytes,
            max_redirects: self.max_redirects,
            user_agent,
            fetch_default_length: self.fetch_default_length,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_shape() {
        let c: HttpConfig = serde_json::from_str(r#"{"allow": ["127.0.0.1:18080"]}"#).unwrap();
        assert_eq!(c.allow, vec!["127.0.0.1:18080".to_owned()]);
        assert_eq!(c.max_response_bytes, 5 * 1024 * 1024);
        assert_eq!(c.timeout_ms, 30_000);
        assert_eq!(c.max_redirects, 5);
        assert_eq!(c.private_addresses, PrivateAddresses::Deny);
        assert!(c.validate().is_ok());
        assert!(serde_json::from_str::<HttpConfig>(r#"{"nope": 1}"#).is_err());
        let c: HttpConfig = serde_json::from_str(r#"{"private_addresses": "allow"}"#).unwrap();
        assert_eq!(c.private_addresses, PrivateAddresses::Allow);
    }

    #[test]
    fn errors_name_the_pattern() {
        let c = HttpConfig {
            deny: vec!["ok.com".into(), "bad*.com".into()],
            ..HttpConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.starts_with("[http] deny: invalid host pattern \"bad*.com\""),
            "{e}"
        );
        let c = HttpConfig {
            timeout_ms: 0,
            ..HttpConfig::default()
        };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "[http] timeout_ms must be greater than 0"
        );
    }
}
