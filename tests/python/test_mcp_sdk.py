"""The queue server driven by the official Python MCP SDK (package `mcp` on PyPI).

What it shows: a stock MCP client works against `relay serve` unchanged, in both MCP eras the
server speaks on one URL: forced to the stateless 2026-07-28 era (`mode="2026-07-28"`), forced to
the legacy initialize/session era (`mode="legacy"`), and the SDK's default probe (`mode="auto"`,
which must settle on 2026-07-28). In each: tools/list with only the granted verbs and strict
input schemas, a fenced claim, heartbeats with the lease token, attempts that end in a dead
letter, get_todo's timeline (newest first, with outcomes), an undeclared argument answered
`invalid`. Modern only: the doorbell heard on `subscriptions/listen` (`relay://queues/<q>`), and
bad envelopes answered with clear JSON-RPC errors that change nothing. Legacy only: 70 clients
that never end their sessions do not lock the 71st out. With RELAY_TEST_POSTGRES: two servers on
one database, modern requests alternating between them.

The server is the real binary (`RELAY_BIN`, default `target/debug/relay`) on a fresh SQLite file;
endpoints and todos are made with the CLI, as an operator would. Nothing sleeps to synchronise:
the one wait (a one-second lease lapsing) polls `claim` until the server hands the todo over,
bounded by a deadline that only a failure reaches.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import secrets

import httpx2
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.subscriptions import ResourceUpdated
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

REPO = Path(__file__).resolve().parents[2]
ENDPOINT = "worker"
QUEUE = "work"
OTHER = "other"  # a second granted queue, so that claim_next on QUEUE has one candidate
MODERN = "2026-07-28"
# The SDK's `mode`s: forced modern, forced legacy, and its default probe (which must pick modern).
MODES = [MODERN, "legacy", "auto"]
BELL = "bell"  # queues the doorbell tests add to, one per mode
SECRET = "secret"  # a queue the endpoint is not granted
CROWD = "crowd"  # the endpoint of the lock-out test, so that other tests' sessions do not count
CROWD_CLIENTS = 70  # above the server's default per-endpoint session cap (64)
DOORBELL_BOUND = 30.0  # seconds; the server's doorbell scan finds a CLI add within 5 s
# The verbs vended to ENDPOINT; get_todo comes with list_todos, release and add_todo are not granted.
GRANTED = ["claim_next", "claim", "heartbeat", "complete", "fail", "list_todos"]
LISTED = {"claim_next", "claim", "heartbeat", "complete", "fail", "list_todos", "get_todo"}
START_BOUND = 30.0  # seconds; only a broken server reaches it
LAPSE_BOUND = 15.0


def relay_bin() -> str:
    path = os.environ.get("RELAY_BIN") or str(REPO / "target" / "debug" / "relay")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no relay binary at {path}; build it (cargo build -p relay) or set RELAY_BIN")
    return path


class Relay:
    """`relay serve` on a temporary SQLite file, plus the operator CLI on the same file."""

    def __init__(self) -> None:
        self.bin = relay_bin()
        self.dir = tempfile.mkdtemp(prefix="relay-sdk-")
        self.env = dict(os.environ, RELAY_DB=f"sqlite:{self.dir}/relay.db")
        self.proc: subprocess.Popen[str] | None = None
        self.base = ""

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [self.bin, *args], env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"relay {args[0]} failed: {done.stderr.strip()}"
        return done.stdout.strip()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.bin, "serve", "--listen", "127.0.0.1:0"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.dir, "serve.log"), "w"),
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: [lines.put(l) for l in stdout], daemon=True).start()
        try:
            first = lines.get(timeout=START_BOUND)
        except queue.Empty:
            pytest.fail(f"relay serve printed nothing in {START_BOUND}s; log: {self.log()}")
        prefix = "listening on "
        assert first.startswith(prefix), f"unexpected first line {first!r}; log: {self.log()}"
        self.base = first[len(prefix) :].strip()

    def log(self) -> str:
        try:
            return Path(self.dir, "serve.log").read_text()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the graceful stop
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, endpoint: str = ENDPOINT) -> str:
        return f"{self.base}/mcp/{endpoint}"


def tag(mode: str) -> str:
    return "modern" if mode == MODERN else mode


def q(base: str, mode: str) -> str:
    """The queue a test uses in one mode: each mode drains its own todos."""
    return f"{base}-{tag(mode)}"


@pytest.fixture(scope="module")
def relay():
    r = Relay()
    granted = [q(base, m) for base in (QUEUE, OTHER, BELL) for m in MODES] + [q(QUEUE, "bad")]
    r.token = r.cli(
        "endpoint", "create", ENDPOINT, "--verbs", ",".join(GRANTED), "--queues", ",".join(granted)
    )
    one_line = bool(r.token) and "\n" not in r.token  # (never shown: it is a credential)
    assert one_line, "endpoint create prints the token on one line"
    r.crowd_token = r.cli("endpoint", "create", CROWD, "--verbs", "claim_next", "--queues", QUEUE)
    r.todos = {
        (name, mode): r.cli(
            "todo", "add", "--endpoint", ENDPOINT, "--queue", q(base, mode), "--title", name,
            "--max-attempts", "2",
        )
        for mode in MODES
        for name, base in (("dead-letter", QUEUE), ("retry", OTHER))
    }
    # The todo every refused request of the bad-input test names; it must stay untouched.
    r.todos["untouched"] = r.cli(
        "todo", "add", "--endpoint", ENDPOINT, "--queue", q(QUEUE, "bad"), "--title", "untouched"
    )
    r.start()
    yield r
    r.stop()


def client(
    r: Relay,
    token: str | None = None,
    mode: str = "auto",
    endpoint: str = ENDPOINT,
    terminate_on_close: bool = True,
) -> Client:
    """An SDK client with the bearer token. mode "auto" (the SDK's default) first probes
    `server/discover` and adopts 2026-07-28 when offered, else falls back to the initialize
    handshake; "2026-07-28" adopts the modern era without a probe; "legacy" goes straight to
    initialize."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token or r.token}"},
        timeout=httpx2.Timeout(30.0, read=300.0),
    )
    transport = streamable_http_client(
        r.url(endpoint), http_client=http, terminate_on_close=terminate_on_close
    )
    return Client(transport, mode=mode)


