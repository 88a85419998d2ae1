"""The router in front of real vLLM engines (vLLM's CPU build), end to end. `scripts/test-vllm`
runs it in the environment of `scripts/vllm/setup-venv`; see docs/server.md ("Tests on real
vLLM engines") for what each check proves.

Two engines serve the test model on loopback (HTTP on 127.0.0.1, KV events and replay on
`ipc://` sockets in a private directory, which vLLM binds), `myelin serve` routes in front of
them, and this script subscribes to the same event streams itself to keep an independent
mirror. Every process it starts is in its own process group, stopped at exit; every wait has a
deadline. Exit status: 0 when every check passed, 1 otherwise.

    python suite.py --myelin target/release/myelin --model DIR [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import msgspec
import zmq

BLOCK = 32
ENGINE_START_S = 420
CHECKS: list[tuple[str, bool, str]] = []
PROCESSES: list[subprocess.Popen] = []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 120.0, headers=None):
    """(status, headers, parsed JSON or text). Never raises for an HTTP status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, head, raw = answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        status, head, raw = error.code, dict(error.headers), error.read()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw.decode(errors="replace")


def wait_until(what: str, done, timeout: float, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def check(name: str, ok: bool, detail: str = "") -> bool:
    CHECKS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  (' + detail + ')' if detail else ''}", flush=True)
    return bool(ok)


def start(command: list[str], log: Path, env=None) -> subprocess.Popen:
    process = subprocess.Popen(
        command,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    PROCESSES.append(process)
    return process


def stop(process: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Engine:
    def __init__(self, index: int, model: Path, sockets: Path, logs: Path, python: str,
                 buffer_steps: int):
        self.index, self.model, self.python = index, model, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.publish = f"ipc://{sockets}/events{index}"
        self.replay = f"ipc://{sockets}/replay{index}"
        self.buffer_steps = buffer_steps
        self.log = logs / f"vllm{index}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.publish,
            "replay_endpoint": self.replay,
            "buffer_steps": self.buffer_steps,
        }
        command = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--max-model-len", "4096",
            "--max-num-seqs", "8", "--dtype", "float32",
            # 256 blocks of 32 tokens: the traffic below overflows it, so engines evict.
            "--num-gpu-blocks-override", "256",
            "--kv-events-config", json.dumps(events),
        ]
        cpus = os.cpu_count() or 1
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.index % cpus),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        self.process = start(command, self.log, env)

    def healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"vLLM {self.index} exited:\n{tail(self.log)}")
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def wait_healthy(self) -> None:
        wait_until(f"vLLM {self.index} to answer /health", self.healthy, ENGINE_START_S, 1.0)

    def kill(self) -> None:
        if self.process is not None:
            stop(self.process, signal.SIGKILL)


@contextmanager
def running_engines(model: Path, count: int, keep_logs: str | None, prefix: str):
    """`count` engines on the test model (vLLM's default replay buffer), started and healthy;
    stopped, with their scratch directory removed (logs kept under `keep_logs` if given), when
    the block ends. For the scripts beside this one (bench.py, steps.py)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    logs = Path(keep_logs).resolve() if keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sockets = work / "sockets"
    sockets.mkdir()
    print(f"engine logs in {logs}", file=sys.stderr, flush=True)
    engines = [Engine(i, model.resolve(), sockets, logs, sys.executable, 10_000)
               for i in range(count)]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy()
        yield engines
    finally:
        for process in PROCESSES:
            stop(process)
        if not keep_logs:
            shutil.rmtree(work, ignore_errors=True)


class EventMirror:
    """An independent mirror of one engine's stream: engine block hash -> copies (GPU blocks
    only), built from the raw msgpack batches by a SUB socket of its own."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.blocks: Counter = Counter()
        self.batches = 0
        self.clears = 0
        # The extra keys of the last chain-starting BlockStored that had any (a salted or
        # adapter request's first block carries them).
        self.first_extra_keys = None
        self.lock = threading.Lock()
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.running:
            try:
                frames = self.socket.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            batch = msgspec.msgpack.decode(frames[-1])
            with self.lock:
                self.batches += 1
                for event in batch[1]:
                    self.apply(event)

    def apply(self, event) -> None:
        # vLLM 0.24+ writes events as maps ({"type": tag, field: value}), earlier releases as
        # tagged arrays ([tag, block_hashes, ...], `medium` at 6 for a stored block, 2 for a
        # removed one).
        if isinstance(event, dict):
            kind, blocks, medium = event.get("type"), event.get("block_hashes"), event.get("medium")
            parent, extra = event.get("parent_block_hash"), event.get("extra_keys")
        else:
            kind = event[0]
            blocks = event[1] if len(event) > 1 else None
            at = 6 if kind == "BlockStored" else 2
            medium = event[at] if len(event) > at else None
            parent = event[2] if len(event) > 2 else None
            extra = event[8] if kind == "BlockStored" and len(event) > 8 else None
        if kind == "BlockStored" and parent is None and extra:
            self.first_extra_keys = extra
        if medium not in (None, "GPU"):
            return
        if kind == "BlockStored":
            for block in blocks:
                self.blocks[hash_key(block)] += 1
        elif kind == "BlockRemoved":
            for block in blocks:
                key = hash_key(block)
                self.blocks[key] -= 1
                if self.blocks[key] <= 0:
                    del self.blocks[key]
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.clears += 1

    def distinct(self) -> int:
        with self.lock:
            return len(self.blocks)

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=2)
        self.socket.close(0)


