"""Run a function on ``world`` gloo processes on 127.0.0.1 and collect what each rank
returns. Workers live here (importable by the children).

What a rank returns travels back as JSON (numbers, strings, lists, dicts) with its tensors
in a safetensors file next to it: no pickles.

Processes come from ``torch.multiprocessing.start_processes`` with the ``forkserver``
start method: the server imports torch (and torch._dynamo, which the custom ops load on
their first call) once, single-threaded, and every rank is a fork of it, so a world
starts in well under a second instead of re-importing torch in every rank (seconds
each on 2 cores). Each rank is still a fresh process with its own gloo group.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 600     # a hang (a peer that died) fails instead of blocking the suite
# (a module that is not installed is skipped by the server)
PRELOAD = ["torch", "torch._dynamo", "poslsh.distributed", "cp_harness", "transformers", "poslsh.integrations.hf"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TENSOR = "__tensor__"      # a JSON placeholder {TENSOR: name} for a tensor in the safetensors file


def _to_json(obj, tensors: dict):
    """``obj`` with every tensor moved to ``tensors`` (tuples become lists); anything that is
    not JSON or a tensor is an error, so nothing is lost on the way back."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {TENSOR: name}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"a rank's result has a dict with non-string keys: {list(obj)[:5]}")
        return {k: _to_json(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a rank's result holds a {type(obj).__name__}: return tensors, numbers, strings, lists, dicts")


def _from_json(obj, tensors: dict):
    if isinstance(obj, dict):
        if set(obj) == {TENSOR}:
            return tensors[obj[TENSOR]]
        return {k: _from_json(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v, tensors) for v in obj]
    return obj


def save_result(result, stem: str) -> None:
    """``stem.json`` (+ ``stem.safetensors`` for the tensors)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    skeleton = _to_json(result, tensors)
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w") as f:
        json.dump(skeleton, f)


def load_result(stem: str):
    from safetensors.torch import load_file

    with open(stem + ".json") as f:
        skeleton = json.load(f)
    return _from_json(skeleton, load_file(stem + ".safetensors"))


def _entry(rank, world, port, fn, args, outdir):
    torch.set_num_threads(1)
    result = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        save_result(result, os.path.join(outdir, f"rank{rank}"))
    except BaseException:
        save_result({"crash": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}"))


def run_world(world: int, fn, *args):
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own gloo process;
    results come back through :func:`save_result` / :func:`load_result` (tuples as lists)."""
    multiprocessing.set_forkserver_preload(PRELOAD)      # no effect once the server runs
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, outdir), nprocs=world, join=True,
                           start_method="forkserver")
        results = [load_result(os.path.join(outdir, f"rank{r}")) for r in range(world)]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "crash" in res:
            raise AssertionError(f"rank {r} of {world} crashed:\n{res['crash']}")
    return results


# ------------------------------------------------------------- attention cases
def case_positional(case):
    """The case's partitions, or its ALiBi window (``window``: per-head windows, with the
    ALiBi slopes of ``Hq`` heads)."""
    import poslsh
    from poslsh.window import make_window
    if case.get("window") is not None:
        return make_window(poslsh.alibi_slopes(case["Hq"]), torch.tensor(case["window"]))
    if case.get("block") is not None:
        return poslsh.Partitions.fixed_blocks(case["Hq"], case["block"])
    return poslsh.sample_partitions(torch.tensor(case["sigmas"], dtype=torch.float64), case["s"], seed=case["seed"])