def answer(result: Any) -> dict[str, Any]:
    """A successful tool result: structuredContent, also given as the text content."""
    assert not result.is_error, f"unexpected tool error: {result.structured_content}"
    out = result.structured_content
    assert isinstance(out, dict)
    texts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
    assert texts and json.loads(texts[0]) == out, "the text content repeats structuredContent"
    return out


def error_code(result: Any) -> str:
    assert result.is_error, f"expected a tool error, got {result.structured_content}"
    err = result.structured_content["error"]
    assert set(err) >= {"code", "message"} and err["message"]
    return err["code"]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize("mode", MODES)
def test_era_and_tools_list(relay: Relay, mode: str) -> None:
    async def go() -> None:
        async with client(relay, mode=mode) as c:
            if mode == "legacy":
                assert c.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS
            else:
                # auto: the probe found server/discover offering 2026-07-28 and adopted it.
                assert c.protocol_version == MODERN
            if mode != MODERN:  # forced modern skips discover, so it has no server info
                assert c.server_info is not None and c.server_info.name == "relay"
                assert c.server_capabilities.tools is not None
            tools = (await c.list_tools()).tools
            assert {t.name for t in tools} == LISTED
            for t in tools:
                schema = t.input_schema
                assert schema.get("type") == "object", t.name
                assert schema.get("additionalProperties") is False, t.name

    run(go())


