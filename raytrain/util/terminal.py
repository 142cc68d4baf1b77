"""The one sanitizer for what raytrain prints for people: ``printable``.

A status record, an MLflow run, a job server and a spec all hold strings raytrain did not
write (a run's name, a param, a tag, an error, a job's message). Printed as they are, a
control character in one is a command to the terminal: ``ESC[2J`` clears the screen, a
carriage return or cursor movement overwrites lines and fakes others, an OSC sequence sets
the window title, plants a hyperlink (OSC 8) or writes the clipboard (OSC 52), and some
sequences make the terminal type a reply into the shell. ``printable`` writes each control
character as a visible escape instead (``ESC`` as the four characters ``\\x1b``), so every
such sequence is shown, inert. It covers C0 (but what the caller keeps: a newline in text it
lays out in lines), DEL, C1 (a UTF-8 terminal may take ``U+009B`` as CSI), the Unicode
bidirectional controls (which reorder what a line shows) and the line and paragraph
separators.

Every human-readable printer goes through it: ``raytrain status``, ``doctor``, ``report``'s
table, the job commands' lines, the CLI's error lines and summaries. ``--json`` output is
left as it is: JSON escapes control characters itself.

``raytrain logs`` prints a job's own driver output: the job may lay its text out as it
likes (newlines, tabs, carriage returns for progress bars) and colour it (SGR, ``ESC[...m``,
as Ray colours its workers' prefixes), as that changes only how its own text looks; it is
still remote data, so every other sequence (cursor movement, screen clearing, titles, links,
clipboard, queries) is escaped there too (``printable(..., keep=JOB_OUTPUT, colours=True)``).
"""

from __future__ import annotations

import functools
import re

# C0 and DEL, C1, the bidirectional controls (ALM, LRM, RLM, LRE..RLO, LRI..PDI), and the
# line and paragraph separators.
_CONTROLS = [
    *range(0x00, 0x20),
    0x7F,
    *range(0x80, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
    0x2028,
    0x2029,
]
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_ESCAPES = {
    code: _NAMED.get(code, f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}")
    for code in _CONTROLS
}
# What a job's own output may use to lay its text out: ``printable(..., keep=JOB_OUTPUT)``.
JOB_OUTPUT = "\n\t\r"
# Select Graphic Rendition: colours and text styles only; it cannot move the cursor, clear,
# retitle, link or query.
_SGR = re.compile(r"(\x1b\[[0-9;:]*m)")


def printable(text: object, *, keep: str = "", colours: bool = False) -> str:
    """``str(text)`` with every control character written as a visible escape (see the
    module docstring). ``keep``: control characters the caller lets through (``"\\n"`` for
    text it lays out in lines itself); ``colours``: let SGR colour sequences through (a
    job's own output only)."""
    table = _table(keep)
    text = str(text)
    if not colours:
        return text.translate(table)
    parts = _SGR.split(text)  # odd positions are the SGR sequences themselves
    return "".join(part if index % 2 else part.translate(table) for index, part in enumerate(parts))


@functools.lru_cache(maxsize=8)
def _table(keep: str) -> dict[int, str]:
    """The translation table escaping every control character but those in ``keep``."""
    return {code: escape for code, escape in _ESCAPES.items() if chr(code) not in keep}
