#!/usr/bin/env bash
# Each crate links only what its side needs: relay-core no async runtime, network or database
# crate, even indirectly; the worker shell no store or web-server crate; the server shell no
# HTTP client. Dev-dependencies do not count (`-e normal`): a test may drive both sides.
set -euo pipefail
cd "$(dirname "$0")/.."

# forbid CRATE WHAT REGEX: fails when CRATE's normal dependency tree has a crate matching REGEX.
forbid() {
  local crate=$1 what=$2 regex=$3 tree bad
  tree=$(cargo tree -p "$crate" -e normal --prefix none --locked)
  bad=$(echo "$tree" | grep -E "^($regex) " || true)
  if [ -n "$bad" ]; then
    echo "$crate must not link $what, but its dependency tree contains:"
    echo "$bad" | sort -u
    exit 1
  fi
  echo "$crate: no $what among $(echo "$tree" | sort -u | wc -l) dependencies"
}

forbid relay-core "runtime, network or database crate" \
  'tokio|mio|reqwest|hyper|hyper-util|rusqlite|libsqlite3-sys|postgres|tokio-postgres|deadpool-postgres|axum|rand|getrandom'
forbid relay-worker "store or web-server crate" \
  'rusqlite|libsqlite3-sys|postgres|tokio-postgres|deadpool-postgres|axum|axum-core'
forbid relay-server "HTTP client" 'reqwest'