@pytest.mark.parametrize("mode", MODES)
def test_fenced_claim_heartbeat_fail_until_dead_letter(relay: Relay, mode: str) -> None:
    todo = relay.todos[("dead-letter", mode)]
    queue_ = q(QUEUE, mode)

    async def go() -> None:
        async with client(relay, mode=mode) as c:
            # Attempt 1: claim_next, fenced, a one-second lease, one heartbeat; then it lapses.
            first = answer(
                await c.call_tool(
                    "claim_next",
                    {"queue": queue_, "require_fence": True, "lease_ttl_seconds": 1},
                )
            )
            assert first["empty"] is False and first["todo"]["id"] == todo
            assert first["attempt_seq"] == 1 and first["prior_attempts"] == []
            token1 = first["lease_token"]
            assert isinstance(token1, str) and len(token1) >= 22
            hb = answer(
                await c.call_tool(
                    "heartbeat", {"id": todo, "lease_token": token1, "lease_ttl_seconds": 1}
                )
            )
            assert hb["id"] == todo and hb["state"] == "claimed"
            # A heartbeat with a token that is not the lease's: the fence refuses it.
            wrong = await c.call_tool("heartbeat", {"id": todo, "lease_token": "A" * 22})
            assert error_code(wrong) == "conflict"

            # Attempt 2: once the lease has lapsed the todo is claimable again (attempt 1 of 2
            # used). Poll `claim` until the server hands it over; `conflict` means "still held".
            deadline = time.monotonic() + LAPSE_BOUND
            while True:
                r = await c.call_tool("claim", {"id": todo, "require_fence": True})
                if not r.is_error:
                    second = answer(r)
                    break
                assert error_code(r) == "conflict"
                assert time.monotonic() < deadline, "the 1 s lease never lapsed"
                await asyncio.sleep(0.05)
            assert second["attempt_seq"] == 2 and second["attempts_total"] == 2
            token2 = second["lease_token"]
            assert token2 != token1
            prior = second["prior_attempts"]
            assert [p["outcome"] for p in prior] == ["lease_expired"]
            # The old holder's token is fenced off; the new one works.
            stale = await c.call_tool("heartbeat", {"id": todo, "lease_token": token1})
            assert error_code(stale) == "conflict"
            answer(await c.call_tool("heartbeat", {"id": todo, "lease_token": token2}))

            # fail at max_attempts: dead letter, no retry.
            failed = answer(
                await c.call_tool(
                    "fail", {"id": todo, "lease_token": token2, "summary": "broken input"}
                )
            )
            assert failed["id"] == todo and failed["state"] == "failed"
            assert failed["dead_letter"] is True and failed["next_retry_at"] is None
            assert failed["attempt"] == 2 and failed["max_attempts"] == 2

            view = answer(await c.call_tool("get_todo", {"id": todo}))
            assert view["todo"]["dead_letter"] is True and view["todo"]["state"] == "failed"
            assert view["attempts_total"] == 2 and view["attempts_pruned"] == 0
            attempts = view["attempts"]
            assert [a["seq"] for a in attempts] == [2, 1], "newest first"
            assert [a["outcome"] for a in attempts] == ["failed", "lease_expired"]
            assert [a["disposition"] for a in attempts] == ["dead_lettered", "requeued"]
            assert [a["died"] for a in attempts] == [False, True]
            assert attempts[0]["summary"] == "broken input"
            # No lease token is ever given back.
            assert token1 not in json.dumps(view) and token2 not in json.dumps(view)

            # Nothing left to claim in the dead-lettered todo.
            again = await c.call_tool("claim", {"id": todo})
            assert error_code(again) == "conflict"

    run(go())


@pytest.mark.parametrize("mode", MODES)
def test_fail_with_attempts_left_schedules_a_retry(relay: Relay, mode: str) -> None:
    todo = relay.todos[("retry", mode)]

    async def go() -> None:
        async with client(relay, mode=mode) as c:
            got = answer(await c.call_tool("claim", {"id": todo, "require_fence": True}))
            token = got["lease_token"]
            failed = answer(await c.call_tool("fail", {"id": todo, "lease_token": token}))
            assert failed["state"] == "failed" and failed["dead_letter"] is False
            assert isinstance(failed["next_retry_at"], str)  # after the backoff (30 s by default)
            # Not claimable before its retry is due.
            assert error_code(await c.call_tool("claim", {"id": todo})) == "conflict"

    run(go())


@pytest.mark.parametrize("mode", MODES)
def test_undeclared_argument_is_invalid(relay: Relay, mode: str) -> None:
    async def go() -> None:
        async with client(relay, mode=mode) as c:
            r = await c.call_tool("claim_next", {"queue": q(QUEUE, mode), "colour": "blue"})
            assert error_code(r) == "invalid"
            r = await c.call_tool("get_todo", {"id": "td_doesnotexist"})
            assert error_code(r) == "not_found"

    run(go())


