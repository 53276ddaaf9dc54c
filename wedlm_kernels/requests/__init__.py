"""What a decoding request means, shared by the front ends above the ops (model_min and the
vLLM plugin), so that both accept, refuse and decode the same requests:

- :mod:`.params`: a request's parameters once (types, bounds, meanings, defaults);
- :mod:`.grammar`: how a grammar (structured outputs) constrains a window;
- :mod:`.logprobs`: which distribution a committed token's logprobs come from;
- :mod:`.bad_words`: how a window never writes a bad word;
- :mod:`.output_ids`: the ids no request outputs (the mask id, ids the tokenizer lacks).

``docs/requests.md`` states each.
"""
