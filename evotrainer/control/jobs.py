"""A version's job, by hand: `evotrainer cancel V` and `evotrainer logs V [-f]`.

Cancelling records first, then stops: the run record turns Cancelled in one commit, so a
reconcile running meanwhile (`reconcile --wait`) never reads the killed job as a failure to
retry; a Cancelled run stays as it is until `evotrainer retry V`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from difflib import SequenceMatcher

from evotrainer.backends import Backends
from evotrainer.backends.base import Backend, JobSpec
from evotrainer.control.reconcile import Context, job_for, load_context, record_text
from evotrainer.errors import EvoError
from evotrainer.store.clock import now_iso
from evotrainer.store.records import JobState, ended_run
from evotrainer.store.workspace import VersionState, Workspace, run_path


@dataclass
class VersionJob:
    ctx: Context
    state: VersionState
    job: JobSpec

    @property
    def backend(self) -> Backend:
        return self.ctx.backend(self.state.run.backend)


def version_job(
    ws: Workspace, name: str, backends: Backends | Mapping[str, Backend] | None = None
) -> VersionJob:
    """The job of `name`'s current run (refused when it was never launched)."""
    ctx = load_context(ws, backends)
    state = ws.version(name, ctx.states)
    if state.run is None:
        raise EvoError(f"{name} was never launched, so it has no job",
                       hint="`evotrainer plan` shows what reconcile does next")
    return VersionJob(ctx, state, job_for(ctx, state, state.records["run"]))


def cancel_version(
    ws: Workspace, name: str, by: str, backends: Backends | Mapping[str, Backend] | None = None
) -> dict:
    """Record `name`'s running job as Cancelled (one commit), then stop it. Cancelling a
    Cancelled run again stops its job again (a stop that failed the first time)."""
    current = version_job(ws, name, backends)
    run = dict(current.state.records["run"])
    if not current.state.run.active and run["state"] != JobState.CANCELLED:
        raise EvoError(
            f"{name} has no running job to cancel (state: {run['state']})",
            hint="cancel stops a Pending, Running or Stalled job",
        )
    if run["state"] != JobState.CANCELLED:
        run = ended_run(run, now_iso(), state=JobState.CANCELLED.value, detail=f"cancelled by {by}")
        ws.commit_records(
            name,
            {run_path(name, "run.yaml"): record_text("run", run).encode()},
            f"Cancel {name}: attempt {run['attempt']} ({run['job_id']}) by {by}",
            {"Action": "cancel", "Version": name},
        )
    try:
        current.backend.cancel(current.job)
    except (OSError, RuntimeError) as err:
        raise EvoError(
            f"{name} is recorded as cancelled, but its job did not stop: {err}",
            hint=f"run `evotrainer cancel {name}` again, or stop job {run['job_id']} by hand",
        ) from None
    return run


def follow_logs(
    current: VersionJob, poll_s: float = 1.0, window: int = 2000,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """The job's log lines as they come, until the job has finished (then the last ones)."""
    backend, shown = current.backend, []
    while True:
        finished = not backend.status(current.job).state.active
        lines = backend.logs(current.job, tail=window).splitlines()
        # Lines new since the last look; the window slides and logs may be concatenated.
        for tag, _, _, first, last in SequenceMatcher(
            None, shown, lines, autojunk=False
        ).get_opcodes():
            if tag in ("insert", "replace"):
                yield from lines[first:last]
        shown = lines
        if finished:
            return
        sleep(poll_s)
