#!/bin/sh
# Run once by the postgres image's entrypoint on an empty data directory: the db
# worker's own role and database, apart from the store's.
set -eu
password=$(cat /etc/airlock/databases/sandbox-password)
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v password="$password" <<'SQL'
CREATE ROLE airlock_tools LOGIN PASSWORD :'password';
CREATE DATABASE sandbox OWNER airlock_tools;
SQL
