#!/usr/bin/env bash
# relay-core must not depend, even indirectly, on an async runtime, a network or a database crate.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(cargo tree -p relay-core -e normal --prefix none --locked)
bad=$(echo "$tree" | grep -E '^(tokio|mio|reqwest|hyper|hyper-util|rusqlite|libsqlite3-sys|postgres|tokio-postgres|deadpool-postgres|axum|rand|getrandom) ' || true)
if [ -n "$bad" ]; then
  echo "relay-core must stay pure, but its dependency tree contains:"
  echo "$bad" | sort -u
  exit 1
fi
echo "relay-core: no runtime, network or database crate among $(echo "$tree" | sort -u | wc -l) dependencies"
