"""The dropout random stream: attncore's own generator, not torch's (docs/design.md section 1.5).

Dropout keeps element (b, h, i, j) iff the Philox4x32-10 uniform at stream position
``offset + ((b*Hq + h)*Lq + i)*Lk + j`` under key ``seed`` is above p. The generator holds
(seed, offset); each call with dropout takes the current pair and advances the offset by
B*Hq*Lq*Lk, the positions it used, so consecutive calls draw disjoint numbers.
"""

import operator
import threading

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
        raise ValueError(f"{op}: {name} is invalid ({name}={number}, expected an int in "
                         "[0, 2^64))")
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
        try:
            seed, offset = state
        except (TypeError, ValueError):
            raise TypeError(f"{op}: state is not a pair (type={type(state).__name__}, expected "
                            "(seed, offset) as get_rng_state() returns it)") from None
        seed, offset = check_u64(op, "seed", seed), check_u64(op, "offset", offset)
        with self._lock:
            self._seed, self._offset = seed, offset

    def take(self, count):
        """(seed, offset) for a call that uses `count` stream positions; advances past them."""
        with self._lock:
            state = self._seed, self._offset
            self._offset = (self._offset + count) % _U64
            return state


default_generator = Generator()


def manual_seed(seed):
    """Seeds attncore's dropout stream (offset back to 0), like torch.manual_seed."""
    return default_generator.manual_seed(seed)


def get_rng_state():
    """(seed, offset) that the next call with dropout will use: pass them to
    attention_backward to replay that call's dropout mask."""
    return default_generator.get_state()


def set_rng_state(state):
    """Sets (seed, offset) of attncore's dropout stream."""
    default_generator.set_state(state)
