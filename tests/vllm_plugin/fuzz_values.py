"""The values the request fuzz tests send for every per-request field (test_vllm_fuzz.py
through ``LLM.generate``, test_vllm_server.py over HTTP), the same request as model_min
decodes it, and the verdict rules both tests apply.

A draw is a dict ``{field: value}`` on top of a fixed good request (greedy, 6 tokens,
``ignore_eos``); the fields are vLLM's names, with WeDLM's settings as their ``extra_args``
/ ``vllm_xargs`` keys.
"""

import math
from dataclasses import dataclass

import model_min
from wedlm_kernels import AdaptiveWindow
from wedlm_kernels.requests import params as rp

from .conftest import TINY, WINDOW

VOCAB = 264  # the tiny model's
MASK_ID = 257
PROMPT = [72, 101, 108, 108, 111, 32]
BASE = {"max_tokens": 6, "temperature": 0}
WEDLM_FIELDS = ("wedlm_window", "wedlm_entropy_threshold", "wedlm_distance_penalty",
                "wedlm_mode", "wedlm_window_policy")
# The adaptive window's floor in the fuzzed engines (max_num_seqs 4 on the CPU's row
# budget), which model_min's one-request Generators are given to decode as they do
ADAPTIVE_FLOOR = AdaptiveWindow.for_device(WINDOW, 4, "cpu").min_window
INF, NAN = math.inf, math.nan

# Every field gets the list: +-inf, NaN, +-1e300, +-3.5e38, 2**31, 2**63, -0.0,
# booleans, strings, lists, null; then values of its own around its bounds.
COMMON = [INF, -INF, NAN, 1e300, -1e300, 3.5e38, -3.5e38, 2**31, 2**63, -0.0, True, False,
          "0.5", "", [1], None]
