"""The swe_rebench pytest grader against the code under test, each attack performed for real
through the domain's own grading of the median instance (unfixed code plus one way of faking
a pass): an import hook that rewrites the graded test's asserts, from a package __init__.py
of the episode's own in the test folder or from the module under test, and objects that
claim equality with what they are not. None may score a pass; what the grader sees is one
clear line in `tampered`, and honest code that looks alike is graded as it is."""

from __future__ import annotations

import pytest
from test_swe_rebench import MODULE, SUBMIT, appended, docker_unready, median_of, write

from evotrainer.domains import make_domain


@pytest.fixture(scope="module", params=["local", "docker"])
def graded(request):
    """The swe_rebench domain and its median instance, graded in the local sandbox or in a
    container of the offline image (skipped where there is none)."""
    if request.param == "docker":
        why = docker_unready()
        if why:
            pytest.skip(why)
        domain = make_domain({"name": "swe_rebench", "params": {"executor": "docker"}})
    else:
        domain = make_domain({"name": "swe_rebench"})
    return domain, median_of(domain)

# A meta_path finder whose loader is a stock SourceFileLoader reading every test module with
# `assert ` turned into `assert True or `: the graded test passes whatever median returns.
FINDER = """
import importlib.machinery as _machinery
import sys as _sys


class _Loader(_machinery.SourceFileLoader):
    def get_data(self, path):
        data = super().get_data(path)
        return data.replace(b"assert ", b"assert True or ") if path.endswith(".py") else data


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if not name.rpartition(".")[2].startswith("test_"):
            return None
        spec = _machinery.PathFinder.find_spec(name, path)
        if spec is None or not str(spec.origin).endswith(".py"):
            return None
        spec.loader = _Loader(name, spec.origin)
        return spec


_sys.meta_path.insert(0, _Finder())
"""

# From the module under test, which the graded test module imports while it is loading: the
# finder goes in, the half-loaded test module is dropped and loaded again through it
# (importlib.import_module raises no import audit event), then the finder takes itself out.
FROM_THE_MODULE = FINDER + """
import importlib as _importlib

_name = next((n for n in list(_sys.modules) if n.rpartition(".")[2] == "test_stats"), None)
if _name is not None:
    _package = _sys.modules["tinystats"]  # still importing this module: give it its names
    _package.median, _package.mean = median, mean
    del _sys.modules[_name]
    try:
        _importlib.import_module(_name)
    finally:
        _sys.meta_path[:] = [f for f in _sys.meta_path if type(f).__name__ != "_Finder"]
"""


def scored(domain, task, calls):
    components = domain.score(task, "", [*calls, SUBMIT]).components
    _, tampered = domain.evaluate(task, [*calls, SUBMIT])
    return components, tampered


def one_clear_line(tampered: list[str], trace: str) -> None:
    lines = [t for t in tampered if trace in t]
    assert lines, tampered
    assert all("\n" not in t and "Traceback" not in t for t in tampered), tampered


def test_an_init_of_its_own_in_the_test_folder_is_put_back(graded):
    """tests/__init__.py installing the rewriting finder: neither a conftest nor a graded
    file, and the compile runs in importlib's frames. Every file the episode adds to a test
    folder is removed before the tests run, so the finder never loads."""
    domain, task = graded
    components, tampered = scored(domain, task, [write("tests/__init__.py", FINDER)])
    assert (components["f2p"], components["correctness"]) == (0, 0), tampered
    assert components["p2p"] == 1  # the honest tests still run, from the base's tree


def test_every_file_the_episode_touched_in_a_test_folder_is_the_bases_again(graded, tmp_path):
    """Not only the graded files and conftests: a file added to a test folder is removed, a
    changed one (text or bytes) and a deleted one are the base's again, before the tests run;
    the code under test's own changes stay."""
    import io
    import json
    import tarfile

    from evotrainer.sandbox import runner

    domain, task = graded
    with tarfile.open(fileobj=io.BytesIO(domain.initial(task))) as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            archive.extractall(tmp_path, filter="data")
        else:
            archive.extractall(tmp_path)
    repo = tmp_path / "repo"
    base_text = (repo / "tests" / "test_text.py").read_bytes()
    (repo / "tests" / "__init__.py").write_text(FINDER)
    (repo / "tests" / "deep").mkdir()
    (repo / "tests" / "deep" / "data.bin").write_bytes(b"\xff\x00")
    (repo / "tests" / "test_text.py").write_bytes(b"\xffnot the base's\n")
    (repo / "tinystats" / "stats.py").write_text(appended("FIXED = 1\n"))
    request = domain.evaluation(task)
    assert request["test_dirs"] == ["tests"]
    reply = runner.do_pytest(str(repo), request)
    assert not (repo / "tests" / "__init__.py").exists()
    assert not (repo / "tests" / "deep" / "data.bin").exists()
    assert (repo / "tests" / "test_text.py").read_bytes() == base_text
    assert "FIXED = 1" in (repo / "tinystats" / "stats.py").read_text()
    assert reply["results"]["tests/test_stats.py::test_median_even"] == "fail"
    (repo / "tests" / "test_text.py").unlink()
    runner.do_pytest(str(repo), request)
    assert (repo / "tests" / "test_text.py").read_bytes() == base_text
    assert json.dumps(request)  # the request crosses to the executor as JSON


