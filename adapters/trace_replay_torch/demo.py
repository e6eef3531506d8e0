"""Trace replay in a small continuous-batching decode loop.

Run it with ``python -m trace_replay_torch.demo`` (CPU) or ``--device cuda`` (GPU).

What it shows:

- A tiny deterministic language model (vocabulary 512; the next token depends on the last four
  tokens and the position) decodes several requests with continuous batching: requests arrive at
  different steps, wait for a free slot, join the running batch, finish at different steps, and
  their slots are reused by later requests.
- Some requests carry a trace. At every step the sampler draws a token for every row; then
  :meth:`TraceReplayState.replay` overwrites, on the device and in place, the rows whose request is
  inside its trace with the trace token of that step. The step of a request is derived on the
  device from the per-slot ``total_len - prompt_len``.
- The logprob and rank of the token that ends up in each row are computed from the real, unmodified
  logits: for a forced token they say how likely the model found it (masking the logits to force a
  token would make them meaningless).
- One traced request asks for more tokens than its trace holds: the sampler takes over after the
  trace ends.
- Requests without a trace are left alone: every step the demo compares their rows before and
  after replay, and a second run of the same schedule with no traces at all gives them the same
  tokens.

The exit status is 0 when every check passes and 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, TextIO

import torch

from .logprob import token_logprob_rank
from .state import TraceReplayState

__all__ = ["TinyModel", "Request", "Engine", "make_requests", "run_demo", "check", "main"]

VOCAB_SIZE = 512
WINDOW = 4               # tokens the model looks back at
MAX_TRACE_LEN = 32       # table row length; generated traces have 5-20 tokens
_IDS = "0123456789abcdefghijklmnopqrstuvwxyz"


# the model -------------------------------------------------------------------------------------
class TinyModel:
    """A deterministic toy language model: logits of the next token from a short causal window.

    ``logits = out(block2(block1(mix(embed(last WINDOW tokens)) + pos_embed(position))))``, each
    block a pre-norm tanh MLP with a residual connection. Weights come from ``seed`` on the CPU
    and are then moved to ``device``, so CPU and GPU runs use the same weights.
    """

    def __init__(self, seed: int, device: torch.device, *, dim: int = 64, max_pos: int = 256):
        g = torch.Generator().manual_seed(seed)

        def weight(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.max_pos = max_pos
        self.tok_embed = weight(VOCAB_SIZE, dim, scale=1.0)
        self.pos_embed = weight(max_pos, dim, scale=0.5)
        self.mix = weight(WINDOW * dim, dim, scale=1 / math.sqrt(WINDOW * dim))
        self.blocks = [(weight(dim, 4 * dim, scale=1 / math.sqrt(dim)),
                        weight(4 * dim, dim, scale=1 / math.sqrt(4 * dim))) for _ in range(2)]
        self.out = weight(dim, VOCAB_SIZE, scale=4 / math.sqrt(dim))  # peaked: free tokens rank low

    def __call__(self, window: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``window``: [batch, WINDOW] int64 tokens; ``position``: [batch]. Returns float32 [batch, vocab]."""
        x = self.tok_embed[window].flatten(1) @ self.mix
        x = x + self.pos_embed[position.long().clamp(0, self.max_pos - 1)]
        for up, down in self.blocks:
            x = x + torch.tanh(_norm(x) @ up) @ down
        return (_norm(x) @ self.out).float()


def _norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


