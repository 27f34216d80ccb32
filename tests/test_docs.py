"""docs/cli.md is generated from the CLI parser and must stay current; every
relative link of the Markdown pages (README, docs/, benchmarks/) reaches a file
and, with ``#anchor``, a heading of it."""

from __future__ import annotations

import re
from pathlib import Path

from ckptstore.cli.docgen import render_cli_reference, subcommands
from ckptstore.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "cli.md"
REGEN = "run python -m ckptstore.cli.docgen > docs/cli.md"


def test_cli_reference_is_current():
    assert CLI_MD.exists(), REGEN
    assert CLI_MD.read_text(encoding="utf-8") == render_cli_reference(), REGEN


def test_every_subcommand_is_documented():
    text = CLI_MD.read_text(encoding="utf-8")
    names = list(subcommands(build_parser()))
    assert names, "the parser has no subcommands?"
    for name in names:
        assert f"\n## ckptstore {name}\n" in text, f"subcommand {name!r} missing from docs/cli.md; {REGEN}"
        assert f"usage: ckptstore {name} " in text, f"help of {name!r} missing from docs/cli.md; {REGEN}"


def test_reference_ignores_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = render_cli_reference()
    monkeypatch.setenv("COLUMNS", "300")
    assert render_cli_reference() == narrow



# ------------------------------------------------------------------ links
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_pages() -> list[Path]:
    """The Markdown pages a reader follows links in (not the generated results under benchmarks/results)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    return [p for p in pages if "results" not in p.relative_to(ROOT).parts]


def _outside_fences(text: str):
    fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield n, line


def anchors(page: Path) -> set[str]:
    """The ``#anchor`` of every heading of ``page``, as GitHub makes them (repeats get ``-1``, ``-2``, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _outside_fences(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_anchors_are_made_as_github_makes_them(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n## FSDP2 / tensor parallel: `CkptStoreModelParallelStrategy`\n"
                    "## Tested\n### Tested\n```sh\n# not a heading\n```\n", encoding="utf-8")
    assert anchors(page) == {"title", "fsdp2--tensor-parallel-ckptstoremodelparallelstrategy", "tested", "tested-1"}


def test_every_relative_link_and_anchor_resolves():
    pages = markdown_pages()
    assert ROOT / "docs" / "integrations" / "deepspeed.md" in pages
    broken = []
    for page in pages:
        for n, line in _outside_fences(page.read_text(encoding="utf-8")):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{n}"
                if not dest.exists():
                    broken.append(f"{where}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where}: {target} (no heading makes #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)