def test_an_import_hook_from_the_module_under_test_is_tampering(graded):
    domain, task = graded
    calls = [write(MODULE, appended(FROM_THE_MODULE))]
    components, tampered = scored(domain, task, calls)
    assert (components["f2p"], components["correctness"], components["tampered"]) == (0, 0, 1)
    one_clear_line(tampered, "an import hook from tinystats/stats.py in sys.meta_path")


ALWAYS_EQUAL_FLOAT = """
class _Median(float):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = float.__hash__


_median = median


def median(values):
    return _Median(_median(values))
"""

ALWAYS_EQUAL_OBJECT = """
class _Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


_median = median


def median(values):
    return _Anything() if len(values) % 2 == 0 else _median(values)
"""

# Equal to every number, and to nothing else: no sentinel catches it, the other value of the
# expected side's type does.
EQUAL_TO_NUMBERS = """
class _Number:
    def __eq__(self, other):
        return isinstance(other, (int, float))

    __hash__ = object.__hash__


_median = median


def median(values):
    return _Number() if len(values) % 2 == 0 else _median(values)
"""


@pytest.mark.parametrize(("attack", "trace"), [
    (ALWAYS_EQUAL_FLOAT, "compares equal to everything"),
    (ALWAYS_EQUAL_OBJECT, "compares equal to everything"),
    (EQUAL_TO_NUMBERS, None),
])
def test_an_object_equal_to_what_it_is_not_fails_the_graded_comparison(graded, attack, trace):
    domain, task = graded
    components, tampered = scored(domain, task, [write(MODULE, appended(attack))])
    assert (components["f2p"], components["correctness"]) == (0, 0), tampered
    if trace:
        assert components["tampered"] == 1
        one_clear_line(tampered, trace)


HONEST_SUBCLASS = """
class _Median(float):
    # A value type of the repository's own with its own (honest) equality.
    def __eq__(self, other):
        return float(self) == other

    __hash__ = float.__hash__


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return _Median(ordered[middle])
    return _Median((ordered[middle - 1] + ordered[middle]) / 2)
"""


def test_an_honest_fix_returning_its_own_value_type_passes(graded):
    """A float subclass with an honest __eq__ compares by its value: the fix is a fix."""
    domain, task = graded
    components, tampered = scored(domain, task, [write(MODULE, appended(HONEST_SUBCLASS))])
    assert (components["f2p"], components["p2p"], components["tampered"]) == (1, 1, 0), tampered


def test_an_honest_fix_that_imports_and_registers_nothing_is_not_flagged(graded):
    """The reference fix, and one importing standard modules while it loads: no import hook,
    nothing equal to everything."""
    domain, task = graded
    fixed = [{"name": "patch", "args": task.meta["patch"]}]
    components, tampered = scored(domain, task, fixed)
    assert (components["f2p"], components["p2p"], components["tampered"]) == (1, 1, 0), tampered
    lazy = appended("import importlib\n_csv = importlib.import_module('csv')\n"
                    "def median(values):\n    ordered = sorted(values)\n"
                    "    middle = len(ordered) // 2\n    if len(ordered) % 2:\n"
                    "        return ordered[middle]\n"
                    "    return (ordered[middle - 1] + ordered[middle]) / 2\n")
    components, tampered = scored(domain, task, [write(MODULE, lazy)])
    assert (components["f2p"], components["p2p"], components["tampered"]) == (1, 1, 0), tampered


def test_the_grader_programs_are_modules_written_into_the_runner():
    """The programs the runner starts are real modules, read as text, and the runner's
    executor copy carries them (it runs alone in a sandbox or a container)."""
    import ast

    from evotrainer.sandbox import runner

    for name in ("call_server", "pytest_bootstrap"):
        assert 'if __name__ == "__main__":' in runner.program(name)
        ast.parse(runner.program(name))
    line = next(li for li in runner.SOURCE.splitlines() if li.startswith("PROGRAMS:"))
    shipped = ast.literal_eval(line.partition("= ")[2])
    assert shipped == {name: runner.program(name) for name in ("call_server",
                                                               "pytest_bootstrap")}


