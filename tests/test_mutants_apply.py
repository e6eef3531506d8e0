"""The planted faults of ``tests/mutants/faults.py`` still apply: each ``old`` text occurs exactly
once in its file and each named test file exists. ``tests/mutants/run.py`` refuses a fault that
no longer applies, but it takes minutes and is run by hand; a patch that code moved away from
would otherwise stay unnoticed until then (seconds here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import module_from_file

ROOT = Path(__file__).resolve().parents[1]
FAULTS = module_from_file(ROOT / "tests" / "mutants" / "faults.py").FAULTS


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_applies_once(fault):
    text = (ROOT / fault.path).read_text()
    for old, new in fault.patches:
        assert old != new, f"{fault.name}: a patch that changes nothing"
        assert text.count(old) == 1, f"{fault.name}: {old!r} occurs {text.count(old)} times in {fault.path}"
    for node in fault.tests:
        assert (ROOT / node.split("::")[0]).is_file(), f"{fault.name}: no test file for {node}"
    runs = {node.split("::")[0] for node in fault.tests}
    assert fault.catcher.split("::")[0] in runs, f"{fault.name}: the catcher {fault.catcher} is not among its tests"
