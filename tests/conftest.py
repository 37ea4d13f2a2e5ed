"""Test-wide setup: 8 simulated CPU devices for the sharding tests (must precede `import jax`)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import settings  # noqa: E402

# JIT compiles make first examples slow: no per-example deadline; CI keeps example counts modest.
settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
