//! The egress policy: host patterns, the special-purpose address table, and the
//! decision for one `(host, port, resolved addresses)` target.
//!
//! A decision is taken in two steps so that a name that policy refuses is never even
//! looked up (no DNS exfiltration): [`EgressPolicy::check_name`] before resolution and
//! [`EgressPolicy::check_addrs`] on every address the name resolved to. The caller then
//! connects only to those checked addresses.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use url::Host;

use crate::config::PrivateAddresses;

/// Why a host pattern is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("the pattern is empty")]
    Empty,
    #[error("invalid port {0:?} (expected 1-65535)")]
    Port(String),
    #[error("invalid CIDR network: {0}")]
    Cidr(String),
    #[error("a CIDR network takes no port")]
    CidrWithPort,
    #[error("unterminated \"[\" of an IPv6 address")]
    Bracket,
    #[error("invalid IPv6 address {0:?}")]
    Ipv6(String),
    #[error("a wildcard is only allowed as the whole first label, like \"*.example.com\"")]
    Wildcard,
    #[error("invalid host name: {0}")]
    Host(String),
}

/// What refused a request. Every message names the rule, so the model (and the operator
/// reading the audit log) know why and what would change it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("refused: scheme {0:?} is not allowed; only http and https URLs can be fetched")]
    Scheme(String),
    #[error(
        "refused: URLs with a user name or password are not allowed; send credentials in an Authorization header instead"
    )]
    Userinfo,
    #[error("refused: the URL has no host")]
    NoHost,
    #[error("refused: {subject} matches [http] deny pattern {pattern:?}")]
    Denied { subject: String, pattern: String },
    #[error(
        "refused: {target} is not in [http] allow (allowed: {allowed}); only an operator can extend that list"
    )]
    NotAllowed { target: String, allowed: String },
    #[error(
        "refused: {addr}{via} is {kind} (special-purpose); internal and special addresses are not reachable unless an operator adds \"{target}\" to [http] allow"
    )]
    SpecialPurpose {
        addr: IpAddr,
        via: String,
        kind: String,
        target: String,
    },
}

/// The host part of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatcher {
    /// `*`: every host.
    Any,
    /// `example.com`: exactly that name.
    Exact(String),
    /// `*.example.com`: every name below `example.com` (stored as `.example.com`).
    Suffix(String),
    /// `1.2.3.4`, `[::1]`: that address (whether written in the URL or resolved).
    Ip(IpAddr),
    /// `10.0.0.0/8`: every address in the network.
    Net(IpNet),
}

/// One `allow`/`deny` entry: `example.com`, `*.example.com`, `host:port`, `1.2.3.4`,
/// `1.2.3.4:80`, `[::1]`, `[::1]:8080`, `::1`, `10.0.0.0/8`, `fd00::/8` or `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern {
    text: String,
    host: HostMatcher,
    port: Option<u16>,
}

fn parse_port(p: &str) -> Result<u16, PatternError> {
    match p.parse::<u16>() {
        Ok(port) if port > 0 && p.bytes().all(|b| b.is_ascii_digit()) => Ok(port),
        _ => Err(PatternError::Port(p.to_owned())),
    }
}

/// Normalises a domain as the URL parser does (lower case, IDNA, numeric IPv4 forms).
fn parse_host(h: &str) -> Result<HostMatcher, PatternError> {
    if h == "*" {
        return Ok(HostMatcher::Any);
    }
    if let Some(rest) = h.strip_prefix("*.") {
        if rest.contains('*') {
            return Err(PatternError::Wildcard);
        }
        return match Host::parse(rest.trim_end_matches('.')) {
            Ok(Host::Domain(d)) => Ok(HostMatcher::Suffix(format!(".{d}"))),
            Ok(_) => Err(PatternError::Wildcard),
            Err(e) => Err(PatternError::Host(e.to_string())),
        };
    }
    if h.contains('*') {
        return Err(PatternError::Wildcard);
    }
    match Host::parse(h.trim_end_matches('.')) {
        Ok(Host::Domain(d)) => Ok(HostMatcher::Exact(d)),
        Ok(Host::Ipv4(ip)) => Ok(HostMatcher::Ip(IpAddr::V4(ip))),
        Ok(Host::Ipv6(ip)) => Ok(HostMatcher::Ip(canonical(IpAddr::V6(ip)))),
        Err(e) => Err(PatternError::Host(e.to_string())),
    }
}