def test_wrong_token_is_401(relay: Relay) -> None:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            },
        }
    ).encode()
    req = urllib.request.Request(
        relay.url(),
        data=body,
        method="POST",
        headers={
            "Authorization": "Bearer not-the-token",
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        },
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    assert e.value.headers.get("WWW-Authenticate", "").lower().startswith("bearer")

    # The SDK sees the same refusal and does not get a session.
    async def go() -> None:
        async with client(relay, token="not-the-token") as c:
            await c.list_tools()

    with pytest.raises(BaseException) as e2:
        run(go())
    # The SDK raises the 401 answer's JSON-RPC error (inside anyio's exception groups).
    errors = leaves(e2.value)
    assert any(
        isinstance(x, MCPError) and "unauthorized" in str(x) for x in errors
    ), f"expected the server's `unauthorized` error, got {errors!r}"


def leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in leaves(sub)]
    return [e]


@pytest.mark.parametrize("mode", [MODERN, "auto"])
def test_modern_client_hears_the_doorbell_and_drains(relay: Relay, mode: str) -> None:
    """A listen on relay://queues/<q> hears a todo added by the operator CLI (another process:
    the server learns of it from its doorbell scan), then the same client drains the queue."""
    queue_ = q(BELL, mode)
    uri = f"relay://queues/{queue_}"

    async def go() -> None:
        async with client(relay, mode=mode) as c:
            assert answer(await c.call_tool("claim_next", {"queue": queue_}))["empty"] is True
            async with c.listen(resource_subscriptions=[uri]) as sub:
                assert sub.honored.resource_subscriptions == [uri]
                todo = await asyncio.to_thread(
                    relay.cli, "todo", "add", "--endpoint", ENDPOINT, "--queue", queue_,
                    "--title", "rung",
                )
                # The one wait: bounded, on the event itself.
                event = await asyncio.wait_for(sub.__anext__(), DOORBELL_BOUND)
                assert isinstance(event, ResourceUpdated) and event.uri == uri
            read = await c.read_resource(uri)
            assert read.contents and "pending" in read.contents[0].text

            got = answer(await c.call_tool("claim_next", {"queue": queue_, "require_fence": True}))
            assert got["empty"] is False and got["todo"]["id"] == todo
            token = got["lease_token"]
            hb = answer(await c.call_tool("heartbeat", {"id": todo, "lease_token": token}))
            assert hb["state"] == "claimed"
            done = answer(
                await c.call_tool(
                    "complete",
                    {"id": todo, "lease_token": token, "result": {"ok": True}, "summary": "done"},
                )
            )
            assert done["state"] == "done"
            assert answer(await c.call_tool("claim_next", {"queue": queue_}))["empty"] is True

    run(go())


# ---- bad input in the modern era: raw HTTP, because the SDK never sends it -------------------


def envelope(version: str = MODERN, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "relay-tests", "version": "0"},
    }
    meta.update(extra)
    return meta


def modern_post(
    relay: Relay,
    method: str,
    params: dict[str, Any],
    *,
    meta: Any = None,
    headers: dict[str, str] | None = None,
    rid: Any = 41,
) -> tuple[int, dict[str, Any]]:
    """One POST in the modern era; headers default to the ones that mirror the body."""
    body_params = dict(params)
    body_params["_meta"] = envelope() if meta is None else meta
    hdrs = {
        "Authorization": f"Bearer {relay.token}",
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": method,
    }
    if method == "tools/call":
        hdrs["Mcp-Name"] = params["name"]
    hdrs.update(headers or {})
    hdrs = {k: v for k, v in hdrs.items() if v is not None}
    body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": body_params}
    resp = httpx2.post(relay.url(), json=body, headers=hdrs, timeout=30.0)
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.text
    assert "mcp-session-id" not in resp.headers, "the modern era mints no session"
    return resp.status_code, resp.json()


def rpc_error(
    status: int, doc: dict[str, Any], code: int, *words: str, http: int = 400
) -> dict[str, Any]:
    assert status == http, (status, doc)
    assert doc.get("id") == 41, "the error echoes the request id"
    err = doc["error"]
    assert err["code"] == code, err
    for w in words:
        assert w.lower() in err["message"].lower(), err
    return err


