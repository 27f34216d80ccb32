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
    ["pipeline.fetch", "pipeline.pack_writer", "pipeline.table_reader", "tier.bands"],
    # repo/ (pipeline.staging reads through a Checkpoint's methods)
    ["repo.catalog", "repo.chunks", "pipeline.staging"],
    ["repo.save", "repo.reader", "repo.tile_read", "repo.plain"],
    ["repo.verify", "repo.zero", "repo.writeback", "repo.gc_refs", "repo.async_save"],
    ["repo.gc", "repo.transfer"],
    ["repo.repository"],
    ["loading"],  # below the package, which exports load_module
    [""],  # the package itself: ckptstore/__init__.py
    # torch.distributed: the exchange, the peer replicas over it, dcp/
    ["dcp.exchange"],
    ["dcp.replicas"],
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


def _package(mod: str) -> str:
    """The node a module is in the package graph: its subpackage (``repo.gc`` -> ``repo``).

    A module at the top of ``ckptstore/`` (``errors``, ``loading``, the package's own
    ``__init__``) is a node of its own: the top is the public face and a few shared
    basics, not one package.
    """
    if "." in mod or (mod and (PKG / mod).is_dir()):
        return mod.split(".")[0]
    return mod or "ckptstore"


def _package_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in (graph if graph is not None else _graph()).items():
        a = _package(mod)
        out.setdefault(a, set())
        for d in deps:
            b = _package(d)
            if b != a:
                out[a].add(b)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_packages_import_each_other_without_a_cycle():
    # issue 44 item 5: module by module there may be no cycle while the packages still
    # import each other in a circle (tier -> repo -> pipeline -> tier); that is a cycle too
    graph = _package_graph()
    assert {"pipeline", "tier", "repo", "dcp", "storage", "format"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "the packages of ckptstore/ import each other in a cycle: " + " -> ".join(cycle) + "\n" + \
        "\n".join(f"  ckptstore.{m} imports ckptstore.{d}" for m, ds in sorted(_graph().items()) for d in sorted(ds)
                  if _package(m) != _package(d) and [_package(m), _package(d)] in
                  [cycle[i:i + 2] for i in range(len(cycle) - 1)])


def test_the_package_cycle_check_names_the_cycle():
    # the checker itself, on a made-up graph with the circle the tier used to close
    graph = {"tier.writeback": {"repo.save"}, "repo.save": {"pipeline.fetch"}, "pipeline.fetch": {"tier.cache"},
             "tier.cache": {"errors"}, "errors": set()}
    assert _package_graph(graph)["tier"] == {"repo", "errors"}
    assert _cycle(_package_graph(graph)) == ["pipeline", "tier", "repo", "pipeline"]
    del graph["tier.writeback"]
    assert _cycle(_package_graph(graph)) is None


#: The longest a function in ckptstore/ may be, in lines (def and decorators to its last
#: line, docstring included): docs/architecture.md, "no function over ~100".
MAX_FUNCTION_LINES = 100


def _long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - start + 1
                if n > limit:
                    out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_no_function_is_over_100_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them along their steps):\n" + "\n".join(long)
