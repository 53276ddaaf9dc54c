"""Tokens per forward under a grammar beside the same requests unconstrained (model_min on
the tiny model): the window rule of ``wedlm_kernels.grammar`` commits one sampled token and
the forced tokens after it each step, free decoding what the entropy rule selects.

Run with the vLLM venv (the grammars are vLLM's xgrammar backend's, as the plugin serves
them): ``.venv-vllm/bin/python -m bench.structured_outputs``. Writes
``bench/results/cpu/structured_outputs.{json,md}``. Tokens and forwards are counts, not
times: they do not depend on the device, and the run's device is recorded anyway.

Each case decodes the four prompts of ``tests/vllm_plugin/test_vllm_decoding.py`` greedily
under the grammar (up to 200 tokens, eos ends), then the same prompts unconstrained for as
many tokens as the longest constrained output (a free request on the tiny model rarely
writes eos).
"""

import argparse
import json
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

                    generator = model_min.Generator(model, window=window, max_batch=4)
                    ruled = generator.generate(PROMPTS, model_min.SamplingParams(
                        max_new_tokens=200, stop_token_ids=(EOS,), grammar=grammar), mode=mode)
                    longest = max(len(r.token_ids) for r in ruled)
                    free = generator.generate(PROMPTS, model_min.SamplingParams(
                        max_new_tokens=longest), mode=mode)
                    tokens = sum(len(r.token_ids) for r in ruled)
                    forwards = sum(r.forwards for r in ruled)
                    free_tokens = sum(len(r.token_ids) for r in free)
                    free_forwards = sum(r.forwards for r in free)
                    rows.append({
                        "grammar": name, "any_whitespace": any_whitespace, "window": window,
                        "mode": mode, "tokens": tokens, "forwards": forwards,
                        "tokens_per_forward": round(tokens / forwards, 3),
                        "finished_on_eos": sum(r.finish_reason == "stop" for r in ruled),
                        "free_tokens": free_tokens, "free_forwards": free_forwards,
                        "free_tokens_per_forward": round(free_tokens / free_forwards, 3),
                    })
    import vllm
    import xgrammar

    from model_min.run_info import device_info, utc_now, versions

    return {"benchmark": "bench.structured_outputs", "date": utc_now(),
            "device": device_info(torch.device("cpu")),
            "versions": {**versions(), "vllm": vllm.__version__,
                         "xgrammar": getattr(xgrammar, "__version__", None)},
            "command": " ".join(["python -m bench.structured_outputs", *sys.argv[1:]]),
            "cases": rows}


def markdown(result: dict) -> str:
    lines = ["# Tokens per forward under a grammar (model_min, tiny model, greedy)", "",
             "Counts, not times (they do not depend on the device). Four prompts; the free "
             "run decodes as many tokens as the longest constrained output.", "",
             "| grammar | JSON whitespace | W | mode | tokens | forwards | tokens/forward "
             "| ended on eos | free tokens/forward |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        lines.append(
            f"| {row['grammar']} | {'free' if row['any_whitespace'] else 'none'} | "
            f"{row['window']} | {row['mode']} | {row['tokens']} | {row['forwards']} | "
            f"{row['tokens_per_forward']:.2f} | {row['finished_on_eos']}/4 | "
            f"{row['free_tokens_per_forward']:.2f} |")
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
