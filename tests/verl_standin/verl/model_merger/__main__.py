"""Stand-in for `python -m verl.model_merger merge --backend fsdp --local_dir … --target_dir …`.

The stand-in trainer has no model, so it writes no FSDP shards; this checks the arguments the
backend renders (the actor folder of the last global step under trainer.default_local_dir)
and writes a Hugging Face directory of the shape verl's merger writes (config, weights,
tokenizer with its chat template) from the test tokenizer at $STANDIN_TOKENIZER. Only the
arguments are real here; the real merger's own output is not exercised by these tests.
`STANDIN_MERGE=fail` makes it fail as the real one does on missing shards."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("operation", choices=["merge"])
    parser.add_argument("--backend", choices=["fsdp"], required=True)
    parser.add_argument("--local_dir", required=True)
    parser.add_argument("--target_dir", required=True)
    args = parser.parse_args()
    if not re.search(r"/checkpoints/global_step_\d+/actor$", args.local_dir):
        print(f"not a verl actor checkpoint folder: {args.local_dir}", file=sys.stderr)
        return 1
    if os.environ.get("STANDIN_MERGE") == "fail":
        print(f"FileNotFoundError: no model shards under {args.local_dir}", file=sys.stderr)
        return 1
    target = Path(args.target_dir)
    target.mkdir(parents=True, exist_ok=True)
    step = int(args.local_dir.rsplit("global_step_", 1)[1].split("/")[0])
    (target / "config.json").write_text(json.dumps({"model_type": "qwen2", "step": step}))
    (target / "model.safetensors").write_bytes(os.urandom(256))
    for file in Path(os.environ["STANDIN_TOKENIZER"]).iterdir():
        shutil.copy(file, target / file.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