impl HostPattern {
    pub fn parse(text: &str) -> Result<Self, PatternError> {
        let t = text.trim().to_ascii_lowercase();
        if t.is_empty() {
            return Err(PatternError::Empty);
        }
        let pattern = |host, port| HostPattern {
            text: text.trim().to_owned(),
            host,
            port,
        };
        if t.contains('/') {
            if t.starts_with('[') || t.rsplit_once(':').is_some_and(|(a, _)| !a.contains(':')) {
                return Err(PatternError::CidrWithPort);
            }
            let net: IpNet = t.parse().map_err(|_| PatternError::Cidr(t.clone()))?;
            return Ok(pattern(HostMatcher::Net(net.trunc()), None));
        }
        if let Some(rest) = t.strip_prefix('[') {
            let (addr, after) = rest.split_once(']').ok_or(PatternError::Bracket)?;
            let ip: Ipv6Addr = addr
                .parse()
                .map_err(|_| PatternError::Ipv6(addr.to_owned()))?;
            let port = match after {
                "" => None,
                p => Some(parse_port(
                    p.strip_prefix(':').ok_or(PatternError::Bracket)?,
                )?),
            };
            return Ok(pattern(HostMatcher::Ip(canonical(IpAddr::V6(ip))), port));
        }
        if let Ok(ip) = t.parse::<Ipv6Addr>() {
            return Ok(pattern(HostMatcher::Ip(canonical(IpAddr::V6(ip))), None));
        }
        match t.rsplit_once(':') {
            Some((host, port)) => Ok(pattern(parse_host(host)?, Some(parse_port(port)?))),
            None => Ok(pattern(parse_host(&t)?, None)),
        }
    }

    /// The pattern as written in the config.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    fn port_matches(&self, port: u16) -> bool {
        self.port.is_none_or(|p| p == port)
    }

    /// An address or network entry (`1.2.3.4`, `[::1]:8080`, `10.0.0.0/8`): the only kind
    /// that matches an address rather than a name.
    pub fn is_address_pattern(&self) -> bool {
        matches!(self.host, HostMatcher::Ip(_) | HostMatcher::Net(_))
    }

    /// Does the pattern match the host as written in the URL?
    fn matches_name(&self, host: &Host<String>, port: u16) -> bool {
        if !self.port_matches(port) {
            return false;
        }
        match (&self.host, host) {
            (HostMatcher::Any, _) => true,
            (HostMatcher::Exact(e), Host::Domain(d)) => e == d,
            (HostMatcher::Suffix(s), Host::Domain(d)) => d.ends_with(s.as_str()),
            _ => false,
        }
    }

    /// Does the pattern match one address the host resolved to (or is)? Only the
    /// address's own form: an allow entry is never widened by what an address carries
    /// (see [`Self::denies_addr`]).
    fn matches_addr(&self, addr: IpAddr, port: u16) -> bool {
        if !self.port_matches(port) {
            return false;
        }
        let addr = canonical(addr);
        match &self.host {
            HostMatcher::Ip(ip) => *ip == addr,
            HostMatcher::Net(net) => net.contains(&addr),
            _ => false,
        }
    }

    /// Does this deny entry refuse the address? It does when it matches the address or
    /// the IPv4 address a NAT64 or 6to4 address carries, which a translator or relay on
    /// the path connects to (the special-purpose table judges them by it too). Without
    /// this, `deny = ["10.0.5.0/24"]` would still let `[64:ff9b::a00:510]` reach
    /// 10.0.5.16. Allow entries get no such second form: a carried address can refuse,
    /// never admit, so an IPv4 entry admits only IPv4 (or IPv4-mapped) addresses, and
    /// NAT64 or 6to4 ones need an entry of their own. Both choices fail closed. `Some`
    /// holds what the refusal adds to name the address (empty, or the carried form).
    fn denies_addr(&self, addr: IpAddr, port: u16) -> Option<String> {
        if self.matches_addr(addr, port) {
            return Some(String::new());
        }
        let IpAddr::V6(v6) = addr else {
            return None;
        };
        let (form, v4) = embedded_v4(v6)?;
        self.matches_addr(IpAddr::V4(v4), port)
            .then(|| format!(", {form} form of {v4}"))
    }

    /// An entry that names one exact host (or address) and port, the only kind that opens
    /// a special-purpose address.
    fn opens(&self, host: &Host<String>, addr: IpAddr, port: u16) -> bool {
        if self.port != Some(port) {
            return false;
        }
        match (&self.host, host) {
            (HostMatcher::Exact(e), Host::Domain(d)) => e == d,
            (HostMatcher::Ip(ip), _) => *ip == canonical(addr),
            _ => false,
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// An IPv4-mapped IPv6 address is the IPv4 address it carries: the kernel connects to it.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        IpAddr::V4(_) => addr,
    }
}

