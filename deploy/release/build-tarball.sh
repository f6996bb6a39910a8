#!/usr/bin/env bash
# Builds the release binary of Airlock and packs it for hosts without a Rust toolchain:
#   dist/airlock-<version>-<arch>-linux.tar.gz   (airlock, README.md, LICENSE if present)
#   dist/airlock-<version>-<arch>-linux.tar.gz.sha256   (check with: sha256sum -c)
# Run from anywhere inside the repository: deploy/release/build-tarball.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

cargo build --release --locked -p airlock

# Honour CARGO_TARGET_DIR and build.target-dir: ask cargo where the binary went.
target_dir="$(cargo metadata --format-version 1 --no-deps --locked |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
binary="${target_dir:-$root/target}/release/airlock"
[ -x "$binary" ] || { echo "build-tarball: no binary at $binary" >&2; exit 1; }

# `airlock --version` prints "airlock <version>": the version the binary itself reports.
version="$("$binary" --version | awk '{print $2}')"
[ -n "$version" ] || { echo "build-tarball: cannot read the version of $binary" >&2; exit 1; }
name="airlock-${version}-$(uname -m)-linux"

dist="$root/dist"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/$name"
install -m 0755 "$binary" "$stage/$name/airlock"
install -m 0644 README.md "$stage/$name/README.md"
for license in LICENSE LICENSE-APACHE LICENSE.md; do
    if [ -f "$license" ]; then install -m 0644 "$license" "$stage/$name/$license"; fi
done

mkdir -p "$dist"
# Owner, group and order fixed, so the archive depends on its contents only.
tar --owner=0 --group=0 --numeric-owner --sort=name -C "$stage" -czf "$dist/$name.tar.gz" "$name"
(cd "$dist" && sha256sum "$name.tar.gz" >"$name.tar.gz.sha256")

echo "$dist/$name.tar.gz ($(du -h "$dist/$name.tar.gz" | cut -f1); binary $(du -h "$binary" | cut -f1))"
echo "$dist/$name.tar.gz.sha256"
