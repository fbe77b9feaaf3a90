"""Run an exported child in vLLM: greedy continuations with log-probs, or prefill/decode timings.

This file runs under vLLM's own interpreter, which has neither mlxkit nor its pinned
transformers, so it imports only the standard library and vLLM. mlxkit starts it as
`python vllm_worker.py REQUEST.json RESULT.json` (engines/serving/vllm.py) and reads the result
file; vLLM's own logging goes to the worker's stdout and stderr.

Request fields: model, mode ("generate" or "time"), dtype, max_model_len, seed, and
  generate: prompts (lists of token ids), max_tokens;
  time: points ([batch, prompt_len] pairs), decode_steps, warmup, repeats, vocab_size.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time


def _engine(request: dict):
    from vllm import LLM

    return LLM(model=request["model"], trust_remote_code=True, dtype=request.get("dtype", "float32"),
               max_model_len=int(request["max_model_len"]), enforce_eager=True, seed=int(request.get("seed", 0)),
               max_num_seqs=int(request.get("max_num_seqs", 256)))


def _prompts(token_lists):
    return [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_lists]


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=int(request["max_tokens"]), temperature=0.0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(_prompts(request["prompts"]), params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
        results.append({"prompt": list(output.prompt_token_ids), "tokens": tokens, "logprobs": logprobs})
    return {"outputs": results}


def _timed(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def time_points(llm, request: dict) -> dict:
    """Per (batch, prompt length): the median prefill time and the median time of one decode step.

    A request of one new token is the prefill (plus one sampling step); one of 1 + decode_steps
    tokens adds the decode steps, so their time is the difference divided by their number.
    Prefix caching is off, so a repeated prompt is computed again.
    """
    rng = random.Random(int(request.get("seed", 0)))
    vocab, steps = int(request["vocab_size"]), int(request["decode_steps"])
    rows = []
    for batch, seq in request["points"]:
        prefill, decode = [], []
        for index in range(int(request["warmup"]) + int(request["repeats"])):
            prompts = _prompts([[rng.randrange(3, vocab) for _ in range(seq)] for _ in range(batch)])
            first = _timed(llm, prompts, 1)
            whole = _timed(llm, prompts, 1 + steps)
            if index >= int(request["warmup"]):
                prefill.append(first)
                decode.append(max(whole - first, 0.0) / steps)
        rows.append({"batch": batch, "seq": seq, "prefill_ms": statistics.median(prefill) * 1e3,
                     "decode_ms": statistics.median(decode) * 1e3, "decode_ctx": seq + (steps + 1) / 2.0})
    return {"timings": rows}


def main(argv: list[str]) -> int:
    request_path, result_path = argv[1], argv[2]
    with open(request_path) as handle:
        request = json.load(handle)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    started = time.perf_counter()
    llm = _engine(request)
    load_s = time.perf_counter() - started
    if request["mode"] == "generate":
        result = generate(llm, request)
    elif request["mode"] == "time":
        result = time_points(llm, request)
    else:
        raise SystemExit(f"unknown mode {request['mode']!r}")
    result.update(vllm_version=vllm.__version__, load_s=load_s)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which re-imports this file
    sys.exit(main(sys.argv))
