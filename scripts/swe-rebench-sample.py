"""Build the shipped SWE-rebench sample: a small Python repository with two real fixes in its
history, as a git bundle, and two SWE-rebench rows (SWE-bench's fields plus `install_config`)
whose base commits are the commits before each fix. Commits have fixed authors and dates, so
the commit ids (and the rows) are the same wherever this runs.

usage: python scripts/swe-rebench-sample.py      writes evotrainer/domains/data/swe_rebench_*
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from evotrainer.domains.swe_repo import GIT_ENV

DATA = Path(__file__).resolve().parents[1] / "evotrainer" / "domains" / "data"
REPO = "tinystats/tinystats"
ENV = {**GIT_ENV, "GIT_CONFIG_GLOBAL": "/dev/null"}

STATS = '''"""Small statistics helpers."""


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    values = list(values)
    return sum(values) / len(values)


def median(values):
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
'''
STATS_FIXED = STATS.replace(
    "    return ordered[len(ordered) // 2]\n",
    "    middle = len(ordered) // 2\n"
    "    if len(ordered) % 2:\n"
    "        return ordered[middle]\n"
    "    return (ordered[middle - 1] + ordered[middle]) / 2\n",
)
TEXT = '''"""Text helpers."""
import re


def slugify(title):
    """A lower-case, dash-separated slug of `title`."""
    return re.sub(r"[^a-z0-9]", "-", title.lower()).strip("-")
'''
TEXT_FIXED = TEXT.replace('r"[^a-z0-9]"', 'r"[^a-z0-9]+"')
TEST_STATS = '''from tinystats import mean, median


def test_mean(numbers):
    assert mean(numbers) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2
'''
TEST_STATS_FIXED = TEST_STATS + '''

def test_median_even(numbers):
    assert median(numbers) == 2.5
'''
TEST_TEXT = '''from tinystats.text import slugify


def test_slug_simple():
    assert slugify("Hello World") == "hello-world"
'''
TEST_TEXT_FIXED = TEST_TEXT + '''

def test_slug_collapses_runs():
    assert slugify("Hello,  World!") == "hello-world"
'''
FILES = {
    "README.md": "# tinystats\n\nSmall statistics and text helpers. `pytest` runs the tests.\n",
    "pyproject.toml": '[project]\nname = "tinystats"\nversion = "0.1.0"\n\n'
    '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "conftest.py": "import pytest\n\n\n@pytest.fixture\ndef numbers():\n"
    "    return [4, 1, 3, 2]\n",
    "tinystats/__init__.py": '"""tinystats."""\nfrom tinystats.stats import mean, median\n\n'
    '__all__ = ["mean", "median"]\n',
    "tinystats/stats.py": STATS,
    "tinystats/text.py": TEXT,
    "tests/test_stats.py": TEST_STATS,
    "tests/test_text.py": TEST_TEXT,
}
ISSUES = [
    (
        "median() is wrong for an even number of values",
        "`median([4, 1, 3, 2])` returns 3; the median of an even-length sequence is the mean "
        "of its two middle values (2.5 here).",
        {"tinystats/stats.py": STATS_FIXED},
        {"tests/test_stats.py": TEST_STATS_FIXED},
        ["tests/test_stats.py::test_median_even"],
        ["tests/test_stats.py::test_mean", "tests/test_stats.py::test_median_odd"],
    ),
    (
        "slugify() leaves runs of dashes",
        '`slugify("Hello,  World!")` gives "hello---world"; a run of separators should become '
        "one dash.",
        {"tinystats/text.py": TEXT_FIXED},
        {"tests/test_text.py": TEST_TEXT_FIXED},
        ["tests/test_text.py::test_slug_collapses_runs"],
        ["tests/test_text.py::test_slug_simple"],
    ),
]


def git(repo: Path, *args: str, day: int = 1) -> str:
    date = f"2024-05-{day:02d}T09:00:00+00:00"
    env = {**ENV, "HOME": str(repo), "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def write(repo: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text, encoding="utf-8")


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tinystats"
        repo.mkdir()
        git(repo, "init", "-q", "--template=", "-b", "main")
        write(repo, FILES)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "tinystats: mean, median and slugify")
        for number, (title, body, fix, tests, f2p, p2p) in enumerate(ISSUES, start=1):
            base = git(repo, "rev-parse", "HEAD").strip()
            write(repo, fix)
            patch = git(repo, "diff")
            write(repo, tests)
            test_patch = git(repo, "diff", "--", *tests)
            git(repo, "add", "-A")
            git(repo, "commit", "-q", "-m", f"Fix #{number}: {title}", day=number + 1)
            rows.append({
                "instance_id": f"tinystats__tinystats-{number}",
                "repo": REPO,
                "base_commit": base,
                "patch": patch,
                "test_patch": test_patch,
                "problem_statement": f"{title}\n\n{body}\n",
                "hints_text": "",
                "created_at": f"2024-05-{number + 1:02d}T09:00:00Z",
                "version": "0.1",
                "FAIL_TO_PASS": json.dumps(f2p),
                "PASS_TO_PASS": json.dumps(p2p),
                "environment_setup_commit": base,
                "install_config": {"python": "3.11", "install": "pip install -e .",
                                   "test_cmd": "pytest -rA"},
            })
        bundle = DATA / "swe_rebench_repos" / "tinystats__tinystats.bundle"
        bundle.parent.mkdir(parents=True, exist_ok=True)
        git(repo, "bundle", "create", "-q", str(bundle), "HEAD", "main")
    (DATA / "swe_rebench_sample.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
