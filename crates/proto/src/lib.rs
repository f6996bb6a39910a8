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
