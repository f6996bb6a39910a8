#!/usr/bin/env bash
# Builds Airlock's images on a machine with a Docker engine and no registry: nothing is
# pulled. Each root file system is assembled here and loaded with `docker import`.
#
#   airlock:dev         the airlock binary (debug info stripped), exactly the shared
#                       libraries it links (ldd), /etc/passwd and /etc/group with airlock
#                       (65532:65532), /etc/nsswitch.conf, the CA bundle. No shell.
#                       (deploy/docker/assemble-rootfs.sh)
#   airlock-shell:dev   for the shell worker: a Debian root (debootstrap --variant=minbase
#                       with git, python3, ca-certificates: sh, coreutils, git, python3 are
#                       what sandboxes see) plus the same binary and user.
#
# Both run as 65532:65532 with ENTRYPOINT ["/usr/local/bin/airlock"], keep their state
# in the data dir /var/lib/airlock (AIRLOCK_DATA_DIR; also the WORKDIR) and declare it
# and /tmp as volumes, so they run with a read-only root file system
# (`docker run --read-only`, Kubernetes' readOnlyRootFilesystem).
#
# Usage: deploy/docker/build-images.sh [airlock] [airlock-shell]     (default: both)
# Environment:
#   AIRLOCK_BIN            binary to put in the images (default <target>/release/airlock;
#                          built with `cargo build --release -p airlock --locked` when
#                          missing). CI passes target/debug/airlock, the binary its tests
#                          built, to save a release build: the images that ship come
#                          from the release binary.
#   AIRLOCK_IMAGE_TAG      tag of both images (default dev)
#   AIRLOCK_IMAGE_CACHE    where the Debian root of airlock-shell is cached as a tarball
#                          (default <target>/airlock-images); a second run reuses it and
#                          needs neither debootstrap nor the network
#   AIRLOCK_DEBIAN_SUITE   Debian release of airlock-shell (default this machine's, so its
#                          glibc is the one the binary was built against)
#   AIRLOCK_DEBIAN_MIRROR  Debian mirror (default the first one in this machine's apt
#                          sources)
#
# Needs: root (the root file systems hold files of root and of 65532, and debootstrap
# runs as root), docker, binutils (objcopy), libc-bin (ldd), ca-certificates, and for the
# first airlock-shell build debootstrap. It installs nothing: `.ci/run` apt-installs
# debootstrap on CI.
set -euo pipefail
shopt -s inherit_errexit

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# A relative AIRLOCK_BIN is relative to where the script was started.
case ${AIRLOCK_BIN:-/} in
    /*) ;;
    *) AIRLOCK_BIN="$PWD/$AIRLOCK_BIN" ;;
esac
cd "$root"
here="$root/deploy/docker"

die() { echo "build-images: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found: $2"; }

images=("$@")
[ ${#images[@]} -gt 0 ] || images=(airlock airlock-shell)
for image in "${images[@]}"; do
    case $image in
        airlock | airlock-shell) ;;
        *) die "unknown image '$image' (airlock or airlock-shell)" ;;
    esac
done

[ "$(id -u)" = 0 ] || die "run as root (sudo $0): the root file systems hold files owned by root and by 65532, and debootstrap needs root"
need docker "install the Docker engine and client (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "docker cannot reach the Docker engine (docker info failed): start it (systemctl start docker, or dockerd &)"
need objcopy "apt-get install binutils"
need ldd "apt-get install libc-bin"
need tar "apt-get install tar"
need sha256sum "apt-get install coreutils"

# Where cargo puts binaries: honour CARGO_TARGET_DIR and build.target-dir.
target_dir=""
if command -v cargo >/dev/null 2>&1; then
    target_dir="$(cargo metadata --format-version 1 --no-deps --locked 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')" || target_dir=""
fi
target_dir="${target_dir:-${CARGO_TARGET_DIR:-$root/target}}"

bin="${AIRLOCK_BIN:-$target_dir/release/airlock}"
if [ ! -e "$bin" ]; then
    if [ -n "${AIRLOCK_BIN:-}" ]; then
        die "AIRLOCK_BIN=$AIRLOCK_BIN does not exist: build it first, or unset AIRLOCK_BIN to build the release binary"
    fi
    need cargo "install a Rust toolchain (rustup), or set AIRLOCK_BIN to a built airlock binary"
    echo "== cargo build --release -p airlock --locked (no binary at $bin)"
    cargo build --release -p airlock --locked
fi
[ -x "$bin" ] || die "$bin is not an executable"
version="$("$bin" --version)" || die "$bin --version failed"

tag="${AIRLOCK_IMAGE_TAG:-dev}"
cache="${AIRLOCK_IMAGE_CACHE:-$target_dir/airlock-images}"
mkdir -p "$cache"
work="$(mktemp -d "$cache/work.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# Debug info stripped once, for both images (a debug build's binary shrinks most).
mkdir "$work/bin"
objcopy --strip-debug "$bin" "$work/bin/airlock"
chmod 0755 "$work/bin/airlock"

# The image config both images share. VOLUME gives the data dir and /tmp a writable
# place under --read-only even when the caller mounts nothing there.
changes=(
    --change 'USER 65532:65532'
    --change 'ENV AIRLOCK_DATA_DIR=/var/lib/airlock'
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin'
    --change 'WORKDIR /var/lib/airlock'
    --change 'VOLUME ["/var/lib/airlock", "/tmp"]'
    --change 'ENTRYPOINT ["/usr/local/bin/airlock"]'
    --change 'CMD ["--help"]'
)

# import NAME DIR: loads DIR as NAME:tag, and removes the image that tag named before if
# nothing else uses it, so that running this again leaves no dangling image behind.
import() {
    local name=$1 dir=$2 old new
    old="$(docker image inspect -f '{{.Id}}' "$name:$tag" 2>/dev/null || true)"
    new="$(tar --numeric-owner --sort=name -C "$dir" -c . |
        docker import "${changes[@]}" --message "$version, $(basename "$bin") from $bin" - "$name:$tag")"
    if [ -n "$old" ] && [ "$old" != "$new" ]; then
        docker image rm "$old" >/dev/null 2>&1 || true
    fi
    echo "$name:$tag $(docker image inspect -f '{{.Size}}' "$name:$tag") bytes ($new)"
}

build_airlock() {
    echo "== airlock:$tag"
    "$here/assemble-rootfs.sh" "$work/bin/airlock" "$work/airlock"
    import airlock "$work/airlock"
}

# The mirror of this machine's apt sources (deb822 .sources or one-line .list).
default_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk '/^URIs:/ && $2 ~ /debian\/?$/ && $2 !~ /security/ { print $2; exit }' "$f"
    done | head -n1 | grep . && return
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { if ($i ~ /debian\/?$/ && $i !~ /security/) print $i; break } }' "$f"
    done | head -n1 | grep . && return
    echo "http://deb.debian.org/debian"
}

# The Debian root of airlock-shell, from the cache or made by debootstrap into it.
debian_root() {
    local suite mirror include key tarball dir
    # shellcheck disable=SC1091
    suite="${AIRLOCK_DEBIAN_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}"
    [ -n "$suite" ] || die "cannot tell this machine's Debian release: set AIRLOCK_DEBIAN_SUITE (e.g. bookworm)"
    mirror="${AIRLOCK_DEBIAN_MIRROR:-$(default_mirror)}"
    include=git,python3,ca-certificates
    # Part of the key: what goes in, and how it is trimmed (the version of this recipe).
    key="$(printf '%s\n' 2 "$suite" "$mirror" "$include" | sha256sum | cut -c1-12)"
    tarball="$cache/debian-$suite-minbase-$key.tar"
    if [ -s "$tarball" ]; then
        echo "== Debian $suite root from the cache: $tarball" >&2
        echo "$tarball"
        return
    fi
    need debootstrap "apt-get install debootstrap (needed once: the Debian root of airlock-shell is then cached in $cache)"
    dir="$work/debootstrap"
    echo "== debootstrap --variant=minbase --include=$include $suite from $mirror" >&2
    if ! debootstrap --variant=minbase --include="$include" "$suite" "$dir" "$mirror" >"$work/debootstrap.log" 2>&1; then
        tail -n 30 "$work/debootstrap.log" >&2
        [ -f "$dir/debootstrap/debootstrap.log" ] && tail -n 30 "$dir/debootstrap/debootstrap.log" >&2
        die "debootstrap of $suite from $mirror failed (above); set AIRLOCK_DEBIAN_MIRROR to a reachable Debian mirror"
    fi
    # Trim what a sandbox never needs: the package caches and lists, documentation (the
    # copyright files stay), manuals, translations, logs; debootstrap's copies of this
    # machine's /etc/hostname, /etc/hosts and /etc/resolv.conf (Docker and Kubernetes
    # provide their own); the device nodes (the runtime mounts /dev).
    rm -rf "${dir:?}"/var/cache/apt/* "$dir"/var/lib/apt/lists/* "$dir"/var/cache/debconf/*-old \
        "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/usr/share/locale/* \
        "$dir"/var/log/* "${dir:?}"/dev/* "$dir"/debootstrap
    find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$dir/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -f "$dir/etc/hostname" "$dir/etc/hosts" "$dir/etc/resolv.conf" "$dir/etc/machine-id"
    : >"$dir/etc/machine-id"
    # No set-user-ID or set-group-ID programs (su, passwd, mount, …): nobody in these
    # containers is meant to change identity.
    find "$dir" -xdev -type f -perm /6000 -exec chmod ug-s {} +
    tar --numeric-owner --sort=name -C "$dir" -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$dir"
    echo "== cached $tarball ($(du -h "$tarball" | cut -f1))" >&2
    echo "$tarball"
}

build_airlock_shell() {
    echo "== airlock-shell:$tag"
    local tarball dir
    tarball="$(debian_root)"
    dir="$work/airlock-shell"
    mkdir -p "$dir"
    tar --numeric-owner -C "$dir" -xf "$tarball"
    install -D -m 0755 "$work/bin/airlock" "$dir/usr/local/bin/airlock"
    # The binary must run on this root's own libraries (Debian's, from the packages).
    if ! chroot "$dir" /usr/local/bin/airlock --version >/dev/null 2>"$work/chroot.err"; then
        cat "$work/chroot.err" >&2
        die "$bin does not run on the Debian root of airlock-shell (above; a binary built against a newer glibc?): set AIRLOCK_DEBIAN_SUITE to the release it was built on"
    fi
    grep -q '^airlock:' "$dir/etc/group" || echo 'airlock:x:65532:' >>"$dir/etc/group"
    grep -q '^airlock:' "$dir/etc/passwd" ||
        echo 'airlock:x:65532:65532:Airlock:/var/lib/airlock:/usr/sbin/nologin' >>"$dir/etc/passwd"
    install -d -m 0700 -o 65532 -g 65532 "$dir/var/lib/airlock"
    install -d -m 0755 "$dir/etc/airlock"
    chmod 1777 "$dir/tmp"
    import airlock-shell "$dir"
    rm -rf "$dir"
}

for image in "${images[@]}"; do
    case $image in
        airlock) build_airlock ;;
        airlock-shell) build_airlock_shell ;;
    esac
done