FIXED_MEDIAN = ("def median(values):\n    ordered = sorted(values)\n"
                "    middle = len(ordered) // 2\n    if len(ordered) % 2:\n"
                "        return ordered[middle]\n"
                "    return (ordered[middle - 1] + ordered[middle]) / 2\n")


def test_an_honest_fix_importing_a_sibling_not_loaded_yet_passes(graded):
    """The edited module imports a repository module no one has loaded: the import machinery
    compiles that file's own text, a module load and not the importer's doing."""
    domain, task = graded
    fix = appended("from tinystats import text\n\n_slugify = text.slugify\n\n" + FIXED_MEDIAN)
    components, tampered = scored(domain, task, [write(MODULE, fix)])
    assert (components["f2p"], components["p2p"], components["tampered"]) == (1, 1, 0), tampered


def test_a_sibling_rewritten_while_the_tests_run_is_no_module_load(graded):
    """Only the text a file held when the grading began loads as that file: a sibling the
    code under test rewrites and then imports compiles other text under its name."""
    domain, task = graded
    attack = appended(
        "with open('tinystats/text.py', 'w') as _f:\n"
        "    _f.write('import gc\\n_all = gc.get_objects()\\n')\n"
        "from tinystats import text\n\n" + FIXED_MEDIAN)
    components, tampered = scored(domain, task, [write(MODULE, attack)])
    assert (components["f2p"], components["correctness"], components["tampered"]) == (0, 0, 1)
    one_clear_line(tampered, "compile from tinystats/stats.py")


# A repository of the test's own: `shapes.middle` (wrong at the base) returns a dataclass the
# graded test compares; `plugins` (unedited) installs a library's import hooks when imported,
# a plain finder and one built by `dataclasses` (its methods compiled from a string).
SHAPES_BASE = '''import dataclasses


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float


def middle(a, b):
    return Point(a.x, b.y)
'''
PLUGINS = '''import dataclasses
import sys


class PlainFinder:
    def find_spec(self, name, path=None, target=None):
        return None


@dataclasses.dataclass
class GeneratedFinder:
    prefix: str = "plugins_"

    def find_spec(self, name, path=None, target=None):
        return None


sys.meta_path.append(PlainFinder())
sys.meta_path.append(GeneratedFinder())
'''
SHAPES_TEST = '''from shapes import Point, middle


def test_middle():
    found = middle(Point(0, 0), Point(2, 4))
    assert found == Point(1, 2)
    assert found != Point(0, 4)
    assert found in [Point(9, 9), Point(1, 2)]
    assert [found] == [Point(1, 2)]
'''
SHAPES_FIX = '''import dataclasses


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float


def middle(a, b):
    import plugins  # noqa: F401 - loaded here for the first time

    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)
'''


def test_an_honest_dataclass_value_and_a_library_finder_are_not_tampering(tmp_path):
    """A graded comparison of a dataclass (its __eq__ built by `exec`) and import hooks a
    library of the repository installs when the fix first imports it: the fix passes,
    nothing is tampering; the base fails the same test."""
    import base64
    import sys

    from evotrainer.sandbox import runner

    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "shapes.py").write_text(SHAPES_BASE)
    (repo / "plugins.py").write_text(PLUGINS)
    (repo / "tests" / "test_shapes.py").write_text(SHAPES_TEST)
    request = {"kind": "pytest", "trusted": {"tests/test_shapes.py": SHAPES_TEST},
               "base": runner.tree_digests(str(repo)), "test_dirs": ["tests"],
               "originals": {"tests/test_shapes.py": base64.b64encode(
                   SHAPES_TEST.encode()).decode()},
               "tests": ["tests/test_shapes.py::test_middle"], "python": sys.executable,
               "timeout": 120.0, "cap": 1 << 16}
    reply = runner.do_pytest(str(repo), request)
    assert (reply["results"], reply["tampered"]) == (
        {"tests/test_shapes.py::test_middle": "fail"}, []), reply["output"]
    (repo / "shapes.py").write_text(SHAPES_FIX)
    reply = runner.do_pytest(str(repo), request)
    assert (reply["results"], reply["tampered"]) == (
        {"tests/test_shapes.py::test_middle": "pass"}, []), reply
