//! Airlock's http tools, `http_request` and `fetch_url`, behind an egress policy that a
//! model cannot turn against the network the worker runs in (server-side request
//! forgery).
//!
//! How a request goes out:
//! 1. The URL is parsed with WHATWG rules (`url` crate), which normalise every spelling
//!    of a host (`2130706433`, `0177.0.0.1`, `0x7f000001`, `127.1`, `[::ffff:7f00:1]`).
//!    Only `http` and `https` are accepted; user info in the URL is refused.
//! 2. The host name is checked against `[http] deny` and `allow` before any lookup.
//! 3. The name is resolved once, and every address is checked: `deny` patterns, the
//!    special-purpose address table (IPv4 and IPv6, IPv4-mapped, NAT64 and 6to4 forms
//!    judged by the IPv4 address they embed), and address patterns of `allow`.
//! 4. The worker opens the TCP connection itself to one of those checked addresses and
//!    speaks HTTP/1.1 over it (rustls with compiled-in Mozilla roots for https): no
//!    second lookup, no proxy from the environment, no connection reuse.
//! 5. Redirects are followed by hand, at most `max_redirects`, each hop going through
//!    steps 1-4 again; credentials are dropped when the origin changes.
//! 6. The body is read up to `max_response_bytes`; gzip (the only encoding asked for) is
//!    decoded by the worker up to the same cap, so a decompression bomb stays bounded.
//!
//! Declared http tools (`[[tools]]` entries with `http`, see [`declared`]) go out through
//! the same client, so through every step above, and so do the requests to Streamable
//! HTTP MCP servers (`[[mcp_servers]]` entries with `url`, see [`mcp`]), which follow
//! no redirect at all.
//!
//! See [`HttpConfig`] for the policy's semantics and the limits.
#![forbid(unsafe_code)]

mod client;
mod config;
pub mod declared;
/// The egress policy (host patterns, the special-purpose address table, the decision for
/// one target), shared with the shell worker's egress proxy so both judge a target alike.
pub mod egress;
pub mod html;
pub mod mcp;
/// From a URL or a name to checked socket addresses, shared with the shell worker's
/// egress proxy (one lookup, every address checked).
pub mod resolve;
mod tools;

pub use config::{ConfigError, HttpConfig, PrivateAddresses};
pub use egress::{PatternError, Refusal};
pub use tools::{StartError, tools, tools_with_declared, tools_with_mcp, tools_with_resolver};

/// The egress decision alone, without any network access: what the http tools would do
/// with `url` if its host resolved to `addrs` (ignored for an IP-literal host). `Ok`
/// holds the socket addresses a request would connect to; `Err` the refusal text.
///
/// This is the function the tools use after their own lookup; it is public so that
/// callers (and tests) can check a policy against a DNS answer they choose, e.g. one
/// that rebinds a public name to `127.0.0.1`.
pub fn check_egress(
    config: &HttpConfig,
    url: &str,
    addrs: Vec<std::net::IpAddr>,
) -> Result<Vec<std::net::SocketAddr>, String> {
    let settings = config.validate().map_err(|e| e.to_string())?;
    let url = resolve::parse_url(url).map_err(|e| e.to_string())?;
    resolve::check_with_resolution(&settings.policy, &url, addrs)
        .map(|t| t.addrs)
        .map_err(|e| e.to_string())
}
