"""Tokens per forward under a grammar beside the same requests unconstrained (model_min on
the tiny model), with drafts (``wedlm_kernels.requests.grammar``: slots past the grammar slot are
drafted and checked by the next walk) and without them (the rule before drafts: one
sampled token a step, plus the forced tokens after it), in the same run.

Run with the vLLM venv (the grammars are vLLM's xgrammar backend's, as the plugin serves
them): ``.venv-vllm/bin/python -m bench.structured_outputs``. Writes
``bench/results/cpu/structured_outputs.{json,md}``. Tokens and forwards are counts, not
times: they do not depend on the device, and the run's device is recorded anyway.

Two families of cases, greedy:

- **model's choice**: the four prompts of ``tests/vllm_plugin/test_vllm_decoding.py``
  under a JSON schema, a regex, a choice and an EBNF grammar (up to 200 tokens, eos ends),
  then the same prompts unconstrained for as many tokens as the longest constrained output
  (a free request on the tiny model rarely writes eos). The grammars overrule what the
  model writes freely;
- **free text accepted**: four predictable prompts (counting, letters: what the tiny model
  writes at many tokens a forward) under permissive grammars (``[0-9a-z ]{n}``,
  ``[^\n]{n}``) for ``n`` tokens, beside free decoding of ``n`` tokens. The summary's
  ``constrained_over_free_toks_per_forward_min`` is over the cases whose grammar accepts
  every free output (recorded per case).
"""

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import model_min

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "model_min" / "tiny_wedlm"
EOS = 256
PROMPTS = [[72, 101, 108, 108, 111, 32], list(range(40, 61)), [1, 2, 3],
           list(b"def add(a, b):\n    return")]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "mood": {"enum": ["happy", "sad", "calm"]}},
    "required": ["name", "age", "mood"], "additionalProperties": False,
}


PREDICTABLE = [list(b"count: 1 2 3 4 5 "), list(b"letters: a b c d e "),
               list(b"count: 10 11 12 "), list(b"letters: abcdef")]
PERMISSIVE = {"[0-9a-z ]": "[0-9a-z ]{%d}", "[^\\n]": "[^\\n]{%d}"}
PERMISSIVE_LENGTHS = (40, 100)


def cases():
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Kind
    from vllm.v1.structured_output.utils import choice_as_grammar

    return {
        "json_schema": (Kind.JSON, json.dumps(SCHEMA)),
        "regex": (Kind.REGEX, r"[0-9]{3}-[a-z]{2,4}( ok)?"),
        "choice": (Kind.GRAMMAR, choice_as_grammar(["positive", "negative", "neutral"])),
        "ebnf": (Kind.GRAMMAR,
                 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] | "x" [0-9]'),
    }


def backend_for(model, any_whitespace: bool):
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = SimpleNamespace(model_config=None, speculative_config=None,
                             structured_outputs_config=SimpleNamespace(
                                 disable_any_whitespace=not any_whitespace))
    return XgrammarBackend(config, tokenizer=AutoTokenizer.from_pretrained(TINY),
                           vocab_size=model.config.vocab_size)


def _decode(model, window, mode, prompts, params, drafts=True):
    generator = model_min.Generator(model, window=window, max_batch=len(prompts),
                                    grammar_drafts=drafts)
    return generator.generate(prompts, params, mode=mode)


def _counts(results) -> tuple[int, int]:
    return sum(len(r.token_ids) for r in results), sum(r.forwards for r in results)


def _row(name, kind, window, mode, ruled, undrafted, free, **extra) -> dict:
    tokens, forwards = _counts(ruled)
    tokens_before, forwards_before = _counts(undrafted)
    free_tokens, free_forwards = _counts(free)
    return {
        "grammar": name, "family": kind, "window": window, "mode": mode, **extra,
        "tokens": tokens, "forwards": forwards,
        "tokens_per_forward": round(tokens / forwards, 3),
        "without_drafts_tokens": tokens_before, "without_drafts_forwards": forwards_before,
        "without_drafts_tokens_per_forward": round(tokens_before / forwards_before, 3),
        "finished_on_eos": sum(r.finish_reason == "stop" for r in ruled),
        "free_tokens": free_tokens, "free_forwards": free_forwards,
        "free_tokens_per_forward": round(free_tokens / free_forwards, 3),
    }


