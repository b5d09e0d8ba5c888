"""Git as the store of record: versions are branches `evo/<name>`, records are commits.

Commits are written with plumbing (a temporary index, `commit-tree`, compare-and-swap
`update-ref`), so a branch gets a commit without being checked out and without touching
anyone's working tree. Reads of many branches use one `for-each-ref` and one persistent
`cat-file --batch` process, so listing hundreds of versions costs a handful of git calls.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import git
from gitdb.base import IStream

from evotrainer.errors import EvoError
from evotrainer.store import halves

BRANCH_PREFIX = "evo/"
PRUNED_TAG_PREFIX = "pruned/"
FULL_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# Every git the controller runs ignores what the repository's own config could make it run:
# hooks, an fsmonitor program (both run on ordinary reads and commits), and — with the flags
# in DIFF_SAFETY — external diff drivers and textconv filters. A workspace's .git/config is
# not reviewed in git, so it is no place to run code in the controller from.
SAFE_CONFIG = ("core.hooksPath=/dev/null", "core.fsmonitor=false")
DIFF_SAFETY = ("--no-ext-diff", "--no-textconv")
FALLBACK_IDENTITY = {
    "GIT_AUTHOR_NAME": "EvoTrainer",
    "GIT_AUTHOR_EMAIL": "evotrainer@localhost",
    "GIT_COMMITTER_NAME": "EvoTrainer",
    "GIT_COMMITTER_EMAIL": "evotrainer@localhost",
}


def branch_name(version: str) -> str:
    return BRANCH_PREFIX + version


def hardened(repo: git.Repo) -> git.Repo:
    """`repo` with every git call run under SAFE_CONFIG."""
    repo.git.set_persistent_git_options(c=list(SAFE_CONFIG))
    _REPOSITORIES[id(repo)] = repo
    return repo


# Every repository opened, for a forked child to start git processes of its own: by
# identity, as two Repo objects of one folder are equal and each has processes of its own.
_REPOSITORIES: weakref.WeakValueDictionary[int, git.Repo] = weakref.WeakValueDictionary()


def _own_processes_after_fork() -> None:
    """In a forked child: GitPython's persistent `cat-file` processes are the parent's, and
    the child shares their pipes (a request from each would read the other's answer, or
    wait forever for one the other read). The child lets them go without stopping them
    (`proc` dropped: they are not its to stop) and starts its own on first use."""
    for repo in list(_REPOSITORIES.values()):
        command = repo.git
        for name in ("cat_file_all", "cat_file_header"):
            persistent = getattr(command, name, None)
            if persistent is not None:
                persistent.proc = None
            setattr(command, name, None)


os.register_at_fork(after_in_child=_own_processes_after_fork)


def with_trailers(message: str, trailers: Mapping[str, str]) -> str:
    lines = [f"Evotrainer-{key}: {value}" for key, value in trailers.items()]
    return message.rstrip() + "\n\n" + "\n".join(lines) + "\n"


class GitStore:
    def __init__(self, root: Path) -> None:
        try:
            self.repo = hardened(git.Repo(root))
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise EvoError(
                "not a git repository",
                where=str(root),
                hint="run `evotrainer init DIR` to create a workspace, or pass -C DIR",
            ) from None
        self.root = Path(self.repo.working_tree_dir or root)
        self._tree_digests: dict[tuple[str, frozenset[str]], str] = {}
        self.identity_env = self._identity_env()

    def _identity_env(self) -> dict[str, str]:
        """Fall back to a tool identity when the machine has no git user configured."""
        reader = self.repo.config_reader()
        configured = reader.has_option("user", "name") and reader.has_option("user", "email")
        return {} if configured else dict(FALLBACK_IDENTITY)

    def user(self) -> str:
        reader = self.repo.config_reader()
        if reader.has_option("user", "name"):
            return str(reader.get_value("user", "name"))
        return os.environ.get("USER", "unknown")

    # ---- reading -------------------------------------------------------------------------

    def version_branches(self) -> dict[str, str]:
        """{version name: tip sha} for every `evo/*` branch, in one git call."""
        out = self.repo.git.for_each_ref(
            "--format=%(refname) %(objectname)", "refs/heads/" + BRANCH_PREFIX
        )
        branches = {}
        for line in out.splitlines():
            ref, sha = line.split(" ")
            branches[ref.removeprefix("refs/heads/" + BRANCH_PREFIX)] = sha
        return branches

    def version_tips(self, names: Iterable[str]) -> dict[str, str]:
        """{version name: tip sha} of the named versions that have a branch, in one git
        call however many branches the repository holds."""
        names = list(names)
        refs = [f"refs/heads/{branch_name(name)}" for name in names]
        if not refs:
            return {}
        out = self.repo.git.for_each_ref("--format=%(refname) %(objectname)", *refs)
        wanted = set(names)
        tips = {}
        for line in out.splitlines():
            ref, sha = line.split(" ")
            name = ref.removeprefix("refs/heads/" + BRANCH_PREFIX)
            if name in wanted:  # a pattern also matches the refs below it
                tips[name] = sha
        return tips

    def tags(self, prefix: str) -> dict[str, str]:
        out = self.repo.git.for_each_ref("--format=%(refname) %(objectname)", "refs/tags/" + prefix)
        return {
            ref.removeprefix("refs/tags/" + prefix): sha
            for ref, sha in (line.split(" ") for line in out.splitlines())
        }

    def read(self, ref: str, path: str) -> bytes | None:
        return self.read_many([(ref, path)])[(ref, path)]

    def read_many(self, wanted: Iterable[tuple[str, str]]) -> dict[tuple[str, str], bytes | None]:
        """Read files at refs in one `git cat-file --batch` run: every request written at
        once, the answers parsed from one stream (thousands of branches cost one process,
        not a round trip each); a missing file or a non-blob → None."""
        wanted = list(dict.fromkeys(wanted))
        if not wanted:
            return {}
        if any("\n" in ref + path for ref, path in wanted):
            raise EvoError("a ref or path holds a newline", hint="git names never do")
        out = self._cat_file("--batch", [f"{ref}:{path}\n".encode() for ref, path in wanted])
        result: dict[tuple[str, str], bytes | None] = {}
        at = 0
        for key in wanted:
            end = out.index(b"\n", at)
            header = out[at:end].split()
            at = end + 1
            if len(header) != 3 or header[-1] == b"missing":  # "<name> missing", ambiguous
                result[key] = None
                continue
            size = int(header[2])
            result[key] = out[at:at + size] if header[1] == b"blob" else None
            at += size + 1  # the content, then a newline
        return result

    def present(self, wanted: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which (ref, path) name an object (a file or a folder), in one `git cat-file
        --batch-check` run: a folder's absence answers for every file under it."""
        wanted = list(dict.fromkeys(wanted))
        if not wanted:
            return set()
        if any("\n" in ref + path for ref, path in wanted):
            raise EvoError("a ref or path holds a newline", hint="git names never do")
        out = self._cat_file("--batch-check",
                             [f"{ref}:{path}\n".encode() for ref, path in wanted]).splitlines()
        return {key for key, line in zip(wanted, out, strict=True)
                if len(line.split()) == 3 and not line.endswith(b" missing")}

    def _cat_file(self, mode: str, requests: list[bytes]) -> bytes:
        """`git cat-file MODE`'s answers to `requests` (one line each), in order. Thousands
        of requests go to two processes at once where a second CPU can take one: git finds
        each file by reading the folders on its path, and a branch of a long chain of
        versions holds every ancestor's spec in one folder."""
        if len(requests) < halves.MIN_ITEMS or halves.cpus() < 2:
            return self._cat_file_run(mode, b"".join(requests))
        half = len(requests) // 2
        with ThreadPoolExecutor(max_workers=1) as pool:
            second = pool.submit(self._cat_file_run, mode, b"".join(requests[half:]))
            first = self._cat_file_run(mode, b"".join(requests[:half]))
            return first + second.result()

    def _cat_file_run(self, mode: str, request: bytes) -> bytes:
        return subprocess.run(
            ["git", *(arg for c in SAFE_CONFIG for arg in ("-c", c)), "cat-file", mode],
            cwd=self.root, input=request, capture_output=True, check=True,
        ).stdout

    def tree_digest(self, commit: str, exclude: frozenset[str]) -> str:
        """sha256 of every file of `commit`'s tree (path, mode and blob id) but `exclude`:
        what an approval binds, so any other change to the tree makes it stale."""
        # A commit's tree never changes: the digest is remembered by the commit's full id
        # (a branch name or a short id is looked up every time).
        key = (commit, exclude)
        if not FULL_SHA.fullmatch(commit) or key not in self._tree_digests:
            listing = self.repo.git.ls_tree("-r", "--full-tree", "-z", commit)
            kept = sorted(e for e in listing.split("\0")
                          if e and e.split("\t", 1)[1] not in exclude)
            self._tree_digests[key] = "sha256:" + hashlib.sha256(
                "\0".join(kept).encode()).hexdigest()
        return self._tree_digests[key]

    def signed_by(self, commit: str, allowed_signers: bytes) -> str | None:
        """The principal whose SSH signature on `commit` verifies against `allowed_signers`
        (git's allowed-signers format), or None. The signature program is named here, not
        taken from the repository's config."""
        with tempfile.NamedTemporaryFile() as signers:
            signers.write(allowed_signers)
            signers.flush()
            try:
                out = self.repo.git(c=[
                    "gpg.format=ssh", "gpg.ssh.program=ssh-keygen",
                    f"gpg.ssh.allowedSignersFile={signers.name}",
                ]).verify_commit(commit, with_extended_output=True)[2]
            except git.GitCommandError:
                return None
        found = re.search(r'Good "git" signature for (\S+) with', out)
        return found.group(1) if found else None

    def first_parents(self, commits: Iterable[str]) -> dict[str, str | None]:
        """{commit: its first parent (None for a root commit)} in one git call."""
        commits = list(dict.fromkeys(commits))
        if not commits:
            return {}
        out = self.repo.git.rev_list("--no-walk=unsorted", "--parents", *commits)
        parents: dict[str, str | None] = {}
        for line in out.splitlines():
            ids = line.split()
            parents[ids[0]] = ids[1] if len(ids) > 1 else None
        return parents

    def last_change(self, commit: str, path: str) -> tuple[str | None, str | None]:
        """(the last commit reachable from `commit` that changed `path`, its first parent);
        (None, None) when none did."""
        out = self.repo.git.log("-1", "--format=%H %P", commit, "--", path).split()
        if not out:
            return None, None
        return out[0], out[1] if len(out) > 1 else None

    def changed_paths(self, old: str, new: str) -> list[str]:
        """Paths whose content differs between two commits."""
        out = self.repo.git.diff("--name-only", "-z", *DIFF_SAFETY, old, new, "--")
        return [p for p in out.split("\0") if p]

    def rev(self, ref: str) -> str | None:
        try:
            return self.repo.rev_parse(ref).hexsha
        except (git.BadName, ValueError):
            return None

    def merged_versions(self, into: str) -> set[str]:
        """Versions whose branch tip is contained in `into`, in one git call."""
        out = self.repo.git.for_each_ref(
            "--format=%(refname)", f"--merged={into}", "refs/heads/" + BRANCH_PREFIX
        )
        return {ref.removeprefix("refs/heads/" + BRANCH_PREFIX) for ref in out.splitlines()}

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        return self.repo.is_ancestor(ancestor, descendant)

    # ---- writing -------------------------------------------------------------------------

    def commit_files(
        self,
        branch: str,
        files: Mapping[str, bytes | None],
        message: str,
        trailers: Mapping[str, str] | None = None,
        start: str | None = None,
        expect: str | None = None,
        sign: bool = False,
    ) -> str:
        """Commit `files` (path → content, None deletes) onto `branch`.

        A new branch starts at `start`. The ref moves by compare-and-swap, so a concurrent
        writer makes this fail instead of losing a commit; `expect` is the tip the caller
        read its content from (the commit then goes exactly onto it). A branch checked out
        in the workspace root gets its working tree fast-forwarded. `sign`: sign the commit
        with the user's configured key (git's `user.signingkey`, `gpg.format`).
        """
        lines = []
        for path, content in files.items():
            if content is None:
                lines.append(f"0 {'0' * 40}\t{path}")
            else:
                blob = self.repo.odb.store(IStream("blob", len(content), io.BytesIO(content)))
                lines.append(f"100644 {blob.hexsha.decode()}\t{path}")
        return self._commit_entries(branch, lines, message, trailers, start, expect, sign)

    def move_folder(self, branch: str, folder: str, to: str, message: str,
                    trailers: Mapping[str, str] | None = None) -> int:
        """Commit onto `branch` its folder `folder` moved to `to`, each file keeping its mode
        and content (so `git log --follow` finds its history); the number of files moved,
        0 (and no commit) when `branch` holds nothing under `folder`."""
        tip = self.rev(f"refs/heads/{branch}")
        listing = self.repo.git.ls_tree("-r", "-z", tip, "--", folder + "/") if tip else ""
        lines = []
        for entry in filter(None, listing.split("\0")):
            meta, path = entry.split("\t", 1)
            mode, _, blob = meta.split()
            lines += [f"0 {'0' * 40}\t{path}", f"{mode} {blob}\t{to}{path[len(folder):]}"]
        if lines:
            self._commit_entries(branch, lines, message, trailers, expect=tip)
        return len(lines) // 2

    def _commit_entries(
        self,
        branch: str,
        lines: list[str],
        message: str,
        trailers: Mapping[str, str] | None = None,
        start: str | None = None,
        expect: str | None = None,
        sign: bool = False,
    ) -> str:
        """Commit `lines` (entries as `git update-index --index-info` reads them) onto
        `branch`, as `commit_files` describes."""
        ref = f"refs/heads/{branch}"
        old = expect or self.rev(ref)
        parent = old or (self.rev(start) if start else None)
        if old is None and start is not None and parent is None:
            raise EvoError(f"cannot create branch {branch}: {start} does not exist")
        with tempfile.TemporaryDirectory() as tmp:
            env = {**self.identity_env, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
            if parent:
                self.repo.git.read_tree(parent, env=env)
            if lines:
                index_info = Path(tmp, "index-info")
                index_info.write_text("\n".join(lines) + "\n")
                with index_info.open("rb") as stream:
                    self.repo.git.update_index("--index-info", istream=stream, env=env)
            tree = self.repo.git.write_tree(env=env)
            full = with_trailers(message, trailers) if trailers else message
            args = [tree, "-m", full] + (["-p", parent] if parent else [])
            try:
                commit = self.repo.git.commit_tree(*args, *(["-S"] if sign else []), env=env)
            except git.GitCommandError as exc:
                if not sign:
                    raise
                raise EvoError(
                    "git could not sign the commit: "
                    + " ".join((exc.stderr or "").split())[-200:],
                    where=str(self.root),
                    hint="this workspace's approvals are signed: configure git's signing "
                    "(git config gpg.format ssh; git config user.signingkey ~/.ssh/KEY.pub)",
                ) from None
        self._check_checkout_follows(branch, old, commit)
        self._move_ref(ref, commit, old)
        self._sync_checked_out(branch, old, commit)
        return commit

    def _move_ref(self, ref: str, new: str, old: str | None) -> None:
        """Compare-and-swap: a commit that landed on the ref meanwhile wins, nothing is lost."""
        try:
            self.repo.git.update_ref(ref, new, old or "0" * 40)
        except git.GitCommandError:
            raise EvoError(
                f"{ref.removeprefix('refs/heads/')} moved while this commit was being written "
                "(someone else committed to it)",
                where=ref,
                hint="nothing was lost and nothing was changed by this write; rerun: the next "
                "pass starts from the new tip",
            ) from None

    def _checked_out(self, branch: str) -> bool:
        return not self.repo.head.is_detached and self.repo.head.ref.name == branch

    def _check_checkout_follows(self, branch: str, old: str | None, new: str) -> None:
        """Before moving a branch checked out in the workspace root: would its files follow?
        (An untracked or edited file in the way would leave the ref moved and the working
        tree behind, and the next ordinary commit would undo the move's files.)"""
        if old is None or not self._checked_out(branch):
            return
        try:
            self.repo.git.read_tree("-n", "-m", "-u", old, new)
        except git.GitCommandError as exc:
            lines = [
                line.strip()
                for line in (exc.stderr or "").splitlines()
                if line.strip() and not line.strip().startswith(("error:", "Please", "Aborting"))
            ]
            raise EvoError(
                f"the checkout of {branch} cannot follow: local files are in the way"
                + (f" ({', '.join(lines[:5])})" if lines else ""),
                where=str(self.root),
                hint=f"{branch} was left untouched; commit, move or remove those files "
                "(`git status`), then rerun",
            ) from None

    def _sync_checked_out(self, branch: str, old: str | None, new: str) -> None:
        """Keep the workspace root's files in step when its checked-out branch moved."""
        if old is None or not self._checked_out(branch):
            return
        # A two-tree fast-forward: updates the touched files, keeps unrelated local edits,
        # refuses (loudly) to overwrite a local edit of a file the commit changed.
        self.repo.git.read_tree("-m", "-u", old, new)

    def tag(self, name: str, ref: str, message: str) -> None:
        if self.rev(f"refs/tags/{name}") is None:
            self.repo.git.tag("-a", name, ref, "-m", message, env=self.identity_env)

    def merge_into(self, target: str, source: str, message: str) -> str:
        """Merge `source` into `target` without checking either out (no conflicts allowed)."""
        target_sha = self.rev(f"refs/heads/{target}")
        source_sha = self.rev(source)
        if target_sha is None or source_sha is None:
            raise EvoError(f"cannot merge {source} into {target}: missing branch")
        if self.is_ancestor(source_sha, target_sha):
            return target_sha
        try:
            tree = self.repo.git.merge_tree("--write-tree", target_sha, source_sha).splitlines()[0]
        except git.GitCommandError as exc:
            raise EvoError(
                f"merging {source} into {target} conflicts",
                hint=f"merge by hand with `git merge {source}` on {target}, then rerun",
            ) from exc
        commit = self.repo.git.commit_tree(
            tree, "-p", target_sha, "-p", source_sha, "-m", message, env=self.identity_env
        )
        self._check_checkout_follows(target, target_sha, commit)
        self._move_ref(f"refs/heads/{target}", commit, target_sha)
        self._sync_checked_out(target, target_sha, commit)
        return commit

    # ---- worktrees -----------------------------------------------------------------------

    def worktree_add(self, path: Path, commit: str) -> Path:
        """A detached worktree at `commit` (the branch can keep receiving record commits).

        An existing worktree is reused; a clean one at another commit is moved there; one
        with uncommitted changes is never touched.
        """
        if path.exists():
            try:
                tree = hardened(git.Repo(path))
            except git.InvalidGitRepositoryError:
                raise EvoError(
                    "exists but is not a worktree of this workspace",
                    where=str(path),
                    hint="move it away, then rerun",
                ) from None
            if tree.head.commit.hexsha != commit:
                if tree.is_dirty(untracked_files=True):
                    raise EvoError(
                        "worktree has uncommitted changes and must move to a new spec commit",
                        where=str(path),
                        hint="commit them to the version's branch (or discard "
                        "them) and rerun; nothing was changed",
                    )
                tree.git.checkout("--detach", commit)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.repo.git.worktree("prune")  # forget worktrees whose folder was deleted
        self.repo.git.worktree("add", "--detach", str(path), commit)
        return path

    def worktree_remove(self, path: Path) -> None:
        if path.exists():
            self.repo.git.worktree("remove", str(path))
        self.repo.git.worktree("prune")