# sampling, logprobs, ranks ---------------------------------------------------------------------
def sample(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """Draw one token per row (Gumbel-max in its exponential form); int64 [batch]."""
    probs = torch.softmax(logits / temperature, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)


def _logprob_rank(logits: torch.Tensor, tokens: torch.Tensor):
    """float32 logprob and int64 rank of ``tokens[b]`` under row ``b`` of the unmodified ``logits``.

    The library's fused kernel (one read of the logits; numpy on the CPU). The rank counts
    vocabulary entries whose logit is >= the token's own (a unique argmax has rank 1).
    """
    return token_logprob_rank(logits, tokens)


# requests --------------------------------------------------------------------------------------
@dataclass
class Request:
    """One request and, after a run, what happened to it (host-side bookkeeping)."""

    rid: int
    prompt: List[int]
    arrival: int                       # first step at which it may be admitted
    max_new_tokens: int
    trace: Optional[List[int]] = None  # forced outputs 0..len(trace)-1; None: samples freely
    # filled in by the engine
    slot: int = -1
    previous: Optional[int] = None     # request that used the slot before, if any
    admitted: int = -1
    finished: int = -1
    draws: List[int] = field(default_factory=list)     # the sampler's token, before replay
    tokens: List[int] = field(default_factory=list)    # the token after replay (the output)
    logprobs: List[float] = field(default_factory=list)
    ranks: List[int] = field(default_factory=list)
    device_steps: List[int] = field(default_factory=list)  # total_len - prompt_len, read back

    @property
    def name(self) -> str:
        return _IDS[self.rid] if self.rid < len(_IDS) else "#"

    def forced(self, i: int) -> bool:
        """Whether output ``i`` is one that replay must force."""
        return self.trace is not None and i < len(self.trace)

    @property
    def kind(self) -> str:
        if self.trace is None:
            return f"free, {self.max_new_tokens} sampled"
        extra = self.max_new_tokens - len(self.trace)
        return f"trace of {len(self.trace)}" + (f", then {extra} sampled" if extra else "")


def make_requests(n: int, seed: int, *, max_batch: int = 4) -> List[Request]:
    """``n`` requests generated from ``seed``: prompts of 3-40 tokens, traces of 5-20 random tokens.

    Kinds cycle through traced, free, traced-then-free (``max_new_tokens`` beyond the trace) and
    free. The first ``max_batch`` arrive in the first steps; the rest later, so they queue for slots.
    """
    rng = random.Random(seed)
    requests = []
    for rid in range(n):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(3, 40))]
        arrival = rid // 2 if rid < max_batch else rng.randint(2, 3 * n)
        kind = rid % 4
        if kind in (0, 2):
            trace = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(5, 20 if kind == 0 else 12))]
            extra = rng.randint(4, 8) if kind == 2 else 0
            requests.append(Request(rid, prompt, arrival, len(trace) + extra, trace))
        else:
            requests.append(Request(rid, prompt, arrival, rng.randint(5, 20)))
    return requests


