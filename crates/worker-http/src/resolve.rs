//! From a URL to the checked socket addresses a request may connect to.
//!
//! The URL parser (WHATWG rules, the `url` crate) already normalises every spelling of an
//! IPv4 address (`2130706433`, `0177.0.0.1`, `0x7f000001`, `127.1`) and of IPv6; the
//! host is then checked by name, resolved once here, and every address is checked. The
//! client connects only to the returned addresses: there is no second lookup that a
//! DNS rebinding answer could change.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use url::{Host, Url};

use crate::egress::{EgressPolicy, Refusal};

/// Why a URL cannot be requested.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("invalid url {url:?}: {reason}; give an absolute http:// or https:// URL")]
    Url { url: String, reason: String },
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("cannot resolve host {host}: {reason}; check the host name")]
    Lookup { host: String, reason: String },
    #[error("host {0} did not resolve to any address")]
    NoAddress(String),
}

/// A URL that passed the egress policy, with the addresses to connect to.
#[derive(Debug, Clone)]
pub struct Target {
    pub url: Url,
    pub host: Host<String>,
    pub port: u16,
    pub addrs: Vec<SocketAddr>,
}

/// Parses `raw` as an absolute URL, as policy read it for `context.url`.
pub fn parse_url(raw: &str) -> Result<Url, ResolveError> {
    airlock_policy::http_url::parse(raw).map_err(|e| ResolveError::Url {
        url: raw.to_owned(),
        reason: e.to_string(),
    })
}

/// Checks the scheme and the parts of a URL that need no lookup, and returns its host
/// (a name lower-cased without a trailing dot, or an address) and port.
pub fn url_parts(url: &Url) -> Result<(Host<String>, u16), Refusal> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refusal::Scheme(url.scheme().to_owned()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Refusal::Userinfo);
    }
    // The host as policy saw it in `context.url` (one function for both): without its
    // trailing dots a "name" may be an address (`93.184.216.34..`), judged as one.
    let host = airlock_policy::http_url::host(url).ok_or(Refusal::NoHost)?;
    let port = url.port_or_known_default().ok_or(Refusal::NoHost)?;
    Ok((host, port))
}

/// A name lookup to use instead of the system resolver (tests, or a deployment that
/// brings its own resolver). Called once per hop.
pub type Lookup = Arc<dyn Fn(&str) -> std::io::Result<Vec<IpAddr>> + Send + Sync>;

/// Looks a name up through `custom` or the system resolver (`/etc/hosts`, then DNS), once;
/// the addresses come back without duplicates, in the resolver's order.
pub async fn lookup(
    host: &str,
    port: u16,
    custom: Option<&Lookup>,
) -> Result<Vec<IpAddr>, ResolveError> {
    let lookup_err = |e: std::io::Error| ResolveError::Lookup {
        host: host.to_owned(),
        reason: e.to_string(),
    };
    let found: Vec<IpAddr> = match custom {
        Some(f) => f(host).map_err(lookup_err)?,
        None => tokio::net::lookup_host((host, port))
            .await
            .map_err(lookup_err)?
            .map(|a| a.ip())
            .collect(),
    };
    let mut addrs: Vec<IpAddr> = Vec::new();
    for a in found {
        if !addrs.contains(&a) {
            addrs.push(a);
        }
    }
    Ok(addrs)
}

/// Checks `url` against `policy`, resolves it and checks every address.
pub async fn check(
    policy: &EgressPolicy,
    url: &Url,
    custom: Option<&Lookup>,
) -> Result<Target, ResolveError> {
    let (host, port) = url_parts(url)?;
    let verdict = policy.check_name(&host, port)?;
    let ips = match &host {
        Host::Ipv4(ip) => vec![IpAddr::V4(*ip)],
        Host::Ipv6(ip) => vec![IpAddr::V6(*ip)],
        Host::Domain(d) => lookup(d, port, custom).await?,
    };
    check_resolved(policy, url, ips, verdict, host, port)
}

