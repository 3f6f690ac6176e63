"""Structured outputs: what a JSON schema costs inside the continuous batch, in one run.

    python -m bench structured                  # 32 requests at once, half with a JSON schema, vs none

Throughput: the same 32 chat requests run twice on one engine, taking turns: once all free, once
with every other request constrained by a JSON schema (an array of records long enough that every
request is cut at --output-tokens, so both runs produce the same number of tokens and the figure
is tokens over wall time). First token: an idle engine gets one request with a schema it has never
seen (compiled on the way in) and then one with the same schema again (a cache hit), against a free
request; each is timed from add to its first token, best of --repetitions.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from bench import report

TOPICS = ("cities of Europe", "rivers", "famous painters", "kitchen tools", "planets and moons", "birds",
          "programming languages", "board games", "mountains", "musical instruments", "fruits", "sports teams",
          "chemical elements", "trees", "car makers", "poets")


def records_schema(field: str = "name", max_length: int | None = None) -> dict:
    # maxLength is off by default: xgrammar fills a bounded string's mask by checking its tokens one
    # by one (up to ms a token at a 49k vocabulary); --max-length measures that case.
    name = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    record = {"type": "object", "properties": {field: name,
                                               "score": {"type": "integer", "minimum": 0, "maximum": 100},
                                               "tags": {"type": "array", "maxItems": 2,
                                                        "items": {"type": "string", "enum": ["a", "b", "c"]}}},
              "required": [field, "score", "tags"], "additionalProperties": False}
    return {"type": "array", "items": record, "minItems": 40, "maxItems": 40}


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} as JSON records with a name, "
                                         f"a score from 0 to 100 and tags."}] for i in range(count)]


def throughput(llm, requests, output_tokens: int, constrained: bool, max_length: int | None) -> dict:
    from conveyor import SamplingParams
    from conveyor.sampling_params import StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=output_tokens,
                            structured_outputs=StructuredOutputsParams(json=records_schema(max_length=max_length)))
    params = [schema if constrained and i % 2 == 0 else free for i in range(len(requests))]
    started = time.perf_counter()
    outputs = llm.chat(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
            "finish_reasons": sorted({o.outputs[0].finish_reason for o in outputs})}


def first_token_s(engine, prompt: str, params) -> float:
    started = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.new_token_ids:
                engine.abort_request(request_id)
                return time.perf_counter() - started


def ttft(llm, repetitions: int) -> dict:
    from conveyor import SamplingParams
    from conveyor.sampling_params import StructuredOutputsParams

    prompt = "List rivers as JSON records."
    figures: dict[str, list[float]] = {"free": [], "new_schema": [], "cached_schema": []}
    for _ in range(repetitions):
        figures["free"].append(first_token_s(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=8)))
        fresh = StructuredOutputsParams(json=records_schema(f"name_{uuid.uuid4().hex[:8]}"))
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=fresh)
        figures["new_schema"].append(first_token_s(llm.engine, prompt, params))
        figures["cached_schema"].append(first_token_s(llm.engine, prompt, params))
    return {name: {"best_s": min(values), "all_s": values} for name, values in figures.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=None, help="maxLength of the records' name string")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repetitions", type=int, default=2, help="runs of each side, alternating; the best counts")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    options = {"threads": args.threads, "dtype": args.dtype, "kv_cache_memory": "2GiB", "max_num_seqs": 64,
               "enable_prefix_caching": False}
    print(f"CPU: {report.machine()}", flush=True)
    from conveyor import LLM, SamplingParams
    from conveyor.sampling_params import StructuredOutputsParams

    llm = LLM(None, **options)
    # Warm-up, xgrammar's import and vocabulary tables included: a server pays them once, at its first grammar.
    llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4,
                                        structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    requests = prompts(args.num_requests)
    runs: dict[str, list[dict]] = {"free": [], "half_schema": []}
    for rep in range(args.repetitions):
        for side in (("free", "half_schema") if rep % 2 == 0 else ("half_schema", "free")):
            runs[side].append(throughput(llm, requests, args.output_tokens, side == "half_schema", args.max_length))
    best = {side: max(figures, key=lambda f: f["output_tokens_per_s"]) for side, figures in runs.items()}
    ratio = best["half_schema"]["output_tokens_per_s"] / best["free"]["output_tokens_per_s"]
    print(f"{args.num_requests} requests: free {best['free']['output_tokens_per_s']:.1f} tok/s, half with a schema "
          f"{best['half_schema']['output_tokens_per_s']:.1f} tok/s: {ratio:.3f}x "
          f"(finish reasons {best['half_schema']['finish_reasons']})", flush=True)
    first = ttft(llm, args.repetitions + 1)
    print("first token, idle engine: " + ", ".join(f"{name} {f['best_s'] * 1e3:.1f} ms" for name, f in first.items()))
    report.save_run("structured", args.out_dir, {"options": options, "output_tokens": args.output_tokens,
                                                 "max_length": args.max_length,
                                                 "throughput": {"runs": runs, "ratio": ratio}, "first_token": first})
