//! The egress proxy of a sandbox with `[sandbox] network = "proxy"` (DESIGN §12).
//!
//! The sandbox's only reachable address is a listener the shell worker serves for the
//! duration of one call ([`serve`]). It speaks HTTP proxy: `CONNECT host:port` for TLS,
//! absolute-form requests (`GET http://host/path`) for plain HTTP, nothing else. A target
//! is judged by the http worker's own egress code (`airlock_worker_http::egress` and
//! `resolve`), so both workers agree on what a host pattern matches and which addresses
//! are special-purpose:
//! 1. `[sandbox.egress] deny` and `allow` on the name as the client wrote it, before any
//!    lookup; an empty `allow` admits nothing, and an IP literal needs an address or
//!    network entry (`*` admits names only).
//! 2. The name resolved once by the proxy (a `hosts` pin answers without DNS), every
//!    address checked (deny, special-purpose, address entries); the proxy connects only
//!    to those addresses.
//! 3. CONNECT: the ClientHello's server name must be the CONNECT host (no domain
//!    fronting). Plain HTTP: the `Host` header must be the URL's host.
//!
//! Every attempt is recorded ([`EgressAttempt`]), and every refusal answers the client
//! with a message naming the rule.

mod proxy;
mod tls;

pub use proxy::serve;

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use airlock_worker_http::PrivateAddresses;
use airlock_worker_http::egress::{EgressPolicy, HostPattern, PatternError, Refusal};
use airlock_worker_http::resolve::{self, Lookup};
use url::Host;

/// `[sandbox.egress]` in `airlock.toml`: where a sandbox with `network = "proxy"` may
/// connect through the proxy, and the per-call limits.
///
/// Patterns are those of `[http] allow`: `example.com`, `*.example.com`, `*`, `1.2.3.4`,
/// `[::1]`, `10.0.0.0/8`, each optionally with `:port` (not networks).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EgressConfig {
    /// Host patterns that may be reached. Empty (the default) means nothing is reachable:
    /// unlike `[http]`, the proxy is opt-in per host.
    pub allow: Vec<String>,
    /// Host patterns that may never be reached; wins over `allow`.
    pub deny: Vec<String>,
    /// Pinned names, `"mirror.internal" = "10.1.2.3"`: the proxy resolves them to that
    /// address without asking DNS (air-gapped mirrors). The address is still checked like
    /// any other: a special-purpose one needs an `allow` entry naming the exact
    /// `host:port`, or `private_addresses = "allow"`.
    pub hosts: BTreeMap<String, String>,
    /// `"deny"` (default) or `"allow"`, as in `[http]`.
    pub private_addresses: PrivateAddresses,
    /// Connections one call may open through the proxy (default 64).
    pub max_connections: u32,
    /// Bytes one call may relay, both directions together (default 1 GiB).
    pub max_bytes: u64,
    /// Time to resolve a name and to connect to it (default 10 000 ms).
    pub connect_timeout_ms: u64,
}

impl Default for EgressConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            deny: Vec::new(),
            hosts: BTreeMap::new(),
            private_addresses: PrivateAddresses::Deny,
            max_connections: 64,
            max_bytes: 1024 * 1024 * 1024,
            connect_timeout_ms: 10_000,
        }
    }
}

/// A malformed `[sandbox.egress]` section or `egress_allow` list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    #[error("{list}: invalid host pattern {pattern:?}: {error}")]
    Pattern {
        list: &'static str,
        pattern: String,
        error: PatternError,
    },
    #[error("[sandbox.egress] hosts: {name:?} = {addr:?}: {reason}")]
    Host {
        name: String,
        addr: String,
        reason: &'static str,
    },
    #[error("[sandbox.egress] {0} must be greater than 0")]
    Zero(&'static str),
}

/// Where an allow list comes from, as refusals name it.
const BASE: &str = "[sandbox.egress] allow";
const NARROWED: &str = "the tool's egress_allow";

