"""The interpreter exits cleanly while daemon threads are inside attncore calls: a thread that
wants the GIL back after finalization began is parked, not unwound (status 0, nothing on
standard error). numpy arrays only: torch 1.13's own bindings abort the same way at exit (a
daemon thread looping over torch operations alone does)."""

import os
import subprocess
import sys

PROGRAM = """
import threading, time
import numpy as np
import attncore
q = np.random.default_rng(0).standard_normal((2, 4, 256, 64), dtype=np.float32)
out, lse = attncore.attention(q, q, q, return_lse=True)
packed = q[0].swapaxes(0, 1)  # [total, H, D]
cu_seqlens = np.array([0, 100, 256], np.int32)
def forward():
    while True:
        attncore.attention(q, q, q)
def backward():
    while True:
        attncore.attention_backward(out, q, q, q, out, lse)
def varlen():
    while True:
        attncore.attention_varlen(packed, packed, packed, cu_seqlens, cu_seqlens, 156, 156)
for target in (forward, backward, varlen):
    threading.Thread(target=target, daemon=True).start()
time.sleep(0.3)
"""


def test_exit_with_daemon_threads_inside_calls():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for _ in range(5):
        run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                             text=True, timeout=120)
        assert (run.returncode, run.stderr) == (0, "")
