"""A small grammar for the structured-output tests: one of a few token sequences, then an end
token (what ``wedlm_kernels.requests.grammar.Grammar`` asks of vLLM's grammars, written out plainly
so the tests need no grammar engine)."""

import torch


class Choice:
    """Accepts one of ``choices`` (token id lists) followed by ``end``; then terminated."""

    def __init__(self, choices: list[list[int]], end: int, vocab_size: int) -> None:
        self.choices = [list(c) for c in choices]
        self.end = end
        self.vocab_size = vocab_size
        self.tokens: list[int] = []
        self.terminated = False
        self.accepted: list[int] = []  # every token ever accepted and kept (for tests)

    def allowed(self) -> set[int]:
        if self.terminated:
            return set()
        n = len(self.tokens)
        allowed = {c[n] for c in self.choices if len(c) > n and c[:n] == self.tokens}
        if self.tokens in self.choices:
            allowed.add(self.end)
        return allowed

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.terminated:
            return True
        for token in tokens:
            if self.terminated:  # tokens after the end are ignored (as vLLM's are)
                break
            if token not in self.allowed():
                return False
            if token == self.end:
                self.terminated = True
            self.tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens:]
        self.terminated = bool(self.tokens) and self.tokens[-1] == self.end

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        words = [0] * bitmask.shape[1]
        for token in self.allowed():
            words[token // 32] |= 1 << (token % 32)
        bitmask[index] = torch.tensor(
            [w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def is_terminated(self) -> bool:
        return self.terminated


class Repeat(Choice):
    """Accepts ``count`` tokens from ``allowed_tokens``, then ``end`` (a regex's
    ``[...]{count}``): a permissive grammar, which text of those tokens always satisfies."""

    def __init__(self, allowed_tokens, count: int, end: int, vocab_size: int) -> None:
        super().__init__([], end, vocab_size)
        self.allowed_tokens = set(allowed_tokens)
        self.count = count

    def allowed(self) -> set[int]:
        if self.terminated:
            return set()
        return set(self.allowed_tokens) if len(self.tokens) < self.count else {self.end}