/// `host:port` as an allow entry would name it (`[v6]:port` for IPv6).
pub fn host_port(host: &Host<String>, port: u16) -> String {
    match host {
        Host::Domain(d) => format!("{d}:{port}"),
        Host::Ipv4(ip) => format!("{ip}:{port}"),
        Host::Ipv6(ip) => format!("[{ip}]:{port}"),
    }
}

fn addr_port(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
}

const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8) -> (Ipv4Addr, u8) {
    (Ipv4Addr::new(a, b, c, d), len)
}

/// IPv4 special-purpose ranges (IANA registry, RFC 6890 and successors) that an agent
/// must not reach by default. Checked in order; the first match names the address.
const SPECIAL_V4: &[((Ipv4Addr, u8), &str)] = &[
    (
        v4(0, 0, 0, 0, 8),
        "an unspecified (\"this network\") address",
    ),
    (v4(10, 0, 0, 0, 8), "a private-use address"),
    (v4(100, 64, 0, 0, 10), "a shared (CGNAT) address"),
    (v4(127, 0, 0, 0, 8), "a loopback address"),
    (
        v4(169, 254, 0, 0, 16),
        "a link-local address (cloud metadata lives here)",
    ),
    (v4(172, 16, 0, 0, 12), "a private-use address"),
    (v4(192, 0, 0, 0, 24), "an IETF protocol assignment address"),
    (v4(192, 0, 2, 0, 24), "a documentation address"),
    (v4(192, 88, 99, 0, 24), "a 6to4 relay anycast address"),
    (v4(192, 168, 0, 0, 16), "a private-use address"),
    (v4(198, 18, 0, 0, 15), "a benchmarking address"),
    (v4(198, 51, 100, 0, 24), "a documentation address"),
    (v4(203, 0, 113, 0, 24), "a documentation address"),
    (v4(224, 0, 0, 0, 4), "a multicast address"),
    (v4(255, 255, 255, 255, 32), "the broadcast address"),
    (v4(240, 0, 0, 0, 4), "a reserved address"),
];

const fn v6(segments: [u16; 8], len: u8) -> (Ipv6Addr, u8) {
    let [a, b, c, d, e, f, g, h] = segments;
    (Ipv6Addr::new(a, b, c, d, e, f, g, h), len)
}

