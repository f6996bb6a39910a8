//! Generated prost/tonic code for the `airlock.v1` package.
//!
//! Only wire types live here; every other crate converts them to domain types once,
//! at its boundary.
#![forbid(unsafe_code)]
#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("airlock.v1");
}

/// Encoded `FileDescriptorSet` of every airlock.v1 proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/airlock_descriptor.bin"));

/// Metadata key a worker sets on an `UNAVAILABLE` answer to `Execute` when it did not
/// start the call (it is draining): the orchestrator may then send the call to another
/// replica whatever the tool, since it cannot have taken effect.
pub const NOT_STARTED_METADATA: &str = "airlock-not-started";

/// Reads a `grpc-timeout` header's value (gRPC over HTTP/2: at most eight digits and a
/// unit, one of `H M S m u n`). What the specification does not allow is read as no
/// timeout, not as a wrong one. The worker reads it to bound a call, and the
/// orchestrator's channel to bound the wait for a worker's answer.
pub fn parse_grpc_timeout(value: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    // Digits only: `u64::from_str` would also take a leading `+`.
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_grpc_timeout;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("30S"), Some(Duration::from_secs(30)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(
            parse_grpc_timeout("30000000u"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        // What the specification does not allow is no timeout, not a wrong one.
        for refused in ["", "S", "123456789S", "10s", "5x", "-1S", "+1S", " 1S"] {
            assert_eq!(parse_grpc_timeout(refused), None, "{refused:?}");
        }
    }

    #[test]
    fn what_tonic_writes_is_read_back() {
        // tonic writes a timeout in the finest unit that fits eight digits.
        for timeout in [
            Duration::from_millis(31_250),
            Duration::from_secs(30),
            Duration::from_nanos(999),
            Duration::from_secs(7 * 24 * 3600),
        ] {
            let mut request = tonic::Request::new(());
            request.set_timeout(timeout);
            let headers = request.metadata().clone().into_headers();
            let value = headers
                .get("grpc-timeout")
                .and_then(|v| v.to_str().ok())
                .unwrap();
            let read = parse_grpc_timeout(value).unwrap();
            // A coarser unit may round down, never up.
            assert!(read <= timeout, "{value} read as {read:?} for {timeout:?}");
            assert!(
                timeout - read < timeout / 1000 + Duration::from_nanos(1),
                "{value}"
            );
        }
    }
}
