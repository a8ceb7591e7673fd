"""Ctrl-C stops a long call made on the main thread: the call runs on a helper thread while the
main thread checks for signals every 20 ms, sets the call's cancel flag and raises
KeyboardInterrupt. The test interrupts a call sized for minutes (its duration predicted from a
call 8192 times smaller, timed in the same process) and compares the time the interrupted call
took with that prediction: a ratio, not a fixed timing. The same for a long merge."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import attncore

PROGRAM = """
import sys, time
import numpy as np
import attncore
rng = np.random.default_rng(0)
def operands(batch, len_q, len_k):
    # q, k [B, 1, L, 64], v [B, 1, Lk, 8] (a small output): one batch entry broadcast
    # (stride 0) over B.
    q = rng.standard_normal((1, 1, len_q, 64), dtype=np.float32)
    k = rng.standard_normal((1, 1, len_k, 64), dtype=np.float32)
    v = rng.standard_normal((1, 1, len_k, 8), dtype=np.float32)
    return (np.broadcast_to(q, (batch, 1, len_q, 64)), np.broadcast_to(k, (batch, 1, len_k, 64)),
            np.broadcast_to(v, (batch, 1, len_k, 8)))
small = operands(1, 1024, 8192)
times = []
for _ in range(3):
    start = time.perf_counter()
    attncore.attention(*small, backend="flash", num_threads=1)
    times.append(time.perf_counter() - start)
predicted = sorted(times)[1] * 128 * 8 * 8  # the call below does 8192x the work
big = operands(128, 8192, 65536)
print(f"ready {predicted:.3f}", flush=True)
start = time.perf_counter()
try:
    attncore.attention(*big, backend="flash", num_threads=1)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {time.perf_counter() - start:.3f}", flush=True)
"""


def interrupt(program, wait):
    """Runs `program` in a child Python, sends it SIGINT `wait` seconds after it prints
    "ready <predicted seconds>", and returns (predicted, elapsed): the seconds its long call was
    predicted to take and took until it printed "interrupted <seconds>"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline().split()
        assert ready[0] == "ready", child.stderr.read()
        predicted = float(ready[1])
        time.sleep(wait)
        child.send_signal(signal.SIGINT)
        result = child.stdout.readline().split()
        child.wait(timeout=60)
    finally:
        child.kill()
    assert result and result[0] == "interrupted", (result, child.stderr.read())
    assert child.returncode == 0
    return predicted, float(result[1])


def test_ctrl_c_stops_a_long_call():
    predicted, elapsed = interrupt(PROGRAM, 1.0)  # elapsed: ~1 s of waiting plus the reaction
    print(f"interrupted after {elapsed:.3f} s of a call predicted at {predicted:.1f} s "
          f"(ratio {elapsed / predicted:.4f})")
    assert predicted > 20 * elapsed


MERGE_PROGRAM = """
import time
import numpy as np
import attncore
def sides(rows):
    # out [rows, 1] and lse [rows]: one row broadcast (stride 0), a merge of `rows` rows.
    out = np.broadcast_to(np.ones((1, 1), np.float32), (rows, 1))
    lse = np.broadcast_to(np.zeros((1,), np.float32), (rows,))
    return out, lse, out, lse
times = []
for _ in range(3):
    start = time.perf_counter()
    attncore.merge_attention_states(*sides(1 << 20), num_threads=1)
    times.append(time.perf_counter() - start)
predicted = sorted(times)[1] * 64  # the call below merges 64x the rows
print(f"ready {predicted:.3f}", flush=True)
start = time.perf_counter()
try:
    attncore.merge_attention_states(*sides(1 << 26), num_threads=1)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {time.perf_counter() - start:.3f}", flush=True)
"""


def test_ctrl_c_stops_a_long_merge():
    predicted, elapsed = interrupt(MERGE_PROGRAM, 0.2)
    print(f"interrupted after {elapsed:.3f} s of a merge predicted at {predicted:.2f} s")
    assert predicted > 3 * elapsed


PAGED_PROGRAM = """
import time
import numpy as np
import attncore
rng = np.random.default_rng(0)
attncore.set_num_threads(1)
q = rng.standard_normal((1, 64, 16), dtype=np.float32)
pool = rng.standard_normal((1, 16, 1, 16), dtype=np.float32)
def call(keys):  # one decode row over `keys` keys: pool page 0 named keys / 16 times
    table = np.zeros((1, keys // 16), np.int32)
    cu_k = np.array([0, keys], np.int32)
    if {kvcache}:
        attncore.flash_attn_with_kvcache(q[None], pool, pool, cache_seqlens=keys,
                                         block_table=table)
    else:
        attncore.flash_attn_varlen_func(q, pool, pool, np.array([0, 1], np.int32), cu_k, 1,
                                        keys, block_table=table)
times = []
for _ in range(3):
    start = time.perf_counter()
    call(1 << 19)
    times.append(time.perf_counter() - start)
predicted = sorted(times)[1] * 128  # the call below reads 128x the keys
print(f"ready {{predicted:.3f}}", flush=True)
start = time.perf_counter()
try:
    call(1 << 26)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {{time.perf_counter() - start:.3f}}", flush=True)
"""


