import os

import pytest
import torch


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        gpus = item.get_closest_marker("gpus")
        need = int(gpus.args[0]) if gpus and gpus.args else (1 if item.get_closest_marker("cuda") else 0)
        if need > count:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {count}"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """Each test runs on the host backend and, where there is one, on a GPU."""
    return request.param


def pytest_runtest_logreport(report):
    """With ``RLMEM_FAIL_LOG=PATH``, each failure's report is appended to PATH as it happens: on the GPU
    machine a call's time limit can end the session before pytest prints its summary of failures."""
    path = os.environ.get("RLMEM_FAIL_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            head = f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)"
            f.write(f"{head}\n{report.longreprtext}\n\n")
