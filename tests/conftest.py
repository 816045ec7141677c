import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/mpirun.py, scripts/


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="run array tests on this device (cuda needs cupy and a GPU)")


def pytest_configure(config):
    """The suite's setup, like any entry point's (nothing happens on import): BLAS threads and
    the device, then MPI for the in-process tests that build one-rank groups."""
    from minidist import backend, comm
    backend.setup(threads=None, device=config.getoption("--device"))
    comm.init()


def pytest_sessionstart(session):
    session.config.addinivalue_line(
        "markers", "cpu_only(reason): cannot run on a GPU; skipped, with the reason, under "
        "--device cuda instead of silently running on the CPU")


def pytest_collection_modifyitems(config, items):
    """In one place: `gpu` tests skip where CuPy is missing or sees no GPU; `cpu_only` tests
    skip under --device cuda, saying why (a CPU timing, a numpy-only check)."""
    from minidist import backend
    no_gpu = backend.cupy_module() is None
    on_cuda = config.getoption("--device") == "cuda"
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU (pip install -e '.[cuda]')")
    for item in items:
        if no_gpu and "gpu" in item.keywords:
            item.add_marker(skip)
        mark = item.get_closest_marker("cpu_only")
        if on_cuda and mark is not None:
            why = mark.args[0] if mark.args else mark.kwargs.get("reason", "CPU only")
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {why}"))


@pytest.fixture(scope="session")
def device(request):
    """"cpu" or "cuda" (--device), made the current device."""
    from minidist import backend
    return backend.set_device(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def xp(device):
    """numpy or cupy, --device's array module: tests build their arrays with it, so
    `python -m pytest --device cuda` runs them on the GPU."""
    from minidist import backend
    return backend.get_xp()


@pytest.fixture(scope="session")
def mpi(device):
    """run_mpi (tests/mpirun.py) with --device bound: `mpi(4, script, *args)` runs the script
    under mpiexec and hands every rank `--device cpu|cuda`, so the distributed tests run on the
    device the suite was asked for."""
    from mpirun import MpiRunner
    return MpiRunner(device)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small Python-like text file for training tests (300 tiny functions, ~9 KB)."""
    d = tmp_path_factory.mktemp("corpus")
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300))
    (d / "code.py").write_text(text)
    return str(d / "code.py")
