"""`myelin bench --engine` on real vLLM engines (vLLM's CPU build): starts two engines as the
real-vLLM suite does (loopback HTTP, KV events and replay on private `ipc://` sockets,
`VLLM_SERVER_DEV_MODE=1` so the harness can empty their caches between legs), runs
`myelin bench` against them with every argument given after `--`, and stops the engines.
`scripts/bench-vllm` runs it in the environment of `scripts/vllm/setup-venv`.

    python bench.py --myelin target/release/myelin --model DIR [--keep-logs DIR] -- BENCH ARGS
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402 (the engines, started and stopped as the suite does)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--myelin", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--keep-logs")
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    with suite.running_engines(Path(args.model), args.engines, args.keep_logs,
                               "myelin-bench-vllm-") as engines:
        command = [args.myelin, "bench"]
        for engine in engines:
            command += ["--engine",
                        f"{engine.url},kv-events={engine.publish},kv-replay={engine.replay}"]
        command += bench
        print(" ".join(command), flush=True)
        return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
