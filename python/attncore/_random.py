"""Dropout's random streams (docs/design.md section 1.5).

Dropout keeps element (b, h, i, j) iff the Philox4x32-10 uniform at stream position
``offset + ((b*Hq + h)*Lq + i)*Lk + j`` under key ``seed`` is above p. A call that is given no
(seed, offset) draws them (seeded()):

- calls on torch tensors take one 64-bit seed from torch's default CPU generator, offset 0, so
  torch.manual_seed reproduces them (the autograd backward replays the seed it saved);
- calls on numpy arrays (and other producers) use attncore's own generator, which holds
  (seed, offset): each call takes the current pair and advances the offset by B*Hq*Lq*Lk, the
  positions it used, so consecutive calls draw disjoint numbers.

A call that raises (a refused call) leaves either generator as it was.
"""

import contextlib
import dataclasses
import operator
import sys
import threading

from . import _arrays
from ._rank4 import pair

# torch's default CPU seed, so that an unseeded process is reproducible as torch's is.
DEFAULT_SEED = 67280421310721
_U64 = 1 << 64


def check_u64(op, name, value):
    """value as an int in [0, 2^64): TypeError for anything but an integer, else ValueError."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise TypeError(f"{op}: {name} is not an integer (type={type(value).__name__}, expected "
                        "an int in [0, 2^64))")
    if not 0 <= number < _U64:
        raise ValueError(f"{op}: {name} is invalid ({name}={_arrays.number_text(number)}, "
                         "expected an int in [0, 2^64))")
    return number


class Generator:
    """(seed, offset) of the dropout stream; thread-safe."""

    def __init__(self, seed=DEFAULT_SEED):
        self._lock = threading.Lock()
        self._seed = check_u64("Generator", "seed", seed)
        self._offset = 0

    def manual_seed(self, seed):
        """Restarts the stream: this seed, offset 0."""
        seed = check_u64("manual_seed", "seed", seed)
        with self._lock:
            self._seed, self._offset = seed, 0
        return self

    def get_state(self):
        """(seed, offset) that the next call with dropout will use."""
        with self._lock:
            return self._seed, self._offset

    def set_state(self, state):
        op = "set_rng_state"
        seed, offset = pair(op, "state", state, "(seed, offset) as get_rng_state() returns it")
        seed, offset = check_u64(op, "seed", seed), check_u64(op, "offset", offset)
        with self._lock:
            self._seed, self._offset = seed, offset

    def take(self, count):
        """(seed, offset) for a call that uses `count` stream positions; advances past them."""
        with self._lock:
            state = self._seed, self._offset
            self._offset = (self._offset + count) % _U64
            return state

    def give_back(self, state, count):
        """Undoes the take(count) that returned `state` (a call that was refused), unless the
        stream moved since: then the positions stay unused."""
        seed, offset = state
        with self._lock:
            if (self._seed, self._offset) == (seed, (offset + count) % _U64):
                self._offset = offset


default_generator = Generator()


def manual_seed(seed):
    """Seeds attncore's dropout stream (offset back to 0), like torch.manual_seed; calls on
    torch tensors draw from torch's generator instead."""
    return default_generator.manual_seed(seed)


def get_rng_state():
    """(seed, offset) that the next call with dropout on numpy arrays will use: pass them to
    attention_backward to replay that call's dropout mask."""
    return default_generator.get_state()


def set_rng_state(state):
    """Sets (seed, offset) of attncore's dropout stream."""
    default_generator.set_state(state)


def _torch_seed():
    """(seed, restore): one 64-bit seed drawn from torch's default CPU generator, and a function
    that sets the generator back to before the draw unless it moved since."""
    torch = sys.modules["torch"]
    generator = torch.default_generator
    before = generator.get_state()
    # from = -2^63 without an upper bound draws all 64 bits.
    seed = torch.empty((), dtype=torch.int64).random_(-2 ** 63, None).item() % _U64
    after = generator.get_state()

    def restore():
        if torch.equal(generator.get_state(), after):
            generator.set_state(before)
    return seed, restore


@contextlib.contextmanager
def seeded(call, positions, from_torch):
    """`call` (an attncore._rank4.Call) with its dropout's (seed, offset) drawn where it has
    dropout and none was given (call.seed is None): one seed of torch's default CPU generator
    and offset 0 when `from_torch`, else `positions` stream positions of attncore's generator.
    If the block raises, the draw is undone."""
    if call.seed is not None:
        yield call
        return
    if from_torch:
        seed, restore = _torch_seed()
        offset = 0
    else:
        seed, offset = state = default_generator.take(positions)

        def restore():
            default_generator.give_back(state, positions)
    try:
        yield dataclasses.replace(call, seed=seed, offset=offset)
    except BaseException:
        restore()
        raise
