import builtins
import errno
import os
import signal
from pathlib import Path
import threading

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Device-parametrized tests: "cpu" always runs; "cuda" runs where torch sees a GPU (skipped in CPU-only CI).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device the test runs on: ``cpu``, and ``cuda:<current GPU>`` where there is one."""
    if request.param == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow``, ``exhaustive`` or ``long`` run only where a ``-m`` expression names that marker
    (``-m slow``; CI runs the default suite, then ``-m slow``)."""
    expression = config.getoption("-m") or ""
    for marker in ("slow", "exhaustive", "long"):
        if marker in expression:
            continue
        skip = pytest.mark.skip(reason=f"{marker}: run with -m {marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


# aten operations after which the host waits for a CUDA device whatever the sizes: a value read to the host,
# or an output whose size depends on the data (``repeat_interleave`` only without ``output_size``; indexing
# only with a boolean mask)
_WAITS_FOR_THE_DEVICE = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2",
                                   "unique_dim", "unique_consecutive", "bincount", "equal", "is_nonzero"})


def _waits_for_the_device(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in _WAITS_FOR_THE_DEVICE:
        return True
    if name == "repeat_interleave":  # (output_size is keyword-only)
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


@pytest.fixture
def device_waits():
    """``with device_waits() as waits:`` records in ``waits`` the names of the aten operations inside the
    block that would make the host wait for a CUDA device (what ``torch.cuda.set_sync_debug_mode("error")``
    refuses on a GPU), whatever device the tensors are on: so that CPU-only CI checks what the GPU tests
    check, for the code paths the CPU takes. Operations inside a Triton kernel run by the interpreter
    (``TRITON_INTERPRET=1``: its copies of the kernel's arguments) are not the library's and are left out."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    inside_kernel = [0]

    class Record(TorchDispatchMode):
        def __init__(self, waits):
            super().__init__()
            self.waits = waits

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not inside_kernel[0] and _waits_for_the_device(func, args, kwargs):
                self.waits.append(func.overloadpacket.__name__)
            return func(*args, **kwargs)

    @contextlib.contextmanager
    def waits():
        found: list[str] = []
        with contextlib.ExitStack() as stack:
            interpreter = _triton_interpreter()
            if interpreter is not None:
                real = interpreter.GridExecutor.__call__

                def call(executor, *a, **k):
                    inside_kernel[0] += 1
                    try:
                        return real(executor, *a, **k)
                    finally:
                        inside_kernel[0] -= 1

                interpreter.GridExecutor.__call__ = call
                stack.callback(setattr, interpreter.GridExecutor, "__call__", real)
            stack.enter_context(Record(found))
            yield found

    return waits


@pytest.fixture
def round_trip_waits(device_waits):
    """``round_trip_waits(codec, fine, bad)``: as on a GPU (checks deferred, the decode's collected), an
    encode of ``bad``, one of ``fine`` and the decode of the latter's packet, after a first round trip outside
    the recorded region (a rotation's signs are made there); returns ``(waits, refused, good, decoded,
    pending)``: what :func:`device_waits` recorded, the two packets, the decode and the collected checks."""
    from aqsgd.compress.base import collecting_pending_checks, deferring_checks

    def run(codec, fine, bad):
        with deferring_checks(True):
            with collecting_pending_checks():
                codec.decode(codec.encode(fine))
            with device_waits() as waits:
                refused = codec.encode(bad)
                good = codec.encode(fine)
                with collecting_pending_checks() as pending:
                    decoded = codec.decode(good)
        return waits, refused, good, decoded, pending

    return run


def _triton_interpreter():
    """Triton's interpreter module where the Triton kernels run under it in this process, else None."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return None
    return interpreter if hasattr(interpreter, "GridExecutor") else None


# Signals whose handlers a test must leave as it found them: a handler left behind outlives the test (one that
# turns SIGTERM into an exception swallowed somewhere keeps ``timeout`` from ending the suite).
_WATCHED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT",
                                                            "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """After each test: the handlers of :data:`_WATCHED_SIGNALS` are those it started with. One left changed
    is put back (so the next tests run with the usual handlers) and fails the test that changed it."""
    before = {s: signal.getsignal(s) for s in _WATCHED_SIGNALS}
    yield
    if threading.current_thread() is not threading.main_thread():  # (only the main thread sets handlers)
        return
    changed = []
    for s, handler in before.items():
        now = signal.getsignal(s)
        if now != handler:
            changed.append(f"{signal.Signals(s).name}: {now!r} (was {handler!r})")
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if changed:
        pytest.fail("the test left signal handlers changed (put back now): " + "; ".join(changed),
                    pytrace=False)


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self._f = f

    def write(self, _data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(matches)``: from then on, the writes of every file opened for writing whose path
    ``matches`` fail with ENOSPC, as on a full disk."""
    real_open = builtins.open

    def fill(matches):
        def open_(file, mode="r", *args, **kw):
            f = real_open(file, mode, *args, **kw)
            named = isinstance(file, (str, bytes, os.PathLike))
            writing = any(m in mode for m in "wxa")
            return _FullDisk(f) if named and writing and matches(Path(os.fsdecode(file))) else f

        monkeypatch.setattr(builtins, "open", open_)

    return fill


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (tiny models run faster so than with two, above all on a busy
    machine); the count is put back after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
