#!/bin/sh
# Run once by the postgres image's entrypoint on an empty data directory: the db
# worker's own role and database, apart from the store's.
set -eu
# psql reads the password from its file itself (a backquoted \set): never on a command
# line, which other processes can read.
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
\set password `cat /etc/airlock/databases/sandbox-password`
CREATE ROLE airlock_tools LOGIN PASSWORD :'password';
CREATE DATABASE sandbox OWNER airlock_tools;
SQL
