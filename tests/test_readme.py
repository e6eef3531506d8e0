"""The README's Python examples run as written (on the CPU here; they pick CUDA when present)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_quick_start_replays_the_trace(capsys):
    quick = next(b for b in BLOCKS if "TraceReplayState" in b)
    exec(compile(quick, "README.md quick start", "exec"), {"__name__": "__readme__"})
    lines = capsys.readouterr().out.splitlines()
    forced = [eval(line.split(" ", 1)[1].split("] ")[0] + "]")[1] for line in lines[:3]]
    assert forced == [11, 12, 13]
