//! Airlock's certificates (DESIGN §9): the development PKI that `airlock certs init`
//! writes ([`devpki`]), and the `[tls]` files each component loads and checks before it
//! listens or connects ([`files`]), mutual TLS ([`mtls`]), serving TLS on accepted
//! connections ([`accept`]) and TLS for PostgreSQL connections ([`postgres`]).
#![forbid(unsafe_code)]

pub mod accept;
pub mod devpki;
pub mod files;
pub mod mtls;
pub mod postgres;

pub use devpki::{COMPONENTS, DevPkiError};
pub use files::{Identity, TlsFileError, TlsFiles};
pub use mtls::{Mtls, MtlsError, TlsConfig};
