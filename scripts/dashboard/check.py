"""The Grafana dashboard (assets/grafana/myelin.json) against a real Prometheus scraping a real
run: two simulated vLLM engines (`myelin sim`, KV events on), two `myelin serve` nodes in front
of them gossiping with each other, traffic through both, and Prometheus (Debian's package)
scraping the routers' and the engines' /metrics every second. Then every query of every panel is
asked of Prometheus' HTTP API and must return at least one series. With --plots DIR each
panel's queries over the run are drawn as a PNG (matplotlib), as docs/operations.md shows them.

Everything listens on 127.0.0.1, every process runs in its own process group and is stopped at
the end, every wait has a deadline. Exit status 0 when every query returned a series.

    python3 check.py --myelin target/release/myelin [--prometheus prometheus] [--requests N]
                     [--duration S] [--speedup X] [--plots DIR]
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
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "assets" / "grafana" / "myelin.json"
SCRAPE_S = 1
# Grafana's `$__rate_interval` at a 1 s scrape interval (at least four scrapes).
RATE_INTERVAL = "15s"
PROCESSES: list[subprocess.Popen] = []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_ports(count: int, spacing: int = 1) -> int:
    """A base port with `count * spacing` free ports from it (for `myelin sim`'s numbering)."""
    for _ in range(200):
        base = free_port()
        if base + count * spacing >= 65535:
            continue
        try:
            probes = []
            for offset in range(count * spacing):
                probe = socket.socket()
                probe.bind(("127.0.0.1", base + offset))
                probes.append(probe)
            for probe in probes:
                probe.close()
            return base
        except OSError:
            for probe in probes:
                probe.close()
    raise RuntimeError("no run of free ports")


def get(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.status, answer.read()


def wait_until(what: str, done, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = done()
        except (OSError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def start(command: list[str], log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    PROCESSES.append(process)
    return process


def stop_all() -> None:
    for process in PROCESSES:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def completion(router: str, prompt: str) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
    request = urllib.request.Request(router + "/v1/completions", data=body, method="POST")
    request.add_header("content-type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()


def traffic(routers: list[str], requests: int, duration_s: float) -> None:
    """Four closed-loop users over prefixes that rotate (every tenth request a user moves on to
    the next), on every router node: `requests` in all, or for `duration_s` when given."""
    deadline = time.monotonic() + duration_s

    def user(index: int) -> None:
        seq = 0
        while (time.monotonic() < deadline) if duration_s > 0 else (seq < requests // 4):
            prefix = (index * 7 + seq // 10) % 40
            words = " ".join(f"p{prefix}w{i}" for i in range(600))
            completion(routers[(index + seq) % len(routers)], f"{words} question {index}-{seq}")
            seq += 1

    users = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(timeout=300)


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every target, Grafana's interval variable filled in."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            found.append((panel["title"], target.get("legendFormat", ""), expr))
    return found


def prometheus_query(base: str, expr: str, at: float | None = None) -> list:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    status, body = get(f"{base}/api/v1/query?{urllib.parse.urlencode(params)}")
    answer = json.loads(body)
    if status != 200 or answer.get("status") != "success":
        raise ValueError(f"query failed: {answer}")
    return answer["data"]["result"]


def plot(base: str, dashboard: dict, start_s: float, end_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Grafana's units as the plots' axis labels (and the factor the values are shown with).
    units = {"percentunit": ("%", 100.0), "s": ("seconds", 1.0), "reqps": ("requests/s", 1.0),
             "ops": ("per second", 1.0), "pps": ("packets/s", 1.0), "short": ("", 1.0)}
    out.mkdir(parents=True, exist_ok=True)
    for number, panel in enumerate(dashboard["panels"], 1):
        label, factor = units.get(panel["fieldConfig"]["defaults"].get("unit", ""), ("", 1.0))
        figure, axes = plt.subplots(figsize=(7, 3.2), dpi=100)
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            params = urllib.parse.urlencode({"query": expr, "start": f"{start_s:.0f}",
                                             "end": f"{end_s:.0f}", "step": "2"})
            _, body = get(f"{base}/api/v1/query_range?{params}")
            for series in json.loads(body)["data"]["result"]:
                legend = target.get("legendFormat", "")
                for key, value in series["metric"].items():
                    legend = legend.replace("{{" + key + "}}", value)
                points = [(float(t) - start_s, float(v) * factor) for t, v in series["values"]
                          if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    axes.plot(*zip(*points), label=legend or expr[:40])
        axes.set_title(panel["title"], fontsize=10)
        axes.set_xlabel("seconds into the run", fontsize=8)
        axes.set_ylabel(label, fontsize=8)
        axes.tick_params(labelsize=8)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7, loc="upper left")
        figure.tight_layout()
        figure.savefig(out / f"panel-{number:02d}.png")
        plt.close(figure)


def run(args) -> int:
    dashboard = json.loads(DASHBOARD.read_text())
    work = Path(tempfile.mkdtemp(prefix="myelin-dashboard-"))
    try:
        sim_http = free_ports(2)
        sim_kv = free_ports(4)
        start([args.myelin, "sim", "--engines", "2", "--listen", f"127.0.0.1:{sim_http}",
               "--kv-events-base-port", str(sim_kv), "--kv-events-host", "127.0.0.1",
               "--speedup", str(args.speedup), "--kv-blocks", "300",
               "--served-model-name", "m"], work / "sim.log")
        engines = [f"http://127.0.0.1:{sim_http + i}" for i in range(2)]
        for engine in engines:
            wait_until(f"{engine} to answer", lambda: get(engine + "/health")[0] == 200, 30)
        key = work / "cluster.key"
        key.write_text("dashboard-check-cluster-key\n")
        routers, metrics_ports = [], []
        seed = None
        for node in range(args.nodes):
            port, metrics, gossip = free_port(), free_port(), free_port()
            command = [args.myelin, "serve", "--listen", f"127.0.0.1:{port}",
                       "--admin-listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{metrics}",
                       "--shards", "1", "--no-pin", "--engine-metrics-interval-ms", "500",
                       "--gossip-listen", f"127.0.0.1:{gossip}", "--node-id", f"node{node}",
                       "--cluster-key-file", str(key)]
            for i, engine in enumerate(engines):
                command += ["--backend", f"{engine},kv-events=tcp://127.0.0.1:{sim_kv + 2 * i},"
                                         f"kv-replay=tcp://127.0.0.1:{sim_kv + 2 * i + 1}"]
            if seed is not None:
                command += ["--peer", seed]
            seed = seed or f"127.0.0.1:{gossip}"
            start(command, work / f"router{node}.log")
            url = f"http://127.0.0.1:{port}"
            wait_until(f"router {node} to answer", lambda: get(url + "/health")[0] == 200, 60)
            routers.append(url)
            metrics_ports.append(metrics)
        prometheus_port = free_port()
        targets = [f"127.0.0.1:{port}" for port in metrics_ports] + \
                  [engine.removeprefix("http://") for engine in engines]
        config = work / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [{"job_name": "myelin", "static_configs": [{"targets": targets}]}],
        }))
        start([args.prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{prometheus_port}"], work / "prometheus.log")
        base = f"http://127.0.0.1:{prometheus_port}"
        wait_until("Prometheus to be ready", lambda: get(base + "/-/ready")[0] == 200, 60)
        wait_until("every target scraped and up", lambda: len(
            [s for s in prometheus_query(base, "up == 1")]) == len(targets), 60)
        started = time.time()
        traffic(routers, args.requests, args.duration)
        # Four more scrapes after the last request: the rates' windows hold the traffic.
        time.sleep(4 * SCRAPE_S + 1)
        ended = time.time()
        failed = []
        for title, legend, expr in queries(dashboard):
            series = prometheus_query(base, expr)
            ok = len(series) > 0
            print(f"{'PASS' if ok else 'FAIL'}  {title} / {legend}: {len(series)} series", flush=True)
            if not ok:
                failed.append(f"{title} / {legend}: {expr}")
        if args.plots:
            plot(base, dashboard, started - 5, ended, Path(args.plots))
            print(f"plots in {args.plots}", flush=True)
        total = len(queries(dashboard))
        print(f"\n{total - len(failed)} of {total} queries returned a series", flush=True)
        return 1 if failed else 0
    except Exception:
        for log in sorted(work.glob("*.log")):
            print(f"--- {log.name} (last lines)\n" + "\n".join(
                log.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)
        raise
    finally:
        stop_all()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--myelin", required=True)
    parser.add_argument("--prometheus", default="prometheus")
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--duration", type=float, default=0.0,
                        help="send traffic for this many seconds instead of --requests")
    parser.add_argument("--speedup", type=float, default=20.0,
                        help="the simulated engines' --speedup")
    parser.add_argument("--nodes", type=int, default=2,
                        help="myelin serve nodes (gossiping with each other when more than one)")
    parser.add_argument("--plots")
    args = parser.parse_args()
    if shutil.which(args.prometheus) is None:
        print(f"check: {args.prometheus} not found (scripts/setup installs Debian's prometheus)",
              file=sys.stderr)
        return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
