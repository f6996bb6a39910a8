#!/usr/bin/env bash
# Prepares what deploy/compose/compose.yaml mounts, in STATE (a directory of the Docker
# host), and the PostgreSQL image it runs, without a registry:
#
#   deploy/compose/prepare.sh STATE
#   docker-compose --env-file STATE/compose.env -f deploy/compose/compose.yaml up -d
#
# STATE/
#   compose.env            AIRLOCK_COMPOSE_STATE=STATE, for docker-compose --env-file
#   principals.env         AIRLOCK_AGENT_TOKEN, AIRLOCK_APPROVER_TOKEN (random; the
#                          orchestrators' [[principals]] token_env)
#   tls/<component>/       ca.crt and that component's own certificate and key, from
#                          `airlock certs init` (orchestrator, worker-shell, -fs, -http, -db)
#   pg-ca/ca.crt           the CA of PostgreSQL's certificate (sslrootcert=), a CA of its own
#   pg-server/             PostgreSQL's certificate and key, valid for the name "postgres"
#   secrets/store/         store-password (the store's PostgreSQL role, airlock)
#   secrets/databases/     sandbox-password (the db worker's role, airlock_tools)
#   workspaces/            the workspaces the shell and fs workers share
#
# Everything a container reads is owned by 65532 (the images' user), keys and passwords
# mode 0600. An existing STATE is kept as it is: certificates and passwords are never
# overwritten (delete STATE to start over, with `docker-compose down -v`).
#
# airlock-postgres:dev is airlock-shell:dev plus this machine's PostgreSQL server (the
# Debian packages postgresql-N and postgresql-client-N) and the libraries it links, loaded
# with `docker import`. Needs root, docker, the images of build-images.sh, and PostgreSQL
# installed here (apt-get install postgresql). AIRLOCK_IMAGE_TAG: tag (default dev).
set -euo pipefail
shopt -s inherit_errexit

die() { echo "prepare: $*" >&2; exit 1; }

