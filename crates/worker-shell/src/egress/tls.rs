//! The server name (SNI) of a TLS ClientHello.
//!
//! The proxy reads the first record a client sends through a CONNECT tunnel and takes the
//! name the client asks the server for, so that a tunnel opened to an allowed host cannot
//! carry a handshake for another one (domain fronting). The parser reads only what it
//! needs, bounds-checks every length against what is left, and fails closed: anything it
//! does not understand is an error, never a guess.

/// A TLS record header: type, version, length.
pub const RECORD_HEADER: usize = 5;
/// The most a TLS plaintext record may carry (2^14 bytes, RFC 8446 §5.1).
pub const MAX_RECORD: usize = 16 * 1024;

const CONTENT_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const NAME_TYPE_HOST: u8 = 0;
/// `encrypted_client_hello` (RFC 9849) and the ESNI draft's `encrypted_server_name`: the
/// real server name is inside, where the proxy cannot read it.
const EXT_ECH: [u16; 2] = [0xfe0d, 0xffce];

/// Why the first bytes of a tunnel are not a ClientHello the proxy can check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    #[error(
        "the tunnel does not start with a TLS handshake record (first byte {0:#04x}); CONNECT tunnels carry TLS only"
    )]
    NotHandshake(u8),
    #[error("the first record's version {0:#06x} is not TLS")]
    Version(u16),
    #[error("the first TLS record is {0} bytes long, over the 16384 a record may carry")]
    RecordLength(usize),
    #[error("the first TLS handshake message is not a ClientHello (type {0})")]
    NotClientHello(u8),
    #[error("the ClientHello is split over several TLS records, which the proxy does not read")]
    Fragmented,
    #[error("the ClientHello is malformed ({0})")]
    Malformed(&'static str),
    #[error("the ClientHello names more than one server (SNI)")]
    SeveralNames,
    #[error("the ClientHello's server name (SNI) is not a host name")]
    BadName,
    #[error(
        "the ClientHello uses Encrypted Client Hello, which hides the server name the proxy must check; turn ECH off in the client"
    )]
    Ech,
}

/// The body length announced by a record header, or why the record cannot hold the
/// ClientHello that must open a tunnel.
pub fn record_len(header: &[u8; RECORD_HEADER]) -> Result<usize, HelloError> {
    let [kind, major, minor, hi, lo] = *header;
    if kind != CONTENT_HANDSHAKE {
        return Err(HelloError::NotHandshake(kind));
    }
    // Record versions seen on a ClientHello are 0x0301 (TLS 1.0, what TLS 1.3 clients
    // write there) to 0x0303; 0x0300 is SSL 3.0, which is no longer TLS.
    if major != 3 || !(1..=4).contains(&minor) {
        return Err(HelloError::Version(u16::from_be_bytes([major, minor])));
    }
    let len = usize::from(u16::from_be_bytes([hi, lo]));
    if len > MAX_RECORD {
        return Err(HelloError::RecordLength(len));
    }
    if len == 0 {
        return Err(HelloError::Malformed("empty record"));
    }
    Ok(len)
}

