"""Reference bad_words rule (docs/requests.md, "Bad words"), literally, one sequence at a
time: positions are logical, ``known`` maps a position to its token (committed output or
filled window slot; prompt positions are never in it)."""


def banned_tokens(position: int, known: dict[int, int], words: list[list[int]]) -> set[int]:
    """Rule 1: the tokens that would complete a word at ``position`` with ``known``."""
    banned = set()
    for word in words:
        for i in range(len(word)):
            start = position - i
            if all(k == i or known.get(start + k) == word[k] for k in range(len(word))):
                banned.add(word[i])
    return banned


def refused_fills(fills: dict[int, int], known: dict[int, int], words: list[list[int]]
                  ) -> set[int]:
    """Rule 2: the positions of ``fills`` (this step's, position -> token) not filled: those
    completing a word, with ``known`` and the other fills, in which no place right of them
    is filled by this step."""
    after = {**known, **fills}
    refused = set()
    for position in fills:
        for word in words:
            for i in range(len(word)):
                start = position - i
                complete = all(after.get(start + k) == word[k] for k in range(len(word)))
                rightmost = not any(start + k in fills for k in range(i + 1, len(word)))
                if complete and rightmost:
                    refused.add(position)
    return refused


def contains_word(tokens: list[int], words: list[list[int]]) -> bool:
    return any(tokens[s: s + len(w)] == list(w) for w in words
               for s in range(len(tokens) - len(w) + 1))
