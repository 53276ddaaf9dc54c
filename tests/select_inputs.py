"""Building select_tokens arguments from plain Python values (shared by the op and kernel tests)."""

import torch

INF = float("inf")


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def batch(logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed):
    """Argument tuple in the op's order (CPU tensors) from plain Python values."""
    if not isinstance(logits, torch.Tensor):
        logits = torch.tensor(logits, dtype=torch.float32)
    return (
        logits, i32(*cu_rows), i64(*row_pos), f32(*temperature), i32(*top_k), f32(*top_p),
        f32(*threshold), f32(*penalty), i64(*seed),
    )


def one_sequence(logits, row_pos, temperature=0.0, top_k=0, top_p=1.0, threshold=-INF,
                 penalty=0.0, seed=0):
    logits = torch.tensor(logits, dtype=torch.float32)
    return batch(logits, [0, logits.shape[0]], row_pos, [temperature], [top_k], [top_p],
                 [threshold], [penalty], [seed])