/// A cursor over untrusted bytes: every read checks what is left.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(rest: &'a [u8]) -> Self {
        Self { rest }
    }

    fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], HelloError> {
        if self.rest.len() < n {
            return Err(HelloError::Malformed(what));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, HelloError> {
        match self.take(1, what)? {
            [b] => Ok(*b),
            _ => Err(HelloError::Malformed(what)),
        }
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, HelloError> {
        match self.take(2, what)? {
            [a, b] => Ok(u16::from_be_bytes([*a, *b])),
            _ => Err(HelloError::Malformed(what)),
        }
    }

    fn u24(&mut self, what: &'static str) -> Result<usize, HelloError> {
        match self.take(3, what)? {
            [a, b, c] => Ok(usize::from(*a) << 16 | usize::from(*b) << 8 | usize::from(*c)),
            _ => Err(HelloError::Malformed(what)),
        }
    }

    /// A vector with a one-byte length prefix.
    fn vec8(&mut self, what: &'static str) -> Result<&'a [u8], HelloError> {
        let n = self.u8(what)?;
        self.take(usize::from(n), what)
    }

    /// A vector with a two-byte length prefix.
    fn vec16(&mut self, what: &'static str) -> Result<&'a [u8], HelloError> {
        let n = self.u16(what)?;
        self.take(usize::from(n), what)
    }
}

/// The SNI host name (lower case, without a trailing dot) of the ClientHello in `record`
/// (header included, nothing after it), or `None` when it sends none.
pub fn server_name(record: &[u8]) -> Result<Option<String>, HelloError> {
    let mut r = Reader::new(record);
    let header: [u8; RECORD_HEADER] = r
        .take(RECORD_HEADER, "record header")?
        .try_into()
        .map_err(|_| HelloError::Malformed("record header"))?;
    let len = record_len(&header)?;
    let body = r.take(len, "record shorter than its header says")?;
    if !r.is_empty() {
        return Err(HelloError::Malformed("bytes after the record"));
    }

    let mut r = Reader::new(body);
    let kind = r.u8("handshake type")?;
    if kind != HANDSHAKE_CLIENT_HELLO {
        return Err(HelloError::NotClientHello(kind));
    }
    let len = r.u24("handshake length")?;
    if len > r.rest.len() {
        return Err(HelloError::Fragmented);
    }
    let hello = r.take(len, "handshake length")?;

    let mut r = Reader::new(hello);
    r.take(2, "client version")?;
    r.take(32, "client random")?;
    let session = r.vec8("session id")?;
    if session.len() > 32 {
        return Err(HelloError::Malformed("session id over 32 bytes"));
    }
    let suites = r.vec16("cipher suites")?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(HelloError::Malformed("cipher suites"));
    }
    if r.vec8("compression methods")?.is_empty() {
        return Err(HelloError::Malformed("compression methods"));
    }
    if r.is_empty() {
        // A ClientHello without extensions (TLS 1.2 and earlier) names no server.
        return Ok(None);
    }
    let extensions = r.vec16("extensions")?;
    if !r.is_empty() {
        return Err(HelloError::Malformed("bytes after the extensions"));
    }

    let mut r = Reader::new(extensions);
    let mut name = None;
    while !r.is_empty() {
        let kind = r.u16("extension type")?;
        let data = r.vec16("extension length")?;
        if EXT_ECH.contains(&kind) {
            return Err(HelloError::Ech);
        }
        if kind == EXT_SERVER_NAME {
            if name.is_some() {
                return Err(HelloError::SeveralNames);
            }
            name = Some(host_name(data)?);
        }
    }
    Ok(name)
}

/// The one `host_name` of a `server_name` extension (RFC 6066 §3).
fn host_name(data: &[u8]) -> Result<String, HelloError> {
    let mut r = Reader::new(data);
    let list = r.vec16("server name list")?;
    if !r.is_empty() {
        return Err(HelloError::Malformed("bytes after the server name list"));
    }
    let mut r = Reader::new(list);
    let mut found = None;
    while !r.is_empty() {
        let kind = r.u8("server name type")?;
        let name = r.vec16("server name")?;
        // Only host_name is defined; RFC 6066 forbids two names of one type, and two
        // would leave the server free to pick the one the proxy did not check.
        if kind == NAME_TYPE_HOST {
            if found.is_some() {
                return Err(HelloError::SeveralNames);
            }
            found = Some(name);
        }
    }
    let name = found.ok_or(HelloError::Malformed(
        "server name list without a host name",
    ))?;
    let valid = !name.is_empty()
        && name.len() <= 254
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if !valid {
        return Err(HelloError::BadName);
    }
    let name = String::from_utf8_lossy(name).to_ascii_lowercase();
    let name = name.trim_end_matches('.');
    if name.is_empty() {
        return Err(HelloError::BadName);
    }
    Ok(name.to_owned())
}

/// A ClientHello record for tests: `sni` as the server name extension (or none), plus
/// any `extra` extensions as `(type, data)`.
#[cfg(test)]
pub fn client_hello(sni: Option<&str>, extra: &[(u16, Vec<u8>)]) -> Vec<u8> {
    fn vec16(data: &[u8]) -> Vec<u8> {
        let mut v = u16::try_from(data.len()).unwrap().to_be_bytes().to_vec();
        v.extend_from_slice(data);
        v
    }
    let mut extensions = Vec::new();
    if let Some(name) = sni {
        let mut entry = vec![NAME_TYPE_HOST];
        entry.extend(vec16(name.as_bytes()));
        extensions.extend(EXT_SERVER_NAME.to_be_bytes());
        extensions.extend(vec16(&vec16(&entry)));
    }
    for (kind, data) in extra {
        extensions.extend(kind.to_be_bytes());
        extensions.extend(vec16(data));
    }
    let mut hello = vec![3, 3];
    hello.extend([7u8; 32]);
    hello.push(0); // session id
    hello.extend(vec16(&[0x13, 0x01, 0x13, 0x02]));
    hello.extend([1, 0]); // compression: null
    hello.extend(vec16(&extensions));
    let mut handshake = vec![HANDSHAKE_CLIENT_HELLO];
    handshake.extend(&u32::try_from(hello.len()).unwrap().to_be_bytes()[1..]);
    handshake.extend(hello);
    let mut record = vec![CONTENT_HANDSHAKE, 3, 1];
    record.extend(vec16(&handshake));
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_server_name() {
        let rec = client_hello(Some("Example.COM."), &[(0x002b, vec![2, 3, 4])]);
        assert_eq!(server_name(&rec), Ok(Some("example.com".to_owned())));
        let rec = client_hello(None, &[(0x000a, vec![0, 2, 0, 0x1d])]);
        assert_eq!(server_name(&rec), Ok(None));
    }

    #[test]
    fn refuses_what_it_cannot_check() {
        let two = client_hello(
            Some("a.com"),
            &[(0, {
                let mut v = vec![0, 6, 0, 0, 3];
                v.extend(b"b.c");
                v
            })],
        );
        assert_eq!(server_name(&two), Err(HelloError::SeveralNames));
        // Two host names in one list.
        let mut list = vec![0, 12];
        list.extend([0, 0, 3]);
        list.extend(b"a.c");
        list.extend([0, 0, 3]);
        list.extend(b"b.c");
        assert_eq!(
            server_name(&client_hello(None, &[(0, list)])),
            Err(HelloError::SeveralNames)
        );
        let ech = client_hello(Some("a.com"), &[(0xfe0d, vec![0; 8])]);
        assert_eq!(server_name(&ech), Err(HelloError::Ech));
        let bad = client_hello(Some("a.com\0b"), &[]);
        assert_eq!(server_name(&bad), Err(HelloError::BadName));
        assert_eq!(
            server_name(&client_hello(Some("."), &[])),
            Err(HelloError::BadName)
        );

        let mut not_tls = b"SSH-2.0-OpenSSH_9.6\r\n".to_vec();
        not_tls.truncate(RECORD_HEADER);
        assert!(matches!(
            server_name(&not_tls),
            Err(HelloError::NotHandshake(b'S'))
        ));
        let mut rec = client_hello(Some("a.com"), &[]);
        rec[5] = 2; // ServerHello
        assert_eq!(server_name(&rec), Err(HelloError::NotClientHello(2)));
        let mut rec = client_hello(Some("a.com"), &[]);
        rec[2] = 0; // SSL 3.0
        assert_eq!(server_name(&rec), Err(HelloError::Version(0x0300)));
        assert_eq!(
            record_len(&[22, 3, 1, 0x40, 0x01]),
            Err(HelloError::RecordLength(16385))
        );
    }

    #[test]
    fn a_hello_longer_than_its_record_is_fragmented() {
        let mut rec = client_hello(Some("a.com"), &[]);
        rec[8] = rec[8].wrapping_add(40); // handshake length beyond the record
        assert_eq!(server_name(&rec), Err(HelloError::Fragmented));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let rec = client_hello(Some("example.com"), &[(0x002b, vec![2, 3, 4])]);
        for n in 0..rec.len() {
            assert!(server_name(&rec[..n]).is_err(), "prefix of {n} bytes");
        }
        // Trailing garbage after a complete record is refused too.
        let mut longer = rec.clone();
        longer.push(0);
        assert!(server_name(&longer).is_err());
    }

    /// A small deterministic generator, so a failure reproduces.
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn random_and_mutated_input_never_panics() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let base = client_hello(Some("example.com"), &[(0x002b, vec![2, 3, 4])]);
        for _ in 0..20_000 {
            // Mutate a valid hello: flip a few bytes, keep or cut its length.
            let mut rec = base.clone();
            for _ in 0..(xorshift(&mut seed) % 4 + 1) {
                let i = (xorshift(&mut seed) % rec.len() as u64) as usize;
                rec[i] = xorshift(&mut seed) as u8;
            }
            let cut = (xorshift(&mut seed) % (rec.len() as u64 + 1)) as usize;
            let _ = server_name(&rec[..cut]);
            let _ = server_name(&rec);
            // And pure noise behind a plausible header.
            let len = (xorshift(&mut seed) % 300) as usize;
            let mut noise = vec![22, 3, 3];
            noise.extend(u16::try_from(len).unwrap().to_be_bytes());
            noise.extend((0..len).map(|_| xorshift(&mut seed) as u8));
            let _ = server_name(&noise);
        }
    }
}
