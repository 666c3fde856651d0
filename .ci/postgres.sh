#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for the multi-worker tests.
#   .ci/postgres.sh start   # prints the SQLAlchemy URL
#   .ci/postgres.sh stop
set -euo pipefail
PGHOME=${PGHOME:-/tmp/skipsearch-pg}
PORT=${PGPORT:-55432}

as_server_user() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

bin_dir() {
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}

case "${1:-}" in
start)
  if [ -z "$(bin_dir)" ]; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  BIN=$(bin_dir)
  rm -rf "$PGHOME" && mkdir -p "$PGHOME"
  [ "$(id -u)" = 0 ] && chown postgres "$PGHOME"
  as_server_user "$BIN/initdb" -D "$PGHOME/data" -A trust -U postgres >/dev/null
  as_server_user "$BIN/pg_ctl" -D "$PGHOME/data" -l "$PGHOME/server.log" -w \
    -o "-p $PORT -k $PGHOME -c listen_addresses=127.0.0.1" start >/dev/null
  as_server_user "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres skipsearch
  echo "postgresql+psycopg2://postgres@127.0.0.1:$PORT/skipsearch"
  ;;
stop)
  BIN=$(bin_dir)
  [ -d "$PGHOME/data" ] && as_server_user "$BIN/pg_ctl" -D "$PGHOME/data" -m fast -w stop >/dev/null || true
  rm -rf "$PGHOME"
  ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
