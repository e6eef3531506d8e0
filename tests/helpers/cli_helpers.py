"""Helpers shared by the command-line test modules: in-process runs, child processes, sentinels,
and checkpoint folders and safetensors files, good and bad."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np

from trace_replay_app import cli
from trace_replay_app.checkpoint import read_safetensors, save_checkpoint, write_safetensors
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_GPT2 = GPT2Config(vocab_size=96, n_positions=40, n_embd=16, n_layer=2, n_head=2)
STAGE = "trace-replay: stage "  # what the command says at each stage when TRACE_REPLAY_TEST_STAGES is set


def load(path):
    """The JSON document at ``path``."""
    with open(path) as f:
        return json.load(f)


def main(*args):
    """Run ``trace-replay args...`` in this process; return (exit status, what it printed)."""
    out = io.StringIO()
    status = cli.main(list(args), out=out)
    return status, out.getvalue()


def sentinel(path) -> str:
    """Write random bytes at ``path`` (a file an output must not replace); return their sha256."""
    data = os.urandom(64)
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclasses.dataclass
class Child:
    """A finished ``python -m trace_replay_app`` child: exit status, stdout, and stderr without
    the stage lines."""

    status: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one line of stderr (no traceback); fails the test otherwise."""
        assert "Traceback" not in self.err, self.err
        lines = self.err.splitlines()
        assert len(lines) == 1, self.err
        return lines[0]


def _env(stages: bool, extra: dict | None) -> dict:
    env = dict(os.environ, **(extra or {}))
    paths = [ROOT, os.path.join(ROOT, "adapters"), os.path.join(ROOT, "tests")]  # tests: helpers run as -m
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.pop("TRACE_REPLAY_TEST_STAGES", None)
    if stages:
        env["TRACE_REPLAY_TEST_STAGES"] = "1"
    return env


def _command(args, memory_limit: int | None, module: str) -> list[str]:
    if memory_limit is None:
        return [sys.executable, "-m", module, *args]
    start = (  # the address-space cap set inside the child: no fork-time hook in this process
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory_limit}, {memory_limit})); "
        f"sys.argv[0] = 'trace-replay'; runpy.run_module({module!r}, run_name='__main__')"
    )
    return [sys.executable, "-c", start, *args]


def child(
    *args: str,
    cwd,
    interrupt_at: str | None = None,
    memory_limit: int | None = None,
    env: dict | None = None,
    timeout_s: float = 120,
    module: str = "trace_replay_app",
) -> Child:
    """Run ``python -m trace_replay_app args...`` in ``cwd``; with ``interrupt_at``, send it
    SIGINT as soon as it says it reached that stage (fails if it ends first). ``memory_limit``
    caps its address space (bytes), so a run that would take the machine's memory fails instead;
    ``env``: variables set for it; ``module``: another module to run (one of ``helpers``)."""
    proc = subprocess.Popen(
        _command(args, memory_limit, module),
        cwd=cwd,
        env=_env(interrupt_at is not None, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stdout is not None
    err: list[str] = []
    deadline = time.monotonic() + timeout_s
    if interrupt_at is not None:
        for line in proc.stderr:  # the stage lines arrive flushed, one by one
            err.append(line)
            if line.strip() == STAGE + interrupt_at:
                proc.send_signal(signal.SIGINT)
                break
        else:
            raise AssertionError(f"the command ended before stage {interrupt_at!r}: {''.join(err)}")
    try:
        out, rest = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    err.append(rest)
    kept = "".join(line for line in "".join(err).splitlines(keepends=True) if not line.startswith(STAGE))
    return Child(proc.returncode, out, kept)


# checkpoint folders and safetensors files, good and bad -------------------------------------------
def file_of_bytes(path, data: bytes, result=None) -> str:
    """Write ``data`` at ``path``; return ``result`` (default ``path``) as a string."""
    path.write_bytes(data)
    return str(path if result is None else result)


def raw_safetensors(path, header: dict | list, data: bytes = b"", *, length=None):
    """A safetensors file written by hand: the header (its length field may lie), then ``data``."""
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return str(path)


def good_safetensors_bytes() -> bytes:
    from safetensors.numpy import save

    return save({"t": np.arange(12, dtype=np.float32)})


def small_checkpoint(tmp_path, **kw):
    """A checkpoint folder of the small GPT-2 (``SMALL_GPT2``, seeded weights); ``kw`` to ``save_checkpoint``."""
    save_checkpoint(str(tmp_path), SMALL_GPT2, seeded_weights(SMALL_GPT2, 0), **kw)
    return str(tmp_path)


def edit_config(folder, **changes):
    """Update the folder's ``config.json`` with ``changes``."""
    path = f"{folder}/config.json"
    hf = load(path)
    hf.update(changes)
    with open(path, "w") as f:
        json.dump(hf, f)


def rewrite_weights(folder, edit):
    """Read the folder's ``model.safetensors``, let ``edit`` change the tensors in place, write it back."""
    tensors, _ = read_safetensors(f"{folder}/model.safetensors")
    edit(tensors)
    write_safetensors(f"{folder}/model.safetensors", tensors)


def store_as_f64(folder, name, index, value):
    """Store every tensor as F64 (through safetensors itself), with ``value`` at ``index`` of ``name``."""
    from safetensors.numpy import save_file

    tensors, _ = read_safetensors(f"{folder}/model.safetensors")
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    wide[name][index] = value
    save_file(wide, f"{folder}/model.safetensors")


def sharded_checkpoint(d):
    """A checkpoint of the small GPT-2 in two shards and an index."""
    save_checkpoint(str(d), SMALL_GPT2, seeded_weights(SMALL_GPT2, 0), shards=2)
    return str(d)


def relabelled_checkpoint(d, model_type):
    edit_config(small_checkpoint(d), model_type=model_type)
    return str(d)


def checkpoint_without_shard(d):
    sharded_checkpoint(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    return str(d)


def truncate(path, keep: int = -10):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def index_naming_absent_tensor(d):
    sharded_checkpoint(d)
    index = load(d / "model.safetensors.index.json")
    index["weight_map"]["h.0.ln_1.weight"] = "model-00002-of-00002.safetensors"  # it lives in shard 1
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(d)
