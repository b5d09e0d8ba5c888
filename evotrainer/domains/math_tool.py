"""`math_tool`: the `math` problems, solved with a Python interpreter the policy may call (the
paper's Math v8: tool-integrated reasoning with a Code Interpreter), multi-turn.

Actions end with the turn terminator "~" (one token in the tiny model's and in byte-level BPE
vocabularies; rare in both Python and LaTeX). An action is one of
  a program:  the last fenced ```python block of the action (untagged fences count too), or,
              when the action has no fence and no final answer, the whole action (the one-line
              form the tiny model's character vocabulary can write: `print(2**100 % 7)~`);
              it runs in the sandbox and its output comes back as the observation;
  an answer:  an action with a final answer and no fence (`\\boxed{56}` or a final line such as
              `Answer: 56`, as `math` reads it); it ends the episode.
A response that ends by itself (eos: a chat model's end of turn) ends the episode too.

Each program runs alone in the project's sandbox (`sandbox.process`: its own uid, no network,
a private /tmp as its scratch directory, CPU, wall, memory and output limits, every process it
started killed at the end); nothing persists between calls, so a call defines what it uses.
Besides the standard library it may import the packages in `domain.params.packages` (default
sympy and mpmath, when installed), whose folders alone are exposed to it, read-only.
The observation is `<output>` + stdout (or the error: the status and the last line of the
traceback) + `</output>`, at most `max_observation_chars` characters inside the tags; any
`<output`/`</output` the program prints is escaped, so printed text can never close the block
early and pass as the policy's own writing.

Every call is recorded in `tool_calls` as {name, args} with the program as args: `python` when
it exited 0, `python_error` when it failed (an exception, a syntax error, a time, memory or
output limit), `unavailable` when the environment disables `python`. The behaviour layer reads
the share of rollouts that call the interpreter, calls per rollout and the share of calls that
failed from these names (the catalogue's `tool_call_rate` and `tool_failure_rate`, h0's
`tool_calls_mean`).

Scoring is `math`'s (`score_math`: math-verify) on the episode's final text, the text after
the last observation: what the program printed never counts as the answer, and neither does
an answer inside a program. Components are `math`'s (`correctness`, `format`, `truncated`), so
a recipe moves from `math` to `math_tool` (the `code-interpreter` skill) with its reward as is;
tasks are `math`'s rows with the same ids, so the two domains' score tables pair. An episode
that ends on a tool call (the turn limit) has no final answer: wrong, but not a format failure.

Rows are `math`'s plus an optional `program` (Python printing the answer): a row with one gives
a warm-start demonstration that calls the interpreter with it (`tool_demo_rate` of the time),
reads the real observation and answers; the others answer from `solution` as `math` does.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from evotrainer.domains.base import Demonstration, EnvStep, Score, Task
from evotrainer.domains.math import MathDomain, extract_answer, score_math
from evotrainer.domains.sandboxed import extract_program
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import Limits, Sandbox, default_sandbox

TURN_END = "~"
TOOL = "python"
DEFAULT_TEMPLATE = (
    "Solve the following problem. You may run Python: write a ```python code block and end "
    "the message with ~ to run it; its output comes back between <output> and </output>. "
    "Each program runs alone (define what you use; print the result). When done, put the "
    "final answer in \\boxed{} and end with ~.\n\n{problem}"
)
OPEN, CLOSE = "<output>\n", "\n</output>\n"
# An observation block as the environment writes it; its contents never hold a closing tag.
_OBSERVATION = re.compile(r"<output>.*?</output>", re.DOTALL)
_TAGS = re.compile(r"<(/?)output", re.IGNORECASE)


def escape_output(text: str) -> str:
    """Printed text with every `<output`/`</output` defused (`<_output`, `</_output`)."""
    return _TAGS.sub(lambda m: f"<{m.group(1)}_output", text)


def cap(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, saying how many were dropped."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} more characters]"
    return text[: max(0, limit - len(marker))] + marker


def final_text(response: str) -> tuple[str, bool]:
    """(the text after the last observation, whether the response ended on an observation,
    i.e. the episode stopped on a tool call without a final answer)."""
    blocks = list(_OBSERVATION.finditer(response))
    if not blocks:
        return response, False
    tail = response[blocks[-1].end():]
    return tail, not tail.strip()


def parse_action(action: str) -> tuple[str, str]:
    """("program", source) or ("answer", text) for one action (its terminator removed): a
    fenced block is a program; else an action with a final answer is the answer, unless it
    is Python that calls something (`print("The answer is", x)` runs; `Answer: 2`, valid
    Python but a bare annotation that could print nothing, is an answer); else the action is
    run as it is, and a syntax error is its reply."""
    program, _cut_off = extract_program(action)
    if program is not None:
        return "program", program
    if extract_answer(action)[0] is None or _calls_something(action):
        return "program", action
    return "answer", action


def _calls_something(source: str) -> bool:
    """Whether `source` parses as Python with at least one call in it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(node, ast.Call) for node in ast.walk(tree))


