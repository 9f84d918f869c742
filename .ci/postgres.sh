#!/usr/bin/env bash
# Start a throwaway PostgreSQL cluster on 127.0.0.1 from Debian's packages; print its SQLAlchemy URL.
# Usage: url=$(.ci/postgres.sh) && SERVESCOPE_TEST_PG_URL=$url pytest tests/storage
# Progress goes to stderr; stdout holds only the URL. Stop it with: pg_ctl -D "$DATA" stop.
set -euo pipefail

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
bin=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")

# The server refuses to run as root, so the cluster belongs to the package's postgres user.
run_as=()
if [ "$(id -u)" = 0 ]; then run_as=(runuser -u postgres --); fi

data=$(mktemp -d /tmp/servescope-pg.XXXXXX)
chmod 700 "$data"
[ "$(id -u)" = 0 ] && chown postgres "$data"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

"${run_as[@]}" "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 >&2
"${run_as[@]}" "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >&2
"${run_as[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres servescope >&2
echo "postgresql+psycopg://postgres@127.0.0.1:$port/servescope"
