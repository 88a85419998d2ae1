"""Step times of one real vLLM engine (vLLM's CPU build, the test model of scripts/test-vllm),
measured from the client, for fitting the simulator's `vllm-cpu-tiny-llama` profile
(docs/simulator.md, "Checked against vLLM on CPU"). Run it in the environment of
`scripts/vllm/setup-venv`, with the model scripts/test-vllm builds:

    $(scripts/vllm/setup-venv)/bin/python scripts/vllm/steps.py --model ~/.cache/myelin/tiny-llama-deepseek-v3

Every engine (`--engines`, 2 by default, as `scripts/bench-vllm` runs them) is measured at the
same time, so the step times include what the engines cost each other on one host.

- Prefill: the time to the first token of one fresh prompt of N tokens (random ids, so nothing
  is cached) on an otherwise idle engine: one scheduler step of N new tokens (two when N exceeds the
  2,048-token step budget), plus the server's own overhead per request.
- Decode: B streams decoding together (fresh prompts of C tokens, `ignore_eos`): the median
  interval between a stream's tokens, once every stream is decoding, is one step of B decodes
  at context about C.

Prints one JSON document: the points and a least-squares fit of
`step_ms = overhead + per_token * new_tokens + per_pair * pairs + per_prefill_chunk * chunks`
(pairs: sum over the step's requests of new tokens x (context + new / 2); chunks: the step's
prefill chunks, requests computing more than one token). A term per sequence came out
negative (decode steps of 1 to 8 streams take the same 12-17 ms here), so it is left out.

Options: --out FILE (the JSON also written there), --keep-logs DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402 (the engine, started and stopped as the suite does)

PREFILL_TOKENS = [16, 64, 256, 512, 1024, 1536, 2048, 3072]
DECODE_BATCHES = [1, 2, 4, 8]
DECODE_CONTEXTS = [128, 768]  # 8 x 808 tokens fit the 256 blocks of 32
REPEATS = 3
DECODE_TOKENS = 40
BUDGET = 2048


def stream_times(url: str, ids: list[int], max_tokens: int, timeout: float = 120.0):
    """Seconds from sending to each streamed token of a completion."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     method="POST")
    request.add_header("content-type", "application/json")
    started = time.monotonic()
    times = []
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        for line in answer:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                times.append(time.monotonic() - started)
    return times


def fresh(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(tokens)]


def measure(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    for _ in range(3):  # warm-up: first requests pay one-time costs
        stream_times(url, fresh(rng, 512), 4)
    prefill = []
    for tokens in PREFILL_TOKENS:
        ttfts = [stream_times(url, fresh(rng, tokens), 1)[0] * 1000 for _ in range(REPEATS)]
        prefill.append({"tokens": tokens, "ttft_ms": ttfts, "median_ms": statistics.median(ttfts)})
        print(f"{url} prefill {tokens:5}: {statistics.median(ttfts):7.1f} ms", file=sys.stderr)
    decode = []
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            intervals: list[float] = []
            for _ in range(REPEATS):
                results: list[list[float]] = [[] for _ in range(batch)]

                def one(slot: int, ids: list[int]) -> None:
                    results[slot] = stream_times(url, ids, DECODE_TOKENS)

                prompts = [fresh(rng, context) for _ in range(batch)]
                threads = [threading.Thread(target=one, args=(slot, prompts[slot]))
                           for slot in range(batch)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                for times in results:
                    steady = times[10:DECODE_TOKENS - 5]
                    intervals += [(b - a) * 1000 for a, b in zip(steady, steady[1:])]
            median = statistics.median(intervals)
            decode.append({"batch": batch, "context": context, "median_ms": median,
                           "p90_ms": statistics.quantiles(intervals, n=10)[-1]})
            print(f"{url} decode batch {batch} context {context:5}: {median:6.2f} ms",
                  file=sys.stderr)
    return {"prefill": prefill, "decode": decode}


def fit(points: dict) -> dict:
    """Least squares over both kinds of points (numpy, from vLLM's environment)."""
    import numpy as np

    rows, targets = [], []
    for point in points["prefill"]:
        tokens, steps, pairs, left = point["tokens"], 0, 0.0, point["tokens"]
        while left > 0:  # chunked prefill: one step per budget's worth
            chunk = min(left, BUDGET)
            done = point["tokens"] - left
            pairs += chunk * (done + chunk / 2)
            left -= chunk
            steps += 1
        rows.append([steps, tokens, pairs, steps])
        targets.append(point["median_ms"])
    for point in points["decode"]:
        batch, context = point["batch"], point["context"] + DECODE_TOKENS / 2
        rows.append([1, batch, batch * (context + 0.5), 0])
        targets.append(point["median_ms"])
    coefficients, *_ = np.linalg.lstsq(np.array(rows, float), np.array(targets, float),
                                       rcond=None)
    overhead, per_token, per_pair, per_prefill_chunk = (float(c) for c in coefficients)
    predicted = np.array(rows, float) @ coefficients
    errors = [float(p / t - 1) for p, t in zip(predicted, targets)]
    return {"overhead_ms": overhead, "per_token_ms": per_token, "per_pair_ms": per_pair,
            "per_prefill_chunk_ms": per_prefill_chunk, "relative_errors": errors}


def pooled(per_engine: list[dict]) -> dict:
    """The engines' points pooled: the median over every engine's repeats."""
    prefill = []
    for index, point in enumerate(per_engine[0]["prefill"]):
        ttfts = [ms for points in per_engine for ms in points["prefill"][index]["ttft_ms"]]
        prefill.append({"tokens": point["tokens"], "ttft_ms": ttfts,
                        "median_ms": statistics.median(ttfts)})
    decode = []
    for index, point in enumerate(per_engine[0]["decode"]):
        medians = [points["decode"][index]["median_ms"] for points in per_engine]
        decode.append({"batch": point["batch"], "context": point["context"],
                       "median_ms": statistics.median(medians), "per_engine_ms": medians})
    return {"prefill": prefill, "decode": decode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engines", type=int, default=2,
                        help="engines measured at once, as scripts/bench-vllm runs them")
    parser.add_argument("--out")
    parser.add_argument("--keep-logs")
    args = parser.parse_args()
    with suite.running_engines(Path(args.model), args.engines, args.keep_logs,
                               "myelin-vllm-steps-") as engines:
        # Every engine measured at the same time: the step times include what the engines
        # cost each other on a shared host, as in a benchmark on them.
        per_engine: list[dict] = [{} for _ in engines]

        def run(index: int) -> None:
            per_engine[index] = measure(engines[index].url, seed=7 + index)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if any(not points for points in per_engine):
            raise RuntimeError("an engine's measurement failed (see above)")
        points = pooled(per_engine)
        document = {"engine": "vLLM CPU build, the test model, block size 32, 1 OMP thread",
                    "engines_measured_at_once": len(engines),
                    "points": points, "per_engine": per_engine, "fit": fit(points)}
        text = json.dumps(document, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
