"""The parameter block that bound launches and launchers hand to ``cuLaunchKernel`` (CPU tier:
the block is built and packed without a driver; the GPU tier launches through it)."""

import numpy as np

from trace_replay_core.kernels._compiled import _ParamBlock


class _Kernel:
    """What ``_ParamBlock`` reads from a compiled kernel: the PTX parameter sizes (the caller's
    arguments, then two scratch pointers Triton appends) and the launch shape."""

    def __init__(self, sizes, n_args):
        self._params = sizes
        self._n_args = n_args
        self._function = 0x1234
        self._threads = 128
        self._shared = 0
        self.name = "fake_kernel"


def _slots(block):
    return [bytes(block.view[8 * i : 8 * i + 8]) for i in range(len(block.values))]


def test_arguments_land_little_endian_in_their_slots_and_scratch_stays_zero():
    # scatter's shape: four pointers, two int32 sizes, two scratch pointers
    block = _ParamBlock(_Kernel([8, 8, 8, 8, 4, 4, 8, 8], 6))
    block.values[:6] = np.uint64(0xA5A5A5A5A5A5A5A5)  # poison the argument slots: each must be rewritten
    args = (0x7F00_1234_5678, 0x7F00_0000_0010, 0x1_0000_0000, 0xDEAD_BEE0, 32768, 7)
    block.pack(block.view, 0, *args)
    slots = _slots(block)
    for i, value in enumerate(args[:4]):
        assert slots[i] == value.to_bytes(8, "little")
    assert slots[4][:4] == (32768).to_bytes(4, "little") and slots[5][:4] == (7).to_bytes(4, "little")
    # a 4-byte argument's slot: the kernel reads its low 4 bytes; struct's padding clears the rest
    assert slots[4][4:] == slots[5][4:] == bytes(4)
    assert slots[6] == slots[7] == bytes(8)
    # the address array points at the slots, in order
    base = block.values.ctypes.data
    assert block.addresses.tolist() == [base + 8 * i for i in range(8)]
    assert block.params == block.addresses.ctypes.data


def test_repacking_overwrites_every_argument():
    block = _ParamBlock(_Kernel([8, 4, 2, 1, 8], 4))
    block.pack(block.view, 0, 2**40 + 3, -5, 300, -1)
    block.pack(block.view, 0, 9, 11, 13, 15)  # a launcher rewrites the block per call
    slots = _slots(block)
    assert slots[0] == (9).to_bytes(8, "little")
    assert slots[1][:4] == (11).to_bytes(4, "little", signed=True)
    assert slots[2][:2] == (13).to_bytes(2, "little", signed=True)
    assert slots[3][:1] == (15).to_bytes(1, "little", signed=True)
    assert slots[4] == bytes(8)


def test_negative_sizes_pack_as_twos_complement():
    block = _ParamBlock(_Kernel([4, 8], 2))
    block.pack(block.view, 0, -3, -(2**40))
    slots = _slots(block)
    assert slots[0][:4] == (-3).to_bytes(4, "little", signed=True)
    assert slots[1] == (-(2**40)).to_bytes(8, "little", signed=True)
