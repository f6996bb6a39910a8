//! Where a worker listens: a Unix socket (local) or TCP (Kubernetes).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListenAddrError {
    #[error("listen address {0:?} is neither unix:/path nor host:port (e.g. 0.0.0.0:50051)")]
    Unrecognised(String),
}

/// A listen address: `unix:/path/to.sock` or `host:port` (optionally `http://host:port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl FromStr for ListenAddr {
    type Err = ListenAddrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(ListenAddrError::Unrecognised(s.to_owned()));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        let bare = s.strip_prefix("http://").unwrap_or(s);
        bare.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| ListenAddrError::Unrecognised(s.to_owned()))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Unix(path) => write!(f, "unix:{}", path.display()),
            ListenAddr::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms() {
        assert_eq!(
            "unix:/run/a.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/run/a.sock".into())
        );
        assert_eq!(
            "127.0.0.1:9".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("127.0.0.1:9".parse().unwrap())
        );
        assert!("unix:".parse::<ListenAddr>().is_err());
        assert!("nonsense".parse::<ListenAddr>().is_err());
    }
}
