#!/usr/bin/env bash
# Assembles the root file system of the minimal Airlock image (airlock:dev) in OUT:
#   /usr/local/bin/airlock     BINARY without its debug info (objcopy --strip-debug; the
#                              symbol names stay, so a panic's backtrace names functions)
#   the shared libraries       exactly those `ldd BINARY` lists, at the paths it lists
#   /etc/passwd, /etc/group    root, airlock (65532:65532) and nobody/nogroup
#   /etc/nsswitch.conf         files for users and groups, files + dns for hosts
#   /etc/ssl/certs/ca-certificates.crt   this machine's CA bundle (ca-certificates)
#   /var/lib/airlock           the data dir (AIRLOCK_DATA_DIR), owned by 65532, mode 0700
#   /tmp                       mode 1777; /etc/airlock, empty, for a mounted config
# Nothing else: no shell, no package manager. No tzdata either: Airlock keeps time in UTC
# (chrono without its clock/local-time feature) and reads no zone files.
#
# Used by build-images.sh on this machine and by the Dockerfile's builder stage, so both
# images hold the same files. Run as root to give /var/lib/airlock to 65532 (otherwise the
# caller sets the ownership, as the Dockerfile does with COPY --chown).
#
#   deploy/docker/assemble-rootfs.sh BINARY OUT
set -euo pipefail

die() { echo "assemble-rootfs: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: $0 BINARY OUT"
bin=$1
out=$2
[ -f "$bin" ] && [ -x "$bin" ] || die "no executable at $bin"
for tool in ldd objcopy install; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found: install binutils (objcopy) and libc-bin (ldd), e.g. apt-get install binutils libc-bin"
done
ca_bundle=/etc/ssl/certs/ca-certificates.crt
[ -s "$ca_bundle" ] || die "no CA bundle at $ca_bundle: apt-get install ca-certificates"
[ ! -e "$out" ] || [ -z "$(ls -A "$out")" ] || die "$out exists and is not empty"

mkdir -p "$out"
out=$(cd "$out" && pwd)

# The directory layout of this machine: on a merged-/usr system (Debian 12) /lib and
# /lib64 are relative symlinks into /usr, and the loader path baked into the binary
# (/lib64/ld-linux-x86-64.so.2) must resolve the same way inside the image.
mkdir -p "$out/usr/bin" "$out/usr/lib" "$out/usr/local/bin"
for d in bin sbin lib lib32 lib64 libx32; do
    if [ -L "/$d" ]; then
        target=$(readlink "/$d")
        case $target in
            /*) target=${target#/} ;; # keep it inside the image
        esac
        mkdir -p "$out/$target"
        ln -s "$target" "$out/$d"
    fi
done

objcopy --strip-debug "$bin" "$out/usr/local/bin/airlock"
chmod 0755 "$out/usr/local/bin/airlock"

# ldd prints "name => /path (addr)" per library and "/path (addr)" for the loader; a
# static binary is "not a dynamic executable" and needs none.
if ldd_out=$(ldd "$bin" 2>&1); then
    if grep -q 'not found' <<<"$ldd_out"; then
        die "$bin links libraries this machine lacks:"$'\n'"$(grep 'not found' <<<"$ldd_out")"
    fi
    libs=$(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_out" | sort -u)
    [ -n "$libs" ] || die "ldd listed no libraries for $bin:"$'\n'"$ldd_out"
    for lib in $libs; do
        mkdir -p "$out$(dirname "$lib")"
        # -L: the file itself, at the path the loader looks for, not a dangling symlink.
        cp -L "$lib" "$out$lib"
    done
elif grep -q 'not a dynamic executable\|statically linked' <<<"$ldd_out"; then
    libs=""
else
    die "ldd $bin failed: $ldd_out"
fi

mkdir -p "$out/etc/ssl/certs" "$out/etc/airlock" "$out/var/lib/airlock" "$out/tmp"
cat >"$out/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/usr/sbin/nologin
airlock:x:65532:65532:Airlock:/var/lib/airlock:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
cat >"$out/etc/group" <<'EOF'
root:x:0:
airlock:x:65532:
nogroup:x:65534:
EOF
# glibc 2.34 and later have the files and dns back ends built in: no libnss_* to copy.
cat >"$out/etc/nsswitch.conf" <<'EOF'
passwd:    files
group:     files
shadow:    files
hosts:     files dns
networks:  files
protocols: files
services:  files
EOF
install -m 0644 "$ca_bundle" "$out/etc/ssl/certs/ca-certificates.crt"
chmod 0644 "$out/etc/passwd" "$out/etc/group" "$out/etc/nsswitch.conf"
chmod 1777 "$out/tmp"
chmod 0700 "$out/var/lib/airlock"
if [ "$(id -u)" = 0 ]; then
    chown -R 0:0 "$out"
    chown 65532:65532 "$out/var/lib/airlock"
fi

echo "assemble-rootfs: $out: airlock $(du -h "$out/usr/local/bin/airlock" | cut -f1)," \
    "libraries: ${libs//$'\n'/ }"
