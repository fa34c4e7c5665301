#!/usr/bin/env bash
# Runs the TypeScript MCP SDK tests (clients.test.mjs; tasks.test.mjs, the Tasks extension client
# @modelcontextprotocol/ext-tasks) against the relay binary.
#   RELAY_BIN  the binary to test (default: $CARGO_TARGET_DIR or target, /debug/relay)
# Needs: (cd tests/typescript && npm ci)
set -euo pipefail
cd "$(dirname "$0")"
export RELAY_BIN="${RELAY_BIN:-${CARGO_TARGET_DIR:-$(cd ../.. && pwd)/target}/debug/relay}"
for pkg in client ext-tasks; do
    [ -d "node_modules/@modelcontextprotocol/$pkg" ] || { echo "typescript: run (cd $(pwd) && npm ci) first" >&2; exit 1; }
done
exec node --test --test-reporter=spec clients.test.mjs tasks.test.mjs
