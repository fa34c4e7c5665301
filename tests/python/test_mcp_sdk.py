"""The queue server driven by the official Python MCP SDK (package `mcp` on PyPI).

What it shows: a stock MCP client works against `relay serve` unchanged — initialize, tools/list
with only the granted verbs and strict input schemas, a fenced claim, heartbeats with the lease
token, attempts that end in a dead letter, get_todo's timeline (newest first, with outcomes), a
wrong bearer token answered 401 and an undeclared argument answered `invalid`.

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

import httpx2
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

REPO = Path(__file__).resolve().parents[2]
ENDPOINT = "worker"
QUEUE = "work"
OTHER = "other"  # a second granted queue, so that claim_next on QUEUE has one candidate
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


@pytest.fixture(scope="module")
def relay():
    r = Relay()
    r.token = r.cli(
        "endpoint", "create", ENDPOINT, "--verbs", ",".join(GRANTED), "--queues", f"{QUEUE},{OTHER}"
    )
    one_line = bool(r.token) and "\n" not in r.token  # (never shown: it is a credential)
    assert one_line, "endpoint create prints the token on one line"
    r.todos = {
        name: r.cli(
            "todo", "add", "--endpoint", ENDPOINT, "--queue", queue, "--title", name,
            "--max-attempts", "2",
        )
        for name, queue in (("dead-letter", QUEUE), ("retry", OTHER))
    }
    r.start()
    yield r
    r.stop()


def client(r: Relay, token: str | None = None, mode: str = "auto") -> Client:
    """An SDK client with the bearer token. mode "auto" (the SDK's default) first probes
    `server/discover` (the 2026-07-28 revision) and falls back to the initialize handshake,
    which is what relay speaks; "legacy" goes straight to initialize."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token or r.token}"},
        timeout=httpx2.Timeout(30.0, read=300.0),
    )
    return Client(streamable_http_client(r.url(), http_client=http), mode=mode)


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


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_initialize_and_tools_list(relay: Relay, mode: str) -> None:
    async def go() -> None:
        async with client(relay, mode=mode) as c:
            assert c.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS
            assert c.server_info is not None and c.server_info.name == "relay"
            assert c.server_capabilities.tools is not None
            tools = (await c.list_tools()).tools
            assert {t.name for t in tools} == LISTED
            for t in tools:
                schema = t.input_schema
                assert schema.get("type") == "object", t.name
                assert schema.get("additionalProperties") is False, t.name

    run(go())


def test_fenced_claim_heartbeat_fail_until_dead_letter(relay: Relay) -> None:
    todo = relay.todos["dead-letter"]

    async def go() -> None:
        async with client(relay) as c:
            # Attempt 1: claim_next, fenced, a one-second lease, one heartbeat; then it lapses.
            first = answer(
                await c.call_tool(
                    "claim_next",
                    {"queue": QUEUE, "require_fence": True, "lease_ttl_seconds": 1},
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


def test_fail_with_attempts_left_schedules_a_retry(relay: Relay) -> None:
    todo = relay.todos["retry"]

    async def go() -> None:
        async with client(relay) as c:
            got = answer(await c.call_tool("claim", {"id": todo, "require_fence": True}))
            token = got["lease_token"]
            failed = answer(await c.call_tool("fail", {"id": todo, "lease_token": token}))
            assert failed["state"] == "failed" and failed["dead_letter"] is False
            assert isinstance(failed["next_retry_at"], str)  # after the backoff (30 s by default)
            # Not claimable before its retry is due.
            assert error_code(await c.call_tool("claim", {"id": todo})) == "conflict"

    run(go())


def test_undeclared_argument_is_invalid(relay: Relay) -> None:
    async def go() -> None:
        async with client(relay) as c:
            r = await c.call_tool("claim_next", {"queue": QUEUE, "colour": "blue"})
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
