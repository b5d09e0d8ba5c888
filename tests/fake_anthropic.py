"""A loopback stand-in for the Anthropic Messages API (POST /v1/messages, JSON, not
streamed) that plays scripted turns, so the planner is tested through the real SDK.

Each script entry is a response body, or a callable that receives the request body and
returns one (to inspect what the planner sent: tool results, the system prompt).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Turn = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]
_ids = itertools.count(1)


def tool_use(tool: str, /, **arguments: Any) -> dict[str, Any]:
    """A tool call; positional-only `tool`, so an argument may itself be called `name`."""
    return {"type": "tool_use", "id": f"toolu_{next(_ids):04d}", "name": tool,
            "input": arguments}


def text(content: str) -> dict[str, Any]:
    return {"type": "text", "text": content}


def message(*blocks: dict[str, Any], input_tokens: int = 100,
            output_tokens: int = 20) -> dict[str, Any]:
    uses_tools = any(b["type"] == "tool_use" for b in blocks)
    return {"id": f"msg_{next(_ids):04d}", "type": "message", "role": "assistant",
            "model": "claude-test", "content": list(blocks),
            "stop_reason": "tool_use" if uses_tools else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool_result blocks of the request's last (user) message."""
    content = request["messages"][-1]["content"]
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


class FakeMessagesAPI:
    def __init__(self, script: list[Turn]) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.split("?")[0] != "/v1/messages" or not api.script:
                    self._send(404, {"type": "error", "error": {
                        "type": "not_found_error", "message": "no scripted turn left"}})
                    return
                api.requests.append(body)
                api.headers.append({k.lower(): v for k, v in self.headers.items()})
                turn = api.script.pop(0)
                self._send(200, turn(body) if callable(turn) else turn)

            def _send(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeMessagesAPI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
