"""The Grafana dashboard (examples/grafana/dsv4.json) against a real Prometheus: a prefill (with
HiCache), a decode and a refusing prefill dsv4-server behind dsv4-router, under a small
workload, scraped every
second by Prometheus (the Debian package `prometheus`, which `make deps` installs); then every
panel's query, with Grafana's variables filled in as Grafana would, through Prometheus's HTTP
API. Each query must return series, and each panel must have moved (a value other than zero)
during the workload, so a panel is known to show something, not hoped to."""

import json
import math
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from test_router import PD, Router
from test_server import FIXTURE, GREEDY, PROMPT, Server

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "dsv4.json"
SCRAPE_S = 1
# What Grafana puts for $__rate_interval: max($__interval + scrape interval, 4 x scrape interval).
RATE_INTERVAL = f"{4 * SCRAPE_S + 1}s"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def targets(dashboard):
    """[(panel title, expr)] of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def grafana_expr(expr):
    """The query Grafana sends with every instance and job selected."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL)
            .replace('"$job"', '".*"').replace('"$instance"', '".*"'))


class Prometheus:
    def __init__(self, tmp_path, jobs):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: run `make deps` (it installs the prometheus package)"
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]}
                                     for job, t in jobs.items()]}
        # JSON is YAML: no YAML writer needed.
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert self.proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.time() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.2)

    def api(self, path, **params):
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def orphan_room(decode, prefill_info, room):
    """A decode request whose prefill half never comes, aborted while it waits: a failed room
    (reason aborted) on the decode."""
    body = {"input_ids": PROMPT, "bootstrap_room": room, "rid": f"orphan-{room}",
            "bootstrap_host": prefill_info["bootstrap_host"],
            "bootstrap_port": prefill_info["bootstrap_port"], "sampling_params": {"max_new_tokens": 2}}
    t = threading.Thread(target=decode.routed, args=("/generate", body))
    t.start()
    time.sleep(0.2)
    decode.json("/abort_request", {"rid": f"orphan-{room}"})
    t.join(timeout=60)


def workload(router, decode, prefill_info, stop, counts):
    """Until `stop`: requests over a dozen long prefixes through the router (the prefill's small
    device pool evicts them to the host tier and loads them back), a request every server
    refuses (a refusal), and an orphaned room (a transfer failure). Every few requests a new
    prefix takes an old one's place, so backups to the host tier go on too."""
    try:
        run_workload(router, decode, prefill_info, stop, counts)
    except Exception as e:  # reported by the test, not lost with the thread
        counts["error"] = repr(e)


