"""A stand-in queue server that is not relay's: the relay-design contract table, and nothing more.

Built on the official MCP Python SDK's low-level server (Streamable HTTP, stateful sessions), so
nothing of relay's own server (its answer shapes, its schema generator, its HTTP layer) is in the
loop. tests/contract.rs runs the real `relay daemon` against it.

What it does, on purpose:
- declares strict input schemas (`additionalProperties: false`, every argument of CONTRACT.md's
  table for the verbs the daemon uses) and refuses any call that breaks them as `invalid`;
- answers exactly the contract table's fields: a claim answers `empty`,
  `todo.{id,queue,title,kind,source,payload,work_order,attempt,max_attempts,created_at}`,
  `attempt_seq`, `lease_token`, `prior_attempts`; a fail answers `state`, `attempt`,
  `max_attempts`, `dead_letter`, `next_retry_at`; heartbeat, complete and release answer a bare
  text "ok" (the contract reads only success from them);
- hands out known lease tokens (`standin-lease-<todo>-<seq>`) and checks them on every call;
- logs every request (HTTP method, JSON-RPC method, tool, arguments) and every tool answer as
  JSON lines to the file given by --log.

With --omit todo.attempt (any field path of the claim answer) it leaves that field out of every
claim answer: a server that does not honour the contract.

With --old it is a server from before the attempt-history arguments: claim_next, heartbeat,
complete and fail declare none of require_fence, claimant, lease_token, summary, artifact, and
release is not advertised.

Todos come from a JSON file (--todos): a list of {"id", "title", "max_attempts"?, "payload"?,
"kind"?, "source"?, "queue"?, "conflict_on_heartbeat"?}; `conflict_on_heartbeat: n` answers the
todo's n-th heartbeat `conflict` (another worker took the lease over). Every request must carry
`Authorization: Bearer <--token>`, else 401.

It binds 127.0.0.1 on a port it picks and prints `listening on http://127.0.0.1:PORT` as its first
stdout line once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
from datetime import datetime, timezone
from typing import Any

import jsonschema
import mcp_types as types
import uvicorn
from mcp.server.lowlevel.server import Server

TTL_MAX = 86_400


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required or [],
        "additionalProperties": False,
    }


STRING = {"type": "string"}
TTL = {"type": "integer", "minimum": 1, "maximum": TTL_MAX}


def tools(old: bool) -> dict[str, dict[str, Any]]:
    """Each verb's input schema: CONTRACT.md's table, or the one before attempt history."""
    if old:
        return {
            "claim_next": schema({"queue": STRING, "lease_ttl_seconds": TTL}),
            "heartbeat": schema({"id": STRING, "lease_ttl_seconds": TTL}, ["id"]),
            "complete": schema({"id": STRING, "result": {"type": "object"}}, ["id"]),
            "fail": schema({"id": STRING, "result": {"type": "object"}}, ["id"]),
        }
    report = {
        "id": STRING,
        "result": {"type": "object"},
        "summary": STRING,
        "artifact": STRING,
        "lease_token": STRING,
    }
    return {
        "claim_next": schema(
            {
                "queue": STRING,
                "lease_ttl_seconds": TTL,
                "require_fence": {"type": "boolean"},
                "claimant": STRING,
            }
        ),
        "heartbeat": schema({"id": STRING, "lease_ttl_seconds": TTL, "lease_token": STRING}, ["id"]),
        "complete": schema(report, ["id"]),
        "fail": schema(report, ["id"]),
        "release": schema({"id": STRING, "summary": STRING, "lease_token": STRING}, ["id"]),
    }


class ToolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Log:
    """JSON lines, one per request or answer, flushed at once (the test reads the file live)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")
        self.lock = threading.Lock()

    def write(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()


class Queue:
    """The todos and their attempts: claims FIFO, a failed todo is claimable again at once."""

    def __init__(self, todos: list[dict[str, Any]]) -> None:
        self.todos: list[dict[str, Any]] = []
        for t in todos:
            self.todos.append(
                {
                    "spec": t,
                    "state": "pending",
                    "attempt": 0,
                    "seq": 0,
                    "heartbeats": 0,
                    "token": None,
                    "attempts": [],  # closed and open, oldest first
                    "created_at": now(),
                    "dead_letter": False,
                }
            )

    def find(self, todo_id: str) -> dict[str, Any]:
        for t in self.todos:
            if t["spec"]["id"] == todo_id:
                return t
        raise ToolError("not_found", f"no todo {todo_id}")

    @staticmethod
    def holder(t: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        """The open attempt, when the caller holds it (the fence, when the claim had one)."""
        if t["state"] != "claimed":
            raise ToolError("conflict", f"todo {t['spec']['id']} is not claimed")
        if t["token"] is not None and args.get("lease_token") != t["token"]:
            raise ToolError("conflict", f"todo {t['spec']['id']}: lease token mismatch")
        return t["attempts"][-1]

    def claim_next(self, args: dict[str, Any]) -> dict[str, Any]:
        queue = args.get("queue")
        for t in self.todos:
            spec = t["spec"]
            if queue is not None and spec.get("queue", "work") != queue:
                continue
            if t["state"] == "pending" or (t["state"] == "failed" and not t["dead_letter"]):
                break
        else:
            return {"empty": True}
        t["attempt"] += 1
        t["seq"] += 1
        t["state"] = "claimed"
        t["heartbeats"] = 0
        t["token"] = f"standin-lease-{spec['id']}-{t['seq']}" if args.get("require_fence") else None
        prior = [a for a in reversed(t["attempts"]) if a["outcome"] is not None][:5]
        t["attempts"].append(
            {
                "seq": t["seq"],
                "attempt": t["attempt"],
                "outcome": None,
                "died": False,
                "claimant": args.get("claimant"),
                "claimed_at": now(),
                "ended_at": None,
                "summary": None,
                "artifact": None,
            }
        )
        answer: dict[str, Any] = {
            "empty": False,
            "todo": {
                "id": spec["id"],
                "queue": spec.get("queue", "work"),
                "title": spec["title"],
                "kind": spec.get("kind"),
                "source": spec.get("source"),
                "payload": spec.get("payload"),
                "work_order": spec.get("work_order"),
                "attempt": t["attempt"],
                "max_attempts": spec.get("max_attempts", 3),
                "created_at": t["created_at"],
            },
            "attempt_seq": t["seq"],
            "prior_attempts": [dict(a) for a in prior],
        }
        if t["token"] is not None:
            answer["lease_token"] = t["token"]
        return answer

    def heartbeat(self, args: dict[str, Any]) -> None:
        t = self.find(args["id"])
        self.holder(t, args)
        t["heartbeats"] += 1
        if t["heartbeats"] == t["spec"].get("conflict_on_heartbeat"):
            # Another worker took the todo over: this lease is gone for good.
            t["token"] = "standin-taken-over"
            raise ToolError("conflict", f"todo {args['id']}: the lease was taken over")

    def close(self, args: dict[str, Any], outcome: str) -> dict[str, Any]:
        t = self.find(args["id"])
        a = self.holder(t, args)
        a.update(outcome=outcome, ended_at=now(), summary=args.get("summary"), artifact=args.get("artifact"))
        t["token"] = None
        return t

    def complete(self, args: dict[str, Any]) -> None:
        self.close(args, "completed")["state"] = "done"

    def fail(self, args: dict[str, Any]) -> dict[str, Any]:
        t = self.close(args, "failed")
        t["state"] = "failed"
        max_attempts = t["spec"].get("max_attempts", 3)
        t["dead_letter"] = t["attempt"] >= max_attempts
        return {
            "state": "failed",
            "attempt": t["attempt"],
            "max_attempts": max_attempts,
            "dead_letter": t["dead_letter"],
            "next_retry_at": None if t["dead_letter"] else now(),
        }

    def release(self, args: dict[str, Any]) -> None:
        t = self.close(args, "released")
        t["state"] = "pending"
        t["attempt"] -= 1  # a release does not count against max_attempts


def text(s: str) -> list[types.TextContent]:
    return [types.TextContent(type="text", text=s)]


def build(args: argparse.Namespace, log: Log) -> Server:
    schemas = tools(args.old)
    with open(args.todos, encoding="utf-8") as f:
        queue = Queue(json.load(f))
    lock = asyncio.Lock()

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[types.Tool(name=name, description=f"stand-in {name}", input_schema=s) for name, s in schemas.items()]
        )

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        name = params.name
        arguments = params.arguments or {}
        try:
            if name not in schemas:
                raise ToolError("invalid", f"unknown tool {name}")
            errors = sorted(jsonschema.Draft202012Validator(schemas[name]).iter_errors(arguments), key=str)
            if errors:
                raise ToolError("invalid", f"{name}: {errors[0].message}")
            async with lock:
                answer = getattr(queue, name)(arguments)
            if name == "claim_next" and args.omit:
                *parents, last = args.omit.split(".")
                target = answer
                for p in parents:
                    target = target.get(p, {})
                target.pop(last, None)
        except ToolError as e:
            log.write({"kind": "answer", "tool": name, "code": e.code})
            error = {"error": {"code": e.code, "message": e.message}}
            return types.CallToolResult(content=text(json.dumps(error)), structured_content=error, is_error=True)
        log.write({"kind": "answer", "tool": name, "code": "ok"})
        if answer is None:
            return types.CallToolResult(content=text("ok"))
        return types.CallToolResult(content=text(json.dumps(answer)), structured_content=answer)

    return Server("standin-queue", version="0", on_list_tools=on_list_tools, on_call_tool=on_call_tool)


# What a legacy-only Streamable HTTP server (the Python SDK before 2.x) answers a request that
# names no session: the daemon must take it as "initialize instead".
MISSING_SESSION = json.dumps(
    {"jsonrpc": "2.0", "id": "server-error",
     "error": {"code": -32600, "message": "Bad Request: Missing session ID"}}
).encode()


def logged(inner: Any, log: Log, token: str, ready: str, legacy_only: bool = False) -> Any:
    """ASGI wrapper: the bearer check, the request log, and the ready line once the app runs.
    With `legacy_only`, requests in the 2026-07-28 era (a `_meta` protocol version, or the
    version header) are refused as a legacy-only server refuses them, after being logged."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":

            async def announce(message: dict[str, Any]) -> None:
                await send(message)
                if message["type"] == "lifespan.startup.complete":
                    print(ready, flush=True)

            await inner(scope, receive, announce)
            return
        if scope["type"] != "http":
            await inner(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"authorization", b"").decode() != f"Bearer {token}":
            log.write({"kind": "request", "http": scope["method"], "refused": 401})
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["method"] != "POST":
            log.write({"kind": "request", "http": scope["method"]})
            await inner(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        for msg in parsed if isinstance(parsed, list) else [parsed]:
            entry: dict[str, Any] = {"kind": "request", "http": "POST"}
            if isinstance(msg, dict):
                entry["method"] = msg.get("method")
                p = msg.get("params") or {}
                if msg.get("method") == "tools/call" and isinstance(p, dict):
                    entry["tool"] = p.get("name")
                    entry["arguments"] = p.get("arguments")
            log.write(entry)
        replayed = False

        modern = headers.get(b"mcp-protocol-version", b"").decode() == "2026-07-28" or any(
            isinstance(m, dict)
            and "io.modelcontextprotocol/protocolVersion" in ((m.get("params") or {}).get("_meta") or {})
            for m in (parsed if isinstance(parsed, list) else [parsed])
        )
        if legacy_only and modern:
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": MISSING_SESSION})
            return

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await inner(scope, replay, send)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--todos", required=True, help="JSON file: the todos to hand out")
    parser.add_argument("--log", required=True, help="JSON-lines file: every request and answer")
    parser.add_argument("--token", required=True, help="the bearer token every request must carry")
    parser.add_argument("--old", action="store_true", help="schemas from before attempt history")
    parser.add_argument("--omit", help="a claim answer field to leave out (todo.attempt)")
    parser.add_argument("--legacy-only", action="store_true",
                        help="refuse 2026-07-28 requests as a legacy-only server does (400)")
    args = parser.parse_args()
    log = Log(args.log)
    server = build(args, log)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # loopback only, a port of its own
    sock.listen(64)
    port = sock.getsockname()[1]
    app = logged(server.streamable_http_app(host="127.0.0.1"), log, args.token,
                 f"listening on http://127.0.0.1:{port}", args.legacy_only)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
