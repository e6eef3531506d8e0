"""The demo: replay a built-in set of traces through the torch and the JAX reference loop.

``trace-replay demo`` (or ``python -m trace_replay_app demo``; ``--device cuda`` on a GPU)
runs a seeded small model (``--model``, default the GPT-2-style one) in both frameworks on a
built-in set of requests, more of them than there are decode slots, so that requests queue and
slots are reused:

- ``own-*``: traced with the model's own greedy continuation (recorded from a torch run
  without traces): replay forces what the model would have chosen anyway, so the forced
  tokens have rank 1 and high logprobs;
- ``random-*``: traced with random tokens: every token is forced against the model's choice,
  and its logprob and rank (from the real, unmodified logits) show how unlikely it was;
- ``free-*``: untraced: decoded greedily, untouched by replay.

It checks, for each framework, that every traced request reproduced its trace exactly and
that every untraced request produced the same tokens as a run of the same requests without
any traces; it shows per request the reproduction, the mean logprob and rank, and how far
torch and JAX agree. With only one framework installed it runs that one and says the other is
missing. Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from .compare import compare_results
from .models import FRAMEWORKS, Family, FrameworkMissing, get_family
from .records import RequestResult, TraceRequest
from .runner import CliError, check_framework_device, replay_requests
from .schedule import slots_for

__all__ = ["builtin_requests", "available_loops", "run_demo", "report", "cmd_demo", "DemoResult", "Check"]

KINDS = ("own", "random", "free")


def builtin_requests(config: Any, *, n_per_kind: int = 4, seed: int = 1234) -> list[TraceRequest]:
    """The demo's requests, untraced (the ``own``/``random`` traces are filled in by
    :func:`run_demo`): ``n_per_kind`` of each kind, interleaved, prompts of 2-24 tokens,
    6-16 decoded tokens each. Fixed (the seed here is not the model's)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_per_kind):
        for kind in KINDS:
            prompt = tuple(rng.randrange(config.vocab_size) for _ in range(rng.randint(2, 24)))
            out.append(TraceRequest(f"{kind}-{i + 1}", prompt, None, rng.randint(6, 16)))
    return out


@dataclasses.dataclass
class Check:
    name: str
    passed: int
    total: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclasses.dataclass
class DemoResult:
    """Everything one demo run produced: the requests as replayed, per framework the results
    with and without traces and their seconds, the torch-vs-JAX comparison, the checks, and the
    frameworks that could not run (name -> why)."""

    config: Any
    device: str
    seed: int
    max_batch: int
    requests: list[TraceRequest]
    results: dict[str, list[RequestResult]]
    baseline: dict[str, list[RequestResult]]
    seconds: dict[str, float]
    comparison: dict | None
    checks: list[Check]
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    family: Family | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def _kind(request: TraceRequest) -> str:
    return request.id.split("-", 1)[0]


def _tokens(result: RequestResult) -> list[int]:
    return [int(t) for t in result.tokens]


def available_loops(family: Family) -> tuple[dict[str, Callable[..., list[RequestResult]]], dict[str, str]]:
    """``(loops, missing)``: ``family``'s decode loop of each framework that imports (imported
    now), and why each other one cannot; :class:`~trace_replay_app.runner.CliError` when none can."""
    loops, missing = {}, {}
    for fw in FRAMEWORKS:
        try:
            loops[fw] = family.run_decode(fw)
        except FrameworkMissing as exc:
            missing[fw] = str(exc)
    if not loops:
        raise CliError("no framework can run the demo: " + "; ".join(missing.values()))
    return loops, missing


def run_demo(
    *,
    device: str = "cpu",
    seed: int = 0,
    max_batch: int = 4,
    loops: Mapping[str, Callable[..., list[RequestResult]]] | None = None,
    show_progress: bool | None = False,
    model: str = "gpt2",
    missing: Mapping[str, str] | None = None,
) -> DemoResult:
    """Run the demo and its checks; return everything (see :class:`DemoResult`).

    ``loops`` maps framework names to ``run_decode`` functions (default: those of
    :func:`available_loops` for the family ``model``, whose ``missing`` frameworks the result
    names; or pass them as ``missing``); ``seed`` seeds the model's weights.
    """
    family = get_family(model)
    config = family.default_config()
    weights = family.seeded_weights(config, seed)
    if loops is None:
        loops, missing = available_loops(family)
    loops, missing = dict(loops), dict(missing or {})
    names = list(loops)
    untraced = builtin_requests(config)

    def run(fw: str, requests: Sequence[TraceRequest]):
        return replay_requests(
            fw,
            config,
            weights,
            requests,
            loop=loops[fw],
            device=device,
            max_batch=max_batch,
            show_progress=show_progress,
        )

    baseline, results, seconds = {}, {}, {}
    for fw in names:
        baseline[fw], _ = run(fw, untraced)
    rng = random.Random(seed + 1)
    requests = []
    for req, base in zip(untraced, baseline[names[0]], strict=True):
        if _kind(req) == "own":
            trace = tuple(_tokens(base))
        elif _kind(req) == "random":
            trace = tuple(rng.randrange(config.vocab_size) for _ in range(req.max_new_tokens))
        else:
            requests.append(req)
            continue
        requests.append(dataclasses.replace(req, trace=trace, max_new_tokens=len(trace)))
    for fw in names:
        results[fw], seconds[fw] = run(fw, requests)

    checks = []
    for fw in names:
        traced = [(q, r) for q, r in zip(requests, results[fw], strict=True) if q.trace is not None]
        bad = [
            f"{q.id}: tokens {_tokens(r)} != trace {list(q.trace or ())}"
            for q, r in traced
            if _tokens(r) != list(q.trace or ()) or not all(bool(f) for f in r.forced)
        ]
        checks.append(
            Check(f"{fw}: traced requests reproduced their traces exactly", len(traced) - len(bad), len(traced), bad)
        )
        free = [(q, r, b) for q, r, b in zip(requests, results[fw], baseline[fw], strict=True) if q.trace is None]
        bad = [
            f"{q.id}: tokens {_tokens(r)} != {_tokens(b)} without traces"
            for q, r, b in free
            if _tokens(r) != _tokens(b) or any(bool(f) for f in r.forced)
        ]
        checks.append(
            Check(f"{fw}: untraced requests equal a run without any traces", len(free) - len(bad), len(free), bad)
        )
    comparison = (
        compare_results(requests, results[names[0]], results[names[1]], names=names[:2]) if len(names) >= 2 else None
    )
    return DemoResult(
        config, device, seed, max_batch, requests, results, baseline, seconds, comparison, checks, missing, family
    )


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}" if x else "0"


