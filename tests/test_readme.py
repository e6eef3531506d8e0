"""The README's Python examples run as written (on the CPU here; they pick CUDA when present)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
QUICK = next(i for i, b in enumerate(BLOCKS) if "TraceReplayState" in b)  # run and checked below


@pytest.mark.parametrize("index", [i for i in range(len(BLOCKS)) if i != QUICK])
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_quick_start_replays_the_trace(capsys):
    exec(compile(BLOCKS[QUICK], "README.md quick start", "exec"), {"__name__": "__readme__"})
    lines = capsys.readouterr().out.splitlines()
    forced = [eval(line.split(" ", 1)[1].split("] ")[0] + "]")[1] for line in lines[:3]]
    assert forced == [11, 12, 13]


def test_gpu_section_names_the_extra_and_the_set_up_that_installs_it():
    """The section "On a GPU machine": the same two commands; the gpu extra brings JAX's CUDA 13 build,
    and scripts/setup.sh picks it from `nvidia-smi -L` (TRACE_REPLAY_GPU overrides) and also
    installs the lint extra the tests' lint step needs."""
    import tomllib

    root = README.parent
    text = README.read_text()
    section = text.split("\n## On a GPU machine\n", 1)[1].split("\n## ", 1)[0]
    assert "bash scripts/demo.sh --device cuda" in section and "bash scripts/test.sh" in section
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.replace(" ", "").startswith("jax[cuda13]") for r in extras["gpu"]) and "jax[cuda13]" in section
    assert {"ruff", "mypy", "pre-commit"} <= {re.split(r"[=<>!~\[ ]", r)[0] for r in extras["lint"]}
    setup = (root / "scripts" / "setup.sh").read_text()
    picks = re.findall(r'^\s*(\d)\) extras="([^"]+)"', setup, re.M)
    assert dict(picks) == {"1": "torch,jax,gpu,test,bench,lint", "0": "torch,jax,test,bench,lint"}, picks
    assert "nvidia-smi -L" in setup and "TRACE_REPLAY_GPU" in setup and "TRACE_REPLAY_GPU" in section
