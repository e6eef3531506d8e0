"""The demo: a continuous-batching decode loop replaying traces, run in-process."""

import io

import numpy as np
import pytest
import torch

from trace_replay_core import token_logprob_rank_reference
from trace_replay_torch import demo


def _main(*args: str):
    out = io.StringIO()
    status = demo.main(list(args), out=out)
    return status, out.getvalue()


def test_demo_passes_its_checks_on_cpu():
    status, text = _main("--device", "cpu")
    assert status == 0, text
    assert "all checks passed" in text
    assert "FAILED" not in text
    assert " trace " in text and "forced tokens" in text    # per-token table and summary
    assert "(after request" in text                        # a slot was reused


def test_demo_quiet_prints_summary_and_checks_only():
    status, text = _main("--device", "cpu", "--quiet")
    assert status == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("summary:") and "forced tokens" in lines[0]
    assert all(line.startswith("check:") and line.endswith(" ok") for line in lines[1:-1])
    assert lines[-1] == "all checks passed"


@pytest.mark.parametrize("args", [("--seed", "3", "--requests", "13", "--max-batch", "3"),
                                  ("--seed", "11", "--max-batch", "1"),
                                  ("--seed", "5", "--requests", "2")])
def test_demo_other_schedules(args):
    status, text = _main("--device", "cpu", "--quiet", *args)
    assert status == 0, text


def test_default_run_covers_every_case():
    result = demo.run_demo(device="cpu")
    assert result.ok, [c.failures for c in result.checks]
    reqs = result.requests
    traced = [r for r in reqs if r.trace is not None]
    free = [r for r in reqs if r.trace is None]
    assert traced and free
    assert len({r.admitted for r in reqs}) > 1 and len({r.finished for r in reqs}) > 1
    # a free request took a slot that a traced request had left: admission must clear the trace
    by_id = {r.rid: r for r in reqs}
    assert any(r.previous is not None and by_id[r.previous].trace is not None for r in free)
    assert any(r.max_new_tokens > len(r.trace) for r in traced)


def test_trace_then_sampler_takes_over():
    result = demo.run_demo(device="cpu")
    longer = [r for r in result.requests if r.trace is not None and r.max_new_tokens > len(r.trace)]
    assert longer
    for r in longer:
        n = len(r.trace)
        assert len(r.tokens) == r.max_new_tokens
        assert sum(r.forced(i) for i in range(len(r.tokens))) == n
        assert r.tokens[:n] == r.trace                          # forced for exactly n steps ...
        assert r.tokens[n:] == r.draws[n:]                      # ... then the sampler's own tokens
        assert any(t != d for t, d in zip(r.tokens[:n], r.draws[:n]))   # replay did overwrite


def test_forced_tokens_logprob_rank_come_from_real_logits():
    result = demo.run_demo(device="cpu")
    forced = [(lp, rk) for r in result.requests for i, (lp, rk) in enumerate(zip(r.logprobs, r.ranks))
              if r.forced(i)]
    assert forced
    assert all(lp < 0 and 1 <= rk <= demo.VOCAB_SIZE for lp, rk in forced)
    # random trace tokens are unlikely under the model; masking the logits would give rank 1, logprob 0
    assert np.mean([rk for _, rk in forced]) > 20


def test_logprob_rank_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, demo.VOCAB_SIZE, generator=g) * 3
    logits[3, :5] = logits[3].max() + 1                      # ties at the top count against the token
    tokens = torch.randint(0, demo.VOCAB_SIZE, (7,), generator=g)
    tokens[3] = 2
    lp, rank = demo._logprob_rank(logits, tokens)
    ref_lp, ref_rank = token_logprob_rank_reference(logits.numpy(), tokens.numpy())
    np.testing.assert_allclose(lp.numpy(), ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rank.numpy(), ref_rank)
    assert rank[3] == 5
    assert demo._logprob_rank(logits, logits.argmax(1))[1].tolist() == [1, 1, 1, 5, 1, 1, 1]


def test_checks_catch_a_slot_whose_old_trace_is_not_cleared(monkeypatch):
    add = demo.TraceReplayState.add_request

    def keeps_old_trace(self, slot, trace=None):
        if trace is not None:
            add(self, slot, trace)

    monkeypatch.setattr(demo.TraceReplayState, "add_request", keeps_old_trace)
    status, text = _main("--device", "cpu", "--quiet")
    assert status == 1
    assert "rows without a trace kept the sampler's token" in text and "FAILED" in text


def test_checks_catch_a_replay_that_does_nothing(monkeypatch):
    monkeypatch.setattr(demo.TraceReplayState, "replay", lambda self, sampled, idx_mapping: sampled)
    status, text = _main("--device", "cpu", "--quiet")
    assert status == 1
    assert "traced requests reproduced their traces exactly: 0/" in text


@pytest.mark.parametrize("args, message", [
    (("--requests", "0"), r"--requests must be between 1 and"),
    (("--max-batch", "0"), r"--max-batch must be at least 1"),
    (("--device", "tpu:0"), r"--device"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(list(args))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_demo_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    status, text = _main("--device", "cuda", "--quiet")
    assert status == 0, text
    assert "forced tokens" in text
