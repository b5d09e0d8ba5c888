"""`python -m evotrainer.engine RECIPE_JSON OUT_DIR VERSION`: one job, as the `local` backend
launches it in a detached subprocess. RECIPE_JSON is a file holding the resolved recipe as JSON.
Exit status 0 on success, 1 on failure (result.json in OUT_DIR says why)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from evotrainer.contract.recipe import check_recipe
from evotrainer.contract.rollout import check_rollout
from evotrainer.engine import offline_environment
from evotrainer.engine.outputs import Stopped, write_json
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m evotrainer.engine RECIPE_JSON OUT_DIR VERSION", file=sys.stderr)
        return 2
    recipe_path, out_dir, version = argv
    offline_environment()
    from evotrainer.engine.grpo import run_job  # after the offline switches are set

    try:
        recipe = json.loads(Path(recipe_path).read_text())
        check_recipe(recipe)
        check_rollout(recipe)  # e.g. rollout.engine: vllm where vLLM is not installed
    except (OSError, ValueError, EvoError) as err:
        # A job that never starts still leaves result.json, so the backend can say why.
        write_json(
            RunArtifacts(Path(out_dir)).result,
            {"status": "failed", "version": version, "error": str(err)},
        )
        print(f"error: {err}", file=sys.stderr)
        return 1
    # `cancel` and an early stop send SIGTERM: leave through Python, so result.json and
    # train.log record why the job ended (not "SystemExit: 143").
    signal.signal(signal.SIGTERM, _stop)
    try:
        run_job(recipe, Path(out_dir), version, progress=sys.stderr.isatty())
    except Stopped as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as exc:  # result.json and train.log already hold the failure
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _stop(signum: int, frame: object) -> None:
    raise Stopped("SIGTERM: the job was stopped (`evotrainer cancel`, or a harness early stop)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
