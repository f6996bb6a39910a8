//! Compiles `proto/airlock/v1/*.proto` with protox (pure Rust, no system `protoc`).

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env_var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = ["airlock/v1/worker.proto", "airlock/v1/orchestrator.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }

    let descriptors = protox::compile(files, [&proto_root])?;
    let descriptor_path = PathBuf::from(env_var("OUT_DIR")?).join("airlock_descriptor.bin");
    std::fs::write(&descriptor_path, descriptors.encode_to_vec())?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}

fn env_var(name: &str) -> Result<String, Box<dyn std::error::Error>> {
    std::env::var(name).map_err(|e| format!("{name} is not set: {e}").into())
}