def hash_key(block):
    return bytes(block) if isinstance(block, (bytes, bytearray, list)) else block


class Router:
    def __init__(self, binary: str, model: Path, engines: list[Engine], logs: Path, name: str,
                 extra: list[str] | None = None):
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log = logs / f"{name}.log"
        command = [
            binary, "serve", "--listen", f"127.0.0.1:{self.port}",
            "--admin-listen", f"127.0.0.1:{self.admin_port}",
            "--tokenizer", str(model / "tokenizer.json"),
            "--chat-template", str(model / "tokenizer_config.json"),
            "--shards", "1", "--no-pin", "--engine-metrics-interval-ms", "500",
            "--health-interval-ms", "200",
        ]
        if not any(arg.startswith("--block-size") for arg in extra or []):
            command += ["--block-size", str(BLOCK)]
        for engine in engines:
            command += [
                "--backend",
                f"{engine.url},kv-events={engine.publish},kv-replay={engine.replay}",
            ]
        self.process = start(command + (extra or []), self.log)
        wait_until(f"{name} to answer /health", self.healthy, 30)

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"myelin exited:\n{tail(self.log)}")
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def backends(self) -> list[dict]:
        return http("GET", self.admin + "/admin/backends", timeout=10)[2]["backends"]

    def metric(self, name: str, *parts: str) -> float:
        text = http("GET", self.admin + "/metrics", timeout=10)[2]
        total = 0.0
        for line in str(text).splitlines():
            if line.startswith(name) and all(part in line for part in parts):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        stop(self.process)


def chat(words: int, seed: int, tail_words: int = 8) -> dict:
    system = " ".join(f"s{seed}w{i % 211}" for i in range(words))
    user = " ".join(f"q{seed}u{i}" for i in range(tail_words))
    return {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    }


def send(router: Router, body: dict, path: str = "/v1/chat/completions"):
    status, head, answer = http("POST", router.url + path, body)
    backend = {k.lower(): v for k, v in head.items()}.get("x-myelin-backend")
    return status, backend, answer


def cached_tokens(answer) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def quiet_mirrors_agree(router: Router, mirrors: list[EventMirror]):
    """Waits until the router's per-backend mirror counts equal the independent mirrors'."""
    def agree():
        ours = [m.distinct() for m in mirrors]
        theirs = [b["resident_blocks"] for b in router.backends()]
        return (ours, theirs) if ours == theirs else None
    try:
        return wait_until("the router's mirror to equal the independent one", agree, 20)
    except TimeoutError:
        return None


