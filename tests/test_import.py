"""The core is framework-neutral: importing it loads neither torch nor jax."""

import subprocess
import sys

CHECK = (
    "import sys, trace_replay_core, trace_replay_core.table, trace_replay_core.dlpack, "
    "trace_replay_core.cpu_backend, trace_replay_core.reference; "
    "import numpy as np; t = trace_replay_core.TraceTable(2, 2, device='cpu'); t.stage(0, [1]); "
    "t.commit(stream=0); t.close(); "
    "bad = [m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules]; "
    "print('loaded:', bad); sys.exit(1 if bad else 0)"
)


def test_core_imports_neither_torch_nor_jax():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout


def test_core_source_never_mentions_framework_imports():
    import pathlib
    import re

    import trace_replay_core
    root = pathlib.Path(trace_replay_core.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+(torch|jax|jaxlib)\b", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
