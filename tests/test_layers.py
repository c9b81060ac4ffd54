"""The layering rules of docs/architecture.md, read from the import statements of every module:
lower layers never import upper ones, only the parser imports lark, only the registry reads YAML,
the front end has no torch, the lowering and the reference stay independent, and nothing
imports the package's ``__init__`` from below."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexspec"
# Bottom to top; a module may import its own layer and those below it.
LAYERS = ("errors", "resources", "limits", "workarounds", "ir", "lang", "kernels", "runtime",
          "tools")
RANK = {"errors": 0, "resources": 0, "limits": 0, "workarounds": 0, "ir": 1, "lang": 2,
        "kernels": 2, "runtime": 3, "tools": 4}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts


def _imports(path: Path) -> set[str]:
    """Every module name an import statement of ``path`` names (relative ones resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
                base = ".".join(package + ((base,) if base else ()))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "flexspec" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


@pytest.mark.parametrize("path, parts", list(_modules()), ids=lambda x: "/".join(x)
                         if isinstance(x, tuple) else "")
def test_no_module_imports_a_layer_above_its_own(path, parts):
    layer = parts[0] if parts[0] in RANK else None
    if layer is None:  # the package __init__, __main__, testing: the top, may import anything
        return
    above = sorted(name for name in _imports(path)
                   if _layer(name) is not None and RANK[_layer(name)] > RANK[layer])
    assert above == [], f"{path.relative_to(ROOT)} imports upwards"
    # the package's public API (flexspec.parse, flexspec.compile...) sits above every layer
    modules = {p.stem for p in PACKAGE.iterdir()} | {"ir", "lang", "kernels", "runtime"}
    public = sorted(name for name in _imports(path) if name.count(".") == 1
                    and name.startswith("flexspec.") and name.split(".")[1] not in modules)
    assert public == [] or layer == "tools", f"{path.relative_to(ROOT)} imports {public}"


@pytest.mark.parametrize("path, parts", list(_modules()), ids=lambda x: "/".join(x)
                         if isinstance(x, tuple) else "")
def test_third_party_imports_stay_in_their_rooms(path, parts):
    roots = {name.split(".")[0] for name in _imports(path)}
    where = "/".join(parts)
    if "lark" in roots:
        assert where == "lang/parser", f"only the parser imports lark, not {where}"
    if "yaml" in roots:
        assert where == "lang/registry", f"only the registry reads YAML, not {where}"
    if parts[0] in ("ir", "lang", "errors", "resources", "limits", "workarounds"):
        assert "torch" not in roots, f"{where} is front end and must not import torch"


def test_lowering_and_reference_never_import_each_other():
    lower = _imports(PACKAGE / "kernels" / "lower.py")
    reference = _imports(PACKAGE / "kernels" / "reference.py")
    assert not any(name.startswith("flexspec.kernels.reference") for name in lower)
    assert not any(name.startswith("flexspec.kernels.lower") for name in reference)


def test_no_module_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for path, _ in _modules() if len(path.read_text().splitlines()) > 500}
    assert long == {}


