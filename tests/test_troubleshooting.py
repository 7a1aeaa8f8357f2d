"""docs/troubleshooting.md shows, for each common mistake, a command and the one line hybridflow
prints for it. Each command runs here (in-process, from a directory that looks like the
repository root) and must exit 2 with exactly that line as its last line on stderr."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```", re.S | re.M)


def cases() -> list[tuple[str, str]]:
    """(command, printed line) of every ```text block of the page that shows a `$ command`."""
    found = []
    for body in TEXT_BLOCK.findall(PAGE.read_text()):
        lines = body.strip().splitlines()
        if lines and lines[0].startswith("$ "):
            assert len(lines) == 2, f"a case is one command and one line:\n{body}"
            found.append((lines[0][2:], lines[1]))
    return found


def test_the_page_has_twenty_cases():
    assert len(cases()) >= 20
    assert len({command for command, _ in cases()}) == len(cases())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("troubleshooting")
    for name in ("graphs", "resource_pools"):
        (work / name).symlink_to(ROOT / name)
    # Case "a run directory that already holds a run": what a finished run leaves behind.
    (work / "runs" / "taken").mkdir(parents=True)
    (work / "runs" / "taken" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    return work


@pytest.mark.parametrize("command, line", cases(), ids=[c for c, _ in cases()])
def test_the_documented_line_is_the_printed_one(command, line, workdir, monkeypatch, capsys):
    argv = shlex.split(command)
    assert argv[0] == "hybridflow", command
    monkeypatch.chdir(workdir)
    code = main(argv[1:])
    printed = [row for row in capsys.readouterr().err.splitlines() if row.strip()]
    assert code == 2, (command, code, printed[-5:])
    assert printed and printed[-1] == line
