"""Paged KV cache: per layer ``k``/``v`` of shape ``[num_pages, page_size, Hkv, D]`` ("NHD",
flash-attn's paged layout) and a free list of pages.

Position ``t`` of a sequence lives at page ``block_table[t // page_size]``, offset
``t % page_size``, i.e. at flat slot ``page * page_size + t % page_size``. A request gets
all the pages it can ever need when it is admitted (prompt + max_new_tokens + window), so a
decode step never allocates, and gives them back when it finishes.
"""

import torch


class CacheFullError(ValueError):
    """A request needs more pages than the whole cache holds."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a cache needs num_pages >= 1 and page_size >= 1, got "
                             f"{num_pages} and {page_size}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first

    def pages_for(self, num_positions: int) -> int:
        return -(-max(num_positions, 0) // self.page_size)

    def check_fits(self, num_positions: int, what: str = "request") -> None:
        """Raise :class:`CacheFullError` if ``num_positions`` can never fit, even alone."""
        needed = self.pages_for(num_positions)
        if needed > self.num_pages:
            raise CacheFullError(
                f"{what} needs {num_positions} cache positions ({needed} pages of "
                f"{self.page_size}) but the KV cache holds only {self.num_pages} pages "
                f"({self.num_pages * self.page_size} positions); raise max_cache_tokens or "
                "lower max_new_tokens"
            )

    def can_allocate(self, num_positions: int) -> bool:
        return self.pages_for(num_positions) <= len(self.free_pages)

    def allocate(self, num_positions: int) -> list[int]:
        needed = self.pages_for(num_positions)
        if needed > len(self.free_pages):
            raise CacheFullError(f"{needed} pages requested, {len(self.free_pages)} free")
        return [self.free_pages.pop() for _ in range(needed)]

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))