/// One allow list (with the deny list, for the base one) compiled twice: for names, and
/// for IP literals, where only address and network entries count.
#[derive(Debug, Clone)]
struct Layer {
    source: &'static str,
    /// An empty list admits nothing (EgressPolicy would read it as "any public host").
    empty: bool,
    /// No address or network entry: no IP literal is admitted (for the same reason).
    no_addresses: bool,
    /// The list as written, for refusals.
    allowed: String,
    names: EgressPolicy,
    literals: EgressPolicy,
}

impl Layer {
    fn new(
        source: &'static str,
        allow: Vec<HostPattern>,
        deny: Vec<HostPattern>,
        private: PrivateAddresses,
    ) -> Self {
        let allowed: Vec<String> = allow.iter().map(|p| format!("{:?}", p.as_str())).collect();
        let addresses: Vec<HostPattern> = allow
            .iter()
            .filter(|p| p.is_address_pattern())
            .cloned()
            .collect();
        Self {
            source,
            empty: allow.is_empty(),
            no_addresses: addresses.is_empty(),
            allowed: allowed.join(", "),
            literals: EgressPolicy::new(addresses, deny.clone(), private),
            names: EgressPolicy::new(allow, deny, private),
        }
    }

    /// A refusal of the shared policy, told in this proxy's terms.
    fn explain(&self, refusal: Refusal, literal: bool) -> String {
        let source = self.source;
        match refusal {
            Refusal::Denied { subject, pattern } => {
                format!("refused: {subject} matches [sandbox.egress] deny pattern {pattern:?}")
            }
            Refusal::NotAllowed { target, .. } if literal => format!(
                "refused: {target} is an IP address, and no address or network entry of {source} matches it (allowed: {}); \"*\" admits host names only; connect to a host name instead",
                self.allowed
            ),
            Refusal::NotAllowed { target, .. } => format!(
                "refused: {target} is not in {source} (allowed: {}); only an operator can extend that list",
                self.allowed
            ),
            Refusal::SpecialPurpose {
                addr,
                via,
                kind,
                target,
            } => format!(
                "refused: {addr}{via} is {kind} (special-purpose); internal and special addresses are not reachable unless an operator adds \"{target}\" to {source}"
            ),
            other => other.to_string(),
        }
    }
}

/// Why a target is not connected to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Blocked {
    /// A rule refused it (the message names the rule).
    Refused(String),
    /// The rules allowed the name, but it did not resolve.
    Unresolved(String),
}

/// `[sandbox.egress]` compiled, possibly narrowed by a tool: what [`serve`] enforces.
#[derive(Clone)]
pub struct EgressRules {
    /// Every layer must admit a target: the section, then each narrowing.
    layers: Vec<Layer>,
    pins: Arc<BTreeMap<String, IpAddr>>,
    /// Answers the pinned names.
    pinned: Lookup,
    /// Answers the other names instead of the system resolver.
    resolver: Option<Lookup>,
    private: PrivateAddresses,
    max_connections: u32,
    max_bytes: u64,
    connect_timeout: Duration,
}

