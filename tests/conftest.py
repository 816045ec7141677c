import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/mpirun.py, scripts/


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="run array tests on this device (cuda needs cupy and a GPU)")


@pytest.fixture(scope="session")
def device(request):
    from minidist import backend
    return backend.set_device(request.config.getoption("--device"))