VALUES = {
    "temperature": COMMON + [0, 1e-40, 0.005, 0.7, 2, 2.5, -1],
    "top_k": COMMON + [-2, -1, 0, 1, 5, 2**31 - 1, 2**40, 2.0],
    "top_p": COMMON + [0, 1e-300, 0.5, 1, 1.5, -0.5],
    "seed": COMMON + [-1, 0, 7, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64, 7.0],
    "max_tokens": COMMON + [0, 1, 3, 200, 2**31 - 1, -5],
    "stop_token_ids": COMMON + [[], [MASK_ID], [VOCAB - 1], [VOCAB], [-1], [True], ["1"],
                                [2**63], list(range(24)), list(range(25)), list(range(1000)),
                                [5, 5, 5]],
    "wedlm_window": COMMON + [0, 1, 3, WINDOW, WINDOW + 1, -1, 4096, 2.0],
    "wedlm_entropy_threshold": COMMON + [0, -0.5, 0.4, 2.5, 3.4e38],
    "wedlm_distance_penalty": COMMON + [0, -0.01, 0.02, 1.5, 3.4e38],
    "wedlm_mode": COMMON + ["streaming", "blockwise", "ar", "STREAMING", 0],
    "wedlm_window_policy": COMMON + ["fixed", "adaptive", "Adaptive", "auto", 1],
    "prompt": [[MASK_ID] * 3 + PROMPT, [VOCAB - 1, 5], [VOCAB], [-1, 5], [2**63], []],
    # the logit rules (wedlm_kernels.process_logits) and n
    "presence_penalty": COMMON + [0, -2, 2, 2.01, 1.5, -0.5],
    "frequency_penalty": COMMON + [0, -2, 2, -2.5, 0.7],
    "repetition_penalty": COMMON + [0, 1, 1e-50, 0.5, 1.8, 2.5, -1],
    "min_p": COMMON + [0, 1, 0.3, 1.1, -0.1],
    "min_tokens": COMMON + [0, 1, 3, 6, 7, -1],
    "logit_bias": COMMON + [{}, {53: 5.0}, {53: -1e300}, {53: 3e38}, {VOCAB: 1.0},
                            {-1: 1.0}, {53: NAN}, {53: INF}, {53: True},
                            {i: 0.5 for i in range(301)}, {i: 0.5 for i in range(300)}],
    "allowed_token_ids": COMMON + [[], [53], [53, 53, 101], [VOCAB], [-1], list(range(VOCAB)),
                                   [True], ["1"], [MASK_ID]],
    "n": COMMON + [0, 1, 2, 3, -1, 2.0],
    # vLLM's max_logprobs is 20 here; WeDLM keeps at most 64 alternatives a slot
    "logprobs": COMMON + [0, 5, 20, 21, 64, 65, -1, -2, 2.0],
    # at most 128 ids (vLLM's MAX_LOGPROB_TOKEN_IDS), each in the vocabulary
    "logprob_token_ids": COMMON + [[], [53], [53, 53, 101], [VOCAB], [-1], list(range(128)),
                                   list(range(129)), [True], ["1"], [MASK_ID]],
    # vLLM tokenizes each word with and without a leading space; at most 128 words (vLLM's
    # bound), 16 tokens a word and 1024 in all
    "bad_words": COMMON + [[], ["e"], ["the", " of"], [""], ["x" * 17], ["x" * 16],
                           [f"w{i}" for i in range(130)], [1], [None], "e"],
    # structured outputs (one constraint each; not COMMON: vLLM's own constructor refuses
    # a dict of no constraint in the caller's process, naming none)
    "structured_outputs": [
        # grammars that allow nothing: an empty class, a JSON string of one (after its
        # forced quote), an EBNF of no character
        {"regex": r"[^\s\S]"}, {"json": {"type": "string", "pattern": r"[^\s\S]"}},
        {"grammar": "root ::= [^\\x00-\\U0010FFFF]"},
        # only the end (eos, at once or after a forced run)
        {"regex": ""}, {"regex": "a{0}"}, {"choice": [""]}, {"grammar": 'root ::= ""'},
        {"json": {"enum": [""]}}, {"regex": "ok"},
        # token boundaries of the byte-level vocabulary: characters of 2 and 3 bytes, NUL
        {"regex": "é"}, {"regex": "[\u4e00-\u9fff]{2}"}, {"choice": ["é", "ü"]},
        {"json": {"const": "é"}}, {"regex": "\\x00"},
        # recursion, JSON's corners, free choices
        {"grammar": 'root ::= "a" root | "b"'}, {"json_object": True},
        {"json": {"type": "object", "properties": {}, "additionalProperties": False}},
        {"json": {"type": "integer"}}, {"regex": "[a-z]{2,5}"}, {"choice": ["yes", "no"]},
        # refused: an unclosed group, an empty choice, an unknown JSON type, a tag of
        # nothing, wrong types
        {"regex": "("}, {"choice": []}, {"json": {"type": "nonsense"}},
        {"structural_tag": "{}"}, "regex", [1], 5],
}
# Values each field is served with, for the combinations (a draw of several fields is
# refused as soon as one is bad; these let most combinations through to the decode step)
SERVED = {
    "temperature": [0, 1e-40, 0.7, 2], "top_k": [-1, 0, 3, 2**40], "top_p": [1e-300, 0.5, 1],
    "seed": [None, -1, 3, 2**63 - 1], "max_tokens": [None, 1, 5, 40],
    "stop_token_ids": [None, [], [MASK_ID], list(range(24)), [32, 101]],
    "wedlm_window": [1, 3, WINDOW], "wedlm_entropy_threshold": [None, 0, 0.4, 2.5, 1e300],
    "wedlm_distance_penalty": [0, -0.0, 0.1, 3.4e38], "wedlm_mode": ["streaming", "blockwise"],
    "wedlm_window_policy": [None, "fixed", "adaptive"],
    "prompt": [[MASK_ID] * 3 + PROMPT, PROMPT, [VOCAB - 1, 5]],
    "presence_penalty": [0, -2, 1.5], "frequency_penalty": [0, 2, 0.7],
    "repetition_penalty": [1, 0.5, 1.8], "min_p": [0, 0.3, 1], "min_tokens": [0, 3, 6],
    "logit_bias": [None, {53: 5.0}, {32: -3.0, 101: 2.5}],
    "allowed_token_ids": [None, [53, 101], list(range(32, 127))], "n": [1, 2],
    "logprobs": [None, 0, 3, 20],
    "logprob_token_ids": [None, [53], [32, 101, 108]],
    "bad_words": [None, ["e"], ["the", "a b"]],
    "structured_outputs": [None, {"regex": "[a-z]{2,5}"}, {"choice": ["yes", "no"]},
                           {"json": {"type": "integer"}}, {"regex": r"[^\s\S]"},
                           {"regex": "é"}],
}
# Fields model_min's SamplingParams takes under the same name as vLLM's.
SAME_NAMES = ("temperature", "top_k", "top_p", "seed", "stop_token_ids", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
              "allowed_token_ids", "logprobs", "logprob_token_ids")
