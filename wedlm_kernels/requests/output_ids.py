"""The token ids no front end ever outputs, defined once (docs/requests.md, "Ids never
output").

A checkpoint's vocabulary (its embedding rows, ``config.json``'s ``vocab_size``) is often
wider than its tokenizer's: Qwen3's has 151936 rows for 151669 tokens, the shipped tiny
model 264 rows for 258. The ids past the tokenizer's decode to no text, and the mask id is
WeDLM's placeholder for an undecided slot, never a token of the text. Both front ends
(``model_min`` and the vLLM plugin) give these ids ``-inf`` in every row a step decides,
before anything else reads the logits (a grammar's mask, the request's logit rules, the
logprobs, the entropy), so no request's rules can bring one back::

    never = never_output_ids(vocab_size=264, mask_token_id=257, tokenizer_ids=range(258))
    # (257, 258, 259, 260, 261, 262, 263)
    logits.index_fill_(1, torch.tensor(never), float("-inf"))

A row whose every other token a request's rules ban is then empty, and ``select_tokens``
gives an empty row token 0 (docs/contracts.md, "select_tokens"), so id 0 must be one the
engine can output: :func:`never_output_ids` refuses a checkpoint where it is not.
"""

import json
from collections.abc import Collection
from pathlib import Path

import numpy as np

__all__ = ["never_output_ids", "output_bitmask", "tokenizer_ids"]


def tokenizer_ids(folder: str | Path) -> frozenset[int] | None:
    """The ids a checkpoint folder's ``tokenizer.json`` decodes: its model's vocabulary
    (BPE, WordPiece and WordLevel's token -> id table, Unigram's list) and its added
    tokens. None when the folder has no ``tokenizer.json``; ``ValueError`` naming the file
    when it cannot be read as one."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids.update(token["id"] for token in data.get("added_tokens") or ())
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a readable tokenizer.json ({error!r:.200})") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: token ids must be integers")
    return frozenset(ids)


def never_output_ids(vocab_size: int, mask_token_id: int | None,
                     tokenizer_ids: Collection[int] | None) -> tuple[int, ...]:
    """The ids of ``[0, vocab_size)`` no request may output, in increasing order: the mask
    id (None: a checkpoint decoded AR only) and, when the tokenizer's ids are known, every
    id the tokenizer does not have.

    Raises ``ValueError`` when id 0 is among them: an empty row's token is 0, which must
    then be text (module docstring)."""
    never = set() if tokenizer_ids is None else set(range(vocab_size)).difference(tokenizer_ids)
    if mask_token_id is not None and 0 <= mask_token_id < vocab_size:
        never.add(int(mask_token_id))
    if 0 in never:
        why = ("it is the mask id" if mask_token_id == 0
               else "the tokenizer has no token 0")
        raise ValueError(
            "token id 0 cannot be output (" + why + "), but it is the token select_tokens "
            "gives a row whose every token is banned; a checkpoint whose id 0 is not text "
            "is not supported")
    return tuple(sorted(never))


def output_bitmask(vocab_size: int, never: Collection[int]) -> np.ndarray:
    """The ids that may be output as a token bitmask, ``[ceil(vocab_size / 32)]`` int32
    (xgrammar's layout: bit ``v % 32`` of word ``v // 32`` set iff ``v`` may be output;
    the bits past ``vocab_size`` are clear)."""
    bits = np.ones(-(-vocab_size // 32) * 32, dtype=bool)
    bits[vocab_size:] = False
    bits[np.asarray(list(never), dtype=np.int64)] = False
    return np.packbits(bits.reshape(-1, 8)[:, ::-1]).view("<i4").copy()
