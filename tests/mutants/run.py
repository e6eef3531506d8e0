"""Fault planting: every fault in ``faults.py`` must make a test fail.

Run from the repository root (a few minutes on two CPU cores; no GPU needed)::

    python tests/mutants/run.py            # every fault
    python tests/mutants/run.py --list     # the faults, numbered
    python tests/mutants/run.py -k grid    # the faults whose name contains "grid"

It copies the tracked and untracked (not ignored) files of the repository to a temporary
folder, checks once that the named tests pass there unchanged, then plants one fault at a time
(a textual patch: each ``old`` must occur exactly once), runs that fault's tests with
``pytest -x`` and restores the file. It prints one row per fault: ``caught`` with the failing
test, ``caught (by another test)`` when a test other than the expected one failed first, or
``SURVIVED``. The exit status is 1 when a fault survived or a patch no longer applies, else 0.
Set ``TRACE_REPLAY_TEST_SEED`` to fix the tests' random inputs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from faults import FAULTS, Fault  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def copy_tree(dest: Path) -> None:
    """The files git would commit (tracked, and untracked but not ignored), copied to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (p.decode() for p in listed)):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def pytest(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "adapters")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", "--hypothesis-profile=mutants"]
    cmd += tests
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, proc.stdout + proc.stderr


def plant(tree: Path, fault: Fault) -> str:
    """Apply ``fault`` to the copy; return the original text (raises if a patch does not apply)."""
    path = tree / fault.path
    original = path.read_text()
    text = original
    for old, new in fault.patches:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{fault.path}: the text to replace occurs {count} times: {old.strip()[:70]!r}")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def verdict(fault: Fault, rc: int, out: str) -> tuple[str, str]:
    failed = FAILED.findall(out)
    if rc == 0 or rc == 5:
        return "SURVIVED", "every test passed"
    if rc == -1:
        return "caught (timeout)", out.strip().splitlines()[-1]
    if any(f.startswith(fault.catcher) for f in failed):
        return "caught", next(f for f in failed if f.startswith(fault.catcher))
    if failed:
        return "caught (by another test)", failed[0]
    return "caught (pytest error)", out.strip().splitlines()[-1] if out.strip() else f"exit status {rc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="", help="only the faults whose name contains this text")
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    args = ap.parse_args(argv)
    faults = [f for f in FAULTS if args.k.lower() in f.name.lower()]
    if args.list:
        for i, f in enumerate(faults, 1):
            print(f"{i:2d}. {f.name}  [{f.path}] -> {f.catcher}")
        return 0
    with tempfile.TemporaryDirectory(prefix="trace-replay-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        baseline = tuple(dict.fromkeys(t for f in faults for t in f.tests))
        t0 = time.monotonic()
        rc, out = pytest(tree, baseline, args.timeout * 2)
        if rc != 0:
            print(out[-6000:])
            print(f"the unchanged tree fails its tests (exit status {rc}): nothing planted")
            return 2
        print(f"unchanged tree: {len(baseline)} test selections pass ({time.monotonic() - t0:.0f} s)\n")
        rows, bad = [], 0
        for i, fault in enumerate(faults, 1):
            t0 = time.monotonic()
            try:
                original = plant(tree, fault)
            except ValueError as exc:
                rows.append((i, fault.name, "PATCH DOES NOT APPLY", str(exc), 0.0))
                bad += 1
                continue
            try:
                rc, out = pytest(tree, fault.tests, args.timeout)
            finally:
                (tree / fault.path).write_text(original)
            status, detail = verdict(fault, rc, out)
            bad += status == "SURVIVED"
            rows.append((i, fault.name, status, detail, time.monotonic() - t0))
            print(f"{i:2d}. {status:26s} {fault.name}: {detail} ({rows[-1][4]:.0f} s)", flush=True)
        print("\n| # | fault | result | test that failed |\n|---|---|---|---|")
        for i, name, status, detail, _ in rows:
            print(f"| {i} | {name} | {status} | {detail} |")
        survived = [r for r in rows if r[2] in ("SURVIVED", "PATCH DOES NOT APPLY")]
        print(f"\n{len(rows) - len(survived)} of {len(rows)} faults caught")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
