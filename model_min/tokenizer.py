"""Tokenizer support: ``tokenizer.json`` from the checkpoint folder through the ``tokenizers``
package (no hub access), and the Qwen chat template."""

from pathlib import Path
from typing import Union

CHAT_TEMPLATE = "<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class Tokenizer:
    """Thin wrapper of a ``tokenizers.Tokenizer``."""

    def __init__(self, path: Union[str, Path]) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ImportError(
                f"{path} needs the `tokenizers` package (pip install tokenizers), or pass "
                "token ids (CLI: --prompt-ids)"
            ) from None
        self.path = Path(path)
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own Exception for a bad file
            raise ValueError(f"{path}: not a readable tokenizer.json ({error})") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def ids(self) -> frozenset[int]:
        """Every id the tokenizer decodes (its vocabulary and added tokens)."""
        return frozenset(self._tokenizer.get_vocab(with_added_tokens=True).values())

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def chat_stop_ids(self) -> tuple[int, ...]:
        """Ids of the tokens that end an assistant turn, those the vocabulary has."""
        ids = (self.token_id(token) for token in CHAT_STOP_TOKENS)
        return tuple(i for i in ids if i is not None)


def chat_prompt(message: str) -> str:
    """One user turn in the Qwen chat template, ready for the assistant's answer."""
    return CHAT_TEMPLATE.format(message=message)


def load_tokenizer(path: Union[str, Path]) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no ``tokenizer.json``."""
    file = Path(path) / "tokenizer.json"
    return Tokenizer(file) if file.exists() else None
