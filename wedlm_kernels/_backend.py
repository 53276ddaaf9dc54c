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


def _setting(variable: str, choices: tuple[str, ...]) -> str:
    """The environment setting ``variable`` (case and spaces ignored; unset or empty: the
    first of ``choices``), which must be one of ``choices``."""
    value = os.environ.get(variable, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{variable}={value!r} is not one of {', '.join(choices)}")
    return value


BACKENDS = ("auto", "interpret", "torch")
BACKEND = _setting("WEDLM_KERNELS_BACKEND", BACKENDS)
if BACKEND == "interpret":
    os.environ["TRITON_INTERPRET"] = "1"

# The select_tokens kernel of "greedy" and "temperature" calls on CUDA or interpreted tensors
# (docs/contracts.md, "Sampling modes"): ``three_launch`` (measured on an H200, the default)
# or ``one_launch`` (ops/select_one_launch.py). ``any`` calls always take the three launches.
SELECT_KERNELS = ("three_launch", "one_launch")
SELECT_KERNEL = _setting("WEDLM_KERNELS_SELECT_KERNEL", SELECT_KERNELS)

# paged_attention's split-KV rule (ops/attention.py): ``measured`` (the rule the H200 runs
# measured, the default) or ``fa2`` (FlashAttention-2's num_splits heuristic, residency-aware;
# not yet measured on a GPU).
ATTENTION_SPLIT_RULES = ("measured", "fa2")
ATTENTION_SPLITS = _setting("WEDLM_KERNELS_ATTENTION_SPLITS", ATTENTION_SPLIT_RULES)

# How paged_attention merges a split-KV launch's partial outputs (ops/attention.py):
# ``combine`` (a second kernel, the one the H200 runs measured, the default) or
# ``last_program`` (one launch: the last split program of each query tile to finish merges
# them; not yet measured on a GPU).
ATTENTION_MERGES = ("combine", "last_program")
ATTENTION_MERGE = _setting("WEDLM_KERNELS_ATTENTION_MERGE", ATTENTION_MERGES)

# The order paged_attention starts its query tiles in: ``forward`` (program ids as laid
# out, the default, measured) or ``heaviest_first`` (in reverse: a sequence's last tiles,
# which see the most keys under the causal mask, first; not yet measured on a GPU).
ATTENTION_ORDERS = ("forward", "heaviest_first")
ATTENTION_ORDER = _setting("WEDLM_KERNELS_ATTENTION_ORDER", ATTENTION_ORDERS)

DEBUG = os.environ.get("WEDLM_KERNELS_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")