# Each field's values on the good request, then on a seeded sampled one (a greedy request
# ignores top_k and top_p, so their bounds only show when sampling): ``(field, draw)``.
SAMPLED = {"temperature": 0.8, "seed": 5, "ignore_eos": False}  # and eos among the stop ids
EOS = 256  # the tiny model's (config.json, generation_config.json, the tokenizer)
GOOD_REQUEST_GRID = [(field, {field: value}) for field, values in VALUES.items()
                     for value in values]
GRID = GOOD_REQUEST_GRID + [(field, {**SAMPLED, **draw}) for field, draw in GOOD_REQUEST_GRID]


def vllm_request(draw: dict, vllm_sampling_params):
    """``(prompt, SamplingParams)`` of a draw through vLLM's Python API; vLLM's own
    constructor may refuse it (raises)."""
    from vllm.sampling_params import StructuredOutputsParams

    fields = {"ignore_eos": True, **BASE, **draw}
    prompt = fields.pop("prompt", PROMPT)
    extra = {key: fields.pop(key) for key in WEDLM_FIELDS if key in fields}
    if isinstance(fields.get("structured_outputs"), dict):
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return prompt, vllm_sampling_params(extra_args=extra or None, **fields)


def http_body(draw: dict) -> dict:
    """The JSON body fields of a draw for ``/v1/completions`` (besides the model)."""
    fields = {"ignore_eos": True, **BASE, **draw}
    body = {"prompt": fields.pop("prompt", PROMPT)}
    extra = {key: fields.pop(key) for key in WEDLM_FIELDS if key in fields}
    if extra:
        body["vllm_xargs"] = extra
    if "logprob_token_ids" in fields and "logprobs" not in fields:
        fields["logprobs"] = 1  # the server asks for it beside the ids (and then drops it)
    return {**body, **fields}


@dataclass
class Refused:
    error: BaseException


@dataclass
class Served:
    tokens: list[int]
    forwards: int | None  # None: not known (over HTTP)
    deterministic: bool  # greedy or seeded: model_min must give the same tokens
    # ended with finish_reason "error" (a grammar that allows nothing more: that request
    # alone; over HTTP a 500 for it)
    error: bool = False


