"""The ``wedlm_patterns`` lm-eval task's items: pattern continuations for the shipped tiny
model (``model_min/tiny_wedlm``), drawn from a fixed seed of their own.

    python -m bench.eval.make_patterns          # rewrites bench/eval/wedlm_patterns/items.jsonl

Each item is a pattern's header and its first few items (``prompt``, ending with the
separator) and the next five items (``target``, joined by the separator): the model must
write exactly those five. The families are the ones the tiny model was trained on
(``model_min/train_tiny.py``: counting in steps of 1, 2, 5 and 10, multiplication tables of
2 to 12, sums, letter, day and month cycles, number words, a repeated phrase), drawn from
the ranges it saw (``"in_training": true``), and variants it never saw (``false``): counting
in steps of 3, 4 and 7, counts past 2000, tables of 13 to 19, the alphabet and the days
backwards. So the table is not all 100%, and the two halves can be scored apart.
"""

import json
import random
from pathlib import Path

from model_min.train_tiny import ADJECTIVES, DAYS, MONTHS, NOUNS, NUMBER_WORDS, count_start

SEED = 20261202
OUT = Path(__file__).resolve().parent / "wedlm_patterns" / "items.jsonl"
NEXT_ITEMS = 5
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PER_FAMILY_IN_TRAINING = 10  # 8 families: 80 items
PER_FAMILY_UNSEEN = 8  # 5 families: 40 items


def item(family: str, in_training: bool, header: str, items: list[str], separator: str,
         shown: int) -> dict:
    """``shown`` items after the header, then the next five as the target."""
    prompt = header + separator.join(items[:shown]) + separator
    target = separator.join(items[shown: shown + NEXT_ITEMS])
    return {"family": family, "in_training": in_training, "prompt": prompt,
            "target": target, "separator": separator}


def count(rng: random.Random, step: int, start: int, in_training: bool) -> dict:
    header = "count: " if step == 1 else f"count by {step}: "
    items = [str(start + step * i) for i in range(12)]
    family = "count" if in_training else "count (unseen step or range)"
    return item(family, in_training, header, items, " ", rng.randrange(3, 7))


def cycle(items: list[str], start: int, length: int) -> list[str]:
    return [items[(start + i) % len(items)] for i in range(length)]


def in_training_items(rng: random.Random) -> list[dict]:
    out = []
    for _ in range(PER_FAMILY_IN_TRAINING):
        step = rng.choice([1, 2, 5, 10])
        out.append(count(rng, step, count_start(rng, step), True))
    for _ in range(PER_FAMILY_IN_TRAINING):
        a, start = rng.randrange(2, 13), rng.randrange(1, 4)
        items = [f"{a}x{i}={a * i}" for i in range(start, start + 12)]
        out.append(item("table", True, f"table of {a}: ", items, ", ", rng.randrange(2, 5)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        a, b = rng.randrange(0, 50), rng.randrange(1, 10)
        items = [f"{a + i}+{b}={a + i + b}" for i in range(12)]
        out.append(item("sums", True, "sums: ", items, "; ", rng.randrange(2, 5)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        letters = LETTERS.upper() if rng.random() < 0.5 else LETTERS
        separator = rng.choice(["", " ", ", "])
        items = cycle(list(letters), rng.randrange(26), 14)
        out.append(item("letters", True, "letters: ", items, separator, rng.randrange(3, 8)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        items = cycle(DAYS, rng.randrange(7), 12)
        out.append(item("days", True, "days: ", items, ", ", rng.randrange(2, 5)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        items = cycle(MONTHS, rng.randrange(12), 12)
        out.append(item("months", True, "months: ", items, ", ", rng.randrange(2, 4)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        items = cycle(NUMBER_WORDS, rng.randrange(13), 12)
        out.append(item("numbers", True, "numbers: ", items, " ", rng.randrange(2, 5)))
    for _ in range(PER_FAMILY_IN_TRAINING):
        phrase = " ".join(rng.choice(ADJECTIVES + NOUNS) for _ in range(2))
        out.append(item("repeat", True, "repeat: ", [phrase] * 9, " | ", rng.randrange(2, 4)))
    return out


def unseen_items(rng: random.Random) -> list[dict]:
    out = []
    for _ in range(PER_FAMILY_UNSEEN):
        step = rng.choice([3, 4, 7])
        out.append(count(rng, step, step * rng.randrange(0, 30), False))
    for _ in range(PER_FAMILY_UNSEEN):
        out.append(count(rng, 1, rng.randrange(2000, 9000), False))
    for _ in range(PER_FAMILY_UNSEEN):
        a, start = rng.randrange(13, 20), rng.randrange(1, 4)
        items = [f"{a}x{i}={a * i}" for i in range(start, start + 12)]
        out.append(item("table (13 to 19)", False, f"table of {a}: ", items, ", ",
                        rng.randrange(2, 5)))
    for _ in range(PER_FAMILY_UNSEEN):
        items = cycle(list(LETTERS[::-1]), rng.randrange(26), 14)
        out.append(item("letters backwards", False, "letters: ", items, " ",
                        rng.randrange(3, 8)))
    for _ in range(PER_FAMILY_UNSEEN):
        items = cycle(DAYS[::-1], rng.randrange(7), 12)
        out.append(item("days backwards", False, "days: ", items, ", ", rng.randrange(2, 5)))
    return out


def make_items(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    items = in_training_items(rng) + unseen_items(rng)
    for index, entry in enumerate(items):
        entry["id"] = index
    return items


def main() -> int:
    items = make_items()
    OUT.write_text("".join(json.dumps(entry) + "\n" for entry in items))
    print(f"{OUT}: {len(items)} items, {sum(e['in_training'] for e in items)} in training")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