impl fmt::Debug for EgressRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EgressRules")
            .field("layers", &self.layers)
            .field("pins", &self.pins)
            .field("resolver", &self.resolver.as_ref().map(|_| "custom"))
            .field("max_connections", &self.max_connections)
            .field("max_bytes", &self.max_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

fn patterns(list: &'static str, raw: &[String]) -> Result<Vec<HostPattern>, EgressError> {
    raw.iter()
        .map(|p| {
            HostPattern::parse(p).map_err(|error| EgressError::Pattern {
                list,
                pattern: p.clone(),
                error,
            })
        })
        .collect()
}

/// A `hosts` entry: the name normalised as URLs normalise it, and its address.
fn pin(name: &str, addr: &str) -> Result<(String, IpAddr), EgressError> {
    let bad = |reason| EgressError::Host {
        name: name.to_owned(),
        addr: addr.to_owned(),
        reason,
    };
    let ip: IpAddr = addr
        .trim()
        .parse()
        .map_err(|_| bad("the value must be an IP address"))?;
    let written = name.trim().trim_end_matches('.');
    if written.contains(['*', ':', '/', '@']) {
        return Err(bad("the key must be a plain host name"));
    }
    match Host::parse(written) {
        Ok(Host::Domain(d)) if !d.is_empty() => Ok((d.to_ascii_lowercase(), ip)),
        Ok(_) => Err(bad(
            "the key is an IP address; allow the address itself instead",
        )),
        Err(_) => Err(bad("the key must be a plain host name")),
    }
}

impl EgressConfig {
    /// Compiles the section; a bad pattern or `hosts` entry is an error naming it.
    pub fn check(&self) -> Result<EgressRules, EgressError> {
        for (key, zero) in [
            ("max_connections", self.max_connections == 0),
            ("max_bytes", self.max_bytes == 0),
            ("connect_timeout_ms", self.connect_timeout_ms == 0),
        ] {
            if zero {
                return Err(EgressError::Zero(key));
            }
        }
        let layer = Layer::new(
            BASE,
            patterns("[sandbox.egress] allow", &self.allow)?,
            patterns("[sandbox.egress] deny", &self.deny)?,
            self.private_addresses,
        );
        let pins: BTreeMap<String, IpAddr> = self
            .hosts
            .iter()
            .map(|(name, addr)| pin(name, addr))
            .collect::<Result<_, _>>()?;
        let pins = Arc::new(pins);
        let answers = pins.clone();
        let pinned: Lookup = Arc::new(move |name: &str| {
            answers.get(name).map(|ip| vec![*ip]).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "not a pinned name")
            })
        });
        Ok(EgressRules {
            layers: vec![layer],
            pins,
            pinned,
            resolver: None,
            private: self.private_addresses,
            max_connections: self.max_connections,
            max_bytes: self.max_bytes,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
        })
    }
}

impl EgressRules {
    /// The rules for a declared tool with `egress_allow`: a target must be allowed by
    /// both lists (an empty list admits nothing), and a special-purpose address must be
    /// named exactly by both.
    pub fn narrowed(&self, allow: &[String]) -> Result<EgressRules, EgressError> {
        let mut rules = self.clone();
        rules.layers.push(Layer::new(
            NARROWED,
            patterns("egress_allow", allow)?,
            Vec::new(),
            self.private,
        ));
        Ok(rules)
    }

    /// Names that are not pinned are looked up through `lookup` instead of the system
    /// resolver (tests, or a site that brings its own resolver).
    pub fn with_resolver(mut self, lookup: Lookup) -> Self {
        self.resolver = Some(lookup);
        self
    }

    /// Judges `host:port`: every layer on the name, one lookup, every layer on every
    /// address. `Ok` holds the addresses the proxy may connect to.
    async fn admit(&self, host: &Host<String>, port: u16) -> Result<Vec<SocketAddr>, Blocked> {
        let literal = match host {
            Host::Ipv4(ip) => Some(IpAddr::V4(*ip)),
            Host::Ipv6(ip) => Some(IpAddr::V6(*ip)),
            Host::Domain(_) => None,
        };
        let mut verdicts = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            if layer.empty {
                return Err(Blocked::Refused(format!(
                    "refused: {} is not reachable: {} is empty, so nothing is; only an operator can add a host",
                    airlock_worker_http::egress::host_port(host, port),
                    layer.source
                )));
            }
            if literal.is_some() && layer.no_addresses {
                let refusal = Refusal::NotAllowed {
                    target: airlock_worker_http::egress::host_port(host, port),
                    allowed: String::new(),
                };
                return Err(Blocked::Refused(layer.explain(refusal, true)));
            }
            let policy = if literal.is_some() {
                &layer.literals
            } else {
                &layer.names
            };
            let verdict = policy
                .check_name(host, port)
                .map_err(|r| Blocked::Refused(layer.explain(r, literal.is_some())))?;
            verdicts.push(verdict);
        }
        let ips = match (literal, host) {
            (Some(ip), _) => vec![ip],
            (None, Host::Domain(name)) => self.lookup(name, port).await?,
            (None, _) => Vec::new(),
        };
        if ips.is_empty() {
            return Err(Blocked::Unresolved(format!(
                "host {host} did not resolve to any address"
            )));
        }
        for (layer, verdict) in self.layers.iter().zip(verdicts) {
            let policy = if literal.is_some() {
                &layer.literals
            } else {
                &layer.names
            };
            policy
                .check_addrs(host, port, &ips, verdict)
                .map_err(|r| Blocked::Refused(layer.explain(r, literal.is_some())))?;
        }
        Ok(ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect())
    }

    /// One lookup of `name`: a pin, or the resolver, bounded by the connect timeout.
    async fn lookup(&self, name: &str, port: u16) -> Result<Vec<IpAddr>, Blocked> {
        let custom = if self.pins.contains_key(name) {
            Some(&self.pinned)
        } else {
            self.resolver.as_ref()
        };
        match tokio::time::timeout(self.connect_timeout, resolve::lookup(name, port, custom)).await
        {
            Ok(Ok(ips)) => Ok(ips),
            Ok(Err(e)) => Err(Blocked::Unresolved(e.to_string())),
            Err(_) => Err(Blocked::Unresolved(format!(
                "cannot resolve host {name}: no answer within {} ms",
                self.connect_timeout.as_millis()
            ))),
        }
    }
}

