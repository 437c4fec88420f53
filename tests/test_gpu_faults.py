"""tests/gpu_faults.py in a pytest run of its own (a subprocess: the plugin's state is per process)."""
import os

TESTS = """
import pytest

@pytest.mark.gpu
def test_1_ok():
    pass

@pytest.mark.gpu
def test_2_plain_failure():
    raise AssertionError("logits differ")            # not a device fault: later tests still run

def test_3_cpu():
    pass

@pytest.mark.gpu
def test_4_fault():
    raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED: An exception occurred on the device while executing a kernel.")

def test_5_cpu_after():
    pass

@pytest.mark.gpu
def test_6_gpu_after():
    pass
"""


def test_device_fault_fails_later_gpu_tests_naming_it(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(test_fake=TESTS)
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = pytester.runpytest_subprocess("-p", "gpu_faults", "-rfE")
    res.assert_outcomes(passed=3, failed=2, errors=1)        # the test after the fault: an error in its setup
    res.stdout.fnmatch_lines(["*ERROR at setup of test_6_gpu_after*",
                              "not run: this process's CUDA context died in test_fake.py::test_4_fault (*",
                              "FAILED test_fake.py::test_2_plain_failure*",
                              "FAILED test_fake.py::test_4_fault*",
                              "ERROR test_fake.py::test_6_gpu_after*"])