class PythonToolEnv:
    """One episode: each program action runs in the sandbox, an answer ends the episode."""

    def __init__(self, domain: MathToolDomain, enabled: bool) -> None:
        self.domain, self.enabled = domain, enabled

    def step(self, action: str) -> EnvStep:
        kind, text = parse_action(action)
        if kind == "answer":
            return EnvStep("", done=True)
        if not self.enabled:
            return EnvStep(f"{OPEN}error: {TOOL} is disabled{CLOSE}", done=False,
                           tool_call={"name": "unavailable", "args": TOOL})
        ok, output = self.domain.run_program(text)
        return EnvStep(output, done=False,
                       tool_call={"name": TOOL if ok else f"{TOOL}_error", "args": text})


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


class MathToolDomain(MathDomain):
    name = "math_tool"
    tools = (TOOL,)
    turn_end = TURN_END
    default_params: dict[str, Any] = {
        "prompt_template": DEFAULT_TEMPLATE,
        "tool_demo_rate": 0.3,  # the paper: about 27% of validation samples call the tool
        "cpu_seconds": 5.0,
        "wall_seconds": 10.0,
        "memory_mb": 1024,
        "output_kb": 64,
        "max_observation_chars": 1024,
        "packages": ["sympy", "mpmath"],
    }
    default_environment: dict[str, Any] = {
        "max_turns": 4,
        "tools": [{"name": TOOL, "enabled": True}],
    }
    sample_file = "math_tool_sample.jsonl"
    # verl scores the decoded response (the final answer follows the calls), not the episode
    # transcript the tools recorded (backends/verl_reward.py).
    answer_in_text = True

    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "prompt_template": {
                "type": "string",
                "pattern": r"\{problem\}",
                "description": "a string containing {problem}",
            },
            "tool_demo_rate": {"type": "number", "minimum": 0, "maximum": 1,
                               "description": "share of warm-start demonstrations that call "
                               "the interpreter (rows with a program), e.g. 0.3"},
            "cpu_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 60,
                            "description": "CPU seconds per program, e.g. 5"},
            "wall_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 120,
                             "description": "wall seconds per program, e.g. 10"},
            "memory_mb": {"type": "number", "minimum": 64, "maximum": 16384,
                          "description": "address space per program in MiB, e.g. 1024"},
            "output_kb": {"type": "number", "exclusiveMinimum": 0, "maximum": 65536,
                          "description": "output a program may write before it is stopped"},
            "max_observation_chars": {"type": "integer", "minimum": 64, "maximum": 100000,
                                      "description": "characters of output the policy sees, "
                                      "e.g. 1024"},
            "packages": {"type": "array", "items": {"type": "string"}, "maxItems": 16,
                         "uniqueItems": True,
                         "description": "installed packages a program may import, e.g. "
                         "[sympy, mpmath]"},
        },
        "additionalProperties": False,
    }

    def validate_params(self) -> None:
        p = self.params
        if p["wall_seconds"] < p["cpu_seconds"]:
            raise EvoError(
                f"wall_seconds {p['wall_seconds']} is below cpu_seconds {p['cpu_seconds']}",
                field="domain.params.wall_seconds",
                hint="give the wall clock at least the CPU time",
            )
        folders = []
        for name in p["packages"]:
            folder = _package_dir(name)
            if folder is None:
                raise EvoError(
                    f"package {name!r} is not installed (a program could not import it)",
                    field="domain.params.packages",
                    hint="install it, or remove it from domain.params.packages",
                )
            folders.append(folder)
        self.expose = tuple(str(f) for f in folders)
        # The exposed packages' parent folders go on the program's path (`-I -S` has none).
        parents = sorted({str(f.parent) for f in folders})
        self.preamble = f"import sys; sys.path[:0] = {parents!r}\n" if parents else ""
        self.limits = Limits(
            cpu_seconds=float(p["cpu_seconds"]),
            wall_seconds=float(p["wall_seconds"]),
            memory_bytes=int(p["memory_mb"] * 2**20),
            output_bytes=int(p["output_kb"] * 1024),
        )
        self._demo_outputs: dict[str, tuple[bool, str]] = {}
        self._lock = threading.Lock()

    def sandbox(self) -> Sandbox:
        return default_sandbox("local", expose=self.expose)

    def run_program(self, source: str) -> tuple[bool, str]:
        """(exited 0, the observation) for one program."""
        try:
            compile(source, "main.py", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            # Never started: the error is the observation, as the interpreter would print it.
            return False, self.observation("", f"error: {type(exc).__name__}: {exc}")
        run = self.sandbox().run(self.preamble + source, "", self.limits)
        if run.status == "ok":
            return True, self.observation(run.stdout)
        limit = {
            "timeout": f"the program ran past {self.limits.wall_seconds:g} s",
            "cpu_limit": f"the program used {self.limits.cpu_seconds:g} CPU seconds",
            "memory_limit": "the program ran out of memory",
            "output_limit": "the program printed too much",
        }
        last = [line for line in run.stderr.splitlines() if line.strip()][-1:]
        if run.status in limit:
            error = f"error: {run.status}: {limit[run.status]}"
        elif run.status == "runtime_error" and last:
            error = f"error: {last[0]}"  # the traceback's last line: the exception
        else:
            error = f"error: {run.status}: {run.detail}"
        return False, self.observation(run.stdout, error)

    def observation(self, printed: str, error: str = "") -> str:
        """What the policy sees: what the program printed, then its error (kept whole: the
        printed text is cut first), escaped and within `max_observation_chars`."""
        limit = int(self.params["max_observation_chars"])
        error = cap(escape_output(error), limit)
        room = limit - len(error) - (1 if error and printed else 0)
        text = cap(escape_output(printed.rstrip("\n")), max(0, room)) if room > 0 else ""
        return OPEN + "\n".join(part for part in (text, error) if part) + CLOSE

    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        task = super().make_task(row, source, where, field)
        program = row.get("program")
        if program is not None and not isinstance(program, str):
            raise EvoError("program must be text (Python printing the answer)", where=where,
                           field=field, hint='"program": "print(2**100 % 7)"')
        return replace(task, meta={**task.meta, "program": program}) if program else task

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        program = task.meta.get("program")
        answer = f"The answer is $\\boxed{{{task.answer}}}$.{TURN_END}"
        if not program or rng.random() >= self.params["tool_demo_rate"]:
            solution = task.meta.get("solution")
            # The solution's own text when it boxes the answer; the answer alone otherwise.
            text = solution if solution and "\\boxed" in solution else answer[: -len(TURN_END)]
            return [(text + TURN_END, True)]
        with self._lock:
            if task.task_id not in self._demo_outputs:
                self._demo_outputs[task.task_id] = self.run_program(program)
        ok, observation = self._demo_outputs[task.task_id]
        if not ok:
            raise EvoError(
                f"the program of task {task.task_id} fails in the sandbox: {observation!r}",
                field="domain.data",
                hint="fix the row's program (it must print the answer), or remove it",
            )
        return [(program + TURN_END, True), (observation, False), (answer, True)]

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        """The Score plus details (`failure`, `answer`): `math`'s on the final text, or a
        turn-limit failure when the episode ended on a tool call."""
        tail, on_a_call = final_text(response)
        if on_a_call and not truncated:
            components = {"correctness": 0.0, "format": 1.0, "truncated": 0.0}
            return Score(components, 0.0), {"answer": None, "form": None,
                                            "failure": "tool_limit"}
        return score_math(tail, task.answer, truncated=truncated)

    def environment(self, task: Task, config: dict[str, Any]) -> PythonToolEnv:
        enabled = any(t["name"] == TOOL and t.get("enabled", True)
                      for t in config.get("tools", []))
        return PythonToolEnv(self, enabled)