[ $# = 1 ] || die "usage: $0 STATE (a directory for certificates, secrets and workspaces)"
[ "$(id -u)" = 0 ] || die "run as root (sudo $0): the files are handed to uid 65532, the containers' user"
command -v docker >/dev/null 2>&1 || die "docker not found: install the Docker engine and client"
docker info >/dev/null 2>&1 || die "docker cannot reach the Docker engine (docker info failed): start it"
tag="${AIRLOCK_IMAGE_TAG:-dev}"
for image in "airlock:$tag" "airlock-shell:$tag"; do
    docker image inspect "$image" >/dev/null 2>&1 || die "no image $image: build it with deploy/docker/build-images.sh"
done
mkdir -p "$1"
state="$(cd "$1" && pwd)"
uid=65532

# --- airlock-postgres -----------------------------------------------------------------
build_postgres_image() {
    local postgres pg_root version share work cid paths=() file lib
    postgres="$(command -v postgres 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/postgres 2>/dev/null | sort -V | tail -n 1 || true)"
    [ -n "$postgres" ] && [ -x "$postgres" ] || die "no PostgreSQL server on this machine: apt-get install postgresql"
    pg_root="$(dirname "$(dirname "$(readlink -f "$postgres")")")"
    version="$(basename "$pg_root")"
    share="/usr/share/postgresql/$version"
    for file in postgres initdb pg_ctl pg_isready psql; do
        [ -x "$pg_root/bin/$file" ] || die "no $pg_root/bin/$file: apt-get install postgresql-$version postgresql-client-$version"
    done
    [ -d "$share" ] || die "no $share: apt-get install postgresql-$version"
    [ -d /usr/share/zoneinfo ] || die "no /usr/share/zoneinfo: apt-get install tzdata"
    paths+=("$pg_root" "$share" /usr/share/zoneinfo)
    # Each library the binaries and modules link, under its real directory (/lib is a
    # link to /usr/lib in the image's root): the name they ask for and the file it names.
    while read -r lib; do
        paths+=("$(readlink -f "$(dirname "$lib")")/$(basename "$lib")" "$(readlink -f "$lib")")
    done < <(ldd "$pg_root"/bin/* "$pg_root"/lib/*.so 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
    work="$(mktemp -d)"
    mkdir "$work/root"
    cid="$(docker create "airlock-shell:$tag")"
    docker export "$cid" | tar -x -C "$work/root"
    docker rm "$cid" >/dev/null
    # Unpacked and packed again: an image's tar may not name a path twice.
    tar -c -C / "${paths[@]#/}" | tar -x -C "$work/root" --keep-directory-symlink
    tar -c -C "$work/root" --numeric-owner . >"$work/rootfs.tar"
    docker import \
        --change "USER $uid:$uid" \
        --change "ENV PATH=$pg_root/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV TZ=UTC" \
        --change "WORKDIR /var/lib/airlock" \
        --change 'VOLUME ["/var/lib/airlock", "/tmp"]' \
        --change 'ENTRYPOINT ["/bin/sh"]' \
        --message "airlock-postgres: airlock-shell:$tag with PostgreSQL $version" \
        "$work/rootfs.tar" "airlock-postgres:$tag" >/dev/null
    rm -rf "$work"
    echo "prepare: built airlock-postgres:$tag (PostgreSQL $("$postgres" --version | awk '{print $3}'))"
}
if ! docker image inspect "airlock-postgres:$tag" >/dev/null 2>&1; then
    build_postgres_image
fi

# --- STATE ---------------------------------------------------------------------------
if [ -s "$state/compose.env" ]; then
    echo "prepare: $state is prepared already (kept as it is)"
    exit 0
fi

random_secret() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# certs_init DIR [SAN...]: `airlock certs init` of the image, as its own user.
certs_init() {
    local dir=$1
    shift
    mkdir -p "$dir"
    chown "$uid:$uid" "$dir"
    local sans=()
    for san in "$@"; do sans+=(--san "$san"); done
    docker run --rm --read-only --network none -v "$dir:/out" "airlock:$tag" \
        certs init --out /out/pki "${sans[@]}" >/dev/null
}

pki="$(mktemp -d)"
trap 'rm -rf "$pki"' EXIT
certs_init "$pki/airlock"
certs_init "$pki/pg" postgres

for component in orchestrator worker-shell worker-fs worker-http worker-db; do
    dir="$state/tls/$component"
    mkdir -p "$dir"
    install -m 0644 "$pki/airlock/pki/ca.crt" "$dir/ca.crt"
    install -m 0644 "$pki/airlock/pki/$component.crt" "$dir/$component.crt"
    install -m 0600 "$pki/airlock/pki/$component.key" "$dir/$component.key"
done
mkdir -p "$state/pg-ca" "$state/pg-server"
install -m 0644 "$pki/pg/pki/ca.crt" "$state/pg-ca/ca.crt"
# A plain --san goes on the orchestrator's certificate alone, taken here as the server's.
install -m 0644 "$pki/pg/pki/orchestrator.crt" "$state/pg-server/server.crt"
install -m 0600 "$pki/pg/pki/orchestrator.key" "$state/pg-server/server.key"

mkdir -p "$state/secrets/store" "$state/secrets/databases" "$state/workspaces"
(umask 077 && random_secret >"$state/secrets/store/store-password")
(umask 077 && random_secret >"$state/secrets/databases/sandbox-password")
chown -R "$uid:$uid" "$state/tls" "$state/pg-ca" "$state/pg-server" "$state/secrets" "$state/workspaces"
chmod 0755 "$state/tls" "$state/secrets"

# Read by docker-compose on this host (root), not mounted into any container.
(umask 077 && printf 'AIRLOCK_AGENT_TOKEN=%s\nAIRLOCK_APPROVER_TOKEN=%s\n' "$(random_secret)" "$(random_secret)" >"$state/principals.env")
printf 'AIRLOCK_COMPOSE_STATE=%s\nAIRLOCK_IMAGE_TAG=%s\n' "$state" "$tag" >"$state/compose.env.partial"
mv "$state/compose.env.partial" "$state/compose.env"
echo "prepare: $state is ready: docker-compose --env-file $state/compose.env -f $(cd "$(dirname "$0")" && pwd)/compose.yaml up -d"
