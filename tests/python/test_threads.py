"""attncore.set_num_threads / get_num_threads and docs/design.md section 8's order: a call's
num_threads, else set_num_threads, else ATTNCORE_NUM_THREADS, else the affinity mask. Each
case runs in a fresh interpreter, so that the process-wide setting and the environment are its
own."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import attncore


def _threads_in_child(code, env=None, taskset=None):
    """What a fresh interpreter prints after running `code` (attncore imported as a)."""
    environment = {k: v for k, v in os.environ.items() if k != "ATTNCORE_NUM_THREADS"}
    environment.update(env or {})
    command = [sys.executable, "-c", "import attncore as a\n" + code]
    if taskset is not None:
        command = ["taskset", "-c", taskset] + command
    result = subprocess.run(command, env=environment, capture_output=True, text=True,
                            check=True)
    return result.stdout.split()


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset is not installed")
def test_affinity_mask_is_the_last_resort():
    assert _threads_in_child("print(a.get_num_threads())", taskset="0") == ["1"]
    # With the variable set, the mask no longer decides.
    assert _threads_in_child("print(a.get_num_threads())", env={"ATTNCORE_NUM_THREADS": "3"},
                             taskset="0") == ["3"]


def test_set_num_threads_beats_the_environment_and_resets_to_it():
    code = ("print(a.get_num_threads()); a.set_num_threads(2); print(a.get_num_threads()); "
            "a.set_num_threads(0); print(a.get_num_threads())")
    assert _threads_in_child(code, env={"ATTNCORE_NUM_THREADS": "3"}) == ["3", "2", "3"]


def test_a_calls_own_count_beats_set_num_threads():
    # A per-call count past the maximum is refused although the process-wide one is valid:
    # the call's own count is the one in force.
    code = ("import numpy as np; a.set_num_threads(1); x = np.ones((1, 1, 4, 8), np.float32)\n"
            "try:\n    a.attention(x, x, x, num_threads=5000)\nexcept ValueError as e:\n"
            "    print('refused')")
    assert _threads_in_child(code) == ["refused"]


def test_bad_counts_are_refused_and_keep_the_setting():
    previous = attncore.get_num_threads()
    with pytest.raises(TypeError, match="set_num_threads: num_threads is not an integer"):
        attncore.set_num_threads(2.0)
    with pytest.raises(ValueError, match="num_threads"):
        attncore.set_num_threads(5000)
    with pytest.raises(ValueError, match="num_threads"):
        attncore.set_num_threads(-1)
    assert attncore.get_num_threads() == previous


def test_the_setting_changes_neither_torch_nor_the_bits():
    torch = pytest.importorskip("torch")
    torch_threads = torch.get_num_threads()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 33, 64), dtype=np.float32) for _ in range(3))
    try:
        attncore.set_num_threads(1)
        one = attncore.attention(q, k, v, causal="upper-left")
        attncore.set_num_threads(2)
        assert attncore.get_num_threads() == 2
        two = attncore.attention(q, k, v, causal="upper-left")
    finally:
        attncore.set_num_threads(0)
    assert torch.get_num_threads() == torch_threads
    np.testing.assert_array_equal(one, two)


def test_a_call_starts_no_more_threads_than_its_work_items():
    """set_num_threads(1024) and a call of one row over one key: its work is one item, so no
    thread of the pool starts (each would get nothing but its scratch and an idle OS thread);
    a call of 8 kv groups starts at most 7 helpers. The forward and the backward alike."""
    code = ("import numpy as np, os, torch\n"
            "a.set_num_threads(1024)\n"
            "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
            "before = tasks()\n"
            "q = np.ones((1, 1, 1, 8), np.float32)\n"
            "a.attention(q, q, q, backend='flash')\n"
            "t = torch.ones(1, 1, 1, 8, requires_grad=True)\n"
            "a.torch.scaled_dot_product_attention(t, t, t, backend='flash').sum().backward()\n"
            "print(tasks() - before)\n"
            "x = np.ones((1, 8, 1, 64), np.float32)\n"
            "a.attention(x, x, x, backend='flash')\n"
            "print(tasks() - before)\n")
    one, eight = (int(n) for n in _threads_in_child(code))
    assert one == 0
    assert 0 <= eight <= 7
