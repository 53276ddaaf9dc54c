"""Scoring of the ``wedlm_patterns`` task (lm-eval ``process_results``)."""


def five_items_exact(generation: str, target: str, separator: str) -> bool:
    """The generation writes the five target items and the fifth ends there: what follows
    it, if anything, starts the next item's separator (a fifth item ``11`` written as
    ``110`` is wrong). Items of a separator-less cycle (letters) are one character each."""
    if not generation.startswith(target):
        return False
    rest = generation[len(target):]
    return not separator or not rest or rest.startswith(separator[0])


def process_results(doc: dict, results: list[str]) -> dict:
    exact = float(five_items_exact(results[0], doc["target"], doc["separator"]))
    # the two halves apart: a half the item is not in scores nothing (None is skipped by
    # lm-eval's mean only where the key is absent, so each half is its own list)
    scores = {"exact": exact}
    scores["exact_in_training" if doc["in_training"] else "exact_unseen"] = exact
    return scores