@pytest.mark.parametrize("kvcache", [False, True])
def test_ctrl_c_stops_a_long_call_over_pages(kvcache):
    # Its work counted from the keys its sequences read, not from the rows of the pools (a
    # pool of one page made it run in place, where Ctrl-C waited for its end).
    predicted, elapsed = interrupt(PAGED_PROGRAM.format(kvcache=kvcache), 0.2)
    print(f"interrupted after {elapsed:.3f} s of a call predicted at {predicted:.2f} s")
    assert predicted > 3 * elapsed


def test_calls_on_the_main_thread_and_others_agree():
    q = np.random.default_rng(1).standard_normal((2, 3, 40, 16), dtype=np.float32)
    out_main = attncore.attention(q, q, q)
    results = []
    import threading
    thread = threading.Thread(target=lambda: results.append(attncore.attention(q, q, q)))
    thread.start()
    thread.join()
    np.testing.assert_array_equal(out_main, results[0])
    # The main thread's enabled backends reach the thread that runs its calls (flash's bits,
    # which differ from the reference's in the last place, would show if they did not).
    with attncore.sdpa_kernel(attncore.SDPBackend.REFERENCE):
        np.testing.assert_array_equal(attncore.attention(q, q, q),
                                      attncore.attention(q, q, q, backend="reference"))
    assert not np.array_equal(attncore.attention(q, q, q, backend="flash"),
                              attncore.attention(q, q, q, backend="reference"))

def test_errors_still_raise_through_the_runner():
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="key has shape"):
        attncore.attention(q, q[..., :7], q)
    assert issubclass(attncore.Cancelled, RuntimeError)


FORK_PROGRAM = """
import os, sys, time
import numpy as np
import attncore
q = np.ones((1, 8, 256, 64), np.float32)
attncore.scaled_dot_product_attention(q, q, q)  # on the main thread: through the runner
pid = os.fork()
if pid == 0:  # the child: its own runner, since its parent's thread is not in it
    out = attncore.scaled_dot_product_attention(q, q, q)
    os._exit(0 if np.allclose(out, 1.0) else 3)
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("child hung", flush=True)
"""


def test_a_child_made_by_fork_runs_main_thread_calls():
    # A call large enough for the runner thread, made in the parent before os.fork(): the
    # child's own such call used to wait forever for the parent's runner, which a child lacks.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", FORK_PROGRAM], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["child", "0"], (result.stdout, result.stderr)


RUNNER_PROGRAM = """
import os
import numpy as np
import attncore
attncore.set_num_threads(1)
def threads():
    return len(os.listdir("/proc/self/task"))
q = np.ones((1, 1, 32, 64), np.float32)
k, v = (np.ones((1, 16384, 32, 64), np.float32) for _ in range(2))  # 16384 slots
k_pages, v_pages = k.reshape(1024, 16, 32, 64), v.reshape(1024, 16, 32, 64)  # pages of 16
table = np.arange(1024, dtype=np.int32)[None]
attncore.flash_attn_with_kvcache(q, k, v, cache_seqlens=1)
before = threads()
for used in (1, 100, np.array([200], np.int32)):  # decode over a few keys of the capacity
    attncore.flash_attn_with_kvcache(q, k, v, cache_seqlens=used)
    attncore.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=used, block_table=table)
new = np.ones((1, 1, 32, 64), np.float32)  # an append of one row: 2 keys attended
attncore.flash_attn_with_kvcache(q, k, v, k=new, v=new, cache_seqlens=1)
# A varlen decode step: 4 sequences of 200 keys (each row against its own sequence's keys).
packed, cu_q = k[0, :800], np.arange(5, dtype=np.int32)
attncore.flash_attn_varlen_func(q[0].repeat(4, 0), packed, packed, cu_q, cu_q * 200, 1, 200)
# 4096 keys: 2^24 multiply-adds (32 rows x 4096 keys x 128), which flash ends in a few ms.
attncore.flash_attn_with_kvcache(q, k, v, cache_seqlens=4096)
few = threads()
# 2048 keys on the reference backend (fp64 loops, weighed 8x): long enough for the runner.
attncore.flash_attn_with_kvcache(q, k, v, cache_seqlens=2048, backend="reference")
reference = threads()
attncore.flash_attn_with_kvcache(q, k, v, cache_seqlens=16384)  # all of them: the runner too
print(before, few, reference, threads(), flush=True)
"""


def test_calls_over_a_few_keys_of_a_large_cache_run_in_place():
    # A call's work counts the keys it attends (cache_seqlens, and the rows it appends), not
    # the cache's capacity, and a varlen call's each sequence's rows against its own keys, not
    # all the packed keys: decode steps over a mostly empty cache run on the main thread, where
    # handing each to the runner thread (made at the first call that needs it) cost 100 us and
    # more a call; so do calls of up to 2^25 multiply-adds on the fused backends. The reference
    # backend's work weighs 8x, and the call over every slot is long enough for the runner.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", RUNNER_PROGRAM], env=env, capture_output=True,
                            text=True, timeout=120)
    before, few, reference, after = (int(n) for n in result.stdout.split())
    assert few == before, (before, few, result.stderr)
    assert reference == before + 1 and after == reference, (before, reference, after,
                                                            result.stderr)
