"""Shared fixtures for the Python tests that drive the spin binary.

Paths come from the environment that tests/CMakeLists.txt sets: SPIN_BIN, SPIN_TEST_MODEL,
SPIN_TEST_DATA, SPIN_TEST_TMP. A missing variable fails the test that needs it (never a skip).
tests/ is put on sys.path so tests can `from reference import forward`.
"""
import os
import pathlib
import subprocess
import sys

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

SPIN_TIMEOUT_S = 300


def env_path(name: str) -> pathlib.Path:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"environment variable {name} is not set (run through ctest, or export it)")
    return pathlib.Path(value)


@pytest.fixture(scope="session")
def spin_bin() -> pathlib.Path:
    path = env_path("SPIN_BIN")
    if not path.is_file():
        pytest.fail(f"SPIN_BIN={path} does not exist")
    return path


@pytest.fixture(scope="session")
def test_model() -> pathlib.Path:
    path = env_path("SPIN_TEST_MODEL")
    if not path.is_file():
        pytest.fail(f"SPIN_TEST_MODEL={path} does not exist")
    return path


@pytest.fixture(scope="session")
def test_data() -> pathlib.Path:
    return env_path("SPIN_TEST_DATA")


@pytest.fixture(scope="session")
def test_tmp() -> pathlib.Path:
    path = env_path("SPIN_TEST_TMP")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _describe(proc: subprocess.CompletedProcess) -> str:
    return (f"command: {' '.join(map(str, proc.args))}\nexit code: {proc.returncode}\n"
            f"--- stderr ---\n{proc.stderr[-4000:]}\n--- stdout ---\n{proc.stdout[-2000:]}")


@pytest.fixture(scope="session")
def run_spin(spin_bin):
    """run_spin(*args, expect_ok=True, input=None) -> CompletedProcess (text mode).
    With expect_ok the test fails unless spin exits 0; otherwise it fails unless spin exits
    non-zero. Either failure shows the command, exit code and stderr."""

    def run(*args, expect_ok=True, input=None, timeout=SPIN_TIMEOUT_S):
        cmd = [str(spin_bin)] + [str(a) for a in args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                                  input=input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"spin timed out after {timeout}s: {' '.join(cmd)}\nstderr: {exc.stderr}")
        if expect_ok and proc.returncode != 0:
            pytest.fail("spin failed\n" + _describe(proc))
        if not expect_ok and proc.returncode == 0:
            pytest.fail("spin unexpectedly succeeded\n" + _describe(proc))
        return proc

    return run
