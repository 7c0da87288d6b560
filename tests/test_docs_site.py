"""The documentation: the README stays a short front door whose every link lands on a page (and heading) of
the MkDocs site, and the site builds with ``--strict`` (a broken link or anchor, a page missing from the nav,
a nav entry without its page all fail)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The issue's bound for a README a newcomer reads in five minutes (torch_xla's is 15 KB, tinygrad's 3 KB).
README_MAX_BYTES = 10 * 1024

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_ID = re.compile(r"""\sid=["']([^"']+)["']""")


def _links(markdown: str) -> list[str]:
    """Targets of the inline Markdown links outside code (fenced blocks and code spans hold examples)."""
    text = _FENCE.sub("", markdown)
    targets = []
    for line in text.splitlines():
        # A code span becomes a plain word: one inside link text (`[`nki_op`](docs/...)`) keeps its link,
        # a link written inside a code span is no link.
        targets += _LINK.findall(_INLINE_CODE.sub("code", line))
    return sorted(set(targets))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner, not a problem here
    )
    if proc.returncode != 0:
        pytest.fail(
            f"mkdocs build --strict failed (exit {proc.returncode}); its messages:\n"
            f"{proc.stderr[-6000:]}{proc.stdout[-2000:]}",
            pytrace=False,
        )
    return out


def _page_html(site: Path, doc: Path) -> Path:
    """Where MkDocs (directory URLs, its default) writes the page built from ``doc`` under docs/."""
    rel = doc.relative_to(DOCS).with_suffix("")
    if rel.name in ("index", "README"):
        return site / rel.parent / "index.html"
    return site / rel / "index.html"


def test_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    for doc in DOCS.glob("*.md"):
        assert _page_html(site, doc).is_file(), f"docs/{doc.name} was not built into the site"


def test_readme_is_at_most_10_kb() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a page under docs/ and link it"
    )


def test_every_relative_link_in_the_readme_resolves(site: Path) -> None:
    links = [t for t in _links(README.read_text()) if not urlsplit(t).scheme]
    assert links, "no relative links found in README.md: the link pattern no longer matches"
    problems = []
    for target in links:
        parts = urlsplit(target)
        if not parts.path:
            problems.append(f"{target}: an anchor in README.md itself (README is not part of the site)")
            continue
        path = (ROOT / unquote(parts.path)).resolve()
        if not path.exists():
            problems.append(f"{target}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} does not exist")
            continue
        if path.suffix == ".md" and path.is_relative_to(DOCS):
            ids = {html.unescape(i) for i in _ID.findall(_page_html(site, path).read_text())}
            if parts.fragment and unquote(parts.fragment) not in ids:
                problems.append(f"{target}: no heading with id '{parts.fragment}' on {path.relative_to(ROOT)}")
        elif parts.fragment:
            problems.append(f"{target}: an anchor into a file that is not a docs page")
    assert not problems, "README.md links that do not resolve:\n" + "\n".join(problems)


def _shell_commands(markdown: str) -> list[str]:
    return [
        line.strip()
        for block in re.findall(r"^```bash\n(.*?)^```", markdown, re.M | re.S)
        for line in block.splitlines()
        if line.strip()
    ]


def test_readme_shows_the_test_command_ci_runs_and_the_demo_command() -> None:
    # .ci/run runs the README's test command verbatim; a README that drifts from it would promise a run that
    # CI does not make.
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    commands = _shell_commands(README.read_text())
    test_command = 'python -m pip install -e ".[test]" && python -m pytest'
    assert test_command in commands, f"the README's commands are {commands}"
    assert test_command in ci, f"CI runs {ci}, not the README's test command"
    assert "python -m pip install -e . && python -m neuron_compile.demo" in commands, commands


def test_every_option_has_a_row_in_the_options_page() -> None:
    import dataclasses

    from neuron_compile.options import Options

    page = (DOCS / "options.md").read_text()
    missing = [f.name for f in dataclasses.fields(Options) if f"| `{f.name}` |" not in page]
    assert not missing, f"options without a row in docs/options.md's table: {missing}"
