"""A CPU stand-in for the tiny part of PyTorch that tests/gpu/workload.py uses.

For tests/gpu/selftest.sh only, on machines without a GPU: it lets run.sh's flow (workload,
verification requests, CRIU checkpoint and restore of the process, cold start, report) run for
real with small sizes. Nothing here touches a GPU and no result from it is a GPU measurement.

"CUDA" here is the stand-in driver tests/gpu/fake/fakecuda.c (STASIS_LIBCUDA): CUDA init creates
a context there (which makes this process a CUDA process to stasis: libcuda mapped, a state the
driver knows), every "device" allocation is counted there (NVML's memory in use), and every step
goes through a call that blocks while the driver has the process locked or checkpointed, as
real CUDA calls do. The tensors' data itself lives in Python memory.
"""

import ctypes
import os
import pickle
import random as _random
from array import array

__version__ = "0.0-fake"
FAKE = True


_LIB = None


def _driver():
    """The stand-in driver, loaded and initialised once (cuInit, a primary context)."""
    global _LIB
    if _LIB is None:
        path = os.environ.get("STASIS_LIBCUDA")
        if not path:
            raise RuntimeError("the fake torch needs STASIS_LIBCUDA naming the stand-in driver "
                               "(tests/gpu/selftest.sh builds it from tests/gpu/fake/fakecuda.c)")
        lib = ctypes.CDLL(path)
        rc = lib.cuInit(0)
        if rc != 0:
            raise RuntimeError("cuInit failed: %d" % rc)
        ctx = ctypes.c_void_p()
        rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
        if rc != 0:
            raise RuntimeError("cuDevicePrimaryCtxRetain failed: %d" % rc)
        _LIB = lib
    return _LIB


def _launch():
    """A CUDA call: blocks while the driver holds the process locked or checkpointed."""
    rc = _driver().stasisFakeLaunch()
    if rc != 0:
        raise RuntimeError("CUDA call failed: %d" % rc)


def _alloc(nbytes):
    ptr = ctypes.c_ulonglong()
    rc = _driver().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if rc != 0:
        raise RuntimeError("cuMemAlloc failed: %d" % rc)


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
        if x == "cuda":
            _alloc(len(self.data) * self.data.itemsize)
        return self

    def cpu(self):
        return self

    def cuda(self):
        return self

    def sum(self):
        _launch()
        return Tensor(array(self.dtype.code, [sum(self.data)]), self.dtype)

    def item(self):
        return self.data[0]

    def __iadd__(self, n):
        _launch()
        for i in range(len(self.data)):
            self.data[i] += n
        return self


class _Matrix:
    """Stands in for the step's small matmul: no arithmetic."""

    def __matmul__(self, other):
        _launch()
        return self

    def __truediv__(self, n):
        return self


def empty(n, dtype=int32, device=None):
    nbytes = n * array(dtype.code).itemsize
    if device == "cuda":
        _alloc(nbytes)
    return Tensor(array(dtype.code, bytes(nbytes)), dtype)


def zeros(n, dtype=int32, device=None):
    return empty(n, dtype, device)


def randn(*shape, device=None, generator=None):
    if device == "cuda":
        n = 1
        for d in shape:
            n *= d
        _alloc(4 * n)
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
        _driver()

    @staticmethod
    def synchronize():
        _launch()

    @staticmethod
    def is_available():
        try:
            _driver()
            return True
        except (OSError, RuntimeError):
            return False

    @staticmethod
    def get_device_name(i=0):
        return "fake CPU stand-in (no GPU)"