def test_modern_bad_input_is_a_clear_error_that_changes_nothing(relay: Relay) -> None:
    claim = {"name": "claim_next", "arguments": {"queue": q(QUEUE, "bad")}}

    # The version header disagrees with _meta.
    st, doc = modern_post(relay, "tools/call", claim, headers={"MCP-Protocol-Version": "2025-11-25"})
    rpc_error(st, doc, -32020, "MCP-Protocol-Version")
    # Mcp-Method / Mcp-Name disagree with the body.
    st, doc = modern_post(relay, "tools/call", claim, headers={"Mcp-Method": "tools/list"})
    rpc_error(st, doc, -32020, "Mcp-Method")
    st, doc = modern_post(relay, "tools/call", claim, headers={"Mcp-Name": "heartbeat"})
    rpc_error(st, doc, -32020, "Mcp-Name")
    st, doc = modern_post(relay, "tools/call", claim, headers={"Mcp-Name": None})
    rpc_error(st, doc, -32020, "Mcp-Name")

    # An unsupported version, in both places: -32022 naming what is supported.
    st, doc = modern_post(
        relay, "tools/list", {}, meta=envelope("2099-01-01"),
        headers={"MCP-Protocol-Version": "2099-01-01"},
    )
    err = rpc_error(st, doc, -32022)
    assert err["data"]["supported"] == [MODERN] and err["data"]["requested"] == "2099-01-01"

    # Malformed _meta: no capabilities, capabilities not an object, a version that is no string.
    no_caps = envelope()
    del no_caps["io.modelcontextprotocol/clientCapabilities"]
    st, doc = modern_post(relay, "tools/list", {}, meta=no_caps)
    rpc_error(st, doc, -32602, "clientCapabilities")
    st, doc = modern_post(
        relay, "tools/list", {}, meta=envelope(**{"io.modelcontextprotocol/clientCapabilities": "all"})
    )
    rpc_error(st, doc, -32602, "clientCapabilities")
    st, doc = modern_post(
        relay, "tools/list", {}, meta=envelope(**{"io.modelcontextprotocol/protocolVersion": 20260728})
    )
    rpc_error(st, doc, -32602, "protocolVersion")
    # A modern header with no envelope at all, or an envelope that is no object.
    st, doc = modern_post(relay, "tools/list", {}, meta={})
    rpc_error(st, doc, -32602, "_meta")
    st, doc = modern_post(relay, "tools/list", {}, meta="2026-07-28")
    rpc_error(st, doc, -32602, "_meta")
    # An unknown method: 404 with a JSON-RPC body (not a legacy transport's bare 404).
    st, doc = modern_post(relay, "todos/steal", {})
    rpc_error(st, doc, -32601, "todos/steal", http=404)

    # A legacy session id beside a modern envelope: refused, not guessed at.
    init = httpx2.post(
        relay.url(),
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "relay-tests", "version": "0"}}},
        headers={"Authorization": f"Bearer {relay.token}", "Content-Type": "application/json",
                 "Accept": "application/json, text/event-stream"},
        timeout=30.0,
    )
    session = init.headers["mcp-session-id"]
    st, doc = modern_post(relay, "tools/call", claim, headers={"Mcp-Session-Id": session})
    rpc_error(st, doc, -32600, "Mcp-Session-Id")

    # A listen for a queue the endpoint is not granted: an error instead of a stream (in-band,
    # HTTP 200, like every handler's -32602), naming the queue.
    st, doc = modern_post(
        relay, "subscriptions/listen",
        {"notifications": {"resourceSubscriptions": [f"relay://queues/{SECRET}"]}},
    )
    rpc_error(st, doc, -32602, "not granted", SECRET, http=200)
    # Reading it: the specification's resource-not-found (-32602 with data.uri).
    uri = f"relay://queues/{SECRET}"
    st, doc = modern_post(relay, "resources/read", {"uri": uri}, headers={"Mcp-Name": uri})
    assert rpc_error(st, doc, -32602, SECRET, http=200)["data"]["uri"] == uri

    # Nothing changed: the todo every refused claim named is still pending, never attempted.
    st, doc = modern_post(
        relay, "tools/call", {"name": "get_todo", "arguments": {"id": relay.todos["untouched"]}}
    )
    assert st == 200, doc
    view = doc["result"]["structuredContent"]
    assert view["todo"]["state"] == "pending" and view["attempts_total"] == 0, view
    # Nothing logged with a token: neither the bearer token nor the legacy session id.
    log = Path(relay.dir, "serve.log").read_text()
    assert relay.token not in log and session not in log


