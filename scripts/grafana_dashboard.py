#!/usr/bin/env python3
"""Writes examples/grafana/dsv4.json, the Grafana dashboard for dsv4-server and dsv4-router
(import it in Grafana: Dashboards → New → Import; pick the Prometheus data source that scrapes
them). The panels are listed here once, as data; tests/python/test_grafana.py evaluates every
query of the committed file through a real Prometheus scraping real servers, and checks that
the file is what this script writes.

  python3 scripts/grafana_dashboard.py [--check]
"""

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "dsv4.json"

# Every query selects the dashboard's instances; rates use Grafana's $__rate_interval.
SEL = 'job=~"$job", instance=~"$instance"'


def sel(extra=""):
    return "{" + SEL + (", " + extra if extra else "") + "}"


def rate(metric, extra=""):
    return f"rate({metric}{sel(extra)}[$__rate_interval])"


HOST = sel('tier="host"')


# dsv4-router exports dsv4_build_info{role="router"} too, so it is among $job and $instance.
ROUTER = 'and on (job, instance) dsv4_build_info{role="router"}'


def quantiles(metric, by=""):
    """p50 and p99 of a histogram over the selected instances."""
    group = "le" + (", " + by if by else "")
    suffix = " {{" + by + "}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) ({rate(metric + '_bucket')}))",
             f"p{int(q * 100)}{suffix}") for q in (0.5, 0.99)]


