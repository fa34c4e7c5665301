#!/usr/bin/env bash
# Runs the TypeScript MCP SDK tests (clients.test.mjs) against the relay binary.
#   RELAY_BIN  the binary to test (default: $CARGO_TARGET_DIR or target, /debug/relay)
# Needs: (cd tests/typescript && npm ci)
set -euo pipefail
cd "$(dirname "$0")"
export RELAY_BIN="${RELAY_BIN:-${CARGO_TARGET_DIR:-$(cd ../.. && pwd)/target}/debug/relay}"
[ -d node_modules/@modelcontextprotocol/client ] || { echo "typescript: run (cd $(pwd) && npm ci) first" >&2; exit 1; }
exec node --test --test-reporter=spec clients.test.mjs
