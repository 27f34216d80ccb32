"""The code blocks of the documentation pages, and how tests/test_doc_blocks.py runs them.

Every fenced block of a page has a language: ``python``, a shell (``sh``,
``shell``, ``bash``, ``console``) or ``text`` (output, or a synopsis: not
run). An HTML comment on the line just before the fence says how a block
runs when the default (the page's one interpreter, in page order) does not
fit::

    <!-- run: session=fsdp ranks=2 -->       python: session "fsdp", all of its blocks
                                            as one script under torchrun with 2 ranks
    <!-- run: session=main,fsdp -->         python: runs in both sessions ("main" is the
                                            page's own interpreter, where unmarked blocks
                                            and the ckptstore commands run)
    <!-- run: server -->                    sh: one command that serves on 127.0.0.1:PORT;
                                            started on a free port (every 127.0.0.1:PORT
                                            of the page follows), stopped after the page
    <!-- run: s3 -->                        the page's S3 URLs need a server: the test's
                                            moto, reached through AWS_ENDPOINT_URL and the
                                            AWS_* variables, with the buckets they name
    <!-- run: synopsis -->                  text: every `ckptstore CMD --opt` in it exists
    <!-- run: recipe=NAME (why) -->         run by another test (doc_blocks.recipe(page, NAME))
    <!-- run: install (why) -->             sh: creates an environment or installs packages: not
                                            run by test_doc_blocks.py (the tests' own environment
                                            has them); tests/test_newcomer.py runs them in a fresh
                                            virtual environment, as a newcomer does
    <!-- run: skip (why) -->                not run, for the reason given

Shell blocks run line by line: ``export A=B`` sets variables for the rest of
the page, ``. DIR/bin/activate`` activates a virtual environment for the rest
of the page (``VIRTUAL_ENV`` and ``PATH``, as the script does), ``ckptstore
...`` runs in the page's interpreter (as the console script would; the
console script itself in a newcomer's run), anything else under ``bash -c``
in the page's folder; every command must exit 0.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose blocks must run (tests/test_doc_blocks.py runs each): every
#: stack's page under docs/integrations/ is one, found by its folder.
PAGES = ("README.md", "docs/quickstart.md", "docs/dcp.md", "docs/integrations.md") + tuple(
    sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "integrations").glob("*.md")))
SHELLS = frozenset({"sh", "shell", "bash", "console"})
LANGS = SHELLS | {"python", "text"}

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->\s*$")
_REASON = re.compile(r"\((.+)\)\s*$")


class DocError(ValueError):
    """A page whose blocks cannot be read: names the page and line."""


@dataclass(frozen=True)
class Marker:
    """What the ``<!-- run: ... -->`` comment above a block says (defaults: nothing)."""

    sessions: tuple[str, ...] = ()
    ranks: int | None = None
    server: bool = False
    s3: bool = False
    synopsis: bool = False
    recipe: str | None = None
    install: bool = False
    skip: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Block:
    """One fenced block: ``line`` is the page line of its first code line."""

    page: str
    line: int
    lang: str
    code: str
    marker: Marker = field(default_factory=Marker)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the test executes it (python and shell blocks not skipped nor run elsewhere)."""
        return (self.lang != "text" and not self.marker.skip and self.marker.recipe is None
                and not self.marker.install)


