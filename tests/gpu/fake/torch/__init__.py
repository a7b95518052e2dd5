"""A CPU stand-in for the tiny part of PyTorch that tests/gpu/workload.py uses.

For tests/gpu/selftest.sh only, on machines without a GPU: it lets run.sh's flow (workload,
verification requests, CRIU checkpoint and restore of the process, cold start, report) run for
real with small sizes. Nothing here touches a GPU and no result from it is a GPU measurement.
"""

import pickle
import random as _random
from array import array

__version__ = "0.0-fake"
FAKE = True


class _Version:
    cuda = "fake"


version = _Version()


class dtype:
    def __init__(self, name, code):
        self.name, self.code = name, code


int32 = dtype("int32", "i")
int64 = dtype("int64", "q")


class Generator:
    def __init__(self, device=None):
        self._r = _random.Random(0)

    def manual_seed(self, seed):
        self._r.seed(seed)
        return self


class Tensor:
    def __init__(self, data, dt):
        self.data, self.dtype = data, dt

    def numel(self):
        return len(self.data)

    def random_(self, generator=None):
        r = (generator._r if generator else _random).getrandbits
        for i in range(len(self.data)):
            self.data[i] = r(31)
        return self

    def __getitem__(self, s):
        return Tensor(self.data[s], self.dtype)

    def to(self, x):
        if isinstance(x, dtype):
            return Tensor(array(x.code, self.data), x)
        return self

    def cpu(self):
        return self

    def cuda(self):
        return self

    def sum(self):
        return Tensor(array(self.dtype.code, [sum(self.data)]), self.dtype)

    def item(self):
        return self.data[0]

    def __iadd__(self, n):
        for i in range(len(self.data)):
            self.data[i] += n
        return self


class _Matrix:
    """Stands in for the step's small matmul: no arithmetic."""

    def __matmul__(self, other):
        return self

    def __truediv__(self, n):
        return self


def empty(n, dtype=int32, device=None):
    return Tensor(array(dtype.code, bytes(n * array(dtype.code).itemsize)), dtype)


def zeros(n, dtype=int32, device=None):
    return empty(n, dtype)


def randn(*shape, device=None, generator=None):
    return _Matrix()


def tanh(x):
    return x


def save(t, path):
    with open(path, "wb") as f:
        pickle.dump((t.dtype.name, t.data.tobytes()), f)


def load(path, mmap=False, weights_only=False):
    with open(path, "rb") as f:
        name, raw = pickle.load(f)
    dt = int32 if name == "int32" else int64
    a = array(dt.code)
    a.frombytes(raw)
    return Tensor(a, dt)


class cuda:
    @staticmethod
    def init():
        pass

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def get_device_name(i=0):
        return "fake CPU stand-in (no GPU)"
