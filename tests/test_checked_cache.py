"""The record of checked documents (.evotrainer/cache/checked, store/specs.py
`cached_valid`): a spec found valid is read again without parsing and checking it, keyed
by the digest of its bytes, never by its name; what it reports is what a full check
reports."""

from __future__ import annotations

import json

from evotrainer.control.versions import spec_text
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, version_spec_path


def commit_spec(ws: Workspace, name: str, recipe: dict) -> None:
    """Commit `name`'s spec (forked from v0, unapproved) straight onto its branch."""
    spec = {"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": name,
            "parent": "v0", "intervention": {"rationale": "scale", "skills": [], "factors": 1},
            "recipe": recipe, "approval": {"approved": False}}
    ws.git.commit_files(branch_name(name), {version_spec_path(name): spec_text(spec).encode()},
                        f"Propose {name}", start=branch_name("v0"))


def test_a_spec_checked_valid_once_is_checked_again_when_its_bytes_change(workspace, cli):
    """`validate` records the specs it found valid by the digest of their bytes. The branch
    then changes v1 into a spec the schema refuses, under the same name and path: the new
    bytes are checked, and refused, by validate and plan alike (a cache keyed by the name
    would have kept reading the old verdict)."""
    commit_spec(workspace, "v1", {"grpo": {"lr": 3e-4}})
    assert cli("-C", str(workspace.root), "validate").code == 0
    assert list(workspace.checked_dir.glob("PolicyVersion-*.json"))
    commit_spec(workspace, "v1", {"grpo": {"lr": 3e-4, "lrr": 1}})
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1 and "unknown key 'lrr'" in result.err and "grpo.lrr" in result.err
    planned = cli("-C", str(workspace.root), "plan", "--json")
    assert planned.code == 1 and "unknown key 'lrr'" in planned.out


def test_a_remembered_spec_reports_a_recipe_problem_at_the_same_line(workspace, cli):
    """A spec the schema accepts, whose recipe the backend refuses (clip_high below
    clip_low): the second validate reads the spec from the record of valid documents and
    still names the file, line and column of the field, as the first did."""
    commit_spec(workspace, "v1", {"grpo": {"clip_low": 0.3, "clip_high": 0.2}})
    first = cli("-C", str(workspace.root), "validate")
    assert first.code == 1 and "evo/v1:spec/versions/v1.yaml:" in first.err
    assert list(workspace.checked_dir.glob("PolicyVersion-*.json"))
    assert cli("-C", str(workspace.root), "validate").err == first.err


def test_the_rules_the_cache_is_keyed_by_are_all_there_and_a_missing_one_changes_the_key(
        tmp_path, monkeypatch):
    """Every file the key names exists (a missing one used to make every read raise, which
    the cache readers took for a miss: the cache was off without a word); were one to go
    missing, the key changes instead of the cache switching off."""
    from evotrainer.store import specs

    files = specs.rule_files()
    assert all(path.is_file() for path in files), [p for p in files if not p.is_file()]
    assert {"specs.py", "cel.py", "recipe.schema.json"} <= {p.name for p in files}
    present = specs.rules_digest()
    specs.rules_digest.cache_clear()
    monkeypatch.setattr(specs, "rule_files", lambda: [*files, tmp_path / "gone.py"])
    try:
        assert specs.rules_digest() != present
    finally:
        specs.rules_digest.cache_clear()


def test_specs_found_valid_together_are_recorded_in_one_pack_and_packs_stay_few(tmp_path):
    """The first check of many specs records them in one file, not a file each; each later
    batch adds a pack, and past the limit the newest pack takes in the others. Every
    recorded spec reads back from the packs; bytes never recorded are a miss."""
    from evotrainer.store import specs

    def doc(i: int) -> tuple[specs.Document, bytes]:
        raw = f"apiVersion: evotrainer/v1\nkind: PolicyVersion\nname: v{i}\n".encode()
        return specs.parse(raw, f"v{i}.yaml"), raw

    first = [doc(i) for i in range(50)]
    specs.remember_valid_many(first, "PolicyVersion", tmp_path)
    assert len(list(tmp_path.glob("PolicyVersion-*.json"))) == 1
    for batch in range(1, specs._MAX_PACKS + 1):
        specs.remember_valid_many([doc(100 + batch)], "PolicyVersion", tmp_path)
    packs = list(tmp_path.glob("PolicyVersion-*-pack-*.json"))
    assert 1 <= len(packs) <= specs._MAX_PACKS
    for d, raw in [*first, doc(100 + specs._MAX_PACKS)]:
        found = specs.cached_valid(raw, "again.yaml", "PolicyVersion", tmp_path)
        assert found is not None and found.data == d.data and found.source == "again.yaml"
    assert specs.cached_valid(b"name: never\n", "x.yaml", "PolicyVersion", tmp_path) is None


