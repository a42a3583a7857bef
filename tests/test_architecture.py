"""The joints of the project, checked from the source (``ast``) and in fresh interpreters.

* no import circle among the modules of ``span_workflows`` and ``span_vllm`` (every import
  counted, also those inside functions);
* the library's modules stand in the layers ARCHITECTURE.md draws (its folders), and each
  imports only from its own layer or the layers below;
* the plugin depends on vLLM alone (and torch, Triton, which vLLM brings) and never on the core;
  the core reaches the plugin only through its public face (``span_vllm`` and
  ``span_vllm.contract``);
* the library never imports its applications (``span_workflows.apps``), nor do the
  integrations;
* importing either package stays light: ``span_vllm`` imports no ``span_workflows`` module,
  ``span_workflows`` no plotting, vector search, embedding or terminal-table library.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"span_workflows": ROOT, "span_vllm": ROOT / "server"}
INTEGRATIONS = ROOT / "integrations"
#: vLLM (torch and Triton come with it) and the span store's checksums
PLUGIN_THIRD_PARTY = {"vllm", "torch", "triton", "xxhash"}
PLUGIN_FACE = {"span_vllm", "span_vllm.contract"}
#: The library's layers, top to bottom (ARCHITECTURE.md): each is a folder of ``span_workflows``
#: (``scaleout`` and ``tune`` share one), but the two the package root holds: its public face
#: and its ground. A module imports from its own layer (without circles) or from a lower one;
#: ``span_workflows.apps`` stands above them all.
LAYERS: dict[str, tuple[str, ...]] = {
    "public face": ("span_workflows", "frameworks"),
    "scale-out and tuning": ("scaleout", "tune"),
    "serving": ("serving",),
    "runtime": ("runtime",),
    "compiler": ("compiler",),
    "commutativity": ("commutativity",),
    "query": ("query",),
    "ground": ("errors", "build_info", "logprobs"),
}
#: the root's modules (files, not folders): the public face and the ground
ROOT_MODULES = {"span_workflows", "frameworks", "errors", "build_info", "logprobs"}


def _modules() -> dict[str, Path]:
    """Every module of the two packages: dotted name -> file."""
    found = {}
    for package, base in PACKAGES.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(path: Path, name: str) -> Iterator[str]:
    """The modules ``path`` (module ``name``) imports, anywhere in its code: for ``from p import
    x``, ``p.x`` when that is a module of ours, else ``p``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    return {name: {m for m in _imported(path, name) if m in MODULES and m != name}
            for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_module_graph_is_read() -> None:
    graph = _graph()
    assert {"span_workflows.runtime.engine", "span_workflows.serving.app",
            "span_vllm.patches"} <= set(graph)
    assert "span_vllm.contract" in graph["span_workflows.compiler.compile"]
    assert "span_workflows.query.ir" in graph["span_workflows.compiler.optimize"]


def test_there_is_no_import_circle() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_a_circle_would_be_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _layer(name: str) -> int:
    """The depth of ``name``'s layer (0 the top): its folder's, or its own for a root module."""
    short = name.removeprefix("span_workflows.") if name != "span_workflows" else name
    room = short if short in ROOT_MODULES else short.split(".")[0]
    for depth, members in enumerate(LAYERS.values()):
        if room in members:
            return depth
    raise AssertionError(f"{name} stands in no layer: place it in LAYERS and ARCHITECTURE.md")


def test_the_layers_are_the_folders() -> None:
    """Every folder of the package is a layer (or the apps, or the adapters' data), every
    layer but the root's two is a folder, and the root holds nothing else."""
    package = ROOT / "span_workflows"
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    folder_layers = {room for members in LAYERS.values() for room in members} - ROOT_MODULES
    assert folders - {"apps"} == folder_layers
    root = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert root == ROOT_MODULES - {"span_workflows"}
    architecture = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for folder in folder_layers:
        assert f"`{folder}/`" in architecture, f"ARCHITECTURE.md does not name {folder}/"


def test_the_library_imports_only_downward() -> None:
    graph = _graph()
    for name in graph:
        if not name.startswith("span_workflows") or name.startswith("span_workflows.apps"):
            continue
        _layer(name)  # every module stands in a layer
        for imported in graph[name]:
            if imported.startswith("span_workflows"):
                assert _layer(imported) >= _layer(name), (
                    f"{name} ({list(LAYERS)[_layer(name)]}) imports {imported} "
                    f"({list(LAYERS)[_layer(imported)]})")


def test_the_plugin_depends_on_vllm_alone() -> None:
    for name, path in MODULES.items():
        if not name.startswith("span_vllm"):
            continue
        for imported in _imported(path, name):
            top = imported.split(".")[0]
            assert top != "span_workflows", f"{name} imports {imported}"
            assert top == "span_vllm" or top in PLUGIN_THIRD_PARTY or top in (
                sys.stdlib_module_names), f"{name} imports {imported}"


def test_the_core_uses_only_the_plugins_public_face() -> None:
    for name, path in MODULES.items():
        if name.startswith("span_workflows"):
            inner = {m for m in _imported(path, name) if m.startswith("span_vllm")}
            assert inner <= PLUGIN_FACE, f"{name} imports {sorted(inner - PLUGIN_FACE)}"


def test_the_library_and_integrations_never_import_the_apps() -> None:
    sources = {name: path for name, path in MODULES.items()
               if name.startswith("span_workflows") and not name.startswith("span_workflows.apps")}
    sources.update({str(p.relative_to(ROOT)): p for p in INTEGRATIONS.rglob("*.py")})
    for name, path in sources.items():
        apps = [m for m in _imported(path, name) if m.startswith("span_workflows.apps")]
        assert not apps, f"{name} imports {apps}"


#: The applications' rooms, lowest first: the demo (and its corpus) serves the benchmarks,
#: and the command line drives both; no room imports one above it.
APP_ROOMS = ("demo", "bench", "cli")


def _room(name: str) -> int:
    parts = name.split(".")
    assert len(parts) > 3 and parts[2] in APP_ROOMS, f"{name} stands in no room of apps/"
    return APP_ROOMS.index(parts[2])


def test_the_apps_rooms_import_only_downward() -> None:
    for name, path in MODULES.items():
        if not name.startswith("span_workflows.apps.") or name.count(".") < 3:
            continue
        for imported in _imported(path, name):
            if imported.startswith("span_workflows.apps.") and imported.count(".") >= 3:
                assert _room(imported) <= _room(name), f"{name} imports {imported}"


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return set(done.stdout.split())


def test_importing_the_plugin_imports_no_core_module() -> None:
    loaded = _loaded_after("import span_vllm, span_vllm.contract")
    assert "span_vllm.contract" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("span_workflows", "vllm", "torch")}


@pytest.fixture(scope="module")
def library_imports() -> set[str]:
    return _loaded_after("import span_workflows")


@pytest.mark.parametrize("heavy", ["matplotlib", "faiss", "sentence_transformers", "vllm",
                                   "rich"])
def test_importing_the_library_imports_no_app_dependency(library_imports, heavy: str) -> None:
    assert "span_workflows.query.ir" in library_imports
    assert not {m for m in library_imports if m.split(".")[0] == heavy}


def test_the_plugins_public_names_are_what_they_say() -> None:
    """Also once every submodule is loaded (a submodule would shadow a name it shares)."""
    import importlib

    import span_vllm

    for module in ("patches", "stats", "rotation", "hashing", "positions"):
        importlib.import_module(f"span_vllm.{module}")
    for name in span_vllm.__all__:
        value = getattr(span_vllm, name)
        assert (name == "contract") == isinstance(value, types.ModuleType), name
    assert set(span_vllm.span_stats()) == set(span_vllm.contract.STAT_HELP)
    assert callable(span_vllm.span_probe) and span_vllm.RopeRotator.__name__ == "RopeRotator"
