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
