"""Real-model decode speed: the Llama-family loops (torch, JAX) next to transformers' ``generate``.

Question: replaying traced requests through a Qwen2.5-0.5B-shaped (and a Llama-3-8B-shaped) model
in bf16 on one GPU, how many ms per decode step do the torch loop (CUDA-graph step) and the JAX
loop (jitted step) take, next to ``generate`` on the same model, batch and lengths with a static
cache and ``torch.compile`` (the strong peer) and with its dynamic cache; how far is each from the
memory floor; how fast is the prefill; what share of a step do replay and logprob/rank take?

Setup (``qwen_shape.py``): ``--shape qwen2.5-0.5b`` (default; ``qwen2``, hidden 896, 24 layers, 14
heads, 2 key/value heads, intermediate 4864, vocabulary 151,936, tied; batches 1, 8, 64, 256, 512)
or ``llama3-8b`` (``llama``, hidden 4096, 32 layers, 32 heads, 8 key/value heads, intermediate
14336, vocabulary 128,256, untied, ``rope_theta`` 500000; batch 64). Every provider decodes the
same bf16 weights, deterministic pattern weights (``qwen_shape.pattern_weights``: N(0, 0.02^2),
each matrix a zero-copy strided view of one random vector: ~50 MB of host memory at 8B, not 32 GB
of float32; the rows of 2026-12-02 used transformers' random init). The torch loop gets them through
``TORCH.model`` (``LlamaTorch`` copies one tensor at a time contiguous and uploads it: host peak
~2.5 GB at 8B); the JAX loop gets the same values made on the device in its parameter layout
(``jax_pattern_params``: its ``_params`` would build a 32 GB float32 host pytree at 8B), checked
bit for bit against ``_params`` on a tiny config in every run; both run the shipped drivers'
``decode_model`` (the bits of ``run_decode``) on a model built once, outside the timing.
transformers' model is made on the device (``from_config``) and the weights copied in. Per batch
``B``: ``B`` requests (seed 0), prompts of 64-512 tokens, traces of 128-512 random tokens, all
decoding at once; ``generate`` gets the same prompts (left-padded) and decodes ``max(trace
lengths)`` tokens greedily for every row (it has no per-row lengths).

Peers. ``generate-static``: ``generate(..., cache=StaticCache(...), compile_config=CompileConfig(
fullgraph=True, dynamic=False, mode="reduce-overhead"))`` (``past_key_values=`` in releases before
``cache``). With a static cache on CUDA, transformers 5 compiles the decode step
itself (``get_compiled_call``; the prefill, whose shape changes, stays eager): the documented
recipe (docs ``llm_optims``: static cache, ``torch.compile`` in ``reduce-overhead`` mode, i.e. CUDA
graphs) without also compiling ``model.forward`` (two nested compiles, one per prefill shape). The
cache is made once per batch (sized for its whole call) and ``reset()`` before each call, so the
addresses the CUDA graphs recorded stay; ``dynamic=False``: a static-shape graph per batch.
``compiles_in_warmup`` / ``compiles_in_timed_calls``: Dynamo graphs compiled (the latter 0 when
the warm-up covered every compile). On a CPU (``--quick``) the same call runs Dynamo's full-graph
trace with ``backend="eager"``. ``generate-dynamic``: plain ``generate`` (dynamic cache, eager).

Method: per provider and batch, warm-up calls (``warmup_s``, left out: our loops the whole call and
the prefill-only one; ``generate`` 8 new tokens, then 1), then ``REPEATS`` alternating timed calls
of the whole decode (prefill included) and of the prefill alone (traces of one token; ``generate``:
``max_new_tokens=1``), medians counted. ``decode_ms_per_step`` = (whole - prefill) / (steps - 1);
``tokens_per_s`` = ``B`` / that; ``call_tokens_per_s`` = the traces' tokens / the whole call;
``prefill_tokens_per_s`` = the prompts' tokens (unpadded) / the prefill-only call (fixed costs
included: the loops' cache, first step, results). ``floor_ms`` = bytes a step must read (every
weight once, bf16, of an untied embedding only ``B`` rows, plus the mean KV cache filled over the
steps) / the device copy bandwidth measured in this run. ``x_generate_static`` / ``_dynamic``: the
peer's ms/step over this row's (same shape and batch, whichever run it came from).
``replay_logprob_*``: what replay and logprob/rank add to a greedy step over ``[B, vocab]`` bf16
logits (``models_sampler.py``), and its share of the step.

Run (GPU): ``python bench/models.py [--shape S] [--batches 1,8] [--providers torch,jax]
[--append]``: rows go to ``bench/results/models.json`` as each is measured; ``--append`` merges
them into the file's rows (one of the same shape, provider and batch replaced; each keeps its own
run's provenance). A device call is limited to 10 minutes: split the sweep, e.g. ``--providers
torch,jax``; ``--providers generate-static --append``; ``--providers generate-dynamic --batches
1,8,64 --append`` and ``256,512`` (eager: 88 ms a step at 0.5B on the H200, 2026-12-02);
``--shape llama3-8b --append`` (torch, JAX, the static peer; ``generate-dynamic`` only when asked,
its 8B time unmeasured). These splits are estimates. ``bench/models_plot.py`` then draws
``bench/results/models.svg``. ``--quick``: a CPU dry run of both shapes' tiny twins and every
provider (writes nothing).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen_shape as qs  # noqa: E402
from harness import PROVENANCE_KEYS, RESULTS_DIR, copy_bandwidth, provenance, table  # noqa: E402
from models_plot import relate, save  # noqa: E402
from models_sampler import replay_logprob_us  # noqa: E402

REPEATS = 2  # timed whole / prefill-only calls (medians)
PROVIDERS = {
    "torch": "torch loop, CUDA-graph step",
    "jax": "JAX loop, jitted step",
    "generate-static": "transformers generate, static cache + torch.compile",
    "generate-dynamic": "transformers generate, dynamic cache",
}
DEFAULTS = {  # shape: (batches, providers)
    "qwen2.5-0.5b": ("1,8,64,256,512", "torch,jax,generate-static,generate-dynamic"),
    "llama3-8b": ("64", "torch,jax,generate-static"),
}
RESULTS = os.path.join(RESULTS_DIR, "models.json")


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


class Loop:
    """One of our loops on a model built once: ``decode_model`` of the shipped driver."""

    def __init__(self, framework, config, device):
        if framework == "torch":
            from trace_replay_app.drivers.torch_driver import decode_model
            from trace_replay_app.models.llama.torch_loop import TORCH

            model = TORCH.model(config, qs.pattern_weights(config), device=device, dtype="bfloat16")
            self.run = lambda reqs: decode_model(
                model, reqs, device=device, max_batch=len(reqs), prefill_tokens=TORCH.prefill_tokens
            )
        else:
            import jax.numpy as jnp

            from trace_replay_app.drivers.jax_attention import attention_for
            from trace_replay_app.drivers.jax_driver import decode_model as jax_decode
            from trace_replay_app.models.llama.jax_loop import JAX
            from trace_replay_jax import resolve_device

            dev = resolve_device(device)
            qs.check_jax_pattern(config, dev)
            attention = attention_for(dev, jnp.bfloat16)  # as run_decode picks it: cuDNN on a GPU
            model, params = JAX.bind(config, jnp.bfloat16, attention), qs.jax_pattern_params(config, dev, jnp.bfloat16)
            self.run = lambda reqs: jax_decode(model, params, reqs, device=device, max_batch=len(reqs))

    def prepare(self, requests):
        return requests  # the warm-up decodes the whole call: the jitted programs follow the lengths

    def compiles(self) -> int:
        return 0  # no torch.compile here

    def __call__(self, requests):
        return self.run(requests)  # host arrays: the call has waited for the device


class Generate:
    """transformers' ``generate`` on ``model``: ``max(trace lengths)`` new tokens for every row."""

    def __init__(self, model, device: str, static: bool) -> None:
        import torch
        import transformers

        self.model, self.device, self.static, self.cache = model, device, static, None
        self.extra: dict = {}
        self.last: dict = {}  # (batch, new tokens) -> the first output: a reused cache must not leak
        self.repeatable = True
        if static:
            options = dict(mode="reduce-overhead") if device == "cuda" else dict(backend="eager", mode=None)
            self.compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, **options)
            if device != "cuda":
                self.compile_config._compile_all_devices = True  # Dynamo on the CPU too
            limit = getattr(torch._dynamo.config, "recompile_limit", 8)
            torch._dynamo.config.recompile_limit = max(limit, 64)  # a graph per batch, never eager

    def compiles(self) -> int:
        import torch._dynamo.utils

        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def prepare(self, requests):
        """The batch's static cache, sized for its whole call; the warm-up requests (8 tokens)."""
        import transformers

        self.last.clear()
        self.repeatable = True
        if self.static:
            longest = max(len(r.prompt) for r in requests) + max(len(r.trace) for r in requests)
            self.cache = transformers.StaticCache(config=self.model.config, max_cache_len=longest)
            # transformers 5's later releases name the argument ``cache`` (``past_key_values`` deprecated)
            forward = inspect.signature(type(self.model).forward).parameters
            self.extra = {"cache" if "cache" in forward else "past_key_values": self.cache}
            self.extra["compile_config"] = self.compile_config
        return [type(r)(r.id, prompt=r.prompt, trace=r.trace[:8]) for r in requests]

    def __call__(self, requests):
        import torch

        new = max(len(r.trace) for r in requests)
        longest = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), longest, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding, as decoder-only generation wants
            ids[i, longest - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, longest - len(r.prompt) :] = 1
        if self.cache is not None:
            self.cache.reset()  # zeroed in place: the addresses the CUDA graphs hold stay
        with torch.no_grad():
            out = self.model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                **self.extra,
            )
        assert out.shape == (len(requests), longest + new), f"generate returned {tuple(out.shape)}"
        last = self.last.setdefault((len(requests), new), out)  # the first output of these inputs
        self.repeatable = self.repeatable and torch.equal(last, out)
        return None


