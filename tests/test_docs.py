"""docs/cli.md is generated from the CLI parser and must stay current."""

from __future__ import annotations

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

