"""The side of the code under test: a child process that imports a module of the repository
(its working directory) and serves calls, one JSON line in (`module`, `name`, `args` as a
Python literal), one out (`value` as a Python literal, or `error`, with `exit` when the code
raised SystemExit or another BaseException that is not an Exception).

The reply channel is a copy of the original stdout; fd 1 itself becomes stderr (/dev/null),
so a stray write to fd 1 reaches nobody. It holds no verdict, so nothing it runs can fake
one. The runner runs this file's text (`python -I -S -c TEXT`): the standard library only.
"""

import ast
import json
import os
import sys


def serve() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())
    for line in sys.stdin:
        try:
            request = json.loads(line)
            module = __import__(request["module"])
            value = getattr(module, request["name"])(*ast.literal_eval(request["args"]))
            answer = {"value": repr(value)}
        except BaseException as exc:  # everything the code under test raises is its answer
            try:
                answer = {"error": type(exc).__name__ + ": " + str(exc)[:200],
                          "exit": not isinstance(exc, Exception)}
            except BaseException:  # an exception whose str() itself raises
                answer = {"error": "an exception that cannot be shown", "exit": False}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
