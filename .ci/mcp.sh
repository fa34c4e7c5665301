#!/usr/bin/env bash
# CI step: real MCP clients against `relay serve`.
#   1. tests/python: the official Python MCP SDK (pinned in requirements.txt) drives the server.
#   2. tests/conformance: the official MCP conformance suite (pinned in package-lock.json), with
#      the committed expected-failures list.
# Installs what they need, builds `relay` once, runs both; non-zero if either fails.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

echo "== mcp: install (pip, npm)"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet -r tests/python/requirements.txt
(cd tests/conformance && npm ci --no-audit --no-fund --loglevel=error)
echo "   install took $((SECONDS - started)) s"

# RELAY_BIN set: test that binary as it is (no build).
if [ -z "${RELAY_BIN:-}" ]; then
    echo "== mcp: build relay"
    step=$SECONDS
    cargo build --quiet --locked -p relay
    RELAY_BIN="$(cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/relay"
    echo "   build took $((SECONDS - step)) s"
fi
export RELAY_BIN

status=0
step=$SECONDS
echo "== mcp: Python SDK test"
bash tests/python/run.sh || status=1
echo "   took $((SECONDS - step)) s"

step=$SECONDS
echo "== mcp: conformance suite"
bash tests/conformance/run.sh || status=1
echo "   took $((SECONDS - step)) s"

echo "== mcp: done in $((SECONDS - started)) s"
exit "$status"