/// What the proxy did with an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allowed,
    Refused,
}

/// One attempt (one connection to the proxy), as the call's result and the audit show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EgressAttempt {
    /// The target host as the proxy understood it (normalised; empty when the request
    /// could not be read).
    pub host: String,
    /// The target port (0 when the request could not be read).
    pub port: u16,
    /// `CONNECT`, a plain HTTP method (`GET`, `HEAD`, `POST`, `PUT`, `DELETE`, `PATCH`,
    /// `OPTIONS`), `other`, or `-` when no request was read.
    pub method: &'static str,
    pub verdict: Verdict,
    /// For a refused attempt, the rule that refused it; for an allowed one that failed
    /// (no address, no connection), why.
    pub reason: Option<String>,
    /// Bytes relayed from the sandbox to the target.
    pub bytes_sent: u64,
    /// Bytes relayed from the target to the sandbox.
    pub bytes_received: u64,
}

/// The attempts of one call. At most [`MAX_RECORDED`] are kept; the others are counted
/// in `dropped`, so memory does not grow with what the sandbox sends.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct EgressLog {
    pub attempts: Vec<EgressAttempt>,
    pub dropped: u64,
}

/// The most attempts an [`EgressLog`] keeps.
pub const MAX_RECORDED: usize = 256;

