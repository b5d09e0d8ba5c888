"""A job stopped by SIGTERM (`evotrainer cancel`, a harness early stop) says so in its log and
result.json, and leaves without a traceback: the real engine, in the subprocess the local
backend starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_checkpoints import TINY

from evotrainer.store.recipe import resolve

# test_checkpoints' tiny recipe, with more steps than any test waits for.
LONG_RUN = [{"grpo": {"steps": 100_000}}]


@pytest.mark.slow
def test_sigterm_is_recorded_as_a_stop_not_as_system_exit(tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(resolve(TINY, LONG_RUN)))
    out = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "evotrainer.engine", str(recipe), str(out), "v1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log = out / "train.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if log.is_file() and " step 1: reward " in log.read_text():
            break  # training, past the warm start
        time.sleep(0.2)
    assert job.poll() is None, job.communicate()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr and "stopped: SIGTERM" in stderr
    text = log.read_text()
    assert "SystemExit" not in text
    assert "SIGTERM: the job was stopped (`evotrainer cancel`, or a harness early stop)" in text
    result = json.loads((out / "result.json").read_text())
    assert "SIGTERM" in result["error"] and "SystemExit" not in result["error"]
