"""The runnable tour (`make demo`) keeps working."""

import pathlib
import runpy


def test_tour_decodes_both_sequences_to_their_limits(capsys):
    runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "tour.py"),
                   run_name="__main__")
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("done after"), out
    # max_new is 10 and 6 with no stop ids: exactly that many tokens each
    committed = eval(last.split(": ", 1)[1])  # noqa: S307  (a printed list of lists)
    assert [len(c) for c in committed] == [10, 6]
    assert all(0 <= t < 64 for c in committed for t in c)


def test_docstring_examples_of_every_public_op_run():
    import doctest

    from wedlm_kernels.ops import attention, commit, reorder, rope, select

    for module in (attention, commit, reorder, rope, select):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0, f"{module.__name__} has no example"
        assert result.failed == 0, f"{module.__name__}: {result.failed} failing example(s)"