def _row(shape, pid, config, setup, batch, requests, warm, wholes, prefills, floor, bandwidth, extra):
    steps = max(len(r.trace) for r in requests)
    whole, prefill = float(np.median(wholes)), float(np.median(prefills))
    step_ms = (whole - prefill) / max(1, steps - 1) * 1e3
    floor_ms = floor / (bandwidth * 1e9) * 1e3
    spec, parts = qs.SHAPES[shape], extra["replay_logprob_parts_us"] or {}
    return dict(
        shape=shape,
        provider_id=pid,
        provider=PROVIDERS[pid],
        batch=batch,
        steps=steps,
        useful_tokens=sum(len(r.trace) for r in requests),
        prompt_tokens_total=sum(len(r.prompt) for r in requests),
        warmup_s=warm,
        whole_s=whole,
        prefill_s=prefill,
        whole_runs_s=wholes,
        prefill_runs_s=prefills,
        decode_ms_per_step=step_ms,
        tokens_per_s=batch / step_ms * 1e3,
        call_tokens_per_s=sum(len(r.trace) for r in requests) / whole,
        prefill_tokens_per_s=sum(len(r.prompt) for r in requests) / prefill,
        floor_ms=floor_ms,
        floor_bytes=floor,
        d2d_gbps=bandwidth,
        x_floor=step_ms / floor_ms if floor_ms == floor_ms else None,
        **extra,
        # replay + logprob's added device time, its share of the step (fused and separate pass);
        # None where not timed (generate; torch on a CPU)
        replay_logprob_us=parts.get("added"),
        replay_logprob_share=parts["added"] / (step_ms * 1e3) if "added" in parts else None,
        replay_logprob_separate_share=(
            parts["added_separate"] / (step_ms * 1e3) if "added_separate" in parts else None
        ),
        model=f"{spec['model_type']} {json.dumps(setup['sizes'])} {json.dumps(spec['options'])}",
        dtype="bfloat16",
        weights="pattern (qwen_shape.pattern_weights, seed 0)",
        prompt_tokens=list(setup["prompt"]),
        trace_tokens=list(setup["trace"]),
    )


