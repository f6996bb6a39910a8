//! Airlock's certificates (DESIGN §9): the development PKI that `airlock certs init`
//! writes ([`devpki`]), and the `[tls]` files each component loads and checks before it
//! listens or connects ([`files`]), mutual TLS ([`mtls`]) and serving TLS on accepted
//! connections ([`accept`]).
#![forbid(unsafe_code)]

pub mod accept;
pub mod devpki;
pub mod files;
pub mod mtls;

pub use devpki::{COMPONENTS, DevPkiError};
pub use files::{Identity, TlsFileError, TlsFiles};
pub use mtls::{Mtls, MtlsError, TlsConfig};