# the engine ------------------------------------------------------------------------------------
class Engine:
    """A decode loop with ``max_batch`` slots and continuous batching.

    Device state per slot: ``total_len`` and ``prompt_len`` (int32, bound into the replay state)
    and ``window`` (the last ``WINDOW`` tokens). Each step: admit waiting requests into free slots,
    apply staged traces, run the model on the active rows, sample, replay, compute logprob and
    rank from the unmodified logits, advance the lengths; then one host read of the step's results
    for bookkeeping. ``use_traces=False`` runs the same schedule with every request untraced.
    """

    def __init__(self, model: TinyModel, requests: Sequence[Request], *, max_batch: int,
                 device: torch.device, seed: int, use_traces: bool = True):
        self.model = model
        self.device = device
        self.max_batch = max_batch
        self.use_traces = use_traces
        self.waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
        self.running: List[Request] = []                      # batch rows, in admission order
        self.slot_owner: List[Optional[Request]] = [None] * max_batch
        self.last_owner: List[Optional[Request]] = [None] * max_batch
        self.total_len = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.prompt_len = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.window = torch.zeros(max_batch, WINDOW, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.state = TraceReplayState(max_batch, MAX_TRACE_LEN, device=device, total_len=self.total_len,
                                      prompt_len=self.prompt_len, vocab_size=VOCAB_SIZE)
        self.timeline: List[List[Optional[int]]] = []        # per step: request id per slot
        self.untouched_rows = 0                               # rows replay had to leave alone ...
        self.altered: List[str] = []                          # ... and those it changed anyway

    def close(self) -> None:
        self.state.close()

    # scheduling ----------------------------------------------------------------------------
    def admit(self, step: int) -> None:
        """Move arrived requests into free slots (lowest first), FIFO; set their slot state."""
        slots, prompt_lens, windows = [], [], []
        while self.waiting and self.waiting[0].arrival <= step and None in self.slot_owner:
            req = self.waiting.pop(0)
            slot = self.slot_owner.index(None)
            prev = self.last_owner[slot]
            req.slot, req.admitted, req.previous = slot, step, prev.rid if prev else None
            self.slot_owner[slot] = self.last_owner[slot] = req
            self.running.append(req)
            # None also resets whatever trace the slot's previous request left behind
            self.state.add_request(slot, req.trace if self.use_traces else None)
            slots.append(slot)
            prompt_lens.append(len(req.prompt))
            windows.append(([0] * WINDOW + req.prompt)[-WINDOW:])
        if slots:
            index = torch.tensor(slots, device=self.device)
            lens = torch.tensor(prompt_lens, dtype=torch.int32, device=self.device)
            self.prompt_len[index] = lens
            self.total_len[index] = lens   # no outputs yet: step 0
            self.window[index] = torch.tensor(windows, dtype=torch.int64, device=self.device)

    def finish(self, step: int) -> None:
        """Release the slots of requests that produced all their tokens this step.

        The replay state is not told: no row maps to a free slot, and the next admission into it
        calls ``add_request``, which replaces (or clears) the old trace.
        """
        for req in [r for r in self.running if len(r.tokens) == r.max_new_tokens]:
            req.finished = step
            self.running.remove(req)
            self.slot_owner[req.slot] = None

    # one step ------------------------------------------------------------------------------
    def decode(self, idx_mapping: torch.Tensor):
        """Model, sampler, replay, logprob/rank and length update for the rows in ``idx_mapping``.

        Everything stays on the device; returns one float64 [5, batch] tensor of
        (draw, token, logprob, rank, step) for the host to read in one go.
        """
        rows = idx_mapping.long()
        step = self.total_len[rows] - self.prompt_len[rows]
        logits = self.model(self.window[rows], self.total_len[rows])
        sampled = sample(logits, self.generator)
        draws = sampled.clone()
        self.state.replay(sampled, idx_mapping)             # in place, on the device
        logprob, rank = _logprob_rank(logits, sampled)      # from the unmodified logits
        self.total_len[rows] += 1
        self.window[rows] = torch.cat([self.window[rows, 1:], sampled[:, None]], dim=1)
        return torch.stack([draws.double(), sampled.double(), logprob.double(), rank.double(), step.double()])

    def run(self) -> int:
        """Decode until every request has finished; returns the number of steps taken."""
        step = 0
        with torch.no_grad():
            while self.waiting or self.running:
                self.admit(step)
                self.state.apply_staged_writes()
                self.timeline.append([r.rid if r else None for r in self.slot_owner])
                if self.running:
                    idx_mapping = torch.tensor([r.slot for r in self.running], dtype=torch.int32,
                                               device=self.device)
                    results = self.decode(idx_mapping).cpu().tolist()   # the step's one host read
                    self.record(results)
                self.finish(step)
                step += 1
        return step

    def record(self, results) -> None:
        """Host bookkeeping of one step; notes rows that replay changed but should not have."""
        for req, draw, token, logprob, rank, step in zip(self.running, *results):
            i = len(req.tokens)
            req.draws.append(int(draw))
            req.tokens.append(int(token))
            req.logprobs.append(logprob)
            req.ranks.append(int(rank))
            req.device_steps.append(int(step))
            if not (self.use_traces and req.forced(i)):
                self.untouched_rows += 1
                if int(token) != int(draw):
                    self.altered.append(f"request {req.rid} output {i}: sampler drew {int(draw)}, "
                                        f"replay wrote {int(token)}")


# checks ----------------------------------------------------------------------------------------
@dataclass
class CheckResult:
    name: str
    passed: int
    total: int
    failures: List[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def check(requests: Sequence[Request], engine: Engine, baseline: Sequence[Request]) -> List[CheckResult]:
    """The demo's checks: traces reproduced exactly, untraced rows untouched, free requests
    identical to a run of the same schedule without traces, device steps as expected."""
    traced = [r for r in requests if r.trace is not None]
    bad = [f"request {r.rid}: outputs {r.tokens[:len(r.trace)]} != trace {r.trace}"
           for r in traced if r.tokens[:len(r.trace)] != r.trace]
    results = [CheckResult("traced requests reproduced their traces exactly", len(traced) - len(bad),
                           len(traced), bad)]
    results.append(CheckResult("rows without a trace kept the sampler's token",
                               engine.untouched_rows - len(engine.altered), engine.untouched_rows,
                               engine.altered))
    free = [(r, b) for r, b in zip(requests, baseline) if r.trace is None]
    bad = [f"request {r.rid}: {r.tokens} != {b.tokens} without traces" for r, b in free if r.tokens != b.tokens]
    results.append(CheckResult("free requests match a run without any traces", len(free) - len(bad),
                               len(free), bad))
    bad = [f"request {r.rid}: device steps {r.device_steps}" for r in requests
           if r.device_steps != list(range(r.max_new_tokens))]
    results.append(CheckResult("device step (total_len - prompt_len) counted outputs 0, 1, ...",
                               len(requests) - len(bad), len(requests), bad))
    return results


# the run ---------------------------------------------------------------------------------------
@dataclass
class DemoResult:
    requests: List[Request]
    steps: int
    timeline: List[List[Optional[int]]]
    checks: List[CheckResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def run_demo(*, device: str = "cpu", seed: int = 0, n_requests: int = 8, max_batch: int = 4) -> DemoResult:
    """Run the request set with traces, then the same schedule without; check; return everything."""
    start = time.perf_counter()
    dev = torch.device(device)
    model = TinyModel(seed, dev)
    runs = []
    for use_traces in (True, False):
        requests = make_requests(n_requests, seed, max_batch=max_batch)
        engine = Engine(model, requests, max_batch=max_batch, device=dev, seed=seed + 1, use_traces=use_traces)
        try:
            steps = engine.run()
        finally:
            engine.close()
        runs.append((requests, engine, steps))
    (requests, engine, steps), (baseline, _, _) = runs
    checks = check(requests, engine, baseline)
    return DemoResult(requests, steps, engine.timeline, checks, time.perf_counter() - start)


# output ----------------------------------------------------------------------------------------
def _timeline_lines(timeline: List[List[Optional[int]]]) -> List[str]:
    steps = len(timeline)
    lines = ["schedule (a character = the request holding the slot at that step; '.' = free):",
             "          " + "".join(str(s // 10 % 10) if s % 10 == 0 else " " for s in range(steps)),
             "   step   " + "".join(str(s % 10) for s in range(steps))]
    for slot in range(len(timeline[0]) if timeline else 0):
        row = "".join(_IDS[t[slot]] if t[slot] is not None and t[slot] < len(_IDS) else
                      ("." if t[slot] is None else "#") for t in timeline)
        lines.append(f"   slot {slot} {row}")
    return lines


def _request_lines(req: Request) -> List[str]:
    reuse = f" (after request {req.previous})" if req.previous is not None else ""
    head = (f"request {req.name}: {req.kind}; slot {req.slot}{reuse}; prompt {len(req.prompt)} tokens; "
            f"arrives step {req.arrival}, runs steps {req.admitted}-{req.finished}")
    if req.trace is None:
        return [head, f"   tokens {req.tokens}",
                f"   sampled freely: mean rank {sum(req.ranks) / len(req.ranks):.1f}, "
                f"mean logprob {sum(req.logprobs) / len(req.logprobs):.2f}"]
    lines = [head, "     out  token  from      logprob   rank   sampler drew"]
    for i, (tok, lp, rank, draw) in enumerate(zip(req.tokens, req.logprobs, req.ranks, req.draws)):
        source = "trace" if req.forced(i) else "sampler"
        lines.append(f"   {i:5d}  {tok:5d}  {source:8s} {lp:8.2f}  {rank:5d}   {draw:5d}")
    return lines


def report(result: DemoResult, *, device: str, seed: int, max_batch: int, quiet: bool, out: TextIO) -> None:
    reqs = result.requests
    if not quiet:
        print(f"trace replay demo: {len(reqs)} requests, {max_batch} slots, vocabulary {VOCAB_SIZE}, "
              f"device {device}, seed {seed}", file=out)
        print("\n".join(_timeline_lines(result.timeline)), file=out)
        for req in reqs:
            print(file=out)
            print("\n".join(_request_lines(req)), file=out)
        print(file=out)
    forced = [(lp, rk) for r in reqs for i, (lp, rk) in enumerate(zip(r.logprobs, r.ranks)) if r.forced(i)]
    free = [(lp, rk) for r in reqs for i, (lp, rk) in enumerate(zip(r.logprobs, r.ranks)) if not r.forced(i)]
    reused = sum(r.previous is not None for r in reqs)

    def means(pairs):
        if not pairs:
            return "none"
        return (f"mean logprob {sum(p[0] for p in pairs) / len(pairs):.2f}, "
                f"mean rank {sum(p[1] for p in pairs) / len(pairs):.1f}")

    n_traced = sum(r.trace is not None for r in reqs)
    plural = "s" if len(reqs) != 1 else ""
    print(f"summary: {len(reqs)} request{plural} ({n_traced} traced, {len(reqs) - n_traced} free), "
          f"{result.steps} steps, {reused} slot reuses; {len(forced)} forced tokens ({means(forced)}); "
          f"{len(free)} sampled tokens ({means(free)}); {result.seconds:.2f} s", file=out)
    for c in result.checks:
        print(f"check: {c.name}: {c.passed}/{c.total} {'ok' if c.ok else 'FAILED'}", file=out)
        for f in c.failures[:10]:
            print(f"   {f}", file=out)
    if result.ok:
        print("all checks passed", file=out)
    else:
        print("CHECKS FAILED: see above", file=out)


def main(argv: Optional[Sequence[str]] = None, *, out: Optional[TextIO] = None) -> int:
    """Command-line entry point; returns the exit status (0: all checks passed, 1: a check failed)."""
    out = out if out is not None else sys.stdout
    parser = argparse.ArgumentParser(prog="python -m trace_replay_torch.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the requests and the sampler")
    parser.add_argument("--requests", type=int, default=8, help="number of requests (default 8)")
    parser.add_argument("--max-batch", type=int, default=4, help="decode slots (default 4)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary and the checks")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.requests > len(_IDS):
        parser.error(f"--requests must be between 1 and {len(_IDS)} (got {args.requests})")
    if args.max_batch < 1:
        parser.error(f"--max-batch must be at least 1 (got {args.max_batch})")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu, cuda or cuda:N (got {args.device})")
    result = run_demo(device=args.device, seed=args.seed, n_requests=args.requests, max_batch=args.max_batch)
    report(result, device=args.device, seed=args.seed, max_batch=args.max_batch, quiet=args.quiet, out=out)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