def run(args) -> None:
    model = Path(args.model).resolve()
    work = Path(tempfile.mkdtemp(prefix="myelin-vllm-"))
    logs = Path(args.keep_logs).resolve() if args.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sockets = work / "sockets"
    sockets.mkdir()
    python = sys.executable
    print(f"logs in {logs}", flush=True)
    # Engine 0 keeps vLLM's default replay buffer, engine 1 only 8 batches (for the warm start).
    engines = [Engine(0, model, sockets, logs, python, 10_000),
               Engine(1, model, sockets, logs, python, 8)]
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.wait_healthy()
    context = zmq.Context()
    mirrors = [EventMirror(context, engine.publish) for engine in engines]
    time.sleep(1.0)
    router = Router(args.myelin, model, engines, logs, "router")
    try:
        checks(args, model, engines, mirrors, router, logs)
    finally:
        router.stop()
        for mirror in mirrors:
            mirror.close()
        context.term()
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)


def checks(args, model, engines, mirrors, router, logs) -> None:
    # 1. The endpoints, through the router.
    status, _, models = http("GET", router.url + "/v1/models")
    check("GET /v1/models through the router", status == 200 and "data" in models, str(status))
    status, backend, answer = send(router, chat(50, 1))
    check("a chat through the router", status == 200 and backend is not None,
          f"{status}, backend {backend}")
    body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4, "temperature": 0}
    status, _, answer = send(router, body, "/v1/completions")
    check("a completion through the router", status == 200, str(status))
    try:
        import openai
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=120)
        streamed = "".join(
            (chunk.choices[0].delta.content or "") if chunk.choices else ""
            for chunk in client.chat.completions.create(
                model="tiny", messages=chat(30, 2)["messages"], max_tokens=4, stream=True))
        check("the openai client streams a chat through the router", True,
              f"{len(streamed)} characters")
    except Exception as error:  # noqa: BLE001 (the check reports any failure)
        check("the openai client streams a chat through the router", False, repr(error))

    # 2. Block size and liveness: both mirrors live and exact.
    live = wait_until("both mirrors live", lambda: all(
        (b.get("kv_events_mirror") or {}).get("live") for b in router.backends()), 30)
    check("both engines' mirrors are live", bool(live))

    # 3. Reuse: the same long prompt again goes to the engine holding it, which reuses it.
    body = chat(900, 3)
    _, first, _ = send(router, body)
    status, again, answer = send(router, body)
    prompt = (answer.get("usage") or {}).get("prompt_tokens", 0)
    reused = cached_tokens(answer)
    check("a repeated prompt goes to the engine that holds it, and is reused there",
          status == 200 and first == again and reused >= (prompt // BLOCK - 1) * BLOCK,
          f"backends {first}/{again}, {reused} of {prompt} prompt tokens cached")

    # 3b. cache_salt: vLLM shares no block between salts; the router keys its history and its
    #     mirror the same way (the salted blocks are mirrored, in their own namespace).
    matched = lambda: router.metric("myelin_router_history_matched_tokens_total")
    skipped = lambda: router.metric("myelin_kv_events_skipped_blocks_total")
    before_matched, before_skipped = matched(), skipped()
    salted = {**body, "cache_salt": "tenant-a"}
    status, salted_first, answer = send(router, salted)
    check("a salted copy of a cached prompt matches no history and hits no cache",
          status == 200 and matched() == before_matched and cached_tokens(answer) == 0,
          f"{status}, {matched() - before_matched} history-matched tokens, "
          f"{cached_tokens(answer)} cached")
    status, salted_again, answer = send(router, salted)
    reused = cached_tokens(answer)
    check("the same salt again goes to the engine holding it, and is reused there",
          status == 200 and salted_again == salted_first
          and reused >= (prompt // BLOCK - 1) * BLOCK and matched() > before_matched,
          f"backends {salted_first}/{salted_again}, {reused} of {prompt} cached")
    mirror = mirrors[int(salted_first or 0)]
    check("vLLM publishes the salt in the first block's extra_keys and the router places it",
          mirror.first_extra_keys is not None and "tenant-a" in str(mirror.first_extra_keys)
          and skipped() == before_skipped,
          f"first block's extra_keys {(mirror.first_extra_keys or [None])[0]}, "
          f"{skipped() - before_skipped} blocks skipped")

    # 4. Traffic with eviction pressure; then the router's mirror equals an independent one.
    for seed in range(10, 10 + args.requests):
        status, _, _ = send(router, chat(300 + 37 * (seed % 11), seed % 17))
        if status != 200:
            check(f"traffic request {seed}", False, str(status))
            break
    agreed = quiet_mirrors_agree(router, mirrors)
    check("the router's mirror equals an independent mirror of the same events",
          agreed is not None, f"independent/router distinct blocks: {agreed or [m.distinct() for m in mirrors]} / {[b['resident_blocks'] for b in router.backends()]}")
    metrics = {name: router.metric(name) for name in (
        "myelin_kv_events_decode_errors_total", "myelin_kv_events_gaps_total",
        "myelin_tokenization_mismatch_total")}
    check("no decode error or gap in the engines' event streams",
          metrics["myelin_kv_events_decode_errors_total"] == 0
          and metrics["myelin_kv_events_gaps_total"] == 0, json.dumps(metrics))
    # The multi-line template renders like vLLM's: the engines count the router's tokens.
    check("tokenization parity: every engine's prompt_tokens equals the router's count",
          metrics["myelin_tokenization_mismatch_total"] == 0)
    token_ids_match(args, model, engines[0])

    # 5. The option that made vLLM re-announce reused blocks is refused.
    body = {**chat(20, 5), "vllm_xargs": {"kv_cache_report_mode": "full"}}
    status, _, answer = send(router, body)
    check("vllm_xargs.kv_cache_report_mode is refused with a 400", status == 400
          and answer.get("error", {}).get("code") == "unsupported_parameter", str(status))

    # 6. Replay: a second router started now rebuilds engine 0's mirror from its buffer, and
    #    finds engine 1 (8 batches kept) partial.
    second = Router(args.myelin, model, engines, logs, "router-late")
    try:
        def late_state():
            listing = second.backends()
            mirror = [b.get("kv_events_mirror") or {} for b in listing]
            ok = mirror[0].get("live") and not mirror[0].get("partial") and mirror[1].get("partial")
            return listing if ok else None
        listing = wait_until("the late router's mirrors", late_state, 30)
        first_listing = router.backends()
        check("a router started later rebuilds the mirror from the replay buffer",
              listing[0]["resident_blocks"] == first_listing[0]["resident_blocks"],
              f"{listing[0]['resident_blocks']} / {first_listing[0]['resident_blocks']} blocks")
        check("beyond the replay buffer the late router's mirror is partial",
              listing[1]["residency"] == "partial", listing[1]["kv_events_mirror"].get("reason", ""))
    except TimeoutError as error:
        check("a router started later rebuilds the mirror / is partial", False, str(error))
    finally:
        second.stop()

    # 7. A foreign block size is refused, and said.
    foreign = Router(args.myelin, model, engines, logs, "router-block16", ["--block-size", "16"])
    try:
        send(foreign, chat(200, 6))
        listing = wait_until("a block-size mismatch", lambda: [
            b for b in foreign.backends()
            if "block" in (b.get("kv_events_mirror") or {}).get("reason", "")], 30)
        check("a router of another block size does not mirror, and says why",
              foreign.metric("myelin_kv_events_block_size_mismatch") >= BLOCK,
              listing[0]["kv_events_mirror"]["reason"])
    except TimeoutError as error:
        check("a router of another block size does not mirror, and says why", False, str(error))
    finally:
        foreign.stop()

    # 8. /reset_prefix_cache empties the mirror. vLLM queues its AllBlocksCleared and publishes
    #    it with the next engine step: one small request makes that step.
    clears = mirrors[0].clears
    status, _, _ = http("POST", engines[0].url + "/reset_prefix_cache")
    http("POST", engines[0].url + "/v1/chat/completions", chat(20, 99))
    try:
        def emptied():
            theirs = router.backends()[0]["resident_blocks"]
            return (mirrors[0].clears > clears and theirs == mirrors[0].distinct()
                    and theirs <= 4)
        wait_until("engine 0's mirror to empty", emptied, 20)
        check("vLLM's /reset_prefix_cache empties the mirror", status == 200,
              f"{router.backends()[0]['resident_blocks']} blocks left: the request after it")
    except TimeoutError as error:
        check("vLLM's /reset_prefix_cache empties the mirror", False,
              f"{status}: {error}; router {router.backends()[0]['resident_blocks']}, "
              f"independent {mirrors[0].distinct()}, clears {mirrors[0].clears - clears}")

    # 9. Kill engine 1: its mirror leaves routing at once; restarted, it is followed again.
    engines[1].kill()
    try:
        wait_until("engine 1 down and its mirror out", lambda: (
            router.backends()[1]["state"] == "down"
            and not (router.backends()[1].get("kv_events_mirror") or {}).get("live")), 20)
        check("a killed engine's mirror leaves routing", True)
    except TimeoutError as error:
        check("a killed engine's mirror leaves routing", False, str(error))
    for _ in range(4):
        status, backend, _ = send(router, chat(100, 7))
    check("traffic goes to the live engine meanwhile", status == 200 and backend == "0",
          f"{status}, backend {backend}")
    mirrors[1].blocks.clear()
    engines[1].start()
    engines[1].wait_healthy()
    wait_until("engine 1 up", lambda: router.backends()[1]["state"] == "up", 30)
    for seed in range(20, 28):
        send(router, chat(200, seed))
    try:
        wait_until("engine 1's mirror live again", lambda: (
            router.backends()[1].get("kv_events_mirror") or {}).get("live"), 30)
        check("the restarted engine is followed again (its new sequence seen as a restart)",
              router.metric("myelin_kv_events_restarts_total") >= 1)
    except TimeoutError as error:
        check("the restarted engine is followed again", False, str(error))


def token_ids_match(args, model: Path, engine: Engine) -> None:
    """Tokenization parity in ids: `myelin tokenize` (the router's own rendering and
    tokenization) against vLLM's `POST /tokenize`, for chats (single and multi-turn, short and
    long) and a completion prompt."""
    multi_turn = chat(80, 8)
    multi_turn["messages"] += [
        {"role": "assistant", "content": "An earlier answer,\nover two lines."},
        {"role": "user", "content": "A follow-up question with   spaces and a tab\there."},
    ]
    bodies = [chat(50, 1), chat(900, 3), multi_turn,
              {"model": "tiny", "prompt": "hello " * 40 + "\nworld", "max_tokens": 4}]
    mismatched = []
    for body in bodies:
        ours = subprocess.run(
            [args.myelin, "tokenize", "--tokenizer", str(model / "tokenizer.json"),
             "--chat-template", str(model / "tokenizer_config.json")],
            input=json.dumps(body).encode(), capture_output=True, timeout=60)
        ids = json.loads(ours.stdout).get("ids") if ours.returncode == 0 else None
        if "messages" in body:
            ask = {"model": "tiny", "messages": body["messages"], "add_generation_prompt": True}
        else:
            ask = {"model": "tiny", "prompt": body["prompt"], "add_special_tokens": True}
        status, _, theirs = http("POST", engine.url + "/tokenize", ask)
        engine_ids = theirs.get("tokens") if status == 200 else None
        if ids is None or ids != engine_ids:
            first = next((i for i, (a, b) in enumerate(zip(ids or [], engine_ids or []))
                          if a != b), min(len(ids or []), len(engine_ids or [])))
            mismatched.append(f"{'chat' if 'messages' in body else 'completion'}: router "
                              f"{len(ids or [])} ids, vLLM {status} {len(engine_ids or [])}, "
                              f"first difference at {first}")
    check("tokenization parity in ids: `myelin tokenize` equals vLLM's POST /tokenize",
          not mismatched, "; ".join(mismatched) or f"{len(bodies)} prompts, every id equal")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--myelin", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--keep-logs")
    args = parser.parse_args()
    try:
        run(args)
    except Exception as error:  # noqa: BLE001 (reported as a failed check, processes stopped)
        check("the suite ran to its end", False, f"{type(error).__name__}: {error}")
    finally:
        for process in PROCESSES:
            stop(process)
    failed = [name for name, ok, _ in CHECKS if not ok]
    print(f"\n{len(CHECKS) - len(failed)} of {len(CHECKS)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