# (row, [(title, unit, [(expr, legend)], description)])
ROWS = [
    ("HiCache", [
        ("Host tier usage per pool", "bytes", [
            (f"sum by (instance, pool) (dsv4_kv_used_bytes{HOST})",
             "{{instance}} {{pool}} used"),
            (f"sum by (instance, pool) (dsv4_kv_capacity_bytes{HOST})",
             "{{instance}} {{pool}} capacity")],
         "Host (HiCache) tier: bytes held and capacity, per pool (pages, snapshots)."),
        ("Prompt tokens by cache tier", "short", [
            (f"sum by (cache_source) ({rate('dsv4_cached_tokens_total')})", "{{cache_source}} hit"),
            (f"sum({rate('dsv4_prompt_tokens_total')}) - sum({rate('dsv4_cached_tokens_total')})",
             "computed")],
         "Prompt tokens per second: reused from the device tier, loaded back from the host "
         "tier, or computed."),
        ("Load-back and backup bandwidth", "Bps", [
            (f"sum by (instance) ({rate('dsv4_hicache_loadback_bytes_total')})",
             "{{instance}} load-back (host → device)"),
            (f"sum by (instance) ({rate('dsv4_hicache_backup_bytes_total')})",
             "{{instance}} backup (device → host)")],
         "Bytes per second moved between the device and host tiers."),
        ("Evictions", "short", [
            (f"sum by (tier, outcome) ({rate('dsv4_kv_evictions_total')})", "{{tier}} {{outcome}}")],
         "Cached prefixes evicted per second: from the device (kept on host or dropped) and "
         "from the host."),
        ("Device KV usage", "percentunit", [
            (f"dsv4_token_usage{sel()}", "{{instance}}")],
         "Share of the device KV pool in use (SGLang's token_usage)."),
    ]),
    ("Admission", [
        ("Requests running and queued", "short", [
            (f"sum by (instance) (dsv4_num_running_reqs{sel()})", "{{instance}} running"),
            (f"sum by (instance) (dsv4_num_queue_reqs{sel()})", "{{instance}} queued")],
         "Requests in the running batch and waiting in the queue."),
        ("Queued prompt tokens", "short", [
            (f"sum by (instance) (dsv4_num_queue_tokens{sel()})", "{{instance}}")],
         "Prompt tokens waiting (bounded by admission.max_queued_tokens)."),
        ("Refusals by reason", "reqps", [
            (f"sum by (reason) ({rate('dsv4_num_rejected_requests_total')})", "{{reason}}")],
         "Submissions refused per second: queue_full (HTTP 429), capacity (413), "
         "invalid_argument (400), shutdown (503)."),
        ("Requests finished by reason", "reqps", [
            (f"sum by (finish_reason) ({rate('dsv4_num_finished_requests_total')})",
             "{{finish_reason}}")],
         "Accepted requests ending per second, by how they ended."),
    ]),
    ("Latency and throughput", [
        ("Time to first token", "s", quantiles("dsv4_time_to_first_token_seconds"),
         "From submission to the first generated token."),
        ("Inter-token latency", "s", quantiles("dsv4_inter_token_latency_seconds"),
         "Between consecutive tokens of a request."),
        ("End-to-end latency", "s", quantiles("dsv4_e2e_request_latency_seconds"),
         "From submission to the terminal event."),
        ("Tokens per second", "short", [
            (f"sum by (instance) ({rate('dsv4_generation_tokens_total')})", "{{instance}} generated"),
            (f"sum by (instance) ({rate('dsv4_prompt_tokens_total')})", "{{instance}} prompt")],
         "Generated and prompt tokens per second."),
    ]),
    ("PD transfer", [
        ("Rooms by state", "short", [
            (f"sum(dsv4_num_prefill_bootstrap_queue_reqs{sel()})", "prefill: waiting for claim"),
            (f"sum(dsv4_num_prefill_inflight_queue_reqs{sel()})", "prefill: computing or sending"),
            (f"sum(dsv4_num_decode_prealloc_queue_reqs{sel()})", "decode: waiting for pages"),
            (f"sum(dsv4_num_decode_transfer_queue_reqs{sel()})", "decode: receiving")],
         "PD rooms in flight, by state (SGLang's queue gauges)."),
        ("Transfer throughput", "Bps", [
            (f"sum by (instance) ({rate('dsv4_kv_transfer_bytes_total')})", "{{instance}}")],
         "KV state bytes of rooms transferred per second (both sides count each room)."),
        ("Transfer latency (claim → done)", "s",
         quantiles("dsv4_kv_transfer_latency_seconds", by="side"),
         "Per room, from the decode's claim to done; includes the prefill computing a room "
         "claimed early."),
        ("Transfer failures by reason", "short", [
            (f"sum by (reason) ({rate('dsv4_kv_transfer_failures_total')})", "{{reason}}")],
         "Failed rooms per second: timeout, peer_dead, aborted, layout, mismatch, checksum, "
         "capacity."),
        ("Rooms transferred", "reqps", [
            (f"sum by (instance) ({rate('dsv4_kv_transfer_requests_total')})", "{{instance}}")],
         "Rooms transferred whole per second."),
    ]),
    ("Node health", [
        ("Engine state", "short", [
            (f"dsv4_engine_state{sel()}", "{{instance}}")],
         "0 loading, 1 ready, 2 draining, 3 stopped, 4 failed."),
        ("Seconds since the last forward step", "s", [
            (f"dsv4_seconds_since_last_step{sel()}", "{{instance}}")],
         "A stall detector: grows while requests wait and nothing runs."),
        ("Resident memory", "bytes", [
            (f"dsv4_process_resident_memory_bytes{sel()}", "{{instance}}")],
         "The server process's resident set."),
        ("NUMA node memory", "bytes", [
            (f"max by (node) (dsv4_numa_node_memory_free_bytes{sel()})", "node {{node}} free"),
            (f"max by (node) (dsv4_numa_node_memory_total_bytes{sel()})", "node {{node}} total")],
         "Free and total memory of each NUMA node (hwloc)."),
        ("Host tier memory by node", "bytes", [
            (f"sum by (instance, node, pool) (dsv4_host_tier_bytes{sel()})",
             "{{instance}} node {{node}} {{pool}}")],
         "Host-tier memory placed on each NUMA node, per pool."),
        ("Build", "short", [
            (f"dsv4_build_info{sel()}", "{{instance}} {{version}} {{backend}} {{role}}")],
         "Version, backend and role of each server and router."),
        ("Targets up", "short", [
            (f"up{sel()}", "{{job}} {{instance}}")],
         "1 while Prometheus scrapes a target, every server and the router; 0 when one "
         "stopped answering (a dead or hung process, a network fault)."),
    ]),
    ("Router", [
        ("Routed requests by outcome", "reqps", [
            (f"sum by (outcome) ({rate('dsv4_router_requests_total')})", "{{outcome}}")],
         "dsv4-router: requests per second; refused_by_prefill / refused_by_decode carried "
         "that server's error status to the client."),
        ("Requests per server", "reqps", [
            (f"sum by (role, url) ({rate('dsv4_router_server_requests_total')})",
             "{{role}} {{url}}"),
            (f"sum({rate('dsv4_router_retries_total')})", "retried elsewhere")],
         "dsv4-router: requests (tries included) sent to each server, and retries."),
        ("Servers in rotation and their load", "short", [
            (f"max by (role, url) (dsv4_router_server_up{sel()})", "{{role}} {{url}} up"),
            (f"max by (role, url) (dsv4_router_server_load{sel()})", "{{role}} {{url}} load")],
         "dsv4-router: 1 while a server is in rotation (it answered one of its last "
         "--health-misses /health polls); the load it picks by."),
        ("Router build and memory", "bytes", [
            (f"dsv4_process_resident_memory_bytes{sel()} {ROUTER}", "{{instance}} resident"),
            ("dsv4_build_info" + sel('role="router"'), "{{instance}} {{version}}")],
         "dsv4-router: its resident memory and version (the build line reads 1)."),
    ]),
]


def variable(name, query, label):
    return {"name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def dashboard():
    panels, y, pid = [], 0, 1
    for row, items in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (title, unit, targets, description) in enumerate(items):
            panels.append({
                "type": "timeseries", "title": title, "id": pid, "description": description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}},
                "targets": [{"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for k, (expr, legend) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(items) + 2) // 3)
    return {
        "title": "dsv4", "uid": "dsv4-serving", "tags": ["dsv4", "deepseek-v4", "llm"],
        "description": "dsv4-server and dsv4-router: HiCache, admission, latency, PD transfer, "
                       "node health. Generated by scripts/grafana_dashboard.py.",
        "editable": True, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}},
            variable("job", "label_values(dsv4_build_info, job)", "Job"),
            variable("instance", 'label_values(dsv4_build_info{job=~"$job"}, instance)',
                     "Instance"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    args = ap.parse_args()
    text = json.dumps(dashboard(), indent=2) + "\n"
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            sys.exit(f"{OUT} is stale: run python3 scripts/grafana_dashboard.py and commit it")
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