/// IPv6 special-purpose ranges. IPv4-mapped (`::ffff:0:0/96`), NAT64 (`64:ff9b::/96`)
/// and 6to4 (`2002::/16`) addresses are judged by the IPv4 address they embed.
const SPECIAL_V6: &[((Ipv6Addr, u8), &str)] = &[
    (v6([0, 0, 0, 0, 0, 0, 0, 0], 128), "the unspecified address"),
    (v6([0, 0, 0, 0, 0, 0, 0, 1], 128), "the loopback address"),
    (
        v6([0, 0, 0, 0, 0, 0, 0, 0], 96),
        "an IPv4-compatible (deprecated) address",
    ),
    (
        v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48),
        "a local-use NAT64 address",
    ),
    (
        v6([0x100, 0, 0, 0, 0, 0, 0, 0], 64),
        "a discard-only address",
    ),
    (
        v6([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32),
        "a documentation address",
    ),
    (
        v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23),
        "an IETF protocol assignment address",
    ),
    (
        v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20),
        "a documentation address",
    ),
    (
        v6([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16),
        "a segment-routing (SRv6) address",
    ),
    (
        v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7),
        "a unique-local (private) address",
    ),
    (
        v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10),
        "a link-local address",
    ),
    (
        v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10),
        "a site-local (deprecated) address",
    ),
    (v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), "a multicast address"),
];

/// What kind of special-purpose address `addr` is, or `None` for an ordinary public
/// address.
pub fn special_purpose(addr: IpAddr) -> Option<String> {
    match addr {
        IpAddr::V4(ip) => special_v4(ip).map(str::to_owned),
        IpAddr::V6(ip) => special_v6(ip),
    }
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    SPECIAL_V4.iter().find_map(|&((net, len), kind)| {
        Ipv4Net::new(net, len)
            .ok()
            .filter(|n| n.contains(&ip))
            .map(|_| kind)
    })
}

/// The IPv4 address an IPv6 address stands for, with the name of its form:
/// IPv4-mapped (`::ffff:0:0/96`, which the kernel connects to as IPv4), NAT64
/// (`64:ff9b::/96`, which a translator on the path does) and 6to4 (`2002::/16`, which a
/// relay does). The special-purpose table and the deny entries both judge by it.
fn embedded_v4(ip: Ipv6Addr) -> Option<(&'static str, Ipv4Addr)> {
    let s = ip.segments();
    let embedded = |hi: u16, lo: u16| {
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    };
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(("an IPv4-mapped", v4));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(("a NAT64", embedded(s[6], s[7])));
    }
    if s[0] == 0x2002 {
        return Some(("a 6to4", embedded(s[1], s[2])));
    }
    None
}

fn special_v6(ip: Ipv6Addr) -> Option<String> {
    if let Some((form, v4)) = embedded_v4(ip) {
        return special_v4(v4).map(|kind| format!("{form} form of {v4}, {kind}"));
    }
    SPECIAL_V6.iter().find_map(|&((net, len), kind)| {
        Ipv6Net::new(net, len)
            .ok()
            .filter(|n| n.contains(&ip))
            .map(|_| kind.to_owned())
    })
}

/// Whether a name may be resolved, and whether its addresses still need an allow match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameVerdict {
    /// `allow` is empty or an allow entry matched the name.
    Allowed,
    /// Only an address pattern of `allow` can still admit it, after resolution.
    NeedsAddressMatch,
}

/// The compiled `[http]` allow/deny lists and private-address rule.
#[derive(Debug, Clone)]
pub struct EgressPolicy {
    allow: Vec<HostPattern>,
    deny: Vec<HostPattern>,
    private: PrivateAddresses,
}

impl EgressPolicy {
    pub fn new(allow: Vec<HostPattern>, deny: Vec<HostPattern>, private: PrivateAddresses) -> Self {
        Self {
            allow,
            deny,
            private,
        }
    }

    fn allowed_list(&self) -> String {
        let list: Vec<String> = self
            .allow
            .iter()
            .map(|p| format!("{:?}", p.as_str()))
            .collect();
        list.join(", ")
    }

