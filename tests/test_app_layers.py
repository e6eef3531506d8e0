"""The application's layering, read from its source with ``ast``: frameworks are imported only by
the framework-specific driver and family modules, the library and the adapters only through their
public top-level names, no module imports another's private name, no ``importlib``/``__import__``,
and no import circle among its modules."""

import ast
import pathlib

import trace_replay_app

ROOT = pathlib.Path(trace_replay_app.__file__).parent
LIBRARIES = ("trace_replay_core", "trace_replay_torch", "trace_replay_jax")
# framework -> the modules that may import it: its drivers (decode, its steps and its
# tensor-parallel option, and score) and each family's math for it
FRAMEWORK_MODULES = {
    "torch": (
        "torch_loop",
        "torch_layers",
        "torch_driver",
        "torch_steps",
        "torch_score",
        "torch_parallel",
        "torch_attention",
    ),
    "jax": ("jax_loop", "jax_driver", "jax_steps", "jax_score", "jax_placement", "jax_attention"),
    "jaxlib": ("jax_loop", "jax_driver", "jax_steps", "jax_score", "jax_placement", "jax_attention"),
}
TORCH_ONLY = tuple("." + m for m in FRAMEWORK_MODULES["torch"])
JAX_ONLY = tuple("." + m for m in FRAMEWORK_MODULES["jax"])


def _modules():
    """``{dotted name: (path, is_package)}`` of every module of the app."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = _modules()


def _imports(name):
    """``[(imported module, line)]`` of module ``name`` (relative imports resolved; ``from X
    import y`` counts ``X.y`` when that is a module of the app, else ``X``)."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                found.append(("<dynamic import>", node.lineno))
    return found


def test_frameworks_only_in_their_loop_modules():
    bad = []
    for name in MODULES:
        for module, line in _imports(name):
            top = module.split(".")[0]
            if top in FRAMEWORK_MODULES and not name.endswith(tuple("." + m for m in FRAMEWORK_MODULES[top])):
                bad.append(f"{name}:{line} imports {module}")
            if module == "<dynamic import>":
                bad.append(f"{name}:{line} imports dynamically")
            if top == "torch" and name.endswith(JAX_ONLY) or top in ("jax", "jaxlib") and name.endswith(TORCH_ONLY):
                bad.append(f"{name}:{line} imports {module}")
    assert bad == []


def test_no_module_imports_another_modules_private_name():
    bad = []
    for name in MODULES:
        path, is_package = MODULES[name]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                bad += [
                    f"{name}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.endswith("__")
                ]
    assert bad == []


def test_library_and_adapters_through_their_public_names_only():
    bad = [
        f"{name}:{line} imports {module}"
        for name in MODULES
        for module, line in _imports(name)
        if module.split(".")[0] in LIBRARIES and module not in LIBRARIES
    ]
    assert bad == []
    for lib in LIBRARIES:
        package = __import__(lib)
        for name in MODULES:
            path, _ = MODULES[name]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == lib:
                    for alias in node.names:
                        assert alias.name in package.__all__, f"{name} uses {lib}.{alias.name}, not in __all__"


def test_no_import_circles():
    graph = {name: {m for m, _ in _imports(name) if m in MODULES and m != name} for name in MODULES}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert graph["trace_replay_app.cli"] >= {"trace_replay_app.demo", "trace_replay_app.runner"}
    assert "trace_replay_app.cli" not in graph["trace_replay_app.demo"]


def test_nothing_below_imports_the_application():
    """The library and the adapters never name the application."""
    for lib in LIBRARIES:
        folder = pathlib.Path(__import__(lib).__file__).parent
        for path in folder.rglob("*.py"):
            assert "trace_replay_app" not in path.read_text(), f"{path} names the application"