def run() -> dict:
    torch.manual_seed(0)
    model = model_min.load_model(TINY)
    rows = []
    for any_whitespace in (False, True):
        backend = backend_for(model, any_whitespace)
        for window in (8, 16):
            for mode in ("streaming", "blockwise"):
                for name, (kind, spec) in cases().items():
                    if any_whitespace and name != "json_schema":
                        continue  # only JSON has free whitespace

                    def grammar(kind=kind, spec=spec, backend=backend):
                        return backend.compile_grammar(kind, spec, stop_token_ids={EOS})

                    params = model_min.SamplingParams(max_new_tokens=200, stop_token_ids=(EOS,),
                                                      grammar=grammar)
                    ruled = _decode(model, window, mode, PROMPTS, params)
                    undrafted = _decode(model, window, mode, PROMPTS, params, drafts=False)
                    longest = max(len(r.token_ids) for r in ruled)
                    free = _decode(model, window, mode, PROMPTS,
                                   model_min.SamplingParams(max_new_tokens=longest))
                    rows.append(_row(name, "model's choice", window, mode, ruled, undrafted,
                                     free, any_whitespace=any_whitespace))
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Kind

    backend = backend_for(model, False)
    for length in PERMISSIVE_LENGTHS:
        for window in (8, 16):
            for mode in ("streaming", "blockwise"):
                free = _decode(model, window, mode, PREDICTABLE,
                               model_min.SamplingParams(max_new_tokens=length))
                for name, pattern in PERMISSIVE.items():
                    regex = pattern % length

                    def grammar(regex=regex):
                        return backend.compile_grammar(Kind.REGEX, regex, stop_token_ids={EOS})

                    params = model_min.SamplingParams(max_new_tokens=length,
                                                      stop_token_ids=(EOS,), grammar=grammar)
                    ruled = _decode(model, window, mode, PREDICTABLE, params)
                    undrafted = _decode(model, window, mode, PREDICTABLE, params, drafts=False)
                    accepts = all(re.fullmatch(regex, bytes(r.token_ids).decode("latin-1"))
                                  for r in free)
                    rows.append(_row(
                        f"{name}{{{length}}}", "free text accepted", window, mode, ruled,
                        undrafted, free, any_whitespace=False, accepts_free_text=accepts,
                        same_text=sum(a.token_ids == b.token_ids for a, b in zip(ruled, free)),
                        extra_forwards_max=max(a.forwards - b.forwards
                                               for a, b in zip(ruled, free))))
    import vllm
    import xgrammar

    from model_min.run_info import device_info, utc_now, versions

    accepted = [r for r in rows if r.get("accepts_free_text")]
    json_rows = [r for r in rows if r["grammar"] == "json_schema" and not r["any_whitespace"]]
    summary = {
        "constrained_over_free_toks_per_forward_min": round(min(
            r["tokens_per_forward"] / r["free_tokens_per_forward"] for r in accepted), 3),
        "constrained_over_free_toks_per_forward_min_without_drafts": round(min(
            r["without_drafts_tokens_per_forward"] / r["free_tokens_per_forward"]
            for r in accepted), 3),
        "json_schema_toks_per_forward": {
            f"W{r['window']} {r['mode']}": r["tokens_per_forward"] for r in json_rows},
        "json_schema_toks_per_forward_without_drafts": {
            f"W{r['window']} {r['mode']}": r["without_drafts_tokens_per_forward"]
            for r in json_rows},
    }
    return {"benchmark": "bench.structured_outputs", "date": utc_now(),
            "device": device_info(torch.device("cpu")),
            "versions": {**versions(), "vllm": vllm.__version__,
                         "xgrammar": getattr(xgrammar, "__version__", None)},
            "command": " ".join(["python -m bench.structured_outputs", *sys.argv[1:]]),
            "summary": summary, "cases": rows}


def markdown(result: dict) -> str:
    lines = ["# Tokens per forward under a grammar (model_min, tiny model, greedy)", "",
             "Counts, not times (they do not depend on the device). Four prompts a case. "
             "*With drafts*: slots past the grammar slot are drafted and checked by the next "
             "walk; *without*: one sampled token a step plus the forced ones (the rule "
             "before drafts), in the same run.", ""]
    summary = result["summary"]
    lines += ["| summary | value |", "|---|---|"]
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v:.2f}" for k, v in value.items())
        lines.append(f"| `{key}` | {value} |")
    lines += ["", "## The grammar overrules what the model writes", "",
              "The free run decodes as many tokens as the longest constrained output.", "",
              "| grammar | JSON whitespace | W | mode | tokens | forwards | tokens/forward "
              "| without drafts | ended on eos | free tokens/forward |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        if row["family"] != "model's choice":
            continue
        lines.append(
            f"| {row['grammar']} | {'free' if row['any_whitespace'] else 'none'} | "
            f"{row['window']} | {row['mode']} | {row['tokens']} | {row['forwards']} | "
            f"{row['tokens_per_forward']:.2f} | "
            f"{row['without_drafts_tokens_per_forward']:.2f} | {row['finished_on_eos']}/4 | "
            f"{row['free_tokens_per_forward']:.2f} |")
    lines += ["", "## The grammar accepts what free decoding writes", "",
              "Predictable prompts (counting, letters), `n` tokens each.", "",
              "| grammar | W | mode | accepts the free text | same text as free | tokens "
              "| forwards | free forwards | most extra forwards a request | tokens/forward "
              "| without drafts | free tokens/forward | over free |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        if row["family"] != "free text accepted":
            continue
        lines.append(
            f"| `{row['grammar']}` | {row['window']} | {row['mode']} | "
            f"{'yes' if row['accepts_free_text'] else 'no'} | {row['same_text']}/4 | "
            f"{row['tokens']} | {row['forwards']} | {row['free_forwards']} | "
            f"{row['extra_forwards_max']} | {row['tokens_per_forward']:.2f} | "
            f"{row['without_drafts_tokens_per_forward']:.2f} | "
            f"{row['free_tokens_per_forward']:.2f} | "
            f"{row['tokens_per_forward'] / row['free_tokens_per_forward']:.2f} |")
    versions = result["versions"]
    lines += ["", f"`{result['command']}` ({result['date']}): torch "
              f"{versions['torch']}, vLLM {versions['vllm']}, Python {versions['python']}, "
              f"on the CPU."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu")
    args = parser.parse_args()
    result = run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_outputs.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "structured_outputs.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
