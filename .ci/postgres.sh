# Sourced by .ci/run: makes sure a PostgreSQL server answers, and exports RELAY_TEST_POSTGRES.
#
# An already-set RELAY_TEST_POSTGRES is used as it is. Otherwise a throwaway cluster is made in a
# temp dir (initdb + pg_ctl, as the postgres user) on a free loopback port, and stopped on exit.
# Where the server binaries are missing, Debian's postgresql package is installed first.

start_postgres() {
  if [ -n "${RELAY_TEST_POSTGRES:-}" ]; then
    echo "postgres: using RELAY_TEST_POSTGRES from the environment"
    return
  fi
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    echo "postgres: server binaries missing; installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  fi
  id postgres >/dev/null 2>&1 || useradd --system --home /var/lib/postgresql postgres
  PG_TMP=$(mktemp -d /tmp/relay-pg.XXXXXX)
  chown postgres "$PG_TMP"
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
  su postgres -s /bin/sh -c "'$bin/initdb' -D '$PG_TMP/data' -U postgres -A trust -E UTF8 --no-locale >'$PG_TMP/initdb.log' 2>&1" \
    || { cat "$PG_TMP/initdb.log"; return 1; }
  su postgres -s /bin/sh -c "'$bin/pg_ctl' -D '$PG_TMP/data' -l '$PG_TMP/server.log' -w -t 60 \
      -o \"-p $port -k '$PG_TMP' -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off\" start" >/dev/null \
    || { cat "$PG_TMP/server.log"; return 1; }
  PG_BIN=$bin
  trap stop_postgres EXIT
  export RELAY_TEST_POSTGRES="postgres://postgres@127.0.0.1:$port/postgres"
  echo "postgres: throwaway cluster on 127.0.0.1:$port ($("$bin/postgres" --version))"
}

stop_postgres() {
  if [ -n "${PG_TMP:-}" ] && [ -d "$PG_TMP/data" ]; then
    su postgres -s /bin/sh -c "'$PG_BIN/pg_ctl' -D '$PG_TMP/data' -m fast stop" >/dev/null 2>&1 || true
    rm -rf "$PG_TMP"
  fi
}