def report(result: DemoResult, *, quiet: bool = False, out: TextIO | None = None) -> None:
    """Print the demo's summary to ``out`` (default stdout): unless ``quiet``, a header and one
    line per request; then per framework the totals, the agreement and the checks."""
    out = out if out is not None else sys.stdout
    names = list(result.results)
    c = result.config
    reqs = result.requests
    family = result.family or get_family("gpt2")
    for fw, why in result.missing.items():
        print(f"{fw}: missing, the demo runs {' and '.join(names)} only ({why})", file=out)
    if not quiet:
        print(
            f"trace-replay demo: {family.label} with seeded weights (seed {result.seed}; "
            f"{family.describe(c)}), {len(reqs)} requests on "
            f"{slots_for([q.new_tokens for q in reqs], result.max_batch)} slots, device {result.device}",
            file=out,
        )
        print(
            "own: traced with the model's own greedy continuation; random: traced with random tokens; free: untraced",
            file=out,
        )
        print(file=out)
        fw_cell = "{:12s} {:>7s} {:>6s}   "
        head1 = f"{'':9s} {'':6s} {'':4s}  " + "".join(f"{fw:29s}" for fw in names)
        head2 = f"{'request':9s} {'prompt':>6s} {'new':>4s}  " + "".join(
            fw_cell.format("result", "logprob", "rank") for _ in names
        )
        rows = {r["id"]: r for r in result.comparison["requests"]} if result.comparison else {}
        if rows:
            head1 += f"{names[0]} vs {names[1]}"
            head2 += f"{'max |dlogprob|':15s} argmax"
        print(head1.rstrip(), file=out)
        print(head2.rstrip(), file=out)
        for i, q in enumerate(reqs):
            line = f"{q.id:9s} {len(q.prompt):6d} {q.new_tokens:4d}  "
            for fw in names:
                r, b = result.results[fw][i], result.baseline[fw][i]
                if q.trace is not None:
                    status = "exact" if _tokens(r) == list(q.trace) else "DIFFERS"
                else:
                    status = "= no traces" if _tokens(r) == _tokens(b) else "DIFFERS"
                line += fw_cell.format(status, f"{_mean(r.logprobs):.2f}", f"{_mean(r.ranks):.1f}")
            if rows:
                row = rows[q.id]
                div = row["first_argmax_divergence"]
                line += f"{_g(row['max_abs_logprob_diff']):15s} " + ("agrees" if div is None else f"differs at {div}")
            print(line.rstrip(), file=out)
        print(file=out)
    for fw in names:
        res = result.results[fw]
        tokens = sum(len(r.tokens) for r in res)
        secs = result.seconds[fw]
        by_kind = []
        for kind in ("own", "random"):
            pairs = [
                (lp, rk)
                for q, r in zip(reqs, res, strict=True)
                if _kind(q) == kind
                for lp, rk in zip(r.logprobs, r.ranks, strict=True)
            ]
            if pairs:
                by_kind.append(
                    f"{kind} traces mean logprob {_mean(p[0] for p in pairs):.2f}, "
                    f"mean rank {_mean(p[1] for p in pairs):.1f}"
                )
        print(
            f"{fw}: {len(res)} requests, {tokens} tokens in {secs:.2f} s ({tokens / secs:.0f} tokens/s); "
            + "; ".join(by_kind),
            file=out,
        )
    if result.comparison:
        s = result.comparison["summary"]
        div = s["requests_with_argmax_divergence"]
        print(
            f"{names[0]} vs {names[1]}: logprobs differ by at most {_g(s['max_abs_logprob_diff'])} (mean "
            f"{_g(s['mean_abs_logprob_diff'])}) over {s['compared_positions']} tokens; "
            + (
                "argmax choices agree everywhere"
                if not div
                else f"argmax choices differ in {div} requests (earliest at position {s['earliest_argmax_divergence']})"
            ),
            file=out,
        )
    for check in result.checks:
        print(f"check: {check.name}: {check.passed}/{check.total} {'ok' if check.ok else 'FAILED'}", file=out)
        for failure in check.failures[:10]:
            print(f"   {failure}", file=out)
    print("all checks passed" if result.ok else "CHECKS FAILED: see above", file=out)


def cmd_demo(args, out: TextIO) -> int:
    """The ``demo`` subcommand: run, report, exit status 0 when every check passed, else 1.
    Before any work, each framework that will run must see ``--device``
    (:class:`~trace_replay_app.runner.CliError` naming it and how to install its CUDA build)."""
    loops, missing = available_loops(get_family(args.model or "gpt2"))
    for fw in loops:
        check_framework_device(fw, args.device)
    result = run_demo(
        device=args.device,
        seed=0 if args.seed is None else args.seed,
        max_batch=args.max_batch,
        loops=loops,
        missing=missing,
        show_progress=False if args.quiet else None,
        model=args.model or "gpt2",
    )
    report(result, quiet=args.quiet, out=out)
    return 0 if result.ok else 1
