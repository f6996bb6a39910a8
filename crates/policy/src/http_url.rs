//! URLs as the http worker reads them, so that a policy's `context.url` names the host
//! and path the worker will actually reach: a rule on `payments.example.com` must also
//! hold for `payments.example.com.` (the same host to DNS, TLS and `Host`), and a path
//! rule must see the path the request is sent to.

use url::{Host, Url};

/// A URL as the http worker takes it: surrounding whitespace trimmed, then parsed.
pub fn parse(raw: &str) -> Result<Url, url::ParseError> {
    Url::parse(raw.trim())
}

/// The host the http worker connects to and names (SNI, `Host`): a name lower-cased
/// without its trailing dots — judged as an address when that leaves one (the URL
/// parser takes `10.0.0.5..` for a name, since it does not end in a number) — or an
/// address. `None` when the URL has no host, or a name of dots only.
pub fn host(url: &Url) -> Option<Host<String>> {
    let host = match url.host()? {
        Host::Domain(d) => {
            let name = d.trim_end_matches('.').to_ascii_lowercase();
            match Host::parse(&name) {
                Ok(Host::Ipv4(ip)) => Host::Ipv4(ip),
                Ok(Host::Ipv6(ip)) => Host::Ipv6(ip),
                _ => Host::Domain(name),
            }
        }
        Host::Ipv4(ip) => Host::Ipv4(ip),
        Host::Ipv6(ip) => Host::Ipv6(ip),
    };
    match &host {
        Host::Domain(d) if d.is_empty() => None,
        _ => Some(host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_of(raw: &str) -> Option<String> {
        host(&parse(raw).unwrap()).map(|h| h.to_string())
    }

    #[test]
    fn a_host_is_named_as_the_worker_reaches_it() {
        assert_eq!(
            host_of("https://Payments.Example.COM./x").unwrap(),
            "payments.example.com"
        );
        assert_eq!(
            host_of("https://payments.example.com.../x").unwrap(),
            "payments.example.com"
        );
        assert_eq!(host_of("http://10.0.0.5../").unwrap(), "10.0.0.5");
        assert_eq!(host_of("http://[::1]:8080/").unwrap(), "[::1]");
        assert_eq!(
            host_of(" \thttps://example.com/a \n").unwrap(),
            "example.com"
        );
        assert_eq!(host_of("http://.../"), None);
        assert_eq!(host(&parse("data:text/plain,x").unwrap()), None);
    }
}
