#!/bin/sh
# The PostgreSQL service of deploy/compose: runs as 65532 on a read-only root. On an
# empty data directory it creates the cluster, the store's role and database (airlock)
# and the db worker's (airlock_tools, sandbox), and allows only TLS connections with a
# password (hostssl, scram-sha-256); then it serves with the certificate of
# <state>/pg-server. The image is airlock-postgres (deploy/compose/prepare.sh).
set -eu
: "${PGDATA:?PGDATA is not set}"
server=/etc/airlock/pg-server
store_password=/etc/airlock/secrets/store/store-password
tools_password=/etc/airlock/secrets/databases/sandbox-password

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    mkdir -p "$PGDATA"
    chmod 0700 "$PGDATA"
    initdb --username=airlock --pwfile="$store_password" --auth=scram-sha-256 \
        --encoding=UTF8 --no-locale -D "$PGDATA" >/tmp/initdb.log 2>&1 ||
        { cat /tmp/initdb.log >&2; exit 1; }
    cat >"$PGDATA/pg_hba.conf" <<'HBA'
# local: the entrypoint's own set-up and pg_isready. Everything else: TLS and a password.
local    all  all                 scram-sha-256
hostssl  all  all  0.0.0.0/0      scram-sha-256
hostssl  all  all  ::/0           scram-sha-256
HBA
    # The set-up server listens on no TCP port: the health check (pg_isready over TCP)
    # passes only once the real server below is up.
    mkdir -p /tmp/setup
    pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=/tmp/setup" -w start >/dev/null
    # Passwords from their files, never on a command line (ps would show them).
    PGPASSFILE=/tmp/pgpass
    (umask 077 && printf '/tmp/setup:5432:*:airlock:%s\n' "$(cat "$store_password")" >"$PGPASSFILE")
    export PGPASSFILE
    psql -v ON_ERROR_STOP=1 -q -h /tmp/setup -U airlock -d postgres <<SQL
\\set tools_password \`cat $tools_password\`
CREATE DATABASE airlock OWNER airlock;
CREATE ROLE airlock_tools LOGIN PASSWORD :'tools_password';
CREATE DATABASE sandbox OWNER airlock_tools;
SQL
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    rm -f "$PGPASSFILE"
    echo "postgres-entry: cluster created in $PGDATA"
fi

exec postgres -D "$PGDATA" \
    -c listen_addresses='*' \
    -c unix_socket_directories=/tmp \
    -c ssl=on \
    -c ssl_cert_file="$server/server.crt" \
    -c ssl_key_file="$server/server.key" \
    -c ssl_min_protocol_version=TLSv1.2 \
    -c max_connections=100
