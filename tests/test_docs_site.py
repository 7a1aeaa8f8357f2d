"""The docs as a site a newcomer can use: a short README, every page in the navigation, every
relative link resolving, `mkdocs build --strict` clean, the CLI reference current, and no words
about the project's own work history in anything a user reads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINKED_FILES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# [text](target) and ![alt](target); the target up to whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)

# Phrases about how the project was built rather than what it does ("this stop's machine", "the
# stop before", "earlier stops", "this session", "the machine before"). "stop" as a word of the
# domain (stop strings, stop-gradient, "stops the run") is not one of them.
HISTORY = re.compile(
    r"\b(?:this|that|earlier|previous|later|last|next|two|three|several|each)\s+(?:earlier\s+|previous\s+)?stops?\b"
    r"(?!\s*(?:string|token|sequence|criteri|word|condition|id\b|reason|flag))"
    r"|\bthe\s+stops?\s+before\b|\bstop's\b|\bmachines?\s+before\b"
    r"|\b(?:this|that|earlier|previous|last|next)\s+sessions?\b|\bsessions?\s+before\b",
    re.I,
)


def _user_read_files() -> list[Path]:
    return [
        ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted(DOCS.rglob("*.md")),
        *sorted((ROOT / "graphs").glob("*.yaml")), *sorted((ROOT / "examples").glob("*.py")),
        *sorted((ROOT / "hybridflow").rglob("*.py")),
    ]


def test_readme_is_a_short_way_in():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; topic material belongs under docs/"


def _slug(heading: str) -> str:
    """The anchor mkdocs (and GitHub, for these headings) gives a heading."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


def test_every_relative_link_resolves():
    broken = {str(p.relative_to(ROOT)): _broken_links(p) for p in LINKED_FILES}
    broken = {k: v for k, v in broken.items() if v}
    assert not broken, broken


def test_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Here\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#here) [gone](c.md) [bad anchor](a.md#there)\n```text\n[in code](x.md)\n```\n")
    assert _broken_links(page) == ["c.md: no such file", "a.md#there: no heading #there in a.md"]


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.Loader)  # mkdocs tags, if any
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), "a page is in the navigation twice"
    missing = sorted(set(pages) - set(nav))
    assert not missing, f"pages under docs/ not in mkdocs.yml's nav: {missing}"
    assert not set(nav) - set(pages), f"nav names pages that do not exist: {sorted(set(nav) - set(pages))}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the `docs` extra (make install installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1",
             "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # The API page is rendered from the docstrings, not left as `::: name` lines.
    assert ":::" not in api and "GraphBuilder" in api and "gae_advantage" in api


def test_cli_reference_is_generated_from_the_parsers():
    from hybridflow.cli.reference import render_cli_reference

    text = render_cli_reference()
    assert (DOCS / "cli.md").read_text() == text, "docs/cli.md is stale: run `hybridflow docs`"
    assert "## hybridflow run" in text and "`--verbose`" in text and "## hybridflow eval" in text


def test_no_work_history_in_what_users_read():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for path in _user_read_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in HISTORY.finditer(line)
    ]
    assert not found, "words about the project's work history: " + "; ".join(found)


@pytest.mark.parametrize("text", [
    "107 s and 183 s on the machines of two earlier stops", "the same code on the stop before's machine",
    "this stop's code", "(later stop)", "This session ran on another VM", "as on the machine before",
])
def test_history_pattern_catches(text):
    assert HISTORY.search(text), text


@pytest.mark.parametrize("text", [
    "generation stops at the closing tag", "a stop-gradient weight", "stop strings end a turn",
    "the NaN guard stops the run", "the policy learns to stop", "every rank raises the same stop",
    "a container stop ends it cleanly", "the last stop string",
])
def test_history_pattern_allows_the_domain_word(text):
    assert not HISTORY.search(text), text
