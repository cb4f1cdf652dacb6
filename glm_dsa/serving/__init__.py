"""Serving: the `Engine` over the model's compiled steps, continuous batching (`scheduler`), the OpenAI-compatible
server, serving across processes (`lockstep`), sampling, speculative decoding with the MTP layer and text."""
