#!/usr/bin/env bash
# Runs the Python MCP SDK test against the relay binary.
#   RELAY_BIN  the binary to test (default: $CARGO_TARGET_DIR or target, /debug/relay)
# Needs: pip install -r tests/python/requirements.txt
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1
cd "$(dirname "$0")"
export RELAY_BIN="${RELAY_BIN:-${CARGO_TARGET_DIR:-$(cd ../.. && pwd)/target}/debug/relay}"
# -p no:cacheprovider: leave no .pytest_cache in the tree.
exec python3 -m pytest -q -p no:cacheprovider test_mcp_sdk.py "$@"
