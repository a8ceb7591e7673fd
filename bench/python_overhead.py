"""What one tiny attention call costs from Python: attncore on numpy arrays and on torch tensors
(with and without inputs that require grad) against torch's own scaled_dot_product_attention,
and the C++ call of the `attncore` program, in one run.

The call is a decode step of a small model: q [1, 1, 1, 64], k and v [1, 1, 16, 64], float32
(and the same step over a KV cache, with and without appending the step's key and value, and
over the first 16 slots of a cache of 4096; and as a varlen batch of one sequence),
one thread everywhere (attncore.set_num_threads(1), torch.set_num_threads(1)). The cases are
timed in interleaved rounds (each round times every case once, over `--calls` calls) and the
table gives each case's median over the rounds and its ratio to torch's own call without
gradients (the forward-only rows) or with them (the rows with gradients), measured in the same
rounds. The C++ row is the `attncore run --json` figure (the best of --repeat calls, in the
program's process), taken once per round.

    PYTHONPATH=build/python python3 bench/python_overhead.py --program build/attncore
"""

import argparse
import json
import statistics
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F

import attncore
import attncore.torch

SHAPE_Q, SHAPE_KV = (1, 1, 1, 64), (1, 1, 16, 64)


def torch_sdpa():
    """torch's own call: the public function of torch 2.x, the private one of torch 1.13."""
    public = getattr(F, "scaled_dot_product_attention", None)
    if public is not None:
        return public
    return lambda q, k, v: F._scaled_dot_product_attention(q, k, v)[0]


def cases():
    """{name: (function of no arguments, baseline name)}."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(SHAPE_Q, dtype=np.float32)
    k = rng.standard_normal(SHAPE_KV, dtype=np.float32)
    v = rng.standard_normal(SHAPE_KV, dtype=np.float32)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))
    ours, theirs = attncore.torch.scaled_dot_product_attention, torch_sdpa()

    def backward(f):
        def run():
            f(qg, kg, vg).sum().backward()
            qg.grad = kg.grad = vg.grad = None
        return run

    # The same step over a KV cache in flash-attn's layout (16 keys of a cache of 17): decode
    # alone (the fast path), and with the step's new key and value appended (general path).
    q_flash = qt.transpose(1, 2).contiguous()
    k_cache = torch.cat([kt.transpose(1, 2), kt[:, :, :1].transpose(1, 2)], 1).contiguous()
    v_cache = torch.cat([vt.transpose(1, 2), vt[:, :, :1].transpose(1, 2)], 1).contiguous()
    k_new, v_new = k_cache[:, 15:16].clone(), v_cache[:, 15:16].clone()
    with_kvcache = attncore.torch.flash_attn_with_kvcache
    # The same 16 keys as the first of a cache of 4096 slots (an engine's cache, mostly empty).
    k_large, v_large = (torch.cat([x, x.new_zeros(1, 4096 - 17, 1, 64)], 1)
                        for x in (k_cache, v_cache))
    # The step as a varlen batch of one sequence: q [1, 1, 64], k and v [16, 1, 64].
    q_packed, k_packed, v_packed = q_flash[0], k_cache[0, :16], v_cache[0, :16]
    cu_q, cu_k = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 16], dtype=torch.int32)
    varlen = attncore.torch.flash_attn_varlen_func

    return {
        "torch's own": (lambda: theirs(qt, kt, vt), None),
        "attncore, numpy": (lambda: attncore.scaled_dot_product_attention(q, k, v),
                            "torch's own"),
        "attncore.torch": (lambda: ours(qt, kt, vt), "torch's own"),
        "attncore.torch flash_attn_with_kvcache": (
            lambda: with_kvcache(q_flash, k_cache, v_cache, cache_seqlens=16), "torch's own"),
        "attncore.torch flash_attn_with_kvcache, appending": (
            lambda: with_kvcache(q_flash, k_cache, v_cache, k_new, v_new, cache_seqlens=15),
            "torch's own"),
        "attncore.torch flash_attn_with_kvcache, 16 keys of 4096 slots": (
            lambda: with_kvcache(q_flash, k_large, v_large, cache_seqlens=16), "torch's own"),
        "attncore.torch flash_attn_varlen_func": (
            lambda: varlen(q_packed, k_packed, v_packed, cu_q, cu_k, 1, 16), "torch's own"),
        "torch's own, inputs require grad": (lambda: theirs(qg, kg, vg), None),
        "attncore.torch, inputs require grad": (lambda: ours(qg, kg, vg),
                                                "torch's own, inputs require grad"),
        "torch's own, forward + backward": (backward(theirs), None),
        "attncore.torch, forward + backward": (backward(ours), "torch's own, forward + backward"),
    }


def time_once(f, calls):
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls


def cpp_seconds(program):
    """The C++ call's time as the attncore program measures it (best of its repeats)."""
    out = subprocess.run(
        [program, "run", "--batch", "1", "--heads-q", "1", "--seqlen-q", "1", "--seqlen-k",
         str(SHAPE_KV[2]), "--head-dim", str(SHAPE_Q[3]), "--threads", "1", "--repeat", "2000",
         "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--program", help="the attncore program, for the C++ row")
    args = parser.parse_args()

    torch.set_num_threads(1)
    attncore.set_num_threads(1)
    table = cases()
    for f, _ in table.values():  # warm up: first-call imports and allocations
        time_once(f, 200)
    samples = {name: [] for name in table}
    cpp = []
    for _ in range(args.rounds):
        for name, (f, _) in table.items():
            samples[name].append(time_once(f, args.calls))
        if args.program:
            cpp.append(cpp_seconds(args.program))
    median = {name: statistics.median(s) for name, s in samples.items()}

    print(f"q {list(SHAPE_Q)}, k and v {list(SHAPE_KV)}, float32, 1 thread, torch "
          f"{torch.__version__}, attncore {attncore.__version__}; median of {args.rounds} "
          f"rounds of {args.calls} calls\n")
    print("| call | us per call | vs torch's own |")
    print("|---|---:|---:|")
    for name, (_, baseline) in table.items():
        ratio = f"{median[name] / median[baseline]:.2f}x" if baseline else "1.00x"
        print(f"| {name} | {median[name] * 1e6:.1f} | {ratio} |")
    if cpp:
        seconds = statistics.median(cpp)
        print(f"| C++ call (`attncore run`, best of 2000) | {seconds * 1e6:.1f} | "
              f"{seconds / median[next(iter(table))]:.2f}x |")


if __name__ == "__main__":
    main()
