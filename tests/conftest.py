"""Test-wide setup (must precede `import jax`): 8 simulated CPU devices for the sharding tests, XLA
flags that compile fast, and one persistent compilation cache shared by the run's processes.

Compiles are three quarters of the suite's time, and tests in different files (so on different
xdist workers, or in the CLI tests' subprocesses) compile some identical programs: a cache that
starts empty with each run and is deleted after it turns those into reads, and cannot carry a
stale program from another commit. The controller creates it and its workers and subprocesses
inherit the environment; a size limit makes JAX lock the directory (`filelock`), so two processes
never read a half-written entry. A `JAX_COMPILATION_CACHE_DIR` set by the user is used as it is.
"""

import os
import shutil
import tempfile

# XLA's CPU backend at optimisation level 0 with the legacy elemental emitters instead of the MLIR fusion
# emitters: a tiny model's gradient compiles in ~0.33x the default flags' time (level 0 alone ~0.57x, the
# emitters alone ~1x; results/bench_compile.md), and compiling is most of the suite (docs/testing.md,
# "Time"). The HLO is the same; the machine code runs slower, which the suite's small shapes pay back.
TEST_XLA_FLAGS = (
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
# The default-flag tier (`tests/repo/test_xla_default_flags.py`): the checks marked `xla_default` (bit for
# bit and cross-implementation) run again at XLA's default flags, what users compile.
XLA_DEFAULT_TIER = os.environ.get("FPA_XLA_DEFAULT_FLAGS") == "1"
if XLA_DEFAULT_TIER:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # true in the controller only
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fpa_jax_test_cache_")
  os.environ["FPA_TEST_CACHE_OWNER"] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # enables the lock

from hypothesis import settings  # noqa: E402

# JIT compiles make first examples slow: no per-example deadline; CI keeps example counts modest.
settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


# Slow tests carry `@pytest.mark.slow` (a parametrized case: `pytest.param(..., marks=pytest.mark.slow)`)
# in their own files; pyproject.toml's addopts deselect them by default (docs/testing.md).


def pytest_unconfigure(config):
  # Only the process that made the cache deletes it (its workers unconfigure first).
  if os.environ.get("FPA_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
