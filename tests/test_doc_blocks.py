"""Every code block of README.md, docs/quickstart.md, docs/dcp.md and docs/integrations{.md,/*.md} runs as written.

Each page runs in a scratch folder of its own, as a reader would run it:
python blocks in one interpreter in page order (or in the session their
marker names, several ranks under torchrun), shell blocks line by line,
the local servers the page starts (moto, gcp-storage-emulator, Azurite) on
free loopback ports. A block that fails names the page and its line.
Markers and rules: tests/doc_blocks.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ckptstore.testing.azurite import azurite_binary

from .doc_blocks import PAGES, ROOT, DocError, Marker, read_blocks, recipe, shell_commands
from .doc_runner import BlockFailed, PageRun

pytestmark = pytest.mark.slow  # runs every block of the pages: interpreters, torchrun, servers

#: Cloud and ckptstore settings of the machine running the tests never reach a page.
_DROP = re.compile(r"^(AWS_|AZURE_|GOOGLE_|GCLOUD|CLOUDSDK_|STORAGE_EMULATOR_HOST$|CKPTSTORE_(?!AZURITE$))")


def page_env() -> dict:
    """The environment a page starts with: this one, without cloud settings, offline, loopback unproxied."""
    env = {k: v for k, v in os.environ.items() if not _DROP.match(k)}
    paths = [str(Path(sys.executable).parent)]
    az = azurite_binary()
    if az:
        paths.append(str(Path(az).parent))
    env["PATH"] = os.pathsep.join(paths + [env.get("PATH", "")])
    no_proxy = ",".join(x for x in ("127.0.0.1", "localhost", env.get("NO_PROXY", "")) if x)
    env.update(NO_PROXY=no_proxy, no_proxy=no_proxy, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":"))
    return env


def _s3(blocks, moto_server, env: dict) -> None:
    """For a page marked ``s3``: the moto server's address in the AWS variables, and the buckets its URLs name."""
    if not any(b.marker.s3 for b in blocks):
        return
    moto_server.reset()
    for bucket in sorted({m for b in blocks for m in re.findall(r"s3://([a-z0-9][a-z0-9.-]+)", b.code)}):
        moto_server.create_bucket(bucket)
    env.update(AWS_ENDPOINT_URL=moto_server.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_as_written(page, tmp_path, moto_server):
    env = page_env()
    blocks = read_blocks(page)
    _s3(blocks, moto_server, env)
    folder = tmp_path / "page"
    folder.mkdir()
    with PageRun(page, folder, env) as run:
        run.run()
    assert run.ran, f"{page}: no block ran"
    # The few blocks not run here say why (pip installs, make, another test's recipe).
    assert all(reason for _, reason in run.skipped), run.skipped


# ------------------------------------------------------------------ the harness itself
def test_markers_and_fences_are_read_strictly():
    text = (
        "<!-- run: session=fsdp ranks=2 -->\n```python\nx = 1\n```\n\n"
        "<!-- run: skip (installs packages) -->\n```sh\npip install x\n```\n\n"
        "<!-- run: synopsis -->\n```text\nckptstore ls URL [--json]     ckptstore tag URL STEP NAME\n```\n"
    )
    a, b, c = read_blocks("page.md", text)
    assert (a.line, a.lang, a.code, a.marker) == (3, "python", "x = 1\n", Marker(sessions=("fsdp",), ranks=2))
    assert not b.runs and b.marker.reason == "installs packages"
    assert c.lang == "text" and c.marker.synopsis
    for bad, says in [
        ("```\nls\n```\n", "page.md:1: a fence needs a language"),
        ("<!-- run: skip -->\n```sh\nls\n```\n", "page.md:2: a skipped block says why"),
        ("<!-- run: ranks=2 -->\n```python\nx\n```\n", "needs one session=NAME"),
        ("<!-- run: sever -->\n```sh\nls\n```\n", "unknown run marker 'sever'"),
        ("```python\nx\n", "never closed"),
    ]:
        with pytest.raises(DocError, match=re.escape(says)):
            read_blocks("page.md", bad)


def test_shell_lines_split_into_exports_overlays_and_commands():
    (block,) = read_blocks("page.md", (
        "```sh\nexport A=1 B='x y'   # both\n# a comment\nC=3 ckptstore ls \\\n    s3://b/r -o k=v\n"
        "python -c \"print('#')\"\n```\n"))
    exp, ls, py = shell_commands(block)
    assert exp.export and exp.overlay == {"A": "1", "B": "x y"} and exp.line == 2
    assert ls.overlay == {"C": "3"} and ls.argv == ["ckptstore", "ls", "s3://b/r", "-o", "k=v"] and ls.line == 4
    assert py.argv == ["python", "-c", "print('#')"]


def test_a_failing_block_is_named_by_page_and_line(tmp_path):
    page = "docs/p.md"  # a page of this text
    text = "```python\nx = 1\n```\n\n```python\ny = x + 1\nraise KeyError('the doc drifted')\n```\n"
    folder = tmp_path / "page"
    folder.mkdir()
    with PageRun(page, folder, page_env(), text=text) as run:
        with pytest.raises(BlockFailed, match=r"^docs/p\.md:6: python block failed") as ei:
            run.run()
    assert "line 7" in str(ei.value) and "KeyError: 'the doc drifted'" in str(ei.value)


def test_a_rank_that_fails_is_named_with_its_line(tmp_path):
    folder = tmp_path / "page"
    folder.mkdir()
    text = ("<!-- run: session=job ranks=2 -->\n```python\nimport os\n```\n\n"
            "<!-- run: session=job ranks=2 -->\n```python\nrank = int(os.environ['RANK'])\n"
            "if rank == 1:\n    raise ValueError('rank one drifted')\n```\n")
    with PageRun("docs/p.md", folder, page_env(), text=text) as run:
        with pytest.raises(BlockFailed, match=r"^docs/p\.md:8: python block failed on rank 1 of session job") as ei:
            run.run()
    assert "line 10" in str(ei.value) and "ValueError: rank one drifted" in str(ei.value)


def test_a_failing_command_and_a_wrong_synopsis_are_named(tmp_path):
    folder = tmp_path / "page"
    folder.mkdir()
    text = "```sh\nexport X=1\nckptstore ls ./nothing-here\n```\n"
    with PageRun("p.md", folder, page_env(), text=text) as run:
        with pytest.raises(BlockFailed, match=r"p\.md:3: `ckptstore ls ./nothing-here` failed \(exit status 1\)"):
            run.run()
    text = "<!-- run: synopsis -->\n```text\nckptstore ls URL [--jsn]\n```\n"
    with PageRun("p.md", folder, page_env(), text=text) as run:
        with pytest.raises(BlockFailed, match=r"p\.md:3: `ckptstore ls` has no option --jsn"):
            run.run()


def test_recipes_are_found_for_the_tests_that_run_them():
    assert "set_state_dict(new_model" in recipe("docs/dcp.md", "optimizer")
