"""pytest plugin: after a device fault, the rest of the process's GPU tests error at once, naming the test that faulted.

A device fault (an illegal address, a faulting copy, ...) kills the process's CUDA context: every later CUDA call
fails, so under `pytest -n` one fault would otherwise show as dozens of unrelated failures in that worker (H200: 86
failures from one faulting MoE launch). Here the first GPU test whose failure names a sticky CUDA error marks the
process dead; each later GPU test of the process errors in its setup without running, saying which test to rerun
alone.
"""
import pytest

STICKY = ("CUDA_ERROR_LAUNCH_FAILED", "cudaErrorLaunchFailure", "CUDA_ERROR_ILLEGAL_ADDRESS", "cudaErrorIllegalAddress",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "cudaErrorIllegalInstruction", "CUDA_ERROR_MISALIGNED_ADDRESS",
          "cudaErrorMisalignedAddress", "CUDA_ERROR_HARDWARE_STACK_ERROR", "cudaErrorHardwareStackError")
DEAD = []        # nodeid of the GPU test whose failure left this process's CUDA context dead


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if (rep.failed and not DEAD and item.get_closest_marker("gpu") is not None
            and any(s in str(rep.longrepr) for s in STICKY)):
        DEAD.append(item.nodeid)


def pytest_runtest_setup(item):
    if DEAD and item.get_closest_marker("gpu") is not None:
        pytest.fail(f"not run: this process's CUDA context died in {DEAD[0]} (a device fault is sticky; run that test "
                    f"alone, under compute-sanitizer to find the kernel)", pytrace=False)
