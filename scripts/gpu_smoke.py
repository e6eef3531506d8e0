"""Quick GPU smoke check of the core's assumptions (device machine)."""
import sys, time, traceback
import numpy as np

def main():
    import triton, cuda.bindings, cuda.core
    print("triton", triton.__version__, "cuda-core", cuda.core.__version__, "cuda-bindings", cuda.bindings.__version__)
    from trace_replay_core import TraceTable, replay_reference
    print("torch loaded after import core:", "torch" in sys.modules)
    import torch
    for placement in ("device", "host_mapped"):
        t = TraceTable(64, 512, device="cuda", placement=placement, vocab_size=50000)
        rng = np.random.default_rng(1)
        traces = {}
        for s in range(0, 64, 3):
            tr = rng.integers(0, 50000, rng.integers(1, 512)).astype(np.int64)
            t.stage(s, tr); traces[s] = tr
        s0 = torch.cuda.current_stream().cuda_stream
        t.commit(stream=s0)
        tab, lens = t.snapshot()
        ok = all((tab[s, :len(tr)] == tr).all() and lens[s] == len(tr) for s, tr in traces.items())
        print(placement, "commit ok", ok, "lens nonzero", int((lens > 0).sum()))
        B = 1000
        idx = torch.randint(-1, 64, (B,), dtype=torch.int32, device="cuda")
        tot = torch.randint(0, 600, (64,), dtype=torch.int64, device="cuda")
        pr = (tot - torch.randint(-5, 520, (64,), device="cuda")).to(torch.int32)
        sampled = torch.full((B,), -5, dtype=torch.int64, device="cuda")
        exp = replay_reference(sampled.cpu().numpy(), idx.cpu().numpy(), tab, lens, tot.cpu().numpy(), pr.cpu().numpy())
        t.replay(sampled, idx, tot, pr, stream=s0)
        got = sampled.cpu().numpy()
        print(placement, "replay ok", (got == exp).all(), "changed", int((exp != -5).sum()))
        # timing of raw launch
        from trace_replay_core import as_view
        vs = t.views(sampled, idx, tot, pr, stream=s0)
        for _ in range(100):
            t.replay_views(*vs, stream=s0)
        torch.cuda.synchronize()
        n = 3000
        t0 = time.perf_counter()
        for _ in range(n):
            t.replay_views(*vs, stream=s0)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(placement, "host us/launch", (t1 - t0) / n * 1e6)
        t0 = time.perf_counter()
        for _ in range(n):
            t.replay(sampled, idx, tot, pr, stream=s0)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(placement, "host us/replay via dlpack", (t1 - t0) / n * 1e6)
        t.close(); t.close()
    import trace_replay_torch as trt
    st = trt.TraceReplayState(8, 16, device="cuda", total_len=torch.zeros(8, dtype=torch.int32, device="cuda"), prompt_len=torch.zeros(8, dtype=torch.int32, device="cuda"))
    st.add_request(1, [3, 4]); st.apply_staged_writes()
    x = torch.zeros(2, dtype=torch.int64, device="cuda"); st.replay(x, torch.tensor([1, 0], dtype=torch.int32, device="cuda"))
    print("adapter", x.tolist())
    torch.cuda.synchronize()
    n = 3000
    idx = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    for _ in range(n):
        st.replay(x, idx)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print("adapter host us/step", (t1 - t0) / n * 1e6)

try:
    main()
except Exception:
    traceback.print_exc()
    sys.exit(1)
