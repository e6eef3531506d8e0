"""CPU tier: random sequences of stage / clear / commit / replay against a plain-Python model.

Hypothesis drives a state machine through the numpy backend and, separately, through the Triton
kernels under the interpreter (scatter for commits, replay for steps). Each replay is checked
step by step against the model; failures shrink to a short, readable sequence of calls.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trace_replay_core import TraceTable
from trace_replay_core.kernels.replay import REPLAY_BLOCK
from trace_replay_core.kernels.scatter import SCATTER_BLOCK

# Traces up to a little past one scatter program's block, batches up to a little past two replay
# programs' blocks: most draws stay small (fast, readable when shrunk), about one in six is large
# enough to need a second kernel program.
MAX_SLOTS, VOCAB = 6, 1000
MAX_LEN = SCATTER_BLOCK + 6
MAX_ROWS = 2 * REPLAY_BLOCK + 9
SMALL_LEN, SMALL_ROWS = 9, 12
SETTINGS = settings(
    max_examples=300,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


def _sometimes_large(small, large):
    """``small`` five times in six, ``large`` otherwise (shrinking goes towards ``small``)."""
    return st.integers(0, 5).flatmap(lambda k: large if k == 5 else small)


def _seeded(fn, *sizes):
    """Large inputs drawn from a seeded generator rather than element by element (fast)."""
    return st.builds(lambda seed, *n: fn(np.random.default_rng(seed), *n), st.integers(0, 2**32 - 1), *sizes)


tokens_st = _sometimes_large(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=SMALL_LEN),
    _seeded(lambda r, n: r.integers(0, VOCAB, n).tolist(), st.integers(SCATTER_BLOCK + 1, MAX_LEN)),
)
slot_st = st.integers(0, MAX_SLOTS - 1)
rows_st = _sometimes_large(
    st.lists(st.integers(-1, MAX_SLOTS + 1), min_size=0, max_size=SMALL_ROWS),
    _seeded(lambda r, n: r.integers(-1, MAX_SLOTS + 2, n).tolist(), st.integers(REPLAY_BLOCK + 1, MAX_ROWS)),
)


def _steps_of(r, n):
    """Steps of a large batch: near the start of a trace, near the table's end (where a long
    trace's second scatter block lies), and anywhere."""
    kind = r.integers(0, 3, n)
    near_end = r.integers(SCATTER_BLOCK - 2, MAX_LEN + 2, n)
    return np.where(
        kind == 0, r.integers(-2, SMALL_LEN + 1, n), np.where(kind == 1, near_end, r.integers(-2, MAX_LEN + 2, n))
    ).tolist()


def _invalid_or_long(r, n):
    """A trace around the table's row length, with one bad token now and then."""
    tokens = r.integers(0, VOCAB, n)
    if n and r.random() < 0.3:
        tokens[r.integers(n)] = r.choice([-1, VOCAB])
    return tokens.tolist()


class Model:
    """The semantics, spelled out: committed traces per slot, and what is staged."""

    def __init__(self):
        self.committed = {}
        self.staged = {}

    def stage(self, slot, tokens):
        self.staged[slot] = list(tokens)

    def clear(self, slot):
        self.staged[slot] = None

    def commit(self):
        for slot, tokens in self.staged.items():
            if tokens is None:
                self.committed.pop(slot, None)
            else:
                self.committed[slot] = tokens
        self.staged = {}

    def replay(self, sampled, rows, steps):
        out = list(sampled)
        for b, (slot, step) in enumerate(zip(rows, steps)):
            trace = self.committed.get(slot) if 0 <= slot < MAX_SLOTS else None
            if trace and 0 <= step < len(trace):
                out[b] = trace[step]
        return out