# ---- no lock-out by forgotten legacy sessions -------------------------------------------------


# At the per-endpoint cap (64) the server ends the least recently used session without an open
# doorbell stream, and forgets a stream's note in the store as soon as its connection closes.
def test_legacy_clients_that_never_end_their_sessions_do_not_lock_out(relay: Relay) -> None:
    """70 legacy clients connect, call a tool and go away without DELETE (as the TypeScript v1
    SDK and the Inspector do); the 71st still connects and calls a tool. Each client opens the
    SDK's GET stream and closes its connections on the way out, as a process that exits does."""

    async def one(i: int) -> None:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {relay.crowd_token}"})
        transport = streamable_http_client(
            relay.url(CROWD), http_client=http, terminate_on_close=False
        )
        async with http, Client(transport, mode="legacy") as c:
            assert c.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS, i
            got = answer(await c.call_tool("claim_next", {"queue": QUEUE}))
            assert got["empty"] is True, i

    async def go() -> None:
        for i in range(CROWD_CLIENTS):
            await one(i)
        await one(CROWD_CLIENTS)  # the 71st

    run(go())


# ---- two servers on one Postgres --------------------------------------------------------------


def pg_url() -> str | None:
    url = os.environ.get("RELAY_TEST_POSTGRES")
    if url:
        return url
    if os.environ.get("RELAY_REQUIRE_POSTGRES") == "1":
        pytest.fail("RELAY_REQUIRE_POSTGRES=1 but RELAY_TEST_POSTGRES is unset")
    pytest.skip("set RELAY_TEST_POSTGRES=postgres://… to run the two-server test")
    return None


@pytest.fixture(scope="module")
def two_servers():
    url = pg_url()
    # One shared database across runs: a fresh endpoint and queue name per run keep it apart.
    run_id = secrets.token_hex(4)
    a, b = Relay(), Relay()
    for r in (a, b):
        r.env["RELAY_DB"] = url
    a.endpoint, a.queue = f"pair-{run_id}", f"pair-{run_id}"
    a.token = a.cli(
        "endpoint", "create", a.endpoint, "--verbs",
        "claim_next,heartbeat,complete,add_todo,list_todos", "--queues", a.queue,
    )
    a.start()
    try:
        b.start()
        yield a, b
    finally:
        b.stop()
        a.stop()


def test_two_servers_one_postgres_modern_requests_alternate(two_servers) -> None:
    a, b = two_servers
    uri = f"relay://queues/{a.queue}"

    async def go() -> None:
        http = lambda: httpx2.AsyncClient(  # noqa: E731
            headers={"Authorization": f"Bearer {a.token}"},
            timeout=httpx2.Timeout(30.0, read=300.0),
        )
        ca = Client(streamable_http_client(f"{a.base}/mcp/{a.endpoint}", http_client=http()), mode=MODERN)
        cb = Client(streamable_http_client(f"{b.base}/mcp/{a.endpoint}", http_client=http()), mode=MODERN)
        async with ca, cb:
            servers = [ca, cb]
            calls = 0

            async def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
                # Every call goes to the other server than the one before: no affinity.
                nonlocal calls
                c = servers[calls % 2]
                calls += 1
                return answer(await c.call_tool(name, args))

            assert (await call("claim_next", {"queue": a.queue}))["empty"] is True
            # A listen on B hears a todo added through A (the ring crosses servers).
            async with cb.listen(resource_subscriptions=[uri]) as sub:
                added = answer(await ca.call_tool("add_todo", {"queue": a.queue, "title": "pair"}))
                todo = added["todo"]["id"] if "todo" in added else added["id"]
                event = await asyncio.wait_for(sub.__anext__(), DOORBELL_BOUND)
                assert isinstance(event, ResourceUpdated) and event.uri == uri
            calls = 0
            got = await call("claim_next", {"queue": a.queue, "require_fence": True})  # A
            assert got["todo"]["id"] == todo
            token = got["lease_token"]
            for _ in range(2):  # B, A
                assert (await call("heartbeat", {"id": todo, "lease_token": token}))["state"] == "claimed"
            # A wrong token is refused on either server.
            for c in servers:
                r = await c.call_tool("heartbeat", {"id": todo, "lease_token": "A" * 22})
                assert error_code(r) == "conflict"
            done = await call("complete", {"id": todo, "lease_token": token})  # B, not the claimer
            assert done["state"] == "done"
            view = await call("get_todo", {"id": todo})  # A
            assert view["todo"]["state"] == "done"
            assert [x["outcome"] for x in view["attempts"]] == ["completed"]

    run(go())