    /// Step 1, before any DNS lookup: deny patterns on the name, and allow patterns on the
    /// name when no address pattern could admit it later.
    pub fn check_name(&self, host: &Host<String>, port: u16) -> Result<NameVerdict, Refusal> {
        let literal = match host {
            Host::Ipv4(ip) => Some(IpAddr::V4(*ip)),
            Host::Ipv6(ip) => Some(IpAddr::V6(*ip)),
            Host::Domain(_) => None,
        };
        for p in &self.deny {
            let via_addr = literal.and_then(|a| p.denies_addr(a, port));
            if p.matches_name(host, port) || via_addr.is_some() {
                return Err(Refusal::Denied {
                    subject: format!(
                        "host {}{}",
                        host_port(host, port),
                        via_addr.unwrap_or_default()
                    ),
                    pattern: p.as_str().to_owned(),
                });
            }
        }
        if self.allow.is_empty() || self.allow.iter().any(|p| p.matches_name(host, port)) {
            return Ok(NameVerdict::Allowed);
        }
        if self.allow.iter().any(HostPattern::is_address_pattern) {
            return Ok(NameVerdict::NeedsAddressMatch);
        }
        Err(Refusal::NotAllowed {
            target: host_port(host, port),
            allowed: self.allowed_list(),
        })
    }

