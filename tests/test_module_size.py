"""No module of the core, the adapters, the application or ``bench/`` is over 400 lines (a module
is something a reader takes in whole), and ``bench/README.md`` is at most 200 (the limits the
project keeps, read from the tree)."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 400
FOLDERS = ("trace_replay_core", "adapters", "trace_replay_app", "bench")


def _sizes():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            with open(path, encoding="utf-8") as f:
                yield str(path.relative_to(ROOT)), sum(1 for _ in f)


SIZES = dict(_sizes())


def test_the_folders_hold_modules():
    assert all(any(name.startswith(folder + "/") for name in SIZES) for folder in FOLDERS), sorted(SIZES)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_over_the_limit(folder):
    over = {name: n for name, n in SIZES.items() if name.startswith(folder + "/") and n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"


def test_the_bench_readme_stays_short():
    """``bench/README.md``: what each bench answers, how to run it and today's figures, at most
    200 lines (the history lives in git)."""
    with open(ROOT / "bench" / "README.md", encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= 200, f"bench/README.md has {n} lines"