# ---- waiting for a human, and spend (both stores) ---------------------------------------------

ASKER_VERBS = "claim_next,heartbeat,complete,fail,add_todo,list_todos,request_input,answer_todo"
NO_ANSWER_BOUND = 45.0  # seconds; the server's retry sweep runs every 15 s


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def asker(request):
    """A server on each store, an endpoint granted the asking verbs, a queue of its own."""
    r = Relay()
    if request.param == "postgres":
        r.env["RELAY_DB"] = pg_url()
    run_id = secrets.token_hex(4)
    r.endpoint, r.queue = f"asker-{run_id}", f"ask-{run_id}"
    r.token = r.cli(
        "endpoint", "create", r.endpoint, "--verbs", ASKER_VERBS, "--queues", r.queue
    )
    r.start()
    yield r
    r.stop()


def asker_client(r: Relay, mode: str) -> Client:
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {r.token}"},
        timeout=httpx2.Timeout(30.0, read=300.0),
    )
    return Client(streamable_http_client(f"{r.base}/mcp/{r.endpoint}", http_client=http), mode=mode)


@pytest.mark.parametrize("mode", [MODERN, "legacy"])
def test_ask_wait_answer_and_the_next_attempt_sees_both(asker: Relay, mode: str) -> None:
    async def go() -> None:
        async with asker_client(asker, mode) as c:
            async def add(**extra: Any) -> str:
                added = answer(
                    await c.call_tool("add_todo", {"queue": asker.queue, "title": "ask", **extra})
                )
                return added["id"]

            async def claim(todo: str) -> dict[str, Any]:
                got = answer(
                    await c.call_tool("claim_next", {"queue": asker.queue, "require_fence": True})
                )
                assert got["todo"]["id"] == todo
                return got

            todo = await add(max_input_requests=1)
            got = await claim(todo)
            token = got["lease_token"]
            # A stale token and an empty question change nothing.
            stale = {"id": todo, "question": "q", "lease_token": "A" * 22}
            assert error_code(await c.call_tool("request_input", stale)) == "conflict"
            empty = {"id": todo, "question": " ", "lease_token": token}
            assert error_code(await c.call_tool("request_input", empty)) == "invalid"
            asked = answer(
                await c.call_tool(
                    "request_input",
                    {
                        "id": todo,
                        "question": "Which branch?",
                        "summary": "found two",
                        "usage": {"cost_usd": 0.25, "input_tokens": 1000},
                        "lease_token": token,
                    },
                )
            )
            assert asked["state"] == "input_required" and asked["input_requests"] == 1
            assert asked["spent"]["cost_usd"] == 0.25
            nothing = answer(await c.call_tool("claim_next", {"queue": asker.queue}))
            assert nothing["empty"] is True, "a waiting todo is not claimable"
            too_long = {"id": todo, "answer": "y" * 8193}
            assert error_code(await c.call_tool("answer_todo", too_long)) == "invalid"
            done = answer(
                await c.call_tool(
                    "answer_todo", {"id": todo, "answer": "main", "idempotency_key": "a1"}
                )
            )
            assert done["state"] == "pending"
            # The same answer again (its reply lost): answered as it is, not twice.
            again = {"id": todo, "answer": "main", "idempotency_key": "a1"}
            assert answer(await c.call_tool("answer_todo", again))["state"] == "pending"
            other = {"id": todo, "answer": "dev", "idempotency_key": "a2"}
            assert error_code(await c.call_tool("answer_todo", other)) == "conflict"
            got = await claim(todo)
            prior = got["prior_attempts"][0]
            assert prior["outcome"] == "needs_input" and prior["disposition"] == "awaiting_input"
            assert prior["question"] == "Which branch?" and prior["answer"] == "main"
            assert prior["answered_by"] == f"endpoint:{asker.endpoint}"
            # A second question is past max_input_requests: a dead letter that says why.
            token = got["lease_token"]
            dead = answer(
                await c.call_tool(
                    "request_input", {"id": todo, "question": "And now?", "lease_token": token}
                )
            )
            assert dead["dead_letter"] is True
            assert dead["dead_letter_reason"] == "input_requests_exhausted"

            # Answered by the operator's CLI.
            todo = await add()
            got = await claim(todo)
            answer(
                await c.call_tool(
                    "request_input",
                    {"id": todo, "question": "ok?", "lease_token": got["lease_token"]},
                )
            )
            assert asker.cli("todo", "answer", todo, "--text", "yes").endswith("pending")
            got = await claim(todo)
            assert got["prior_attempts"][0]["answered_by"] == "operator:cli"
            answer(await c.call_tool("complete", {"id": todo, "lease_token": got["lease_token"]}))

            # Nobody answers within answer_within_seconds: the sweep dead-letters it.
            todo = await add(answer_within_seconds=1)
            got = await claim(todo)
            answer(
                await c.call_tool(
                    "request_input",
                    {"id": todo, "question": "anyone?", "lease_token": got["lease_token"]},
                )
            )
            deadline = time.monotonic() + NO_ANSWER_BOUND
            while True:
                view = answer(await c.call_tool("get_todo", {"id": todo}))
                if view["todo"]["dead_letter"]:
                    break
                assert time.monotonic() < deadline, "no_answer never fired"
                await asyncio.sleep(0.5)
            assert view["todo"]["dead_letter_reason"] == "no_answer"

    run(go())