    /// Step 2, on every address the host is or resolved to: deny patterns, the
    /// special-purpose table, and (when the name alone was not enough) allow patterns.
    /// Any refused address refuses the whole request.
    pub fn check_addrs(
        &self,
        host: &Host<String>,
        port: u16,
        addrs: &[IpAddr],
        verdict: NameVerdict,
    ) -> Result<(), Refusal> {
        let via = match host {
            Host::Domain(d) => format!(" (address of {d})"),
            _ => String::new(),
        };
        for &addr in addrs {
            if let Some((p, form)) = self
                .deny
                .iter()
                .find_map(|p| p.denies_addr(addr, port).map(|form| (p, form)))
            {
                return Err(Refusal::Denied {
                    subject: format!("address {}{form}{via}", addr_port(addr, port)),
                    pattern: p.as_str().to_owned(),
                });
            }
            if self.private == PrivateAddresses::Deny
                && let Some(kind) = special_purpose(addr)
                && !self.allow.iter().any(|p| p.opens(host, addr, port))
            {
                return Err(Refusal::SpecialPurpose {
                    addr,
                    via: via.clone(),
                    kind,
                    target: host_port(host, port),
                });
            }
            if verdict == NameVerdict::NeedsAddressMatch
                && !self.allow.iter().any(|p| p.matches_addr(addr, port))
            {
                return Err(Refusal::NotAllowed {
                    target: format!("{} (address {})", host_port(host, port), addr),
                    allowed: self.allowed_list(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> EgressPolicy {
        let parse = |v: &[&str]| v.iter().map(|p| HostPattern::parse(p).unwrap()).collect();
        EgressPolicy::new(parse(allow), parse(deny), PrivateAddresses::Deny)
    }

    fn host(h: &str) -> Host<String> {
        Host::parse(h).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn patterns_parse() {
        let p = HostPattern::parse("Example.COM").unwrap();
        assert_eq!(p.host, HostMatcher::Exact("example.com".into()));
        assert_eq!(p.port, None);
        let p = HostPattern::parse("*.example.com:8443").unwrap();
        assert_eq!(p.host, HostMatcher::Suffix(".example.com".into()));
        assert_eq!(p.port, Some(8443));
        assert_eq!(
            HostPattern::parse("127.0.0.1:18080").unwrap().host,
            HostMatcher::Ip(ip("127.0.0.1"))
        );
        let p = HostPattern::parse("[::1]:8080").unwrap();
        assert_eq!((p.host, p.port), (HostMatcher::Ip(ip("::1")), Some(8080)));
        assert_eq!(HostPattern::parse("::1").unwrap().port, None);
        assert_eq!(
            HostPattern::parse("10.1.2.3/8").unwrap().host,
            HostMatcher::Net("10.0.0.0/8".parse().unwrap())
        );
        assert_eq!(
            HostPattern::parse("2130706433:80").unwrap().host,
            HostMatcher::Ip(ip("127.0.0.1")),
            "numeric IPv4 forms normalise as in URLs"
        );
        assert_eq!(HostPattern::parse("*").unwrap().host, HostMatcher::Any);
        for bad in [
            "",
            " ",
            "exa*mple.com",
            "*example.com",
            "a.*.com",
            "host:0",
            "host:99999",
            "host:x",
            "10.0.0.0/33",
            "10.0.0.0/8:80",
            "[::1",
            "[zz]:80",
            "[::1]x",
            "a b.com",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn special_table() {
        for a in [
            "0.0.0.0",
            "10.1.2.3",
            "100.64.0.1",
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "100::1",
            "2001:db8::1",
            "2001::1",
            "2002:7f00:1::",
            "2002:a00:1::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fec0::1",
            "ff02::1",
            "3fff::1",
        ] {
            assert!(
                special_purpose(ip(a)).is_some(),
                "{a} must be special-purpose"
            );
        }
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.216.34",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "2a00:1450::1",
        ] {
            assert!(special_purpose(ip(a)).is_none(), "{a} is public");
        }
    }

    #[test]
    fn empty_allow_means_public_internet() {
        let p = policy(&[], &[]);
        let h = host("example.com");
        assert_eq!(p.check_name(&h, 443), Ok(NameVerdict::Allowed));
        assert!(
            p.check_addrs(&h, 443, &[ip("93.184.216.34")], NameVerdict::Allowed)
                .is_ok()
        );
        let e = p
            .check_addrs(
                &h,
                443,
                &[ip("93.184.216.34"), ip("10.0.0.1")],
                NameVerdict::Allowed,
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("10.0.0.1 (address of example.com) is a private-use address"),
            "{e}"
        );
        assert!(e.contains("\"example.com:443\""), "{e}");
    }

    #[test]
    fn deny_wins_and_is_named() {
        let p = policy(&["*.example.com", "example.com"], &["*.com", "8.8.8.0/24"]);
        let e = p
            .check_name(&host("a.example.com"), 443)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "refused: host a.example.com:443 matches [http] deny pattern \"*.com\""
        );
        let p = policy(&[], &["bad.example:8080", "8.8.8.0/24"]);
        assert!(p.check_name(&host("bad.example"), 80).is_ok());
        assert!(p.check_name(&host("bad.example"), 8080).is_err());
        let e = p
            .check_addrs(
                &host("dns.example"),
                443,
                &[ip("8.8.8.8")],
                NameVerdict::Allowed,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("8.8.8.0/24"), "{e}");
        assert!(
            p.check_name(&host("8.8.8.8"), 443).is_err(),
            "literal matches deny cidr"
        );
    }

    #[test]
    fn allow_list() {
        let p = policy(&["*.example.com", "api.other.org:443"], &[]);
        assert!(p.check_name(&host("www.example.com"), 80).is_ok());
        assert!(
            p.check_name(&host("example.com"), 80).is_err(),
            "*. needs a label"
        );
        assert!(p.check_name(&host("api.other.org"), 443).is_ok());
        let e = p
            .check_name(&host("api.other.org"), 80)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not in [http] allow"), "{e}");
        let p = policy(&["93.184.216.0/24"], &[]);
        let v = p.check_name(&host("example.com"), 443).unwrap();
        assert_eq!(v, NameVerdict::NeedsAddressMatch);
        assert!(
            p.check_addrs(&host("example.com"), 443, &[ip("93.184.216.34")], v)
                .is_ok()
        );
        assert!(
            p.check_addrs(&host("example.com"), 443, &[ip("1.1.1.1")], v)
                .is_err()
        );
    }

    #[test]
    fn only_exact_host_port_opens_special_addresses() {
        let p = policy(
            &[
                "127.0.0.1:18080",
                "localhost:9000",
                "10.0.0.0/8",
                "10.9.9.9",
            ],
            &[],
        );
        let lo = host("127.0.0.1");
        assert!(
            p.check_addrs(&lo, 18080, &[ip("127.0.0.1")], NameVerdict::Allowed)
                .is_ok()
        );
        assert!(
            p.check_addrs(&lo, 18081, &[ip("127.0.0.1")], NameVerdict::Allowed)
                .is_err()
        );
        let name = host("localhost");
        assert!(
            p.check_addrs(
                &name,
                9000,
                &[ip("127.0.0.1"), ip("::1")],
                NameVerdict::Allowed
            )
            .is_ok()
        );
        let ten = host("10.9.9.9");
        let e = p
            .check_addrs(&ten, 80, &[ip("10.9.9.9")], NameVerdict::Allowed)
            .unwrap_err()
            .to_string();
        assert!(e.contains("adds \"10.9.9.9:80\" to [http] allow"), "{e}");
        // A name that resolves to an opened address does not open itself by the address
        // pattern unless the address and port match exactly.
        let rebind = host("rebind.example");
        assert!(
            p.check_addrs(&rebind, 18080, &[ip("127.0.0.1")], NameVerdict::Allowed)
                .is_ok()
        );
        assert!(
            p.check_addrs(&rebind, 80, &[ip("127.0.0.1")], NameVerdict::Allowed)
                .is_err()
        );
        let open = EgressPolicy::new(vec![], vec![], PrivateAddresses::Allow);
        assert!(
            open.check_addrs(&lo, 1, &[ip("127.0.0.1")], NameVerdict::Allowed)
                .is_ok()
        );
    }

    #[test]
    fn mapped_addresses_match_v4_patterns() {
        let p = policy(&[], &["127.0.0.1"]);
        let h = host("[::ffff:127.0.0.1]");
        assert!(p.check_name(&h, 80).is_err());
        let e = policy(&[], &[])
            .check_addrs(&h, 80, &[ip("::ffff:127.0.0.1")], NameVerdict::Allowed)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is an IPv4-mapped form of 127.0.0.1, a loopback address"),
            "{e}"
        );
    }

    #[test]
    fn deny_entries_match_the_ipv4_address_of_nat64_and_6to4_forms() {
        let parse = |v: &[&str]| v.iter().map(|p| HostPattern::parse(p).unwrap()).collect();
        let p = EgressPolicy::new(vec![], parse(&["10.0.5.0/24"]), PrivateAddresses::Allow);
        for (a, form) in [
            ("64:ff9b::a00:510", "a NAT64 form of 10.0.5.16"),
            ("2002:a00:510::1", "a 6to4 form of 10.0.5.16"),
        ] {
            let e = p.check_name(&host(&format!("[{a}]")), 80).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "refused: host [{a}]:80, {form} matches [http] deny pattern \"10.0.5.0/24\""
                )
            );
            let e = p
                .check_addrs(&host("nat64.example"), 80, &[ip(a)], NameVerdict::Allowed)
                .unwrap_err();
            assert!(
                e.to_string().contains(&format!(
                    "address [{a}]:80, {form} (address of nat64.example) matches"
                )),
                "{e}"
            );
        }
        for outside in ["64:ff9b::a00:610", "2002:a00:610::1"] {
            assert!(
                p.check_addrs(&host("x.example"), 80, &[ip(outside)], NameVerdict::Allowed)
                    .is_ok(),
                "{outside}"
            );
        }
        // A carried address never admits: an IPv4 allow entry does not open its NAT64 or
        // 6to4 forms, which need an entry of their own.
        let p = EgressPolicy::new(parse(&["10.0.5.0/24"]), vec![], PrivateAddresses::Allow);
        for a in ["64:ff9b::a00:510", "2002:a00:510::1"] {
            let h = host(&format!("[{a}]"));
            assert!(p.check_name(&h, 80).is_ok());
            assert!(
                p.check_addrs(&h, 80, &[ip(a)], NameVerdict::NeedsAddressMatch)
                    .is_err(),
                "{a}"
            );
        }
    }
}
