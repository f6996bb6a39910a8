//! Link options of the `airlock` binary.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        // Every start of the binary (each component, each `airlock sandbox run`) has the
        // dynamic loader apply ~72 000 relative relocations of this position-independent
        // executable. Packed (DT_RELR: glibc 2.36+, GNU ld 2.38+), their table shrinks
        // from 1.7 MB to 27 kB that the loader reads and walks: `airlock
        // --version` took a quarter less time. The executable stays position-independent,
        // so it keeps its address-space randomisation; a linker too old for the option
        // warns and ignores it.
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