impl EgressLog {
    fn record(&mut self, attempt: EgressAttempt) {
        if self.attempts.len() < MAX_RECORDED {
            self.attempts.push(attempt);
        } else {
            self.dropped = self.dropped.saturating_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(allow: &[&str], deny: &[&str]) -> EgressConfig {
        EgressConfig {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            ..EgressConfig::default()
        }
    }

    fn domain(d: &str) -> Host<String> {
        Host::Domain(d.to_owned())
    }

    fn public(ip: &'static str) -> Lookup {
        Arc::new(move |_: &str| Ok(vec![ip.parse().unwrap()]))
    }

    #[test]
    fn shape_and_defaults() {
        let c: EgressConfig = toml::from_str(
            r#"allow = ["pypi.org"]
               hosts = { "mirror.internal" = "10.1.2.3" }"#,
        )
        .unwrap();
        assert_eq!(c.max_connections, 64);
        assert_eq!(c.max_bytes, 1 << 30);
        assert_eq!(c.connect_timeout_ms, 10_000);
        assert_eq!(c.private_addresses, PrivateAddresses::Deny);
        assert!(toml::from_str::<EgressConfig>("nope = 1").is_err());
        let rules = c.check().unwrap();
        assert_eq!(
            rules.pins.get("mirror.internal"),
            Some(&"10.1.2.3".parse().unwrap())
        );
    }

    #[test]
    fn errors_name_the_entry() {
        let e = config(&["ok.com", "bad*.com"], &[]).check().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("[sandbox.egress] allow: invalid host pattern \"bad*.com\""),
            "{e}"
        );
        for (name, addr) in [
            ("mirror", "not-an-ip"),
            ("*.mirror", "10.0.0.1"),
            ("1.2.3.4", "10.0.0.1"),
            ("a b", "10.0.0.1"),
            ("m:80", "10.0.0.1"),
        ] {
            let mut c = config(&["x.com"], &[]);
            c.hosts.insert(name.into(), addr.into());
            let e = c.check().unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("[sandbox.egress] hosts: {name:?} = {addr:?}")),
                "{e}"
            );
        }
        let c = EgressConfig {
            max_bytes: 0,
            ..EgressConfig::default()
        };
        assert_eq!(
            c.check().unwrap_err(),
            EgressError::Zero("max_bytes"),
            "a zero limit is a mistake, not a way to turn the proxy off"
        );
        let rules = config(&["x.com"], &[]).check().unwrap();
        assert!(matches!(
            rules.narrowed(&["*x".into()]),
            Err(EgressError::Pattern {
                list: "egress_allow",
                ..
            })
        ));
    }

    #[tokio::test]
    async fn empty_allow_reaches_nothing() {
        let rules = config(&[], &[])
            .check()
            .unwrap()
            .with_resolver(public("93.184.216.34"));
        let e = rules.admit(&domain("example.com"), 443).await.unwrap_err();
        assert!(
            matches!(&e, Blocked::Refused(m) if m.contains("[sandbox.egress] allow is empty")),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn literals_need_an_address_entry() {
        let rules = config(&["*"], &[])
            .check()
            .unwrap()
            .with_resolver(public("93.184.216.34"));
        assert!(rules.admit(&domain("example.com"), 443).await.is_ok());
        let e = rules
            .admit(&Host::Ipv4("93.184.216.34".parse().unwrap()), 443)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Blocked::Refused(m) if m.contains("is an IP address") && m.contains("\"*\" admits host names only")),
            "{e:?}"
        );
        let rules = config(&["*", "93.184.216.0/24"], &[]).check().unwrap();
        assert_eq!(
            rules
                .admit(&Host::Ipv4("93.184.216.34".parse().unwrap()), 443)
                .await,
            Ok(vec!["93.184.216.34:443".parse().unwrap()])
        );
    }

    #[tokio::test]
    async fn narrowed_admits_what_both_lists_allow() {
        let rules = config(&["*.example.com", "pypi.org"], &["bad.example.com"])
            .check()
            .unwrap()
            .with_resolver(public("93.184.216.34"));
        let narrow = rules
            .narrowed(&["api.example.com".into(), "other.org".into()])
            .unwrap();
        assert!(narrow.admit(&domain("api.example.com"), 443).await.is_ok());
        for (host, rule) in [
            ("pypi.org", NARROWED),
            ("other.org", BASE),
            ("www.example.com", NARROWED),
        ] {
            let e = narrow.admit(&domain(host), 443).await.unwrap_err();
            assert!(
                matches!(&e, Blocked::Refused(m) if m.contains(&format!("is not in {rule}"))),
                "{host}: {e:?}"
            );
        }
        // The section's deny still applies to a narrowed list that names the host.
        let narrow = rules.narrowed(&["bad.example.com".into()]).unwrap();
        let e = narrow
            .admit(&domain("bad.example.com"), 443)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Blocked::Refused(m) if m.contains("[sandbox.egress] deny pattern")),
            "{e:?}"
        );
        // An empty egress_allow admits nothing.
        let none = rules.narrowed(&[]).unwrap();
        assert!(none.admit(&domain("api.example.com"), 443).await.is_err());
        // The original rules are unchanged.
        assert!(rules.admit(&domain("pypi.org"), 443).await.is_ok());
    }

    #[test]
    fn the_log_keeps_a_bounded_number_of_attempts() {
        let mut log = EgressLog::default();
        for _ in 0..MAX_RECORDED + 10 {
            log.record(EgressAttempt {
                host: "x".into(),
                port: 1,
                method: "GET",
                verdict: Verdict::Refused,
                reason: None,
                bytes_sent: 0,
                bytes_received: 0,
            });
        }
        assert_eq!(log.attempts.len(), MAX_RECORDED);
        assert_eq!(log.dropped, 10);
        let json = serde_json::to_value(&log.attempts[0]).unwrap();
        assert_eq!(json["verdict"], "refused");
    }
}