class ModelMinDecoder:
    """The draw as model_min takes it: the window is a Generator's, the mode a generate
    argument, the rest SamplingParams; ``max_tokens`` means what vLLM makes of it (at most
    the room ``max_model_len`` leaves, which is also what None means there).

    Verdicts are kept for the whole session, per model, by the draw as model_min decodes it
    (its ``max_tokens`` resolved against the room): the in-process fuzz and the one over
    HTTP send the same draws with different contexts, and model_min decodes each such
    request once (a decode of one request alone depends on nothing else)."""

    def __init__(self, model, max_model_len: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.generators = _GENERATORS.setdefault(id(model), {})
        self.verdicts = _VERDICTS.setdefault(id(model), {})

    def decode(self, draw: dict) -> Refused | Served:
        prompt = draw.get("prompt", PROMPT)
        room = self.max_model_len - len(prompt) if isinstance(prompt, list) else None
        wanted = draw.get("max_tokens", BASE["max_tokens"])
        resolved, context = dict(draw), self.max_model_len
        # (min_tokens is checked against the max_tokens asked for: then nothing is shared)
        if room is not None and "min_tokens" not in draw and (
                wanted is None or (type(wanted) is int and 1 <= wanted <= rp.INT32_MAX)):
            resolved["max_tokens"] = room if wanted is None else min(wanted, room)
            context = None  # the tokens model_min decodes, whatever the context
        # (a repr tells True from 1, and 2.0 from 2)
        key = repr((sorted(resolved.items()), context))
        if key not in self.verdicts:
            self.verdicts[key] = self._decode(draw)
        return self.verdicts[key]

    def _decode(self, draw: dict) -> Refused | Served:
        fields = {"ignore_eos": True, **BASE, **draw}
        prompt = fields.get("prompt", PROMPT)
        room = self.max_model_len - len(prompt)
        if "bad_words" in fields:  # model_min takes the ids vLLM's tokenizer finds
            words = fields.pop("bad_words")
            try:
                fields["bad_words_token_ids"] = vllm_bad_words_token_ids(words)
            except Exception as error:  # noqa: BLE001 - vLLM's own refusals included
                return Refused(rp.ParameterError(f"bad_words: {error}", "bad_words"))
        if fields.get("structured_outputs") is not None:
            stops = {EOS, *(fields.get("stop_token_ids") or ())}
            try:  # (vLLM compiles with every stop id, eos included)
                fields["grammar"] = model_min_grammar(fields["structured_outputs"], stops)
            except Exception as error:  # noqa: BLE001 - vLLM's own refusals included
                return Refused(rp.ParameterError(f"structured_outputs: {error}",
                                                 "structured_outputs"))
        names = {"max_tokens": "max_new_tokens", "wedlm_entropy_threshold": "threshold",
                 "bad_words_token_ids": "bad_words_token_ids", "grammar": "grammar",
                 "wedlm_distance_penalty": "penalty", "wedlm_window_policy": "window_policy",
                 **{name: name for name in SAME_NAMES}}
        try:
            # n: model_min decodes one sequence (vLLM's child 0 has the request's seed);
            # its bound is the shared definition's
            rp.n(fields.get("n", 1), "n")
            window = fields.get("wedlm_window", WINDOW)
            key = (type(window), repr(window))  # True == 1, but only 1 is a window
            if key not in self.generators:
                floor = (min(ADAPTIVE_FLOOR, window) if rp.is_integer(window)
                         and 1 <= window <= rp.MAX_WINDOW else None)
                self.generators[key] = model_min.Generator(self.model, window=window,
                                                           max_batch=1, min_window=floor)
            generator = self.generators[key]
            params = model_min.SamplingParams(**{names[f]: v for f, v in fields.items()
                                                 if f in names})
            wanted = params.max_new_tokens
            params.max_new_tokens = room if wanted is None else min(wanted, room)
            if not fields["ignore_eos"]:  # vLLM adds the checkpoint's eos
                params.stop_token_ids = (*params.stop_token_ids, EOS)
            [result] = generator.generate(
                [prompt], params, mode=fields.get("wedlm_mode", "streaming"))
        except (ValueError, TypeError) as error:  # a refusal (check_draw: it names a field)
            return Refused(error)
        return Served(result.token_ids, result.forwards,
                      params.temperature == 0 or params.seed is not None,
                      result.finish_reason == "error")


_GENERATORS: dict[int, dict[tuple, model_min.Generator]] = {}
_VERDICTS: dict[int, dict[str, Refused | Served]] = {}


def xgrammar_backend():
    """vLLM's xgrammar backend for the tiny model, as the test engines and servers set it
    up (JSON without free whitespace), built once."""
    global _BACKEND
    if _BACKEND is None:
        from types import SimpleNamespace

        from transformers import AutoTokenizer
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        config = SimpleNamespace(model_config=None, speculative_config=None,
                                 structured_outputs_config=SimpleNamespace(
                                     disable_any_whitespace=True))
        _BACKEND = XgrammarBackend(config, tokenizer=AutoTokenizer.from_pretrained(TINY),
                                   vocab_size=VOCAB)
    return _BACKEND


_BACKEND = None


def model_min_grammar(value, stop_token_ids: set[int]):
    """model_min's ``SamplingParams.grammar`` for a request's ``structured_outputs`` (a
    dict of vLLM's fields or vLLM's StructuredOutputsParams): vLLM's own check of it
    (raises as vLLM refuses it) and its grammar, compiled by the engine's backend as the
    engine compiles it (its key, every stop id)."""
    import copy

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    from vllm.v1.structured_output.request import get_structured_output_key

    if isinstance(value, dict):
        value = StructuredOutputsParams(**value)
    if not isinstance(value, StructuredOutputsParams):
        raise TypeError(f"must be an object, got {type(value).__name__}")
    params = SamplingParams(structured_outputs=copy.deepcopy(value))
    validate_xgrammar_grammar(params)  # (a choice becomes its grammar here, as in vLLM)
    kind, spec = get_structured_output_key(params.structured_outputs)
    backend = xgrammar_backend()
    backend.compile_grammar(kind, spec, stop_token_ids=stop_token_ids)  # compiles at all
    return lambda: backend.compile_grammar(kind, spec, stop_token_ids=stop_token_ids)


def vllm_bad_words_token_ids(words) -> tuple | None:
    """``bad_words`` as the plugin's check tokenizes them (with vLLM's tokenizer)."""
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from wedlm_kernels.integrations.vllm.settings import bad_words_token_ids

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = get_tokenizer(str(TINY))
    return bad_words_token_ids(SamplingParams(bad_words=words), _TOKENIZER, VOCAB)


_TOKENIZER = None


def names_a_field(error: BaseException | str, fields) -> bool:
    """The error names one of ``fields`` (in its message or as its parameter)."""
    text = f"{error} {getattr(error, 'parameter', '')}"
    aliases = {"prompt": ("prompt", "Token id", "token ids"),  # model_min's names too
               "max_tokens": ("max_tokens", "max_new_tokens"),
               "wedlm_window": ("wedlm_window", "window"), "wedlm_mode": ("wedlm_mode", "mode"),
               "wedlm_entropy_threshold": ("wedlm_entropy_threshold", "threshold"),
               "wedlm_distance_penalty": ("wedlm_distance_penalty", "penalty"),
               "wedlm_window_policy": ("wedlm_window_policy", "window_policy"),
               "structured_outputs": ("structured_outputs", "grammar")}
    return any(name in text for field in fields for name in aliases.get(field, (field,)))


def engine_refusal(draw: dict, max_model_len: int) -> bool:
    """A draw model_min takes that the engine must refuse by its own bounds: a window above
    the engine's, a max_tokens that does not fit int32 beside max_model_len (vLLM's
    ``prompt_len + max_tokens`` buffer), an empty prompt (vLLM refuses it), the mode
    "ar" (model_min's AR loop; vLLM decodes AR without the plugin), n > 1 on a greedy
    request or above vLLM's 16384, or more logprobs than vLLM's max_logprobs."""
    window, most = draw.get("wedlm_window", WINDOW), rp.INT32_MAX - max_model_len
    max_tokens = draw.get("max_tokens")
    greedy = draw.get("temperature", BASE["temperature"])
    return (draw.get("prompt") == [] or draw.get("wedlm_mode") == "ar"
            or (rp.is_integer(window) and WINDOW < window <= rp.MAX_WINDOW)
            or (rp.is_integer(max_tokens) and most < max_tokens <= rp.INT32_MAX)
            # vLLM's rules: n > 1 needs sampling, and at most VLLM_MAX_N_SEQUENCES (16384)
            # (model_min has no n)
            or (rp.is_integer(draw.get("n")) and draw["n"] > 1 and rp.is_number(greedy)
                and greedy < 1e-5)
            or (rp.is_integer(draw.get("n")) and draw["n"] > 16384)
            # vLLM's max_logprobs (20 by default) below WeDLM's 64
            or (rp.is_integer(draw.get("logprobs")) and 20 < draw["logprobs"] <= 64))