@pytest.mark.parametrize("mode", [MODERN, "legacy"])
def test_spend_sums_and_a_heartbeat_over_budget_stops_the_attempt(asker: Relay, mode: str) -> None:
    async def go() -> None:
        async with asker_client(asker, mode) as c:
            bad = [
                {"queue": asker.queue, "title": "t", "budget": {"tokens": 0}},
                {"queue": asker.queue, "title": "t", "budget": {"cost_usd": -1}},
                {"queue": asker.queue, "title": "t", "budget": {"cost_usd": "ten"}},
            ]
            for args in bad:
                assert error_code(await c.call_tool("add_todo", args)) == "invalid"
            added = answer(
                await c.call_tool(
                    "add_todo",
                    {"queue": asker.queue, "title": "spend", "budget": {"cost_usd": 1.0}},
                )
            )
            todo = added["id"]
            assert added["budget"] == {"cost_usd": 1.0}
            got = answer(
                await c.call_tool("claim_next", {"queue": asker.queue, "require_fence": True})
            )
            token = got["lease_token"]
            hb = {"id": todo, "lease_token": token}
            for usage in ({"cost_usd": -0.1}, {"input_tokens": -5}, {"cost_usd": "x"}):
                r = await c.call_tool("heartbeat", {**hb, "usage": usage})
                assert error_code(r) == "invalid"
            ok = answer(await c.call_tool("heartbeat", {**hb, "usage": {"cost_usd": 0.4}}))
            assert ok["state"] == "claimed" and ok["spent"]["cost_usd"] == 0.4
            # A lower figure never lowers the spend.
            ok = answer(await c.call_tool("heartbeat", {**hb, "usage": {"cost_usd": 0.1}}))
            assert ok["spent"]["cost_usd"] == 0.4
            over = await c.call_tool("heartbeat", {**hb, "usage": {"cost_usd": 1.2}})
            assert error_code(over) == "conflict", "the holder hears what a cancel tells it"
            view = answer(await c.call_tool("get_todo", {"id": todo}))
            assert view["todo"]["dead_letter_reason"] == "budget_exhausted"
            assert view["todo"]["spent"]["cost_usd"] == 1.2
            assert view["attempts"][0]["outcome"] == "canceled"
            assert "spent $1.2" in (view["attention"] or "")
            nothing = answer(await c.call_tool("claim_next", {"queue": asker.queue}))
            assert nothing["empty"] is True

    run(go())