def _provider(pid, shape, sizes, config, device, hf):
    if pid in ("torch", "jax"):
        return Loop(pid, config, device)
    if "model" not in hf:
        hf["model"] = qs.hf_pattern_model(shape, sizes, config, device)
    return Generate(hf["model"], device, static=pid == "generate-static")


def _free(device):
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _measure(call, requests, prefill_requests, device):
    """``(warmup_s, whole call times, prefill-only call times, results of the last whole call,
    Dynamo graphs compiled (during the warm-up, during the timed calls))``."""
    warm_requests, start = call.prepare(requests), call.compiles()
    warm = _timed(lambda: (call(warm_requests), call(prefill_requests)), device)[0]
    before = call.compiles()
    wholes, prefills, results = [], [], None
    for _ in range(REPEATS):
        whole, results = _timed(lambda: call(requests), device)
        wholes.append(whole)
        prefills.append(_timed(lambda: call(prefill_requests), device)[0])
    return warm, wholes, prefills, results, (before - start, call.compiles() - before)


def _extra(call, pid, batch, config, device, requests, results, compiles):
    """The provider's own fields: replay + logprob timing and trace check (our loops), the
    transformers version and compile settings (``generate``)."""
    if isinstance(call, Loop):
        replay = replay_logprob_us(pid, batch, config.vocab_size, device)
        exact = all(res.tokens.tolist() == list(r.trace) for r, res in zip(requests, results))
        return dict(replay_logprob_parts_us=replay, traces_reproduced=exact)
    import transformers

    extra = dict(transformers=transformers.__version__, traces_reproduced=None, replay_logprob_parts_us=None)
    extra["same_tokens_each_call"] = call.repeatable  # greedy: every call of the same inputs alike
    if call.static:
        extra.update(compile=call.compile_config.to_dict(), compiles_in_warmup=compiles[0])
        extra["compiles_in_timed_calls"] = compiles[1]
    return extra


