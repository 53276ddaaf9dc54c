"""The runnable tour (`make tour`) keeps working."""

import pathlib
import re
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


def test_docstring_examples_of_every_public_op_and_helper_run():
    import doctest

    from wedlm_kernels import batch, window_policy
    from wedlm_kernels.ops import attention, commit, logits, reorder, rope, select, silu_mul

    for module in (attention, commit, logits, reorder, rope, select, silu_mul, batch,
                   window_policy):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0, f"{module.__name__} has no example"
        assert result.failed == 0, f"{module.__name__}: {result.failed} failing example(s)"


def test_readme_runnable_snippets_print_what_their_comments_say(capsys):
    """Blocks marked `<!-- runnable -->` run as they are; each `print` is followed in the
    block by a comment line with the expected output."""
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"<!-- runnable -->\n```python\n(.*?)```", readme, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102
        printed = capsys.readouterr().out.strip().splitlines()
        lines = block.splitlines()
        expected = [
            lines[i + 1].removeprefix("# ").strip()
            for i, line in enumerate(lines) if line.startswith("print(")
        ]
        assert printed == expected


PUBLIC_OPS = ("commit_window", "paged_attention", "process_logits", "reorder_window",
              "rope_cache", "rope_kv_append", "select_tokens", "silu_mul",
              # the helpers around them (wedlm_kernels.batch)
              "mask_rows", "new_window_state", "paged_slots", "prefill_slots",
              # the adaptive window (wedlm_kernels.window_policy)
              "new_policy_state", "next_window_lengths", "resize_windows", "window_masks")
# an op's argument, a helper's result, the adaptive window's settings and state
PUBLIC_CLASSES = ("YarnScaling", "WindowState", "AdaptiveWindow", "WindowPolicyState")


def test_public_classes_document_every_field_in_numpy_style():
    import dataclasses
    import inspect

    import wedlm_kernels as wk

    assert set(PUBLIC_CLASSES) == {name for name in wk.__all__
                                   if inspect.isclass(getattr(wk, name))}
    for name in PUBLIC_CLASSES:
        doc = inspect.getdoc(getattr(wk, name))
        assert "\nParameters\n----------\n" in doc, name
        for field in dataclasses.fields(getattr(wk, name)):
            assert re.search(rf"\n{field.name}(, \w+)* : |\n\w+, {field.name} : ", doc), (
                name, field.name)


def test_public_ops_document_every_parameter_in_numpy_style():
    import inspect

    import wedlm_kernels as wk

    assert set(PUBLIC_OPS) == {name for name in wk.__all__ if callable(getattr(wk, name))
                               and not inspect.isclass(getattr(wk, name))}
    for name in PUBLIC_OPS:
        op = getattr(wk, name)
        doc = inspect.getdoc(op)
        for section in ("Parameters", "Returns", "Examples"):
            assert f"\n{section}\n{'-' * len(section)}\n" in doc, (name, section)
        for parameter in inspect.signature(op).parameters:
            assert f"\n{parameter} : " in doc, (name, parameter)


def test_no_docstring_uses_google_style_sections():
    """One docstring style in the project: numpy sections (``Parameters`` over dashes),
    never ``Args:`` / ``Returns:`` blocks."""
    import re

    root = pathlib.Path(__file__).parents[1]
    google = re.compile(r"^\s+(Args|Arguments|Returns|Raises|Yields|Examples?):\s*$", re.M)
    offenders = [
        f"{path.relative_to(root)}: {match.group(1)}:"
        for folder in ("wedlm_kernels", "model_min", "reference", "bench", "examples", "tests")
        for path in sorted((root / folder).rglob("*.py"))
        for match in google.finditer(path.read_text())
    ]
    assert not offenders, offenders
