"""CPU tier: a table's lifetime on the GPU backend, over the stand-in CUDA driver
(``staging_doubles.FakeDriver``): ``close`` frees every resource even when a driver call fails,
and a call racing ``close`` gets the closed-table error."""

from __future__ import annotations

import pytest
from helpers.staging_doubles import fake_cuda  # noqa: F401  (a fixture)

from trace_replay_core import CudaError, TraceTable


def _used_table(driver) -> TraceTable:
    """A 2-deep table with one commit behind it, the device idle (nothing queued is left to run)."""
    t = TraceTable(4, 8, device="cuda:0", staging_depth=2)
    t.stage(1, [3, 4, 5])
    t.commit(stream=0)
    driver.run()
    return t


def test_close_frees_everything_when_the_device_sync_fails(fake_cuda):  # noqa: F811
    t = _used_table(fake_cuda)
    assert fake_cuda.buffers and fake_cuda.events
    fake_cuda.cuCtxSynchronize = lambda: (700,)
    with pytest.raises(CudaError, match=r"^cuCtxSynchronize failed: CUDA_ERROR_FAKE$"):
        t.close()
    assert fake_cuda.buffers == {} and fake_cuda.events == {}  # every allocation and event freed
    assert t.closed
    t.close()  # a second close has nothing left to do: no error


def test_close_frees_the_rest_when_frees_fail_and_raises_the_first_error(fake_cuda):  # noqa: F811
    t = _used_table(fake_cuda)
    kept = {t._backend.table_ptr, t._backend.trace_len_ptr}  # their frees fail
    free = fake_cuda.cuMemFree
    fake_cuda.cuMemFree = lambda ptr: (1,) if ptr in kept else free(ptr)
    fake_cuda.cuCtxSynchronize = lambda: (700,)
    with pytest.raises(CudaError, match=r"^cuCtxSynchronize failed"):  # the first of three errors
        t.close()
    assert set(fake_cuda.buffers) == kept  # the staging ring's buffers went all the same
    assert fake_cuda.events == {}
    t.close()


class _CloseOnEntry:
    """Stands in for a table's lock: the first ``with`` closes the table (through the real lock)
    before taking the lock, as a ``close()`` in another thread that wins the lock would."""

    def __init__(self, table: TraceTable):
        self.table, self.lock = table, table._lock

    def __enter__(self):
        self.table._lock = self.lock
        self.table.close()
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_commit_racing_close_gets_the_closed_table_error(fake_cuda, device):  # noqa: F811
    t = TraceTable(4, 8, device=device)
    t.stage(2, [7, 8])
    t._lock = _CloseOnEntry(t)
    with pytest.raises(RuntimeError, match=r"^this TraceTable is closed$"):
        t.commit(stream=0)
