"""The import order of docs/architecture.md holds: no cycles, no upward imports.

Every ``import`` inside ``ckptstore/`` is read from the source (module level
and inside functions alike: a lazy import hides a cycle, it does not remove
it), resolved to a ckptstore module, and checked against :data:`LAYERS`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ckptstore"

#: Lowest first. A module may import modules of its own layer or of lower
#: ones; keep in step with the table in docs/architecture.md.
LAYERS: list[list[str]] = [
    # the shared basics, and the packages' own __init__ (docstrings, no imports)
    ["errors", "units", "clock", "progress", "pipeline", "tier", "repo"],
    # storage/: the ObjectStore interface, its helpers, the backends, open_store
    ["storage.base"],
    ["storage._classify", "storage._blocking", "storage.upload", "storage.wrappers", "storage._azure_client",
     "storage.throttle", "storage._credentials"],
    ["storage.memory", "storage.local", "storage.retry", "storage.faults", "storage.s3", "storage.gcs", "storage.azure"],
    ["storage"],
    # format/ (pure) and the pure parts of pipeline/
    ["format.codec", "format.tree", "format.unpickle", "format.tiles", "pipeline.planner", "pipeline.tensors",
     "pipeline.snapshot", "pipeline.tp_plan"],
    ["format.pack", "format.model", "format.strict_json", "format.manifest_v1", "format.manifest_v2", "format.refs",
     "format.manifest", "format.safetensors"],
    ["format.layout", "format.chunk_table", "format"],
    # pipeline/ with the tier's files under it
    ["pipeline.options"],
    ["pipeline.runtime"],
    ["pipeline.relocations", "tier.cache", "tier.admin"],
    ["pipeline.fetch", "pipeline.pack_writer", "pipeline.table_reader"],
    # repo/ (pipeline.staging reads through a Checkpoint's methods)
    ["repo.catalog", "pipeline.staging"],
    ["repo.save", "repo.reader", "repo.tile_read", "repo.plain"],
    ["repo.verify", "repo.zero", "tier.writeback", "repo.gc_refs", "repo.async_save"],
    ["repo.gc", "repo.transfer"],
    ["repo.repository"],
    ["loading"],  # below the package, which exports load_module
    [""],  # the package itself: ckptstore/__init__.py
    # torch.distributed: the exchange, the tier's replicas, dcp/
    ["dcp.exchange"],
    ["tier.replicas"],
    ["dcp.ids", "dcp.metadata", "dcp.exchanged", "dcp.shared"],
    ["dcp.writer", "dcp.reader"],
    ["dcp"],
    ["integrations"],
    ["testing"],
    ["cli"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _layer(mod: str) -> int:
    """The layer of a module: its own entry, else its package's (``cli.main`` -> ``cli``)."""
    probe = mod
    while True:
        for i, names in enumerate(LAYERS):
            if probe in names:
                return i
        if not probe:
            raise AssertionError(f"ckptstore.{mod} is in no layer of tests/test_layers.py")
        probe = probe.rpartition(".")[0]


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    here = mod.split(".") if mod else []
    pkg = here if is_pkg else here[:-1]
    found = set()

    def resolve(name: str) -> str | None:
        # the longest known module prefix of a dotted name under ckptstore
        while name not in known:
            if "." not in name:
                return None if name not in known else name
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "ckptstore" or a.name.startswith("ckptstore."):
                    r = resolve(a.name.removeprefix("ckptstore").lstrip("."))
                    if r is not None:
                        found.add(r)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                prefix = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "ckptstore" or node.module.startswith("ckptstore.")):
                prefix = node.module.removeprefix("ckptstore").lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{prefix}.{a.name}" if prefix else a.name
                r = sub if sub in known else resolve(prefix) if prefix else ("" if "" in known else None)
                if r is not None:
                    found.add(r)
    found.discard(mod)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_every_module_has_a_layer():
    for mod in _modules():
        _layer(mod)


def test_no_module_imports_a_higher_layer():
    bad = []
    for mod, deps in sorted(_graph().items()):
        for d in sorted(deps):
            # a package's own submodules are part of it (cli.main imports cli.commands)
            if d.startswith(mod + ".") if mod else False:
                continue
            if _layer(d) > _layer(mod):
                bad.append(f"ckptstore.{mod} (layer {_layer(mod)}) imports ckptstore.{d} (layer {_layer(d)})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    # the checker itself: a lazy relative import inside a function is an edge
    mods = _modules()
    known = set(mods)
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from .repository import Repository\n    from ..format import manifest as m\n")
    assert _imports("repo.gc", src, known) == {"repo.repository", "format.manifest"}
    up = tmp_path / "y.py"
    up.write_text("from .. import open as open_repo\nimport ckptstore.storage.s3\n")
    assert _imports("cli.commands", up, known) == {"", "storage.s3"}