def test_parsing_and_loading_import_no_torch():
    code = ("import sys, flexspec\n"
            "flexspec.parse('causal & window(128) + alibi')\n"
            "flexspec.load(sys.argv[1])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "model.attn")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict:
    """Module -> the flexspec modules it imports (``from a import b`` counts ``a.b`` where that is
    a module, else ``a``)."""
    modules = {_module_name(path): path for path, _ in _modules()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            if imported in modules:
                targets.add(imported)
            elif imported.rsplit(".", 1)[0] in modules:
                targets.add(imported.rsplit(".", 1)[0])
        graph[name] = targets - {name}
    return graph


def test_the_import_graph_has_no_circle():
    graph = _graph()
    # a package's __init__ that re-exports its modules is not a circle with them
    graph = {name: {t for t in targets if not name.startswith(t + ".")}
             for name, targets in graph.items()}
    state: dict = {}
    circle: list = []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                circle.extend(path[path.index(target):] + [target] if target in path else
                              [node, target])
                return True
            if target not in state and visit(target, path + [target]):
                return True
        state[node] = "done"
        return False

    for node in sorted(graph):
        if node not in state and visit(node, [node]):
            break
    assert circle == []


BACKENDS = PACKAGE / "runtime" / "backends"
# What a backend may not import: another backend, and the runtime above the contract
ABOVE_BACKENDS = ("flexspec.runtime.plan", "flexspec.runtime.masks", "flexspec.runtime.attention",
                  "flexspec.runtime.calls", "flexspec.runtime.positions",
                  "flexspec.runtime.module", "flexspec.runtime.multihead",
                  "flexspec.runtime.explanation", "flexspec.runtime.serving")


@pytest.mark.parametrize("path", sorted(p for p in BACKENDS.glob("*.py")
                                        if p.name != "__init__.py"), ids=lambda p: p.stem)
def test_a_backend_imports_no_other_backend_and_nothing_above_the_contract(path):
    imported = _imports(path)
    siblings = sorted(name for name in imported
                      if name.startswith("flexspec.runtime.backends")
                      and name != "flexspec.runtime.backends")
    assert siblings == []
    assert sorted(name for name in imported if name.startswith(ABOVE_BACKENDS)) == []


# The facade: the objects users hold. The serving room lies below it, the engine below both.
FACADE = ("flexspec.runtime.attention", "flexspec.runtime.module", "flexspec.runtime.multihead")
SERVING = PACKAGE / "runtime" / "serving"


@pytest.mark.parametrize("path", sorted(SERVING.glob("*.py")), ids=lambda p: p.stem)
def test_serving_never_imports_the_facade(path):
    """The serving room (paged caches, their reads, mixed and jagged batches) calls the engine
    and is called by the facade: it never imports the facade's modules."""
    assert sorted(name for name in _imports(path) if name.startswith(FACADE)) == []


@pytest.mark.parametrize("path", sorted(p for p in (PACKAGE / "runtime").rglob("*.py")
                                        if SERVING not in p.parents and p.parent.name != "serving"
                                        and _module_name(p) not in FACADE
                                        and p.name != "__init__.py"),
                         ids=lambda p: str(p.relative_to(PACKAGE / "runtime")))
def test_the_engine_never_imports_serving_or_the_facade(path):
    """Below the serving room, the engine (the call path, plans, backends, block masks) never
    imports it nor the facade, so neither can be called through it."""
    imported = _imports(path)
    assert sorted(name for name in imported
                  if name.startswith(("flexspec.runtime.serving", *FACADE))) == []


def test_serving_functions_take_the_engine_not_the_facade():
    """The serving room's entry points are handed the engine's ``Calls``: a paged call, a read
    and a jagged call reach it without touching the ``Attention`` object (its methods are
    replaced by ones that fail, after the call has begun)."""
    import torch

    import flexspec
    from flexspec.runtime.attention import Attention
    attn = flexspec.compile("causal")
    cache = flexspec.PagedKVCache(pages=4, page_size=16, kv_heads=1, head_dim=16, slots=2,
                                  max_pages=2)
    slots = torch.tensor([0, 1])
    cache.append(slots, torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16))
    q = torch.randn(2, 2, 1, 16)
    calls = attn._calls
    names = [name for name in vars(Attention) if callable(getattr(Attention, name))
             and not name.startswith("__")]
    for name in names:
        setattr(attn, name, lambda *a, name=name, **k: pytest.fail(f"serving called {name}"))
    from flexspec.runtime.serving import reads
    with torch.no_grad():
        out = reads.paged(calls, q, cache, slots, bindings={})
        read = reads.paged_read(calls, q, cache, slots, read="auto", bindings={})
    torch.testing.assert_close(read(q), out)