class CpuBackendMachine(RuleBasedStateMachine):
    """The numpy backend of TraceTable."""

    def new_table(self):
        return TraceTable(MAX_SLOTS, MAX_LEN, device="cpu", vocab_size=VOCAB)

    @initialize(traces=st.dictionaries(slot_st, tokens_st, max_size=MAX_SLOTS))
    def setup(self, traces):
        """Start from committed traces, so that even short sequences replay something (a large
        batch then has traced rows past the first replay block)."""
        self.model = Model()
        self.table = self.new_table()
        for slot, tokens in traces.items():
            self.table.stage(slot, tokens)
            self.model.stage(slot, tokens)
        self.table.commit(stream=0)
        self.model.commit()

    def teardown(self):
        self.table.close()

    @rule(slot=slot_st, tokens=tokens_st)
    def stage(self, slot, tokens):
        self.table.stage(slot, tokens)
        self.model.stage(slot, tokens)

    @rule(
        slot=slot_st,
        tokens=_sometimes_large(
            st.lists(st.integers(-5, VOCAB + 5), min_size=0, max_size=SMALL_LEN + 2),
            _seeded(_invalid_or_long, st.integers(MAX_LEN - 2, MAX_LEN + 2)),
        ),
    )
    def stage_maybe_invalid(self, slot, tokens):
        valid = 0 < len(tokens) <= MAX_LEN and all(0 <= t < VOCAB for t in tokens)
        try:
            self.table.stage(slot, np.asarray(tokens, dtype=np.int64))
        except (ValueError, TypeError):
            assert not valid, f"valid trace {tokens} refused"
        else:
            assert valid, f"invalid trace {tokens} accepted"
            self.model.stage(slot, tokens)

    @rule(slot=slot_st)
    def clear(self, slot):
        self.table.clear(slot)
        self.model.clear(slot)

    @rule()
    def commit(self):
        self.table.commit(stream=0)
        self.model.commit()

    @rule(rows=rows_st, data=st.data(), per_row=st.booleans(), wide=st.booleans())
    def replay(self, rows, data, per_row, wide):
        if len(rows) > SMALL_ROWS:
            seed = data.draw(st.integers(0, 2**32 - 1))
            r = np.random.default_rng(seed)
            steps = _steps_of(r, len(rows))
            drawn = r.integers(0, 2**31 - 1, len(rows)).tolist()
        else:
            step_st = st.one_of(st.integers(-2, SMALL_LEN + 1), st.integers(SCATTER_BLOCK - 2, MAX_LEN + 1))
            steps = data.draw(st.lists(step_st, min_size=len(rows), max_size=len(rows)))
            drawn = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=len(rows), max_size=len(rows)))
        sampled = np.array(drawn, dtype=np.int64 if wide else np.int32)
        idx = np.array(rows, dtype=np.int64 if wide else np.int32)
        expected = self.model.replay(sampled.tolist(), rows, steps)
        if per_row:
            self.table.replay_at_step(sampled, idx, np.array(steps, np.int32), stream=0)
        else:
            prompt = np.arange(MAX_SLOTS + 2, dtype=np.int64) * 3
            total = prompt.copy()
            for slot, step in zip(rows, steps):  # a per-slot step must agree across rows
                if 0 <= slot < MAX_SLOTS:
                    total[slot] = prompt[slot] + step
            steps = [int(total[s] - prompt[s]) if 0 <= s < MAX_SLOTS else 0 for s in rows]
            expected = self.model.replay(sampled.tolist(), rows, steps)
            self.table.replay(sampled, idx, total, prompt, stream=0)
        assert sampled.tolist() == expected

    @invariant()
    def pending_matches(self):
        if hasattr(self, "table"):
            assert self.table.pending == len(self.model.staged)


class InterpretedKernelsMachine(CpuBackendMachine):
    """The same sequences, with commits and replays done by the Triton kernels (interpreted)."""

    def new_table(self):
        from helpers.kernel_double import InterpretedTable

        return InterpretedTable(MAX_SLOTS, MAX_LEN, vocab_size=VOCAB)


TestCpuBackend = CpuBackendMachine.TestCase
TestCpuBackend.settings = SETTINGS
TestInterpretedKernels = InterpretedKernelsMachine.TestCase
TestInterpretedKernels.settings = SETTINGS