def parse_marker(text: str, where: str) -> Marker:
    """The marker of ``<!-- run: TEXT -->``; a ``(reason)`` closes it."""
    reason = None
    m = _REASON.search(text)
    if m:
        reason, text = m.group(1).strip(), text[: m.start()]
    kw: dict = {"reason": reason}
    for tok in text.split():
        key, _, value = tok.partition("=")
        if key in ("server", "s3", "synopsis", "skip", "install") and not value:
            kw[key] = True
        elif key == "session" and value:
            kw["sessions"] = tuple(s for s in value.split(",") if s)
        elif key == "ranks" and value.isdigit() and int(value) > 0:
            kw["ranks"] = int(value)
        elif key == "recipe" and value:
            kw["recipe"] = value
        else:
            raise DocError(f"{where}: unknown run marker {tok!r} in <!-- run: {text} -->")
    if (kw.get("skip") or kw.get("recipe") or kw.get("install")) and not reason:
        raise DocError(f"{where}: a skipped block says why: <!-- run: skip (reason) -->")
    if kw.get("ranks") and len(kw.get("sessions", ())) != 1:
        raise DocError(f"{where}: ranks=N needs one session=NAME (its blocks run as one script)")
    return Marker(**kw)


def read_blocks(page: str, text: str | None = None) -> list[Block]:
    """Every fenced block of ``page`` (relative to the repository root), in order."""
    if text is None:
        text = (ROOT / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        where = f"{page}:{start}"
        if lang not in LANGS:
            raise DocError(f"{where}: a fence needs a language, one of {sorted(LANGS)} (got {lang!r})")
        end = start
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise DocError(f"{where}: the block is never closed")
        mm = _MARKER.match(lines[i - 1]) if i > 0 else None
        marker = parse_marker(mm.group(1), where) if mm else Marker()
        _check_marker(marker, lang, where)
        code = "\n".join(lines[start:end]) + "\n"
        blocks.append(Block(page, start + 1, "sh" if lang in SHELLS else lang, code, marker))
        i = end + 1
    return blocks


def _check_marker(marker: Marker, lang: str, where: str) -> None:
    if lang == "text" and marker not in (Marker(), Marker(synopsis=True)):
        raise DocError(f"{where}: a text block is not run; only <!-- run: synopsis --> applies")
    if marker.synopsis and lang != "text":
        raise DocError(f"{where}: synopsis is for text blocks")
    if marker.install and lang != "sh":
        raise DocError(f"{where}: install is for shell blocks")
    if marker.server and lang != "sh":
        raise DocError(f"{where}: server is for a shell block of one command")
    if (marker.sessions or marker.ranks) and lang != "python":
        raise DocError(f"{where}: session=/ranks= are for python blocks")


def recipe(page: str, name: str) -> str:
    """The code of the block marked ``recipe=NAME`` on ``page`` (run by a test of its own)."""
    found = [b for b in read_blocks(page) if b.marker.recipe == name]
    if len(found) != 1:
        raise DocError(f"{page}: {len(found)} blocks marked recipe={name}")
    return found[0].code


# ------------------------------------------------------------------ shell lines
@dataclass(frozen=True)
class Command:
    """One command line of a shell block: ``VAR=value ... argv``, or ``export VAR=value ...``."""

    line: int
    text: str
    overlay: dict
    argv: list
    export: bool = False


_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    out: list[Command] = []
    pending, first = "", 0
    for n, raw in enumerate(block.code.splitlines()):
        if not pending:
            first = block.line + n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        text, pending = (pending + raw).strip(), ""
        if not text or text.startswith("#"):
            continue
        words = shlex.split(text, comments=True)
        export = words[:1] == ["export"]
        if export:
            words = words[1:]
        overlay = {}
        while words and _ASSIGN.match(words[0]):
            k, _, v = words.pop(0).partition("=")
            overlay[k] = v
        if export and words:
            raise DocError(f"{block.page}:{first}: export takes VAR=value words only")
        out.append(Command(first, text, overlay, words, export))
    return out


def synopsis_commands(block: Block) -> list[tuple[int, str, list[str]]]:
    """``(line, subcommand, options)`` of every ``ckptstore CMD ...`` in a synopsis block."""
    found = []
    for n, raw in enumerate(block.code.splitlines()):
        for part in re.split(r"(?=\bckptstore )", raw):
            words = part.split()
            if len(words) >= 2 and words[0] == "ckptstore":
                opts = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", " ".join(words[2:]))
                found.append((block.line + n, words[1], opts))
    return found
