"""A fake GitHub REST API on loopback: the pull-request, review and issue-comment endpoints
EvoTrainer calls, over a local bare repository standing in for the GitHub remote.

What it models of GitHub's behaviour: an open PR's head follows its branch in the bare
repository, and a PR whose head commit reaches the base branch is marked merged (as GitHub
does when the commits are pushed to the base); tokens are checked; comments can be edited
only by their author. It serves from a daemon thread and stops by itself after `lifetime_s`.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class FakeGitHub:
    bare: Path
    slug: str
    token: str
    bot_login: str = "evotrainer-bot"
    lifetime_s: float = 120.0
    pulls: dict[int, dict] = field(default_factory=dict)
    reviews: dict[int, list[dict]] = field(default_factory=dict)
    comments: dict[int, dict] = field(default_factory=dict)  # id → comment (with "number")
    requests: list[tuple[str, str]] = field(default_factory=list)
    _next_id: int = 1000

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null") if length else None
                auth = self.headers.get("Authorization", "")
                if auth not in (f"token {fake.token}", f"Bearer {fake.token}"):
                    return self._send(401, {"message": "Bad credentials"})
                with fake.lock:
                    status, payload = fake.handle(method, self.path, body)
                self._send(status, payload)

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def do_PATCH(self) -> None:  # noqa: N802
                self._serve("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.timer = threading.Timer(self.lifetime_s, self.server.shutdown)
        self.timer.daemon = True

    def __enter__(self) -> FakeGitHub:
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    # ---- the reviewer's side (a person on github.com) ---------------------------------------

    def review(self, number: int, login: str, state: str, commit_id: str,
               association: str = "MEMBER") -> None:
        with self.lock:
            self.reviews.setdefault(number, []).append({
                "id": self._new_id(), "user": self._user(login), "state": state,
                "commit_id": commit_id, "author_association": association, "body": "",
                "submitted_at": "2026-01-01T00:00:00Z",
                "html_url": f"{self.url}/{self.slug}/pull/{number}"})

    def comment_as(self, number: int, login: str, body: str) -> None:
        with self.lock:
            self._add_comment(number, login, body)

    def pull(self, number: int) -> dict:
        with self.lock:
            return self._refresh(self.pulls[number])

    def pr_comments(self, number: int) -> list[dict]:
        with self.lock:
            return [c for c in self.comments.values() if c["number"] == number]

    # ---- the API ------------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        path, query = parts.path.rstrip("/"), {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.requests.append((method, path))
        prefix = f"/repos/{self.slug}"
        if path == "/user":
            return 200, self._user(self.bot_login)
        if path == prefix:
            owner, name = self.slug.split("/")
            return 200, {"full_name": self.slug, "name": name, "owner": self._user(owner),
                         "url": self.url + prefix}
        route = path.removeprefix(prefix)
        if route == "/pulls" and method == "GET":
            found = [self._refresh(p) for p in self.pulls.values()
                     if query.get("state", "open") in ("all", p["state"])
                     and query.get("base", p["base"]["ref"]) == p["base"]["ref"]
                     and query.get("head", p["head"]["label"]) == p["head"]["label"]]
            return 200, found
        if route == "/pulls" and method == "POST":
            return self._create_pull(body)
        if m := re.fullmatch(r"/pulls/(\d+)", route):
            pull = self.pulls.get(int(m[1]))
            if pull is None:
                return 404, {"message": "Not Found"}
            if method == "PATCH":
                for key in ("title", "body", "state"):
                    if key in body:
                        pull[key] = body[key]
            return 200, self._refresh(pull)
        if m := re.fullmatch(r"/pulls/(\d+)/reviews", route):
            return 200, self.reviews.get(int(m[1]), [])
        if m := re.fullmatch(r"/issues/(\d+)/comments", route):
            number = int(m[1])
            if method == "POST":
                return 201, self._add_comment(number, self.bot_login, body["body"])
            return 200, [c for c in self.comments.values() if c["number"] == number]
        if (m := re.fullmatch(r"/issues/comments/(\d+)", route)) and method == "PATCH":
            comment = self.comments[int(m[1])]
            if comment["user"]["login"] != self.bot_login:
                return 403, {"message": "Must have admin rights to Repository."}
            comment["body"] = body["body"]
            return 200, comment
        return 404, {"message": f"Not Found: {method} {path}"}

    def _create_pull(self, body: dict) -> tuple[int, Any]:
        head, base = body["head"], body["base"]
        if self._rev(head) is None:
            return 422, {"message": "Validation Failed", "errors": [{"field": "head"}]}
        label = f"{self.slug.split('/')[0]}:{head}"
        if any(p["head"]["label"] == label and p["state"] == "open" for p in self.pulls.values()):
            return 422, {"message": f"A pull request already exists for {label}."}
        number = len(self.pulls) + 1
        url = f"{self.url}/repos/{self.slug}"
        repo = {"full_name": self.slug, "url": url}
        self.pulls[number] = {
            "number": number, "state": "open", "title": body["title"], "body": body["body"],
            "merged": False, "merged_at": None,
            "head": {"ref": head, "label": label, "sha": self._rev(head), "repo": repo},
            "base": {"ref": base, "label": f"{self.slug.split('/')[0]}:{base}", "repo": repo},
            "url": f"{url}/pulls/{number}", "issue_url": f"{url}/issues/{number}",
            "comments_url": f"{url}/issues/{number}/comments",
            "review_comments_url": f"{url}/pulls/{number}/comments",
            "html_url": f"{self.url}/{self.slug}/pull/{number}",
            "user": self._user(self.bot_login),
        }
        return 201, self._refresh(self.pulls[number])

    def _refresh(self, pull: dict) -> dict:
        """GitHub's view after pushes: an open PR's head follows its branch; a head commit
        contained in the base branch makes the PR merged."""
        if pull["state"] == "open":
            pull["head"]["sha"] = self._rev(pull["head"]["ref"]) or pull["head"]["sha"]
            base = self._rev(pull["base"]["ref"])
            if base and self._git("merge-base", "--is-ancestor", pull["head"]["sha"], base):
                pull.update(state="closed", merged=True, merged_at="2026-01-01T00:00:00Z")
        return dict(pull)

    def _add_comment(self, number: int, login: str, text: str) -> dict:
        cid = self._new_id()
        url = f"{self.url}/repos/{self.slug}/issues/comments/{cid}"
        self.comments[cid] = {"id": cid, "number": number, "body": text, "url": url,
                              "user": self._user(login), "author_association": "NONE",
                              "html_url": url}
        return self.comments[cid]

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _user(self, login: str) -> dict:
        kind = "Bot" if login == self.bot_login else "User"
        return {"login": login, "type": kind, "id": abs(hash(login)) % 10**6}

    def _rev(self, branch: str) -> str | None:
        out = subprocess.run(["git", "rev-parse", "--verify", "-q", f"refs/heads/{branch}"],
                             cwd=self.bare, capture_output=True, text=True)
        return out.stdout.strip() or None

    def _git(self, *args: str) -> bool:
        return subprocess.run(["git", *args], cwd=self.bare, capture_output=True).returncode == 0
