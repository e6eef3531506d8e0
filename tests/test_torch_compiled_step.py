"""A torch family's decode step under ``torch.compile`` (the CPU backend): the eager step's
logits and cache writes, and no copy of the cache in the compiled code (the step's keys and
values are stored in it in place: ``drivers/torch_attention.store_step_kv``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from trace_replay_app.models.gpt2 import config as gpt2_config
from trace_replay_app.models.gpt2.torch_loop import GPT2Torch
from trace_replay_app.models.llama.config import default_config, seeded_weights
from trace_replay_app.models.llama.torch_loop import LlamaTorch

ROWS, KV_LEN = 3, 40


def _model(family: str):
    if family == "gpt2":
        small = gpt2_config.GPT2Config(n_layer=2)
        return GPT2Torch(small, gpt2_config.seeded_weights(small, seed=2), torch.device("cpu"))
    config = default_config(family)
    return LlamaTorch(config, seeded_weights(config, seed=2), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_compiled_decode_step_writes_the_cache_in_place(family, rng):
    from torch._inductor.utils import run_and_get_code

    model = _model(family)
    torch._dynamo.reset()
    cache = torch.from_numpy(rng.standard_normal(model.new_cache(ROWS, KV_LEN).shape).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, model.vocab_size, ROWS))
    positions = torch.tensor([0, 17, KV_LEN - 1])
    eager_cache = cache.clone()
    with torch.no_grad():
        want = model.decode(eager_cache, tokens, positions)
        got, code = run_and_get_code(torch.compile(model.decode, dynamic=False), cache, tokens, positions)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.numpy(), eager_cache.numpy(), rtol=1e-5, atol=1e-5)  # written, once
    # A write through a view of the cache would be lowered as a copy of all of it (a buffer of
    # the cache's size); the masked attention may still copy one layer's keys for its product.
    pattern = r"empty_strided_cpu\(\(([0-9, ]*)\)"
    sizes = [int(np.prod([int(d) for d in s.split(",") if d.strip()])) for s in re.findall(pattern, "\n".join(code))]
    assert sizes and max(sizes) < cache.numel() // 2, f"a buffer of {max(sizes)} elements (the cache: {cache.numel()})"
