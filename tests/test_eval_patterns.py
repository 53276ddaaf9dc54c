"""The wedlm_patterns lm-eval task (bench/eval): its committed items are what the generator
writes, the families and halves are as documented, and the score reads five items exactly."""

import importlib.util
import json

import pytest

from bench.eval import make_patterns

TASK = make_patterns.OUT.parent


def load_utils():
    spec = importlib.util.spec_from_file_location("wedlm_patterns_utils", TASK / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_items_are_what_the_generator_writes():
    committed = [json.loads(line) for line in make_patterns.OUT.read_text().splitlines()]
    assert committed == make_patterns.make_items()
    assert make_patterns.make_items(seed=1) != committed  # the seed matters


def test_items_continue_a_pattern_with_five_items_in_both_halves():
    items = make_patterns.make_items()
    assert len(items) == 120 and sum(item["in_training"] for item in items) == 80
    families = {item["family"] for item in items if not item["in_training"]}
    assert families == {"count (unseen step or range)", "table (13 to 19)",
                        "letters backwards", "days backwards"}
    for item in items:
        separator = item["separator"]
        assert item["prompt"].endswith(separator) and not item["target"].endswith(" ")
        parts = item["target"].split(separator) if separator else list(item["target"])
        assert len(parts) == 5 and all(parts), item
        assert len(item["target"]) <= 80  # the task's max_gen_toks (one token a byte)


@pytest.mark.parametrize("generation, target, separator, exact", [
    ("7 8 9 10 11", "7 8 9 10 11", " ", True),
    ("7 8 9 10 11 12 13", "7 8 9 10 11", " ", True),
    ("7 8 9 10 110", "7 8 9 10 11", " ", False),  # the fifth item is longer
    ("7 8 9 10", "7 8 9 10 11", " ", False),
    (" 7 8 9 10 11", "7 8 9 10 11", " ", False),
    ("monday, tuesday, x, y, z, friday", "monday, tuesday, x, y, z", ", ", True),
    ("monday, tuesday, x, y, zz", "monday, tuesday, x, y, z", ", ", False),
    ("QRSTUV", "QRSTU", "", True),  # separator-less letters: one character each
    ("QRSTV", "QRSTU", "", False),
])
def test_the_score_reads_the_next_five_items_exactly(generation, target, separator, exact):
    assert load_utils().five_items_exact(generation, target, separator) is exact


def test_each_item_scores_its_own_half():
    utils = load_utils()
    seen = {"target": "a b c d e", "separator": " ", "in_training": True}
    unseen = {**seen, "in_training": False}
    assert utils.process_results(seen, ["a b c d e"]) == {"exact": 1.0,
                                                          "exact_in_training": 1.0}
    assert utils.process_results(unseen, ["a b c d"]) == {"exact": 0.0, "exact_unseen": 0.0}


def test_the_task_reads_the_committed_items():
    text = (TASK / "wedlm_patterns.yaml").read_text()
    assert "bench/eval/wedlm_patterns/items.jsonl" in text
    assert "process_results: !function utils.process_results" in text
    assert "max_gen_toks: 80" in text
