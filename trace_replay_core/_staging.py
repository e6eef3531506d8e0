"""Staging: how traces travel from the caller's host memory to the table.

Three pieces, each used by both backends and by the tests' interpreted double:

- :func:`copy_trace`: copies token ids into memory the library owns with numpy and checks them
  on the way (the copy read back from cache);
- :class:`StagedEntries`: the layout of one staging buffer (tokens back to back, each trace on
  a 16-byte boundary, then one ``(slot, length, offset)`` int64 triple per entry) and the
  bookkeeping of what is staged; a rejected trace changes nothing;
- :class:`StagingRing`: the GPU's ring of (pinned host buffer, device buffer, event) triples and
  its guard: a buffer is written again only after the event recorded behind its last copy
  and scatter has completed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from itertools import chain, repeat

import numpy as np

from . import _cuda
from ._validate import TOKEN_LIMIT, token_error

__all__ = [
    "copy_trace",
    "StagedEntries",
    "StagingRing",
    "META_FIELDS",
    "META_BYTES",
    "ALIGN_TOKENS",
    "CHECK_CHUNK_BYTES",
]

META_FIELDS = 3  # slot, length, offset (int64 each)
META_BYTES = META_FIELDS * 8
ALIGN_TOKENS = 4  # each trace starts on a 16-byte boundary

_UINT64 = np.dtype(np.uint64)
_INT32 = np.dtype(np.int32)  # native byte order only
# A block of traces is copied and checked in pieces of about this many bytes, so that the check
# reads what the copy just wrote from cache: a block copied and checked this way takes the time
# of the bare copy, whole it took about 15% longer; smaller pieces were slower.
CHECK_CHUNK_BYTES = 1 << 18


def copy_trace(arr: np.ndarray, out: np.ndarray, *, vocab_size: int | None, name: str = "tokens") -> None:
    """Copy the token ids of ``arr`` (a :func:`~._validate.trace_array` or :func:`~._validate.trace_block` result) into
    ``out``, refusing any id that is negative, or at least ``vocab_size`` (``2**31`` when
    ``None``). Host-only.

    ``out``: ``uint32``, of ``arr``'s shape (a block may be a strided view, such as rows with
    padding between them); a uint32 view of the int32 storage that keeps the trace (an id below
    ``2**31`` has the same bits in both). ``arr`` is read once when its integers have 4 bytes or
    fewer. On a refusal ``out`` holds unspecified values: the caller publishes it only when this
    returns. A value that does not fit int32 is refused, never wrapped.
    """
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    if arr.dtype.itemsize <= 4:
        signed = arr.dtype.kind == "i"
        if arr.ndim == 2 and arr.dtype == _INT32:
            # A block of native int32 as uint32, the same bits: numpy then copies it with memmove
            # instead of an element-wise cast loop, about 15% faster on large blocks. Not for one
            # trace: there the cast was no slower than memmove, and the view only adds its cost.
            arr = arr.view(np.uint32)
        # Up to 4 bytes the copy keeps every bit that matters: as uint32 a negative id becomes
        # >= 2**31 >= limit, so the largest staged value checks both bounds, on exactly the bytes
        # that were staged, read back from cache. 1-D: argmax, not max() (~0.5 us less call
        # overhead); a block: max(), which argmax would first copy to contiguous memory, piece
        # by piece (CHECK_CHUNK_BYTES) while the piece is still in cache.
        if out.ndim == 1:
            out[...] = arr  # memmove or a C cast, like np.copyto(casting="unsafe") without its dispatch
            if out[out.argmax()] < limit:
                return
            bad = out
        else:
            rows = max(1, CHECK_CHUNK_BYTES // max(1, 4 * out.shape[1]))
            for start in range(0, out.shape[0], rows):
                piece = out[start : start + rows]
                piece[...] = arr[start : start + rows]
                if piece.max() >= limit:
                    bad = out[: start + rows]  # the first bad trace is in this piece
                    break
            else:
                return
        raise token_error(bad.view(np.int32) if signed else bad, vocab_size, name)
    # 8 bytes: check before the casting copy, which keeps only the low 32 bits. As uint64 a
    # negative id becomes >= 2**63, so again the largest value checks both bounds.
    if arr.dtype.kind == "i":
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        wide = arr.view(_UINT64)
    else:
        wide = arr
    if (wide[wide.argmax()] if wide.ndim == 1 else wide.max()) >= limit:
        raise token_error(arr, vocab_size, name)
    out[...] = arr


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class StagedEntries:
    """What is staged in one staging buffer, and how it is laid out (host-only, not thread-safe:
    the table's lock serialises it).

    ``tokens`` is the buffer seen as uint32 (a view of pinned memory on the GPU; any numpy
    array in the tests' double); ``reserve(tokens_needed, new_entries)`` must make it hold
    that many tokens plus the entry table with ``new_entries`` more entries, growing it (and
    rebinding :attr:`tokens`) if need be.
    """

    def __init__(self, tokens: np.ndarray, reserve: Callable[[int, int], None]):
        self.tokens = tokens
        self._reserve = reserve
        self.entries: dict[int, tuple[int, int, int]] = {}  # slot -> (slot, length, token offset)
        self.fill = 0  # tokens written so far
        self.longest = 0  # an upper bound of the longest entry

    def bytes_needed(self, tokens_needed: int, new_entries: int = 1) -> int:
        return _round_up(tokens_needed * 4, 16) + (len(self.entries) + new_entries) * META_BYTES + 16

    def stage(self, slot: int, tokens: np.ndarray, vocab_size: int | None) -> None:
        """Copy ``tokens`` (a :func:`~._validate.trace_array` result) after what is staged and
        check its ids in the same pass; record the entry only if they pass."""
        n = tokens.shape[0]
        start = self.fill
        end = start + n
        if 4 * end + META_BYTES * len(self.entries) + 52 > self.tokens.nbytes:  # an upper bound of the need
            self._reserve(end, 1)
        copy_trace(tokens, self.tokens[start:end], vocab_size=vocab_size)
        self.entries[slot] = (slot, n, start)
        self.fill = (end + ALIGN_TOKENS - 1) & -ALIGN_TOKENS
        self.longest = max(self.longest, n)  # an upper bound (a restaged slot may shrink): sizes the grid

    def stage_many(self, slots: list[int], traces: np.ndarray | list[np.ndarray], vocab_size: int | None) -> None:
        """Stage ``traces[i]`` for ``slots[i]``, in order, as one step: a 2-D block (one copy
        and one check for all of it; rows padded to 16 bytes) or a list of
        :func:`~._validate.trace_array` results. Entries are recorded only once every trace has
        passed; a refusal changes no entry and no fill mark."""
        start = self.fill
        entries: Iterable[tuple[int, int, int]]
        if isinstance(traces, np.ndarray):
            rows, length = traces.shape
            stride = (length + ALIGN_TOKENS - 1) & -ALIGN_TOKENS
            end = start + rows * stride
            self._reserve(end, rows)
            copy_trace(
                traces, self.tokens[start:end].reshape(rows, stride)[:, :length], vocab_size=vocab_size, name="traces"
            )
            entries = zip(slots, repeat(length), range(start, end, stride))
            longest = length
        else:
            lengths = [t.shape[0] for t in traces]
            end = start + sum((n + ALIGN_TOKENS - 1) & -ALIGN_TOKENS for n in lengths)
            self._reserve(end, len(traces))
            listed = []
            at = start
            for i, (slot, tokens, n) in enumerate(zip(slots, traces, lengths)):
                copy_trace(tokens, self.tokens[at : at + n], vocab_size=vocab_size, name=f"traces[{i}]")
                listed.append((slot, n, at))
                at = (at + n + ALIGN_TOKENS - 1) & -ALIGN_TOKENS
            entries = listed
            longest = max(lengths, default=0)
        self.entries.update(zip(slots, entries))  # a slot given twice keeps its last entry
        self.fill = end
        self.longest = max(self.longest, longest)

    def clear(self, slot: int) -> None:
        """Stage "no trace" for ``slot``: an entry of length 0, its place in the entry table
        reserved now (as :meth:`stage` does), so that :meth:`pack` never grows the buffer."""
        if slot not in self.entries:
            self._reserve(self.fill, 1)
        self.entries[slot] = (slot, 0, 0)

    def pack(self) -> tuple[int, int, int]:
        """Append the entry table after the tokens; return ``(entries, meta byte offset, bytes
        used)``: the bytes to copy to the device, and where its scatter reads the entries."""
        self._reserve(self.fill, 0)
        meta_off = _round_up(self.fill * 4, 16)
        n = len(self.entries)
        # One pack_into for all entries: 64 entries cost ~7 us against ~60 us row by row in numpy.
        struct.pack_into(
            f"<{n * META_FIELDS}q",
            self.tokens.data.cast("B"),
            meta_off,
            *chain.from_iterable(self.entries.values()),
        )
        return n, meta_off, meta_off + n * META_BYTES

    def reset(self) -> None:
        self.entries = {}
        self.fill = 0
        self.longest = 0


class _StagingPair:
    """One pinned host buffer, its device twin and the event behind their last use."""

    def __init__(self, nbytes: int):
        self.host = _cuda.PinnedAllocation(nbytes)
        self.device = _cuda.DeviceAllocation(nbytes)
        self.event = _cuda.Event()
        self.tokens = self.host.numpy(np.uint32)  # where stage copies tokens (int32 ids, as uint32)

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def grow(self, nbytes: int, keep_tokens: int) -> None:
        """Replace both buffers with ``nbytes`` ones, keeping the first ``keep_tokens`` tokens.
        Only called on the open pair, whose last copy and scatter have completed."""
        host = _cuda.PinnedAllocation(nbytes)
        host.numpy(np.uint32)[:keep_tokens] = self.tokens[:keep_tokens]
        device = _cuda.DeviceAllocation(nbytes)
        self.host.close()
        self.device.close()
        self.host, self.device = host, device
        self.tokens = host.numpy(np.uint32)

    def close(self) -> None:
        _cuda.close_all((self.host.close, self.device.close, self.event.close))


class StagingRing:
    """A ring of ``depth`` staging pairs on device ``device_id`` (host-blocking to build; owns
    all their memory until :meth:`close`). The open pair takes the staged traces; :meth:`commit`
    queues its copy to the device and the caller's scatter, records its event and opens the
    next pair. Not thread-safe: the table's lock serialises every call.

    The guard: the first write into a reused pair waits for the pair's event (host-blocking,
    and only when ``depth`` commits are still in flight). Once the open pair is known to be
    free, staging makes no driver call at all. :attr:`guard_waits` counts the waits.
    """

    def __init__(self, device_id: int, depth: int, nbytes: int):
        self.device_id = device_id
        self._pairs: list[_StagingPair] = []
        try:
            for _ in range(depth):
                self._pairs.append(_StagingPair(nbytes))
        except BaseException:
            self.close()
            raise
        self._open = 0
        self._prepared = False  # the open pair's last commit has completed
        self.guard_waits = 0
        self.staged = StagedEntries(self._pairs[0].tokens, self._reserve)

    def open_pair(self) -> _StagingPair:
        """The open pair, once the commit that last read it has completed (the staging guard)."""
        pair = self._pairs[self._open]
        if not self._prepared:
            with _cuda.on_device(self.device_id):  # any thread, any current device
                if not pair.event.done():
                    self.guard_waits += 1
                    pair.event.synchronize()
            self._prepared = True
            self.staged.tokens = pair.tokens
        return pair

    def _reserve(self, tokens_needed: int, new_entries: int) -> None:
        pair = self._pairs[self._open]
        need = self.staged.bytes_needed(tokens_needed, new_entries)
        if need > pair.nbytes:
            with _cuda.on_device(self.device_id):
                pair.grow(max(need, 2 * pair.nbytes), self.staged.fill)
            self.staged.tokens = pair.tokens

    def entries(self) -> StagedEntries:
        """What is staged, in the open pair (waiting for it first when it may still be read)."""
        if not self._prepared:
            self.open_pair()
        return self.staged

    def commit(self, stream: int, scatter: Callable[[int, int, int, int], None]) -> None:
        """Queue the open pair's copy to the device and ``scatter(entries, meta_ptr, tokens_ptr,
        longest)`` on ``stream``, record the pair's event and open the next pair. Stream-ordered;
        the caller has made the device current."""
        pair = self.open_pair()
        staged = self.staged
        n, meta_off, nbytes = staged.pack()
        _cuda.memcpy_htod_async(pair.device.ptr, pair.host.ptr, nbytes, stream)
        scatter(n, pair.device.ptr + meta_off, pair.device.ptr, staged.longest)
        pair.event.record(stream)
        staged.reset()
        self._open = (self._open + 1) % len(self._pairs)
        self._prepared = False

    @property
    def pairs(self) -> list[_StagingPair]:
        return self._pairs

    def close(self) -> None:
        """Free every pair (each even when one before it fails; the first error is raised)."""
        pairs, self._pairs = self._pairs, []
        _cuda.close_all(pair.close for pair in pairs)
