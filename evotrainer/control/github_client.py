"""The few GitHub REST calls the pull-request lifecycle makes, through PyGithub.

The token comes from the environment only (`GITHUB_TOKEN`, as GitHub Actions provides it),
never from a file or an option, so it cannot end up in git or in a run record. The API
address comes from `GITHUB_API_URL` (GitHub Enterprise sets it; tests point it at a fake
server on loopback). Every GitHub error reaches the user as one `EvoError` line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from evotrainer.errors import EvoError

DEFAULT_API_URL = "https://api.github.com"
# GitHub asks integrations to pace their writes (secondary rate limits); PyGithub sleeps
# this long between two writes. Tests against the loopback fake set it to 0.
WRITE_PACING_S = 1.0
REQUEST_TIMEOUT_S = 30


@contextmanager
def github_errors(what: str) -> Iterator[None]:
    """Turn PyGithub's exceptions (and network failures) into one readable EvoError."""
    from github import GithubException
    from requests import RequestException

    try:
        yield
    except GithubException as exc:
        message = exc.data.get("message") if isinstance(exc.data, dict) else None
        raise EvoError(
            f"GitHub refused to {what}: HTTP {exc.status} {message or ''}".rstrip(),
            hint="check that GITHUB_TOKEN may do this (the workflow's `permissions:`: "
            "contents and pull-requests) and that GITHUB_REPOSITORY names this repository",
        ) from None
    except RequestException as exc:
        raise EvoError(f"cannot reach GitHub to {what}: {type(exc).__name__}",
                       hint="check GITHUB_API_URL and the network, then rerun") from None


class GitHubRepo:
    """One repository on GitHub: pull requests, their reviews and issue comments."""

    def __init__(self, slug: str, token: str, api_url: str = DEFAULT_API_URL) -> None:
        try:
            from github import Auth, Github
        except ImportError:
            raise EvoError(
                "the GitHub pull-request flow needs PyGithub",
                hint="pip install 'evotrainer[github]' (without GitHub, review with "
                "`git diff` and approve with `evotrainer approve`)",
            ) from None
        if slug.count("/") != 1 or not all(slug.split("/")):
            raise EvoError(f"{slug!r} is not OWNER/NAME", field="GITHUB_REPOSITORY",
                           hint="e.g. GITHUB_REPOSITORY=acme/rl-runs (Actions sets it)")
        self.slug = slug
        self.owner = slug.split("/")[0]
        self._api = Github(
            auth=Auth.Token(token), base_url=api_url.rstrip("/"), timeout=REQUEST_TIMEOUT_S,
            retry=None, seconds_between_requests=None, seconds_between_writes=WRITE_PACING_S,
        )
        with github_errors(f"read the repository {slug}"):
            self._repo = self._api.get_repo(slug)
        self._own_login: str | None | bool = False  # False: not asked yet

    @classmethod
    def from_env(cls, slug: str | None = None) -> GitHubRepo | None:
        """The repository named by `slug` or GITHUB_REPOSITORY, or None without a token
        (the plain git flow)."""
        token = os.environ.get("GITHUB_TOKEN")
        if not token:
            return None
        slug = slug or os.environ.get("GITHUB_REPOSITORY")
        if not slug:
            raise EvoError("GITHUB_TOKEN is set but no repository is named",
                           field="GITHUB_REPOSITORY",
                           hint="pass --repo OWNER/NAME or set GITHUB_REPOSITORY")
        return cls(slug, token, os.environ.get("GITHUB_API_URL") or DEFAULT_API_URL)

    # ---- pull requests ---------------------------------------------------------------------

    def pulls(self, base: str, state: str = "open") -> list[Any]:
        with github_errors(f"list the pull requests into {base}"):
            return list(self._repo.get_pulls(state=state, base=base))

    def pull(self, number: int) -> Any:
        with github_errors(f"read pull request #{number}"):
            return self._repo.get_pull(number)

    def pull_for_branch(self, branch: str, base: str) -> Any | None:
        """The open pull request from this repository's `branch` into `base`, if any."""
        with github_errors(f"look up the pull request of {branch}"):
            found = list(self._repo.get_pulls(state="open", base=base,
                                              head=f"{self.owner}:{branch}"))
        return found[0] if found else None

    def create_pull(self, branch: str, base: str, title: str, body: str) -> Any:
        with github_errors(f"open a pull request {branch} → {base}"):
            return self._repo.create_pull(base=base, head=branch, title=title, body=body)

    def edit_pull(self, pull: Any, **fields: str) -> None:
        with github_errors(f"edit pull request #{pull.number}"):
            pull.edit(**fields)

    def reviews(self, pull: Any) -> list[Any]:
        with github_errors(f"read the reviews of pull request #{pull.number}"):
            return list(pull.get_reviews())

    # ---- comments --------------------------------------------------------------------------

    def comments(self, pull: Any) -> list[Any]:
        with github_errors(f"read the comments of pull request #{pull.number}"):
            return list(pull.get_issue_comments())

    def own_comment(self, pull: Any, marker: str) -> Any | None:
        """Our comment that starts with `marker`. Anyone may paste the marker into a comment
        of their own, so only one written by this token's account counts (GitHub Actions'
        token cannot read its own account: then only a bot's comment counts)."""
        if self._own_login is False:
            from github import GithubException

            try:
                self._own_login = self._api.get_user().login
            except GithubException:
                self._own_login = None
        for comment in self.comments(pull):
            author = comment.user
            mine = (author.login == self._own_login if self._own_login
                    else author.type == "Bot")
            if mine and (comment.body or "").startswith(marker):
                return comment
        return None

    def upsert_comment(self, pull: Any, marker: str, body: str) -> bool:
        """Keep one comment of ours starting with `marker` (an HTML comment) with `body`:
        edit it in place when it differs, create it when missing. Returns whether anything
        was written."""
        text = f"{marker}\n{body}"
        existing = self.own_comment(pull, marker)
        if existing is not None and existing.body == text:
            return False
        with github_errors(f"comment on pull request #{pull.number}"):
            if existing is None:
                pull.create_issue_comment(text)
            else:
                existing.edit(text)
        return True