def test_an_invalid_spec_among_many_is_reported_on_a_cold_start(tmp_path, cli, monkeypatch):
    """A lineage of many valid proposals, one of them changed into a spec the schema
    refuses, never validated before (no record of checked documents): `validate` names that
    one spec's branch and file with line and column, its field and the fix, and nothing
    else; `plan` refuses it. The specs are parsed and checked in two halves at once here
    (store/halves.py), as in a lineage of thousands."""
    from test_scale import bench_build

    from evotrainer.store import halves

    monkeypatch.setattr(halves, "MIN_ITEMS", 8)
    # pytest-xdist's I/O thread takes no lock the parse and check do: the halves still fork.
    monkeypatch.setattr(halves, "_other_threads", lambda: False)
    ws = bench_build(tmp_path / "ws", 60)
    commit_spec(ws, "v37", {"grpo": {"lr": 3e-4, "lrr": 1}})
    assert not ws.checked_dir.exists()
    result = cli("-C", str(ws.root), "validate")
    assert result.code == 1
    [problem] = [line for line in result.err.splitlines() if "✗" in line]
    assert "evo/v37:spec/versions/v37.yaml:13:5: recipe.grpo.lrr: unknown key 'lrr'" in problem
    assert "did you mean 'lr'?" in problem
    planned = cli("-C", str(ws.root), "plan", "--json")
    refused = [v for v in json.loads(planned.out)["versions"] if v["error"]]
    assert planned.code == 1 and [v["version"] for v in refused] == ["v37"]
    assert "v37.yaml:13:5: recipe.grpo.lrr: unknown key 'lrr'" in refused[0]["error"]
    # The 59 valid specs were recorded by their bytes, the refused one was not: the second
    # run reads them and reports the same.
    assert cli("-C", str(ws.root), "validate").err == result.err


def test_identical_spec_texts_on_two_branches_are_each_checked_and_reported(workspace, cli):
    """The same bytes on two branches are two specs: a text the schema refuses is reported
    at each branch, and a valid text named after one branch is refused on the other."""
    refused = spec_text({"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": "a",
                         "parent": "v0", "recipe": {"grpo": {"lrr": 1}}}).encode()
    named_c = spec_text({"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": "c",
                         "parent": "v0"}).encode()
    for name, text in (("a", refused), ("b", refused), ("c", named_c), ("d", named_c)):
        workspace.git.commit_files(branch_name(name), {version_spec_path(name): text},
                                   f"Propose {name}", start=branch_name("v0"))
    for _ in range(2):  # cold, then with the specs found valid recorded
        result = cli("-C", str(workspace.root), "validate")
        assert result.code == 1
        problems = [line for line in result.err.splitlines() if "✗" in line]
        assert [p.split(":")[0].removeprefix("✗ ") for p in problems] == ["evo/a", "evo/b",
                                                                         "evo/d"]
        assert all("unknown key 'lrr'" in p for p in problems[:2])
        assert "name 'c' does not match 'd'" in problems[2]


def test_a_valid_spec_holding_a_date_is_checked_every_time_and_not_recorded(workspace, cli):
    """YAML reads an unquoted 2024-01-01 as a date, which the record of checked documents
    (JSON) cannot keep: the spec is valid, `validate` says so every time without writing it
    to the record, and its bytes are checked again rather than read back as a string."""
    from evotrainer.store import specs

    text = spec_text({"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": "v1",
                      "parent": "v0", "proposal": {"trigger": {"seen": "DATE"}}})
    raw = text.replace("DATE", "2024-01-01").encode()  # unquoted: YAML reads a date
    workspace.git.commit_files(branch_name("v1"), {version_spec_path("v1"): raw}, "Propose v1",
                               start=branch_name("v0"))
    for _ in range(2):
        assert cli("-C", str(workspace.root), "validate").code == 0
    specs._packs.cache_clear()
    assert specs.cached_valid(raw, "v1", "PolicyVersion", workspace.checked_dir) is None
    assert workspace.versions()["v1"].spec["proposal"]["trigger"]["seen"].year == 2024


def test_a_record_parsed_once_is_read_back_and_a_forged_parse_is_not(
        workspace, standin, monkeypatch):
    """A version's records, once parsed, are kept in the checked folder with a MAC under the
    controller's key over their bytes and their data, and read back from there without
    parsing. The attack: the kept parse of v1's diagnosis is edited to say another value,
    its MAC kept or made again under another key; the next read finds the MAC wrong and
    parses the record's bytes, which say what the controller wrote. A reader without the
    key keeps nothing."""
    from standin import converge
    from standin import propose as train

    from evotrainer.store import seal, specs
    from evotrainer.store import workspace as store

    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    truth = Workspace(workspace.root).versions()["v1"].records
    assert truth["diagnosis"]["metrics"]
    assert list(workspace.checked_dir.glob("ParsedRecord-*.json"))
    parse = store.load_record

    def unparsed(blob, source):
        assert blob is None, f"{source} parsed again"
        return parse(blob, source)

    with monkeypatch.context() as patched:
        patched.setattr(store, "load_record", unparsed)
        assert Workspace(workspace.root).versions()["v1"].records == truth

    metric = next(iter(truth["diagnosis"]["metrics"]))

    def forge(mac_of) -> None:  # every kept parse of the diagnosis says 12345.0
        for pack in workspace.checked_dir.glob("ParsedRecord-*.json"):
            entries = json.loads(pack.read_text())
            for entry in entries.values():
                if entry["record"].get("kind") == "Diagnosis":
                    entry["record"]["metrics"][metric] = 12345.0
                    entry["mac"] = mac_of(entry)
            pack.write_text(json.dumps(entries))
        specs._packs.cache_clear()  # a new process reads the packs anew

    for mac_of in (lambda entry: entry["mac"],
                   lambda entry: seal.parsed_mac(b"another key" * 3, b"",
                                                 specs.json_text(entry["record"]))):
        forge(mac_of)
        read = Workspace(workspace.root).versions()["v1"].records
        assert read["diagnosis"]["metrics"][metric] == truth["diagnosis"]["metrics"][metric]
        assert read == truth

    for kept in workspace.checked_dir.glob("ParsedRecord-*.json"):
        kept.unlink()
    specs._packs.cache_clear()
    monkeypatch.setattr(Workspace, "record_key", property(lambda self: None))
    Workspace(workspace.root).versions()
    assert not list(workspace.checked_dir.glob("ParsedRecord-*.json"))
