"""Test-only: let DeepSpeed run its fp16 path (FP16_Optimizer, dynamic loss scaling) on the CPU.

DeepSpeed refuses fp16 on its CPU accelerator ("Type fp16 is not supported on your device"), so the
fp16 code path could not be tested on CI machines. Putting this directory on ``PYTHONPATH`` makes
every Python process of a test run (the launcher and its workers) import this module at start-up
and declare fp16 supported (FACTS-DEEPSPEED-CPU.md: the path then runs on CPU). Production code has
no such switch: ``train.precision=fp16`` on a CPU machine is refused by the preflight.
"""

try:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
except ImportError:  # an interpreter without deepspeed (e.g. a tool run by the tests)
    pass
