"""``raytrain.util.terminal.printable``, and the printers that go through it: a hostile record, run
or job message reaches the terminal as visible escapes, never as a command to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain.cli import app as cli
from raytrain.records.run_status import STATUS_FILE, Restart, RunStatus
from raytrain.tracking.report import text_table
from raytrain.util.terminal import JOB_OUTPUT, printable

# A window title (OSC 0, BEL-ended), a screen clear, a cursor move up, a carriage return
# over the line, an OSC 8 link (ST-ended), a C1 CSI, DEL, a bidi override, a NUL.
HOSTILE = (
    "\x1b]0;pwned\x07\x1b[2J\x1b[1A\rfake\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\"
    "\x9b31m\x7f\u202e\x00"
)


def _no_controls(text: str, keep: str = "") -> None:
    bad = [
        c
        for c in text
        if (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\u202e") and c not in keep
    ]
    assert not bad, (bad, text)


def test_every_control_character_becomes_a_visible_escape() -> None:
    shown = printable(HOSTILE)
    _no_controls(shown)
    assert shown.startswith("\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A\\rfake")
    assert "\\x9b31m\\x7f\\u202e\\x00" in shown
    assert printable("line\nnext\tcol") == "line\\nnext\\tcol"
    assert printable("line\nnext", keep="\n") == "line\nnext"
    assert printable("plain: ümlaut, 日本, emoji 🙂, back\\slash") == (
        "plain: ümlaut, 日本, emoji 🙂, back\\slash"
    )
    assert printable(shown) == shown  # escaping twice changes nothing
    assert printable(3.5) == "3.5"


def test_a_jobs_own_output_keeps_its_layout_and_colours_only() -> None:
    text = "\x1b[36m(worker pid=1)\x1b[0m epoch 1\r 50%\tok\n" + HOSTILE
    shown = printable(text, keep=JOB_OUTPUT, colours=True)
    assert shown.startswith("\x1b[36m(worker pid=1)\x1b[0m epoch 1\r 50%\tok\n")
    rest = shown.split("\n", 1)[1]
    _no_controls(rest, keep="\r")
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A" in rest
    # an incomplete or non-SGR CSI is escaped, even next to a colour
    assert printable("\x1b[31m\x1b[2J", colours=True) == "\x1b[31m\\x1b[2J"


def test_the_report_table_escapes_cells_and_aligns_what_is_shown() -> None:
    table = text_table(["field", f"run{HOSTILE}"], [["lr", "0.1"], [f"k{HOSTILE}", "v"]])
    _no_controls(table, keep="\n")
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[1].index("0.1") == lines[0].index("run")  # widths count the escapes


def _hostile_record(root: Path) -> None:
    status = RunStatus(
        name=f"r{HOSTILE}",
        state="failed",
        started_at=1.0,
        updated_at=2.0,
        driver=f"h{HOSTILE}:1",
        restarts=[Restart(at=1.0, step=1, reason=HOSTILE)],
        error=f"boom{HOSTILE}\nerror: a faked line",
        val_metrics={f"val{HOSTILE}": 0.5},
        stopped=HOSTILE,
        hang=HOSTILE,
        straggler=HOSTILE,
        mlflow_run_id=None,
    )
    (root / "r").mkdir(parents=True)
    (root / "r" / STATUS_FILE).write_text(status.to_json())


def test_status_and_doctor_print_a_hostile_record_escaped_and_json_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _hostile_record(tmp_path)
    for command in ("status", "doctor"):
        assert cli.main([command, "r", "--storage", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        _no_controls(out, keep="\n")
        assert "\\x1b]0;pwned" in out
    assert cli.main(["status", "r", "--storage", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("error: a faked line") for line in lines)
    assert cli.main(["status", "r", "--storage", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert out == (tmp_path / "r" / STATUS_FILE).read_text() + "\n"
    assert json.loads(out)["error"].startswith(f"boom{HOSTILE}")


def test_an_error_line_is_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / f"x{HOSTILE[:12]}"
    assert cli.main(["status", "r", "--storage", str(folder)]) == 2
    err = capsys.readouterr().err
    _no_controls(err, keep="\n")
    assert err.count("\n") == 1 and err.startswith("error: ")