/// The address step of [`check`], separate so that tests can inject a resolution.
pub fn check_resolved(
    policy: &EgressPolicy,
    url: &Url,
    ips: Vec<IpAddr>,
    verdict: crate::egress::NameVerdict,
    host: Host<String>,
    port: u16,
) -> Result<Target, ResolveError> {
    if ips.is_empty() {
        return Err(ResolveError::NoAddress(host.to_string()));
    }
    policy.check_addrs(&host, port, &ips, verdict)?;
    Ok(Target {
        url: url.clone(),
        addrs: ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect(),
        host,
        port,
    })
}

/// [`check`] with a given resolution instead of a lookup: what a resolver answering
/// `ips` for the URL's host would lead to.
pub fn check_with_resolution(
    policy: &EgressPolicy,
    url: &Url,
    ips: Vec<IpAddr>,
) -> Result<Target, ResolveError> {
    let (host, port) = url_parts(url)?;
    let verdict = policy.check_name(&host, port)?;
    let ips = match &host {
        Host::Ipv4(ip) => vec![IpAddr::V4(*ip)],
        Host::Ipv6(ip) => vec![IpAddr::V6(*ip)],
        Host::Domain(_) => ips,
    };
    check_resolved(policy, url, ips, verdict, host, port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PrivateAddresses;

    fn open() -> EgressPolicy {
        EgressPolicy::new(vec![], vec![], PrivateAddresses::Deny)
    }

    #[test]
    fn url_parser_normalises_ipv4_spellings() {
        for raw in [
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f000001/",
            "http://127.1/",
            "http://0x7f.1/",
            "http://127.000.000.001/",
            "http://①②⑦.0.0.1/",
        ] {
            let url = parse_url(raw).unwrap();
            assert_eq!(url.host_str(), Some("127.0.0.1"), "{raw}");
        }
    }

    /// Trailing dots make the URL parser read an address as a name; without them it is
    /// an address again, and is judged as one (an address entry, the special ranges).
    #[test]
    fn an_address_spelled_with_trailing_dots_is_an_address() {
        for (raw, expected) in [
            ("http://93.184.216.34../", "93.184.216.34"),
            ("http://93.184.216.34.../", "93.184.216.34"),
            ("http://0x7f.1../", "127.0.0.1"),
            ("http://2130706433../", "127.0.0.1"),
        ] {
            let (host, port) = url_parts(&parse_url(raw).unwrap()).unwrap();
            assert_eq!(
                host,
                Host::<String>::Ipv4(expected.parse().unwrap()),
                "{raw}"
            );
            assert_eq!(port, 80);
        }
        let (host, _) = url_parts(&parse_url("http://Example.COM../").unwrap()).unwrap();
        assert_eq!(host, Host::Domain("example.com".to_owned()));
    }

    #[test]
    fn resolution_to_private_addresses_is_refused() {
        let url = parse_url("https://rebind.example/x").unwrap();
        let e = check_with_resolution(
            &open(),
            &url,
            vec!["8.8.8.8".parse().unwrap(), "10.0.0.5".parse().unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("10.0.0.5 (address of rebind.example) is a private-use address"),
            "{e}"
        );
        let e = check_with_resolution(
            &open(),
            &url,
            vec!["::ffff:169.254.169.254".parse().unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("IPv4-mapped"), "{e}");
        let t =
            check_with_resolution(&open(), &url, vec!["93.184.216.34".parse().unwrap()]).unwrap();
        assert_eq!(t.addrs, vec!["93.184.216.34:443".parse().unwrap()]);
        assert!(check_with_resolution(&open(), &url, vec![]).is_err());
    }

    #[test]
    fn schemes_and_userinfo() {
        for raw in [
            "file:///etc/passwd",
            "gopher://x/",
            "ftp://x/",
            "data:,hi",
            "javascript:1",
        ] {
            let e = check_with_resolution(&open(), &parse_url(raw).unwrap(), vec![])
                .unwrap_err()
                .to_string();
            assert!(e.contains("only http and https"), "{raw}: {e}");
        }
        let e = check_with_resolution(
            &open(),
            &parse_url("http://u:p@example.com/").unwrap(),
            vec![],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("user name or password"), "{e}");
        assert!(parse_url("/relative").is_err());
    }
}
