"""The house's import rules, read from the source (every import statement, also those inside functions):
no import cycles between our modules, no module importing a private name from another module, and the
dependency direction of docs/architecture.md (kernels know neither the model nor the mesh; sharding knows the
mesh, not the model; checkpoints map names and shapes; glm_dsa composes them), and inside glm_dsa the model apart
from serving: glm_dsa.model imports nothing of glm_dsa.serving, glm_dsa.debug or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glm_dsa", "kernels", "sharding", "checkpoints", "benchmarks")

#: package -> the packages of ours it may import
ALLOWED = {
    "kernels": set(),
    "sharding": {"kernels"},
    "checkpoints": {"kernels"},  # kernels' array codecs only (CODEC_MODULES)
    "glm_dsa": {"kernels", "sharding", "checkpoints"},
    "benchmarks": {"glm_dsa", "kernels", "sharding", "checkpoints"},
}
#: the kernels modules checkpoints may import: the FP8 block codec (one codec for checkpoints and kernels)
CODEC_MODULES = {"kernels.common.fp8_formats"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: Path):
    """(target module, imported names, line) for every import in the file that targets one of our modules."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] not in PACKAGES:
                continue
            names = [a.name for a in node.names]
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
            if subs:  # `from pkg import submodule`
                for s in subs:
                    yield s, [], node.lineno
                rest = [n for n in names if f"{mod}.{n}" not in MODULES]
                if rest:
                    yield mod, rest, node.lineno
            else:
                yield mod, names, node.lineno


def _graph() -> dict[str, set[str]]:
    g = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for target, _, _ in _imports(m, path):
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != m:
                g[m].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert MODULES, "no modules found"
    assert _cycles(_graph()) == []


def test_no_private_names_from_other_modules():
    bad = []
    for m, path in MODULES.items():
        for target, names, line in _imports(m, path):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != m:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {n} from {target}")
    assert bad == []


def test_checkpoints_take_only_the_kernels_codec():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}" for m, path in MODULES.items()
           if m.split(".")[0] == "checkpoints" for target, _, line in _imports(m, path)
           if target.split(".")[0] == "kernels" and target not in CODEC_MODULES]
    assert bad == []
    assert any(target in CODEC_MODULES for m, path in MODULES.items() if m.startswith("checkpoints")
               for target, _, _ in _imports(m, path))


def test_packages_import_only_downwards():
    bad = []
    for m, path in MODULES.items():
        pkg = m.split(".")[0]
        for target, _, line in _imports(m, path):
            other = target.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({pkg}) imports {target}")
    assert bad == []


#: glm_dsa subpackage -> the glm_dsa modules (and the packages under them) it must not import. `glm_dsa` itself (its
#: __init__ imports the engine) is out of bounds for all three.
FORBIDDEN_INSIDE = {
    "glm_dsa.model": ("glm_dsa.serving", "glm_dsa.debug", "glm_dsa.cli"),
    "glm_dsa.debug": ("glm_dsa.serving", "glm_dsa.cli"),
    "glm_dsa.serving": ("glm_dsa.cli",),
}


def test_the_model_imports_nothing_of_serving():
    assert {m.rpartition(".")[0] for m in MODULES if m.startswith("glm_dsa.")} >= set(FORBIDDEN_INSIDE)
    bad = []
    for m, path in MODULES.items():
        sub = next((s for s in FORBIDDEN_INSIDE if m == s or m.startswith(s + ".")), None)
        if sub is None:
            continue
        for target, _, line in _imports(m, path):
            if target == "glm_dsa" or any(target == f or target.startswith(f + ".") for f in FORBIDDEN_INSIDE[sub]):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({sub}) imports {target}")
    assert bad == []
