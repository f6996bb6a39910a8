//! The orchestrator's front-door listeners, bound by `airlock up` and inherited by the
//! orchestrator process it starts (see `airlock_sandbox::pass_listeners`).
//!
//! The launcher announces the ports (port 0 resolved) and holds the sockets for its
//! whole life: no other process can take a port between its choice and the
//! orchestrator's start, and a restarted orchestrator comes back on the very same
//! sockets. The orchestrator serves on them only when they are exactly its two front
//! doors, on the addresses it was told; anything else stops it. Started without them
//! (`airlock serve orchestrator`), it binds its own.

use std::net::{SocketAddr, TcpListener};

use airlock_orchestrator::BoundListeners;
use anyhow::{Context, bail, ensure};

/// The launcher's side: both listeners, bound once and passed to every orchestrator
/// process it starts.
#[derive(Debug)]
pub struct FrontDoors {
    http: TcpListener,
    grpc: TcpListener,
}

impl FrontDoors {
    /// Binds both addresses; a port 0 becomes a free port, held from now on.
    pub fn bind(http: &str, grpc: &str) -> anyhow::Result<Self> {
        let bind = |door: &str, addr: &str| {
            TcpListener::bind(addr)
                .with_context(|| format!("cannot bind the orchestrator's {door} address {addr}"))
        };
        Ok(FrontDoors {
            http: bind("http", http)?,
            grpc: bind("grpc", grpc)?,
        })
    }

    /// The addresses as bound: the orchestrator's `--http-listen` and `--grpc-listen`.
    pub fn addrs(&self) -> anyhow::Result<(String, String)> {
        let addr = |listener: &TcpListener| -> anyhow::Result<String> {
            Ok(listener
                .local_addr()
                .context("a front-door listener has no address")?
                .to_string())
        };
        Ok((addr(&self.http)?, addr(&self.grpc)?))
    }

    /// Makes the process `command` starts inherit both listeners; no other process this
    /// launcher starts inherits them.
    pub fn pass_to(&self, command: &mut tokio::process::Command) {
        airlock_sandbox::pass_listeners(
            command.as_std_mut(),
            &[("http", &self.http), ("grpc", &self.grpc)],
        );
    }
}

/// The orchestrator's side: the listeners it inherited, or `None` when it was started
/// without (it binds its own). `http` and `grpc` are the addresses it was told to
/// listen on.
pub fn inherited(http: &str, grpc: &str) -> anyhow::Result<Option<BoundListeners>> {
    let inherited =
        airlock_sandbox::inherited_listeners().context("inherited listeners; refusing to start")?;
    inherited
        .map(|listeners| {
            front_doors(listeners, http, grpc)
                .with_context(|| format!("{}: refusing to start", airlock_sandbox::LISTEN_FDS_ENV))
        })
        .transpose()
}

/// `listeners` as the two front doors: exactly `http` and `grpc`, each bound to its
/// address.
fn front_doors(
    listeners: Vec<(String, TcpListener)>,
    http: &str,
    grpc: &str,
) -> anyhow::Result<BoundListeners> {
    let mut doors = [None, None];
    for (name, listener) in listeners {
        let (slot, expected) = match name.as_str() {
            "http" => (&mut doors[0], http),
            "grpc" => (&mut doors[1], grpc),
            _ => bail!("unknown front door {name:?} (expected http and grpc)"),
        };
        let bound = listener
            .local_addr()
            .with_context(|| format!("the {name} listener has no address"))?;
        let expected_addr: SocketAddr = expected
            .parse()
            .with_context(|| format!("the {name} address {expected:?} is not host:port"))?;
        ensure!(
            bound == expected_addr,
            "the {name} listener is bound to {bound}, not to {expected}"
        );
        listener
            .set_nonblocking(true)
            .with_context(|| format!("cannot make the {name} listener non-blocking"))?;
        *slot = Some(listener);
    }
    let [Some(http), Some(grpc)] = doors else {
        bail!("both the http and the grpc listeners must be passed");
    };
    Ok(BoundListeners { http, grpc })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (TcpListener, String) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        (listener, addr)
    }

    #[test]
    fn the_front_doors_are_served_as_passed() {
        let (http_listener, http) = listener();
        let (grpc_listener, grpc) = listener();
        let doors = front_doors(
            vec![
                ("grpc".to_owned(), grpc_listener),
                ("http".to_owned(), http_listener),
            ],
            &http,
            &grpc,
        )
        .expect("front doors");
        assert_eq!(doors.http.local_addr().expect("addr").to_string(), http);
        assert_eq!(doors.grpc.local_addr().expect("addr").to_string(), grpc);
    }

    #[test]
    fn a_door_missing_unknown_or_elsewhere_is_refused() {
        let refused = |passed: Vec<(&str, TcpListener)>, http: &str, grpc: &str| {
            let passed = passed
                .into_iter()
                .map(|(name, l)| (name.to_owned(), l))
                .collect();
            format!(
                "{:#}",
                front_doors(passed, http, grpc).expect_err("refused")
            )
        };
        let (a, a_addr) = listener();
        let err = refused(vec![("http", a)], &a_addr, "127.0.0.1:1");
        assert!(err.contains("both"), "{err}");

        let (a, a_addr) = listener();
        let (b, b_addr) = listener();
        let err = refused(vec![("http", a), ("smtp", b)], &a_addr, &b_addr);
        assert!(err.contains("unknown front door"), "{err}");

        // Each on the other's address.
        let (a, a_addr) = listener();
        let (b, b_addr) = listener();
        let err = refused(vec![("http", a), ("grpc", b)], &b_addr, &a_addr);
        assert!(err.contains("not to"), "{err}");
    }
}
