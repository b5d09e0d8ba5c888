"""Printing untrusted text: rollout fields, spec keys, `--set` values and model output reach
the terminal only through `safe()`, so Rich markup in them is shown, not interpreted, and
control bytes (ESC/OSC sequences, NUL, bells) never reach the user's terminal raw."""

from __future__ import annotations

import re
import sys

from rich.console import Console
from rich.markup import escape

# ANSI/VT sequences first (CSI, OSC up to BEL or ST, other ESC pairs), then any remaining
# C0/C1 control character except newline and tab.
_SEQUENCE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: object) -> str:
    """`text` as a string without terminal control sequences or control characters."""
    return _CONTROL.sub("", _SEQUENCE.sub("", str(text)))


def safe(text: object) -> str:
    """`text` cleaned and with Rich markup escaped: print it inside a markup string."""
    return escape(clean(text))


# Piped output (CI logs, `| less`, a file) has no width to fit: lines are kept whole up to
# this many columns instead of Rich's 80-column default.
PIPED_WIDTH = 200


def console(*, stderr: bool = False) -> Console:
    """A Console that keeps lines whole instead of cropping or folding them at 80 columns
    when the output is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty()
    return Console(stderr=stderr, soft_wrap=piped, width=PIPED_WIDTH if piped else None,
                   highlight=False)
