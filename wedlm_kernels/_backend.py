"""The backend switch (docs/testing.md, "Backends"), read once at import.

``WEDLM_KERNELS_BACKEND``:

- ``auto`` (default): CUDA tensors run the compiled Triton kernels, CPU tensors run the
  vectorised PyTorch implementations.
- ``interpret``: CPU tensors run the Triton kernels through Triton's interpreter (this
  module sets ``TRITON_INTERPRET=1`` before any kernel module is imported).
- ``torch``: the PyTorch implementations everywhere.

``WEDLM_KERNELS_DEBUG=1`` additionally checks tensor *values* at the public boundary
(lengths within capacity, monotone row offsets, ...). Those checks synchronise with the
host, so they are off by default.
"""

import os

BACKENDS = ("auto", "interpret", "torch")

BACKEND = os.environ.get("WEDLM_KERNELS_BACKEND", "auto").strip().lower() or "auto"
if BACKEND not in BACKENDS:
    raise ValueError(
        f"WEDLM_KERNELS_BACKEND={BACKEND!r} is not one of {', '.join(BACKENDS)}"
    )
if BACKEND == "interpret":
    os.environ["TRITON_INTERPRET"] = "1"

# The select_tokens kernel of "greedy" and "temperature" calls on CUDA or interpreted tensors
# (docs/contracts.md, "Sampling modes"): ``three_launch`` (measured on an H200, the default)
# or ``one_launch`` (ops/select_one_launch.py). ``any`` calls always take the three launches.
SELECT_KERNELS = ("three_launch", "one_launch")
SELECT_KERNEL = os.environ.get("WEDLM_KERNELS_SELECT_KERNEL", "three_launch").strip().lower() \
    or "three_launch"
if SELECT_KERNEL not in SELECT_KERNELS:
    raise ValueError(f"WEDLM_KERNELS_SELECT_KERNEL={SELECT_KERNEL!r} is not one of "
                     f"{', '.join(SELECT_KERNELS)}")

# paged_attention's split-KV rule (ops/attention.py): ``measured`` (the rule the H200 runs
# measured, the default) or ``fa2`` (FlashAttention-2's num_splits heuristic, residency-aware;
# not yet measured on a GPU).
ATTENTION_SPLIT_RULES = ("measured", "fa2")
ATTENTION_SPLITS = os.environ.get("WEDLM_KERNELS_ATTENTION_SPLITS", "measured").strip().lower() \
    or "measured"
if ATTENTION_SPLITS not in ATTENTION_SPLIT_RULES:
    raise ValueError(f"WEDLM_KERNELS_ATTENTION_SPLITS={ATTENTION_SPLITS!r} is not one of "
                     f"{', '.join(ATTENTION_SPLIT_RULES)}")

DEBUG = os.environ.get("WEDLM_KERNELS_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")