def run_shape(
    shape: str,
    args: argparse.Namespace,
    device: str,
    bandwidth: float,
    stamp: dict,
    base: list,
    rows: list,
    failed: list,
) -> None:
    """Every provider and batch of ``shape``; rows appended to ``rows`` (and saved as they come)."""
    from trace_replay_app.models.llama.hf import config_from_hf

    spec = qs.SHAPES[shape]
    setup = spec["quick"] if args.quick else spec["full"]
    config = config_from_hf(qs.hf_config(setup["sizes"], spec["model_type"], **spec["options"]).to_dict())
    default_batches = ",".join(map(str, setup["batches"])) if args.quick else DEFAULTS[shape][0]
    providers = args.providers or (",".join(PROVIDERS) if args.quick else DEFAULTS[shape][1])
    work, lengths = [], (setup["prompt"], setup["trace"])
    for batch in [int(b) for b in (args.batches or default_batches).split(",")]:
        requests = qs.traced_requests(np.random.default_rng(0), batch, *lengths, config.vocab_size)
        work.append((batch, requests, qs.prefill_only(requests), qs.floor_bytes(config, requests)))
    hf: dict = {}
    for pid in providers.split(","):
        t0 = time.perf_counter()
        try:
            call = _provider(pid, shape, setup["sizes"], config, device, hf)
            ready = time.perf_counter() - t0  # weights made and uploaded, models built
            print(f"{shape} {pid}: ready in {ready:.1f} s", flush=True)
            for batch, requests, prefill_requests, floor in work:
                t_start = time.perf_counter()
                warm, wholes, prefills, results, compiles = _measure(call, requests, prefill_requests, device)
                extra = _extra(call, pid, batch, config, device, requests, results, compiles)
                row = _row(shape, pid, config, setup, batch, requests, warm, wholes, prefills, floor, bandwidth, extra)
                row.update(bench_s=time.perf_counter() - t_start, setup_s=ready)
                rows.append(dict(row, **stamp))
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                if not args.quick:
                    save(args.results, base, rows)
            del call
        except Exception:  # noqa: BLE001 - one provider failing leaves the others' rows
            traceback.print_exc()
            failed.append(f"{shape}/{pid}")
        _free(device)
    hf.clear()
    _free(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a CPU dry run of the tiny twins (writes nothing)")
    ap.add_argument("--shape", choices=list(qs.SHAPES), help="default: qwen2.5-0.5b (--quick: both)")
    ap.add_argument("--batches", help="comma-separated (default: 1,8,64,256,512 for Qwen, 64 for the 8B shape)")
    ap.add_argument("--providers", help=f"comma-separated of {', '.join(PROVIDERS)} (default: by shape)")
    ap.add_argument("--append", action="store_true", help="merge the rows into the results file's rows")
    ap.add_argument("--results", default=RESULTS, help="the results file (default: bench/results/models.json)")
    args = ap.parse_args()
    for pid in args.providers.split(",") if args.providers else []:
        if pid not in PROVIDERS:
            ap.error(f"unknown provider {pid!r} (known: {', '.join(PROVIDERS)})")
    device = "cpu" if args.quick else "cuda"
    shapes = [args.shape] if args.shape else (list(qs.SHAPES) if args.quick else ["qwen2.5-0.5b"])
    bandwidth = copy_bandwidth()["d2d"]["gbps_p50"] if device == "cuda" else float("nan")
    prov = provenance()
    stamp = {k: prov[k] for k in PROVENANCE_KEYS}
    base = []
    if args.append and os.path.exists(args.results):
        with open(args.results) as f:
            base = json.load(f)
        print(f"--append: {len(base)} rows in {args.results}")
    rows: list[dict] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    for shape in shapes:
        run_shape(shape, args, device, bandwidth, stamp, base, rows, failed)
    relate(rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    if args.quick:
        json.dumps(rows)  # the rows serialise; a dry run writes nothing
        print("quick run: nothing written")
    elif rows:
        save(args.results, base, rows)
        print("wrote", args.results)
    columns = ["shape", "provider_id", "batch", "decode_ms_per_step", "floor_ms", "x_floor", "prefill_tokens_per_s"]
    columns += ["x_generate_static", "replay_logprob_us", "replay_logprob_share", "traces_reproduced"]
    print(table(rows, columns))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
