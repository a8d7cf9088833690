"""The layer rules of docs/architecture.md, checked on the import graph of inferd/ (every import, also
those inside functions)."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "inferd"

# folder -> the folders it may import besides itself; the command line (inferd/cli.py) may import any
ALLOWED = {
    "protocol": set(),
    "models": {"kernels"},
    "kernels": set(),  # the C++ kernels, their builds, which one runs, and their Python face
    "router": set(),
    "telemetry": set(),
    "engine": {"models", "kernels"},
    "gateway": {"protocol", "router", "telemetry"},
    "replica": {"protocol", "engine", "models", "telemetry"},
    "embeddings": {"protocol", "replica", "models", "kernels", "telemetry"},  # the replica of the embedding kind
    "classical": {"protocol", "replica", "models", "telemetry"},  # the replica of the classical (tabular) kind
    "policy": {"protocol", "replica", "models", "telemetry"},  # the robot-policy kind: model, simulator, replica
    "console": {"protocol", "gateway", "telemetry"},  # the operator console: pages over the gateway's state
    "control": {"protocol", "console", "gateway", "replica", "embeddings", "classical", "policy", "router", "models",
                "kernels", "engine", "telemetry", "eval"},
    "bench": {"models", "eval"},  # prompts of a given length in the model's tokens; the quality set's items
    "eval": set(),  # the quality set and its scoring: it calls the service over HTTP like a user
    "settings": set(),
}
EVERYONE = ("settings",)  # inferd/settings.py: config fields to flags; it imports nothing of inferd
DATA_PATH = ("gateway", "router", "protocol")  # what a request passes through before a replica
NEVER_FROM_DATA_PATH = ("control", "engine", "models", "kernels", "replica", "embeddings", "classical", "policy", "cli")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _folder(module: str) -> str:
    parts = module.split(".")
    return "cli" if parts[1] in ("cli", "__main__") else parts[1]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts or path.parent == ROOT and path.name == "__init__.py":
            continue
        module = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[module] |= {n for n in names if n.startswith("inferd.") and _exists(n)}
        graph[module].discard(module)
    return graph


def _exists(module: str) -> bool:
    path = ROOT.parent / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_import_keeps_to_its_layer():
    bad = [f"{m} imports {t}" for m, targets in import_graph().items() for t in targets if _folder(m) != "cli"
           and _folder(t) not in (_folder(m), *EVERYONE) and _folder(t) not in ALLOWED[_folder(m)]]
    assert not bad, "imports across layers that the rules forbid:\n" + "\n".join(sorted(bad))


def test_the_data_path_never_reaches_the_engine_or_the_control_plane():
    graph = import_graph()
    for start in (m for m in graph if _folder(m) in DATA_PATH):
        seen, todo = set(), [start]
        while todo:
            for t in graph.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reached = sorted(t for t in seen if _folder(t) in NEVER_FROM_DATA_PATH)
        assert not reached, f"{start} reaches {reached}"


def first_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A path of imports that comes back to where it started, or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    return next((c for node in sorted(edges) if node not in state and (c := visit(node, []))), None)


def test_no_cycles_between_folders():
    edges = defaultdict(set)
    for m, targets in import_graph().items():
        edges[_folder(m)] |= {_folder(t) for t in targets} - {_folder(m)}
    cycle = first_cycle(edges)
    assert cycle is None, f"import cycle between folders: {' -> '.join(cycle)}"


def test_no_asyncio_wait_for():
    """docs/architecture.md: asyncio.wait_for of Python 3.11 may drop a cancel; asyncio.timeout does not."""
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for path in ROOT.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "wait_for"
             and isinstance(node.value, ast.Name) and node.value.id == "asyncio"]
    assert not found, f"asyncio.wait_for at {found}"


def test_no_cpp_inside_a_python_string():
    """docs/architecture.md: C++ lives in inferd/kernels/csrc's files, where a compiler, an editor and a linter read
    it, not in Python strings."""
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for path in ROOT.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and any(marker in node.value for marker in ("#include <", "torch::Tensor", "PYBIND11_MODULE"))]
    assert not found, f"C++ in a Python string at {found}"


def test_only_the_kernels_variants_read_the_cpus_flags():
    """docs/kernels.md: inferd/kernels/variants.py reads what the CPU reports; everything else asks
    inferd.kernels.select (which kernel runs), so that one cap (INFERD_KERNEL_ISA) holds for every rule."""
    owner = ROOT / "kernels" / "variants.py"
    readers = [f"{path.relative_to(ROOT.parent)}" for path in ROOT.rglob("*.py") if path != owner
               and any(marker in path.read_text() for marker in ("/proc/cpuinfo", "get_cpu_capability", "cpuid"))]
    assert not readers, f"CPU flags read outside inferd/kernels/variants.py: {readers}"
    askers = [f"{path.relative_to(ROOT.parent)}" for path in ROOT.rglob("*.py") if path.parent.name != "kernels"
              and any(name in path.read_text() for name in ("cpu_flags", "host_flags"))]
    assert not askers, f"the CPU's flags asked outside inferd/kernels/ (ask inferd.kernels.select): {askers}"


def test_no_cycles_between_modules():
    """docs/architecture.md: no module imports one that imports it back, at any distance (imports inside functions
    and under TYPE_CHECKING count: they are the same knot, only deferred)."""
    cycle = first_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
