"""The probe of the weights a vLLM engine serves (broker/weights/probe.py): vLLM's prompt log-probs.

A request for one token with `prompt_logprobs=0` returns, for every prompt token after the first,
the log-probability of that token given the ones before it, computed from the model's logits at
temperature 1 (prompt log-probs are the raw log_softmax, whatever `logprobs_mode` does to sampled
ones), through the adapter the request carries. Prefix caching does not serve prompt log-probs:
the whole prompt is computed again with the weights loaded now. The engine is stepped until the
request is done, so it must have no other request in flight (the caller checks `busy`).
"""

from __future__ import annotations

from typing import Any


def prompt_logprobs(llm: Any, ids: list[int], request_id: str, lora_request: Any) -> list[float]:
    """The log-probabilities of `ids[1:]` given their prefixes, from the `vllm.LLM` `llm`."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    engine = llm.llm_engine
    engine_input = llm.renderer.render_cmpl([{"prompt_token_ids": ids}])[0]
    engine.add_request(request_id, engine_input, params, lora_request=lora_request)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                result = out
    if result is None or result.prompt_logprobs is None:
        raise RuntimeError("vLLM returned no prompt log-probs for the probe")
    # the first entry is None: no log-prob for a sequence's first token
    return [float(lp[t].logprob) for t, lp in zip(ids[1:], result.prompt_logprobs[1:])]
