import compileall
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/mpirun.py, scripts/


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="run array tests on this device (cuda needs cupy and a GPU)")


def _compile_sources():
    """Byte-compile minidist and the rank scripts' helpers (tests/scripts) into their
    __pycache__ folders (git-ignored), once.
    The suite starts a Python process for every rank of every mpiexec and every script, and
    each imports minidist. Where PYTHONDONTWRITEBYTECODE is set (it is on the machines this
    suite is developed on), no process writes the cache, so each compiled all of minidist
    again: 0.3 s of CPU a process; tests/test_cli.py (then all the command-line tests) took
    69 s without the cache, 51 s with it. py_compile writes whatever that variable says; a
    process that may not write still reads the cache."""
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    for folder in (os.path.join(root, "minidist"), os.path.join(tests, "scripts")):
        compileall.compile_dir(folder, quiet=1)


def pytest_configure(config):
    """The suite's setup, like any entry point's (nothing happens on import): minidist's
    bytecode, BLAS threads and the device, then MPI for the in-process tests that build
    one-rank groups."""
    _compile_sources()
    from minidist import backend, comm
    try:
        backend.setup(threads=None, device=config.getoption("--device"))
    except RuntimeError as e:               # --device cuda without a GPU: one line, not a dump
        raise pytest.UsageError(str(e)) from None
    comm.init()


def pytest_sessionstart(session):
    session.config.addinivalue_line(
        "markers", "cpu_only(reason): cannot run on a GPU; skipped, with the reason, under "
        "--device cuda instead of silently running on the CPU")
    session.config.addinivalue_line(
        "markers", "bfloat16: computes in bfloat16 on the device; skipped on a GPU whose CuPy "
        "cannot (CuPy 13; CuPy 14 without ml_dtypes or NumPy >= 2.1.2), as a test whose "
        "parameters name bfloat16 is")


def _cupy_without_bfloat16():
    """True where CuPy sees a GPU but cannot compute with bfloat16 (train/amp.py's probe)."""
    from minidist import backend
    from minidist.train.amp import half_dtype
    cupy = backend.cupy_module()
    return cupy is not None and half_dtype(cupy).name != "bfloat16"


def _on_the_device(item, on_cuda):
    """Whether the test's arrays live on the GPU: a `gpu` test, or under --device cuda one
    that takes the device (xp, device or mpi; the others are numpy-only checks)."""
    return "gpu" in item.keywords or (
        on_cuda and bool({"xp", "device", "mpi"} & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(config, items):
    """In one place: `gpu` tests skip where CuPy is missing or sees no GPU; `cpu_only` tests
    skip under --device cuda, saying why (a CPU timing, a numpy-only check); bfloat16 tests
    on the device skip where this CuPy cannot compute with bfloat16."""
    from minidist import backend
    no_gpu = backend.cupy_module() is None
    on_cuda = config.getoption("--device") == "cuda"
    no_bf16 = not no_gpu and _cupy_without_bfloat16()
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU (pip install -e '.[cuda]')")
    skip_bf16 = pytest.mark.skip(reason="this CuPy cannot compute with bfloat16 (CuPy 13; "
                                 "CuPy 14 needs ml_dtypes and NumPy >= 2.1.2)")
    for item in items:
        if no_gpu and "gpu" in item.keywords:
            item.add_marker(skip)
        if (no_bf16 and _on_the_device(item, on_cuda)
                and ("bfloat16" in item.keywords or "bfloat16" in item.name)):
            item.add_marker(skip_bf16)
        mark = item.get_closest_marker("cpu_only")
        if on_cuda and mark is not None:
            why = mark.args[0] if mark.args else mark.kwargs.get("reason", "CPU only")
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {why}"))


def _ran_whole(session, files):
    """Whether this run held every test of `files` its marks select: each file is, or is in,
    a path the command line named (none: the suite) and has tests selected, and no -k or
    --deselect picked tests out (nor --collect-only ran none)."""
    opt = session.config.option
    asked = [pathlib.Path(a).resolve() for a in session.config.args if "::" not in a]
    inside = all(any(a == f or a in f.parents for a in asked) for f in files)
    selected = {item.path.resolve() for item in session.items}   # (files: resolved)
    return (inside and set(files) <= selected and not opt.keyword and not opt.deselect
            and not opt.collectonly)


def pytest_sessionfinish(session, exitstatus):
    """A CUDA kernel that no test runs on the CPU harness fails a passing run of the suite,
    naming it (before, a new kernel without a CPU test failed nothing: walk 40). Checked
    where the run held every file that imports tests/cuda_cpu.py, on the CPU, with a C++
    compiler; its launches are cuda_cpu.LAUNCHED."""
    if exitstatus != 0 or session.config.getoption("--device") != "cpu":
        return
    import cuda_cpu
    if cuda_cpu.reason_unavailable() or not _ran_whole(session, cuda_cpu.harness_files()):
        return
    missing = cuda_cpu.never_launched(cuda_cpu.LAUNCHED)
    if missing:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(
            f"error: no test ran these CUDA kernels on the CPU harness (tests/cuda_cpu.py): "
            f"{', '.join(missing)}; prove each against the numpy code there", red=True)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def device(request):
    """"cpu" or "cuda" (--device), made the current device."""
    from minidist import backend
    return backend.set_device(request.config.getoption("--device"))


@pytest.fixture
def cupy_new(device, monkeypatch):
    """cupy, with MINIDIST_CUDA_NEW_KERNELS=1 (the kernel path of every op proven on the CPU
    only); skips without --device cuda."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    return cupy


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
def sweep(mpi, tmp_path_factory):
    """One composition sweep (tests/scripts/layout_sweep.py) for the whole session: each
    one-process reference (one per distinct reference_flags: the model, data, dropout, MoE,
    --amp and optimizer flags) runs once, for every test whose layouts compare with it,
    instead of once per test; each layout's own runs are its own."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
    import layout_sweep
    return layout_sweep.Sweep(str(tmp_path_factory.mktemp("sweep")), mpi.device or "cpu",
                              say=print)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small Python-like text file for training tests (300 tiny functions, ~9 KB)."""
    d = tmp_path_factory.mktemp("corpus")
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300))
    (d / "code.py").write_text(text)
    return str(d / "code.py")