def run_workload(router, decode, prefill_info, stop, counts):
    prefixes = [[(7 * k + i) % 300 + 2 for i in range(600)] for k in range(12)]
    i = 0
    while not stop.is_set():
        if i % 4 == 3:
            prefixes[i % len(prefixes)] = [(11 * i + j) % 300 + 2 for j in range(600)]
        prompt = prefixes[i % len(prefixes)] + [5 + i % 50, 9]
        status, _, body = router.json("/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, **GREEDY}})
        counts[status] = counts.get(status, 0) + 1
        if i % 5 == 0:
            router.json("/generate", {"input_ids": [999999]})  # outside the vocabulary: 400
        if i % 10 == 5:
            orphan_room(decode, prefill_info, 1_000_000 + i)
        i += 1


def evaluate(prom, queries, start):
    """(queries without data, what never moved) over the workload so far. Gauges may sit at
    zero at every scrape (a queue that drains between them); a rate may not, and neither may
    a whole panel."""
    empty, moved, still = [], {}, []
    now = time.time()
    for title, expr in queries:
        q = grafana_expr(expr)
        result = prom.api("query", query=q, time=now)["result"]
        values = [float(r["value"][1]) for r in result]
        if not values or not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {q} → {result}")
            continue
        series = prom.api("query_range", query=q, start=start, end=now, step=1)["result"]
        hit = any(math.isfinite(float(v)) and float(v) != 0 for s in series for _, v in s["values"])
        moved[title] = moved.get(title, False) or hit
        if "rate(" in q and not hit:
            still.append(f"{title}: {q}")
    return empty, still + [f"panel {title}" for title, m in moved.items() if not m]


def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    fresh = subprocess.run([sys.executable, str(ROOT / "scripts" / "grafana_dashboard.py"),
                            "--check"], capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    queries = targets(dashboard)
    assert len(queries) >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job", "instance"}
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]

    hicache = {"enabled": True, "ratio": 4.0, "write_policy": "write_through"}
    small = {"device_memory_bytes": "4MiB", "max_running_requests": 4, "page_size": 128}
    for d in ("p", "d", "q"):
        (tmp_path / d).mkdir()
    prefill = Server(tmp_path / "p", role="prefill", pd=PD, kv=small, hicache=hicache)
    decode = Server(tmp_path / "d", role="decode", pd=PD)
    # A second prefill server that refuses every prompt (429): the router tries those requests
    # on the first (the retries panel), and queue_full refusals show.
    refusing = Server(tmp_path / "q", role="prefill", pd=PD, admission={"max_queued_tokens": 4})
    router = Router([prefill, refusing], [decode])
    prom = None
    stop = threading.Event()
    counts = {}
    try:
        prom = Prometheus(tmp_path, {"dsv4": [f"127.0.0.1:{s.port}" for s in (prefill, decode, refusing)],
                                     "dsv4-router": [f"127.0.0.1:{router.port}"]})
        start = time.time()
        info = prefill.json("/server_info")[2]
        load = threading.Thread(target=workload, args=(router, decode, info, stop, counts))
        load.start()
        # Enough scrapes for a rate over RATE_INTERVAL, with the workload running throughout.
        deadline = time.time() + 60
        while True:
            up = prom.api("query", query="up")["result"]
            if len(up) == 4 and all(r["value"][1] == "1" for r in up) and time.time() - start > 12:
                break
            assert time.time() < deadline, f"the targets are not up: {up}"
            time.sleep(0.5)
        # Every query now; the panels that have not moved yet get more time (a slow machine
        # runs fewer requests per second), up to a minute of workload.
        while True:
            empty, never_moved = evaluate(prom, queries, start)
            if not never_moved or time.time() - start > 60 or not load.is_alive():
                break
            time.sleep(2)
        stop.set()
        load.join(timeout=120)
        assert "error" not in counts, counts["error"]
        assert counts.get(200, 0) > 10, counts
        assert not empty, "panel queries without data:\n" + "\n".join(empty)
        assert not never_moved, "stayed at zero:\n" + "\n".join(never_moved)
    finally:
        stop.set()
        if prom:
            prom.stop()
        for s in (router, decode, refusing, prefill):
            s.stop()


def test_latency_histograms_resolve_a_quarter_second_to_thirty_seconds(tmp_path):
    """The latency panels' p50/p99 interpolate within a bucket: between 0.25 s and 30 s every
    bucket of TTFT, inter-token and end-to-end latency, as a server exports them, spans at most
    1.25x (a p99 read 24.7 s off a 10-25 s bucket while clients measured 11.3 s)."""
    from prometheus_client.parser import text_string_to_metric_families
    s = Server(tmp_path)
    try:
        text = s.call("/metrics")[2]
    finally:
        s.stop()
    bounds = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                bounds.setdefault(sample.name, set()).add(float(sample.labels["le"]))
    for name in ("dsv4_time_to_first_token_seconds_bucket", "dsv4_inter_token_latency_seconds_bucket",
                 "dsv4_e2e_request_latency_seconds_bucket"):
        les = sorted(bounds[name])
        assert les[0] <= 0.25 and les[-1] >= 30, (name, les)
        for lo, hi in zip(les, les[1:]):
            if hi > 0.25 and lo < 30:
                assert hi / lo <= 1.25 + 1e-9, (name, lo, hi)
