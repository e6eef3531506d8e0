"""The layers: the core is framework-neutral and never reaches up; nothing imports the application."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN_IN_CORE = ("torch", "jax", "jaxlib", "trace_replay_torch", "trace_replay_jax", "trace_replay_app")

CHECK = (
    "import sys, trace_replay_core, trace_replay_core.kernels.replay, trace_replay_core.kernels.scatter, "
    "trace_replay_core.kernels.logprob_rank, trace_replay_core.reference; "
    "import numpy as np; t = trace_replay_core.TraceTable(2, 2, device='cpu'); t.stage(0, [1]); "
    "t.commit(stream=0); t.close(); "
    "bad = [m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules]; "
    "print('loaded:', bad); sys.exit(1 if bad else 0)"
)


def test_core_imports_neither_torch_nor_jax():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout


def _imported_names(tree: ast.AST):
    """Every module name a source file imports: import/from statements, and calls of
    ``importlib.import_module(...)`` / ``__import__(...)`` with a literal first argument (a
    non-literal one is reported as ``<dynamic>``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.module, node.lineno
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if name in ("import_module", "__import__"):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield arg.value, node.lineno
                else:
                    yield "<dynamic>", node.lineno


def _offenders(package: str, forbidden):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in _imported_names(ast.parse(path.read_text(), str(path))):
            top = name.split(".")[0]
            if top in forbidden or name == "<dynamic>":
                found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return found


def test_core_source_imports_no_framework_adapter_or_application():
    assert _offenders("trace_replay_core", FORBIDDEN_IN_CORE) == []


def test_the_walk_sees_every_kind_of_import(tmp_path):
    src = (
        "import torch\nfrom jax import numpy\nimport importlib\nimportlib.import_module('jaxlib')\n"
        "__import__('trace_replay_app')\nimportlib.import_module(name)\n"
    )
    names = [n for n, _ in _imported_names(ast.parse(src))]
    assert names == ["torch", "jax", "importlib", "jaxlib", "trace_replay_app", "<dynamic>"]


def test_adapters_never_import_the_application():
    for package in ("adapters/trace_replay_torch", "adapters/trace_replay_jax"):
        assert _offenders(package, ("trace_replay_app",)) == []


def test_adapters_use_only_the_core_public_names():
    """An adapter that needs a private module of the core is a sign the core lacks a public name:
    no ``trace_replay_core.<module>`` import, and every name taken ``from trace_replay_core`` is
    in its ``__all__`` (so ``from trace_replay_core import _numpy_backend`` fails too)."""
    import trace_replay_core

    found = []
    for package in ("adapters/trace_replay_torch", "adapters/trace_replay_jax"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for name, line in _imported_names(tree):
                if name.startswith("trace_replay_core."):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "trace_replay_core":
                    found += [
                        f"{path.relative_to(ROOT)}:{node.lineno}: trace_replay_core.{a.name}"
                        for a in node.names
                        if a.name not in trace_replay_core.__all__
                    ]
    assert found == []
