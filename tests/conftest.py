import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/mpirun.py, scripts/


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="run array tests on this device (cuda needs cupy and a GPU)")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, in one place, where CuPy is missing or sees no GPU."""
    from minidist import backend
    if backend.cupy_module() is not None:
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU (pip install -e '.[cuda]')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(request):
    from minidist import backend
    return backend.set_device(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small Python-like text file for training tests (300 tiny functions, ~9 KB)."""
    d = tmp_path_factory.mktemp("corpus")
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300))
    (d / "code.py").write_text(text)
    return str(d / "code.py")
