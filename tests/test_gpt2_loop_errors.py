"""The GPT-2 reference decode loops refuse bad arguments before anything runs: a table of
id -> (arguments, exception, anchored message) for both frameworks, checked to run no decode
step and change no weight; a device this machine lacks is refused. CPU tier."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from helpers.gpt2_cases import CONFIG, LOOPS  # noqa: E402

from trace_replay_app.models.gpt2 import seeded_weights  # noqa: E402
from trace_replay_app.records import TraceRequest  # noqa: E402


def _args(**change):
    """Valid arguments of run_decode, with some replaced."""
    args = {
        "config": CONFIG,
        "weights": seeded_weights(CONFIG),
        "device": "cpu",
        "max_batch": 2,
        "requests": [TraceRequest("a", (1, 2, 3), (4, 5)), TraceRequest("b", (6,), max_new_tokens=2)],
    }
    args.update(change)
    return args


def _weights(**change):
    w = seeded_weights(CONFIG)
    for name, value in change.items():
        name = name.replace("__", ".")
        if value is None:
            del w[name]
        else:
            w[name] = value
    return w


def _request(**fields):
    base = {"id": "x", "prompt": (1, 2), "trace": None, "max_new_tokens": 2}
    base.update(fields)
    return [TraceRequest("a", (1, 2, 3), (4, 5)), TraceRequest(**base)]


ERRORS = {
    "config": (_args(config={"n_embd": 64}), TypeError, r"^config must be a GPT2Config \(got dict\)$"),
    "weights-type": (
        _args(weights=[1, 2]),
        TypeError,
        r"^weights must be a mapping of parameter name -> array \(got list\)$",
    ),
    "weights-missing": (
        _args(weights=_weights(ln_f__bias=None)),
        ValueError,
        r"^weights lack parameter 'ln_f\.bias' \(shape \(64,\)\)$",
    ),
    "weights-shape": (
        _args(weights=_weights(wte__weight=np.zeros((511, 64), np.float32))),
        ValueError,
        r"^weights\['wte\.weight'\] must have shape \(512, 64\) \(got \(511, 64\)\)$",
    ),
    "weights-dtype": (
        _args(weights=_weights(ln_f__bias=np.ones(64, np.int64))),
        ValueError,
        r"^weights\['ln_f\.bias'\] must be a floating-point array \(got dtype int64\)$",
    ),
    "requests-type": (
        _args(requests=TraceRequest("a", (1,), (2,))),
        TypeError,
        r"^requests must be a sequence of TraceRequest \(got TraceRequest\)$",
    ),
    "request-type": (
        _args(requests=[("a", (1,), (2,))]),
        TypeError,
        r"^requests\[0\] must be a TraceRequest \(got tuple\)$",
    ),
    "empty-prompt": (
        _args(requests=_request(prompt=())),
        ValueError,
        r"^requests\[1\] \(id 'x'\): prompt must hold at least one token \(got an empty prompt\)$",
    ),
    "prompt-vocab": (
        _args(requests=_request(prompt=(5, 512))),
        ValueError,
        r"^requests\[1\] \(id 'x'\): prompt\[1\]=512 is outside \[0, vocab_size=512\)$",
    ),
    "prompt-float": (
        _args(requests=_request(prompt=(1.5, 2.0))),
        ValueError,
        (
            r"^requests\[1\] \(id 'x'\): prompt must be a 1-D sequence of int token ids "
            r"\(got float64\[2\]\)$"
        ),
    ),
    "trace-negative": (
        _args(requests=_request(trace=(3, -1))),
        ValueError,
        r"^requests\[1\] \(id 'x'\): trace\[1\]=-1 is outside \[0, vocab_size=512\)$",
    ),
    "trace-empty": (
        _args(requests=_request(trace=())),
        ValueError,
        (
            r"^requests\[1\] \(id 'x'\): trace must hold at least one token \(got an empty trace\); "
            r"use trace=None with max_new_tokens for free decoding$"
        ),
    ),
    "max-new-tokens": (
        _args(requests=_request(max_new_tokens=-1)),
        ValueError,
        r"^requests\[1\] \(id 'x'\): max_new_tokens must be an int >= 0 \(got -1\)$",
    ),
    "too-long": (
        _args(requests=_request(prompt=tuple(range(100)), trace=tuple(range(29)))),
        ValueError,
        (
            r"^requests\[1\] \(id 'x'\): prompt \(100 tokens\) \+ 29 new tokens = 129 exceeds "
            r"config\.n_positions=128$"
        ),
    ),
    "max-batch-zero": (_args(max_batch=0), ValueError, r"^max_batch must be an int >= 1 \(got 0\)$"),
    "max-batch-float": (_args(max_batch=2.0), ValueError, r"^max_batch must be an int >= 1 \(got 2\.0\)$"),
    "max-batch-bool": (_args(max_batch=True), ValueError, r"^max_batch must be an int >= 1 \(got True\)$"),
    "on-step": (
        _args(on_step=3),
        TypeError,
        (r"^on_step must be a callable taking the tokens decoded in a step, or None \(got int\)$"),
    ),
    "device-name": (_args(device="tpu"), ValueError, r"^device must be 'cpu', 'cuda' or 'cuda:N' \(got 'tpu'\)$"),
    "device-index": (
        _args(device="cuda:x"),
        ValueError,
        r"^device must be 'cpu', 'cuda' or 'cuda:N' \(got 'cuda:x'\)$",
    ),
    "device-type": (_args(device=0), TypeError, r"^device must be a str: 'cpu', 'cuda' or 'cuda:N' \(got int\)$"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_argument_errors(framework, case):
    args, error, pattern = ERRORS[case]
    args = dict(args)
    before = {name: w.copy() for name, w in args["weights"].items()} if isinstance(args["weights"], dict) else None
    calls = []
    args.setdefault("on_step", calls.append)
    with pytest.raises(error, match=pattern):
        LOOPS[framework](**args)
    assert calls == [], "a rejected call ran decode steps"
    if before is not None:
        assert all(np.array_equal(before[k], args["weights"][k]) for k in before), "a rejected call changed weights"


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_unavailable_device(framework):
    """A device that this machine lacks is refused before anything runs."""
    if framework == "torch" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU for torch")
    if framework == "jax" and any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a CUDA GPU for JAX")
    with pytest.raises(ValueError, match=r"^device 'cuda:0' is not available: "):
        LOOPS[framework](**_args(device="cuda:0"))