def case_tensors(case):
    """Full-sequence ``q [B, Hq, n, d]``, ``k, v [B, Hkv, n, d|dv]`` and an output weight ``w``
    (the loss is ``(out * w).sum()``), float64."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hq, Hkv, d, dv, n = case["B"], case["Hq"], case["Hkv"], case["d"], case["dv"], sum(case["lengths"])
    q = torch.randn(B, Hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, n, dv, generator=g, dtype=torch.float64)
    w = torch.randn(B, Hq, n, dv, generator=g, dtype=torch.float64)
    return q, k, v, w


def attention_worker(rank, world, cases, mesh_shape=None):
    """Every case on this rank's shard: out and dq, dk, dv of its rows, the layout and the
    bytes exchanged. With ``mesh_shape = (data, context)`` the ranks form a 2-D device mesh,
    each data-parallel replica runs its own sequence (seed + replica) over the mesh's
    "context" group."""
    from poslsh.distributed import comm_stats, context_parallel_attention, gather_layout

    group, crank, replica = None, rank, 0
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("data", "context"))
        group, crank, replica = mesh.get_group("context"), mesh.get_local_rank("context"), mesh.get_local_rank("data")
    results = []
    for case in cases:
        case = dict(case, seed=case["seed"] + replica)
        lengths = case["lengths"]
        a = sum(lengths[:crank])
        b = a + lengths[crank]
        q, k, v, w = (t[:, :, a:b].clone() for t in case_tensors(case))
        for t in (q, k, v):
            t.requires_grad_(True)
        parts = case_positional(case)
        comm_stats.reset()
        out = context_parallel_attention(q, k, v, parts, causal=case["causal"], shard_start=a, group=group,
                                         backend=case["backend"])
        (out * w).sum().backward()
        exchanged = (comm_stats.sent_bytes, comm_stats.received_bytes)
        layout = gather_layout(q, k, v, parts, causal=case["causal"], group=group, backend=case["backend"])
        results.append(dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, lo=layout.lo, hi=layout.hi,
                            starts=layout.starts, sent=exchanged[0], received=exchanged[1], replica=replica,
                            crank=crank))
    return results


class ExplodingScale(float):
    """A scale whose conversion fails with an error that is neither ValueError nor TypeError."""

    def __float__(self):
        raise RuntimeError("this scale cannot be read")


def error_worker(rank, world, n=60):
    """Bad calls, each raising on every rank: the messages, rank by rank."""
    import poslsh
    from poslsh.window import make_window
    from poslsh.distributed import context_parallel_attention

    g = torch.Generator().manual_seed(0)
    L = n // world
    q, k, v = (torch.randn(1, 4, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sig = poslsh.alibi_sigmas(4)
    good = poslsh.sample_partitions(sig, 3, seed=1)
    other = poslsh.sample_partitions(sig, 3, seed=2)
    win = make_window(poslsh.alibi_slopes(4), 5)
    wider = make_window(poslsh.alibi_slopes(4), torch.tensor([5, 5, 5, 6]))
    k_grad = k.clone().requires_grad_(rank == 0)
    bad_calls = {
        "gap": dict(shard_start=rank * L + (rank == world - 1)),            # last shard shifted by one
        "order": dict(shard_start=(world - 1 - rank) * L),                   # reversed
        "partitions": dict(positional=other if rank == 1 else good),
        "seq_len": dict(seq_len=n + 1),
        "some_starts": dict(shard_start=0 if rank == 0 else None),
        "causal": dict(causal=rank == 0),
        "scale": dict(scale=0.5 if rank == 1 else None),
        "scale_resolved": dict(scale=1 / math.sqrt(8) if rank == 0 else None),   # the default itself: no error
        "window": dict(positional=wider if rank == 2 else win, backend="reference"),
        "kind": dict(positional=win if rank == 0 else good, backend="reference"),
        "grad": dict(k=k_grad),
        "backend": dict(backend="reference" if rank == 2 else "torch"),
        "none_positional": dict(positional=None if rank == 1 else good),
        "unexpected_error": dict(scale=ExplodingScale(1.0) if rank == 1 else None),
        "unknown_backend": dict(backend="no-such-backend" if rank == 1 else "auto"),
        "two_bad_ranks": dict(k=k[..., :4] if rank == 0 else k, positional=None if rank == 2 else good),
        "all_bad_alike": dict(k=k[..., :4]),
        "one_bad_rank": dict(k=k[..., :4] if rank == 1 else k),
    }
    messages = {}
    for name, kw in bad_calls.items():
        kw = {"positional": good, "causal": True, "k": k, **kw}
        try:
            context_parallel_attention(q, kw.pop("k"), v, kw.pop("positional"), **kw)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    # the group still works after the errors: a good call
    out = context_parallel_attention(q, k, v, good, causal=True)
    messages["ok_after"] = bool(torch.isfinite(out).all())
    return messages
