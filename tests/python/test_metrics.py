"""Metrics from Python: Engine.metrics() and Engine.prometheus(), the exposition parsed by the
prometheus_client parser and checked against a known workload."""

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsv4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32"
LONG = [(i * 37 + 11) % 384 for i in range(300)]
SHORT = [5, 17, 300, 2, 9, 44, 81, 120, 7, 66]
NO_EOS = dict(temperature=0, logit_bias_tokens=[1], logit_bias_values=[-1000.0])
LABELS = {"cluster": "eu-1", "quoted": 'a"b\\c'}


def samples(text):
    """{(sample name, sorted labels without ours): value}; checks our labels on every sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            for k, v in LABELS.items():
                assert labels.pop(k) == v, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def run():
    params = {"model_path": str(FIXTURE), "threads": 2,
              "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 8, "page_size": 128},
              "metrics": {"labels": LABELS}}
    with dsv4.Engine(params) as engine:
        first = engine.generate(LONG, max_new_tokens=4, **NO_EOS)
        again = engine.generate(LONG, max_new_tokens=4, **NO_EOS)
        assert first == again
        engine.generate(SHORT, max_new_tokens=6, **NO_EOS)
        with pytest.raises(dsv4.InvalidArgument):
            engine.submit([384], max_new_tokens=1)
        yield engine.metrics(), engine.prometheus()


def test_the_exposition_parses_and_counts_the_workload(run):
    _, text = run
    got = samples(text)
    assert got[("dsv4_num_requests_total", ())] == 3
    assert got[("dsv4_num_finished_requests_total", (("finish_reason", "length"),))] == 3
    assert got[("dsv4_num_rejected_requests_total", (("reason", "invalid_argument"),))] == 1
    assert got[("dsv4_num_rejected_requests_total", (("reason", "queue_full"),))] == 0
    assert got[("dsv4_generation_tokens_total", ())] == 14
    assert got[("dsv4_prompt_tokens_total", ())] == 610
    # The repeat resumes from the snapshot at the prompt's last page boundary (256).
    assert got[("dsv4_cached_tokens_total", (("cache_source", "device"),))] == 256
    assert got[("dsv4_cached_tokens_total", (("cache_source", "host"),))] == 0
    assert got[("dsv4_num_running_reqs", ())] == 0
    assert got[("dsv4_num_queue_reqs", ())] == 0
    assert 0 < got[("dsv4_token_usage", ())] < 1
    for name, count in [("time_to_first_token_seconds", 3), ("inter_token_latency_seconds", 11),
                        ("e2e_request_latency_seconds", 3), ("queue_time_seconds", 3)]:
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in got.items()
                          if k[0] == "dsv4_" + name + "_bucket"))
        values = [v for _, v in buckets]
        assert values == sorted(values), name
        assert buckets[-1] == (float("inf"), count), name
        assert got[("dsv4_" + name + "_count", ())] == count
        assert got[("dsv4_" + name + "_sum", ())] > 0


def test_metrics_dict_agrees_with_the_exposition(run):
    m, text = run
    got = samples(text)
    assert m["requests_total"] == 3 and m["finished_length_total"] == 3
    assert m["rejected_invalid_total"] == 1
    assert m["generation_tokens_total"] == got[("dsv4_generation_tokens_total", ())]
    assert m["cached_tokens_device_total"] == 256
    assert m["ttft_count"] == 3 and m["itl_count"] == 11
    assert m["ttft_seconds_sum"] == pytest.approx(
        got[("dsv4_time_to_first_token_seconds_sum", ())])
    pages = m["device_pages"]
    assert pages["total"] == got[("dsv4_kv_capacity_units", (("pool", "pages"), ("tier", "device")))]
    assert pages["used"] == got[("dsv4_kv_used_units", (("pool", "pages"), ("tier", "device")))]
    assert m["device_slots"] == {"used": 0, "total": 8, "used_bytes": 0,
                                 "total_bytes": m["device_slots"]["total_bytes"]}
    assert m["kv_transfer_requests_total"] == 0


def promtool_check(text):
    """`promtool check metrics` (Prometheus's linter, from the Debian package `prometheus`
    that `make deps` installs) accepts `text`: parsable, and no lint problem (HELP on every
    family, counters ending in _total, units in names)."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make deps` (it installs the prometheus package)"
    run = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                         capture_output=True, timeout=60)
    assert run.returncode == 0, (run.stdout + run.stderr).decode()


def test_promtool_accepts_the_exposition(run):
    promtool_check(run[1])


def meminfo_kib(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def test_node_health_and_build_series():
    """The node-health series against what Python reads itself: the process's peak RSS
    (getrusage), /proc/meminfo, the package version; the state and the stall clock through a
    workload and a shutdown."""
    import resource
    import time

    params = {"model_path": str(FIXTURE), "threads": 2,
              "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 8, "page_size": 128},
              "hicache": {"enabled": True, "size_bytes": "64MiB"},
              "metrics": {"labels": LABELS}}
    with dsv4.Engine(params) as engine:
        engine.generate(SHORT, max_new_tokens=3, **NO_EOS)
        got = samples(engine.prometheus())
        assert got[("dsv4_engine_state", ())] == dsv4.EngineState.READY
        assert 0 <= got[("dsv4_seconds_since_last_step", ())] < 30
        build = [k for k in got if k[0] == "dsv4_build_info"]
        assert build == [("dsv4_build_info", (("backend", "cpu"), ("role", "unified"),
                                              ("version", dsv4.__version__)))]
        assert got[build[0]] == 1
        rss = got[("dsv4_process_resident_memory_bytes", ())]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        # The kernel updates the peak lazily (it can trail the current RSS by a few pages).
        assert 10 << 20 < rss <= peak + (4 << 20), (rss, peak)
        nodes = sorted(k[1][0][1] for k in got if k[0] == "dsv4_numa_node_memory_total_bytes")
        assert nodes, "at least one NUMA node"
        total = sum(got[("dsv4_numa_node_memory_total_bytes", (("node", n),))] for n in nodes)
        free = sum(got[("dsv4_numa_node_memory_free_bytes", (("node", n),))] for n in nodes)
        # hwloc's node sizes and the kernel's total agree to within reserved memory.
        assert abs(total - meminfo_kib("MemTotal") * 1024) <= 0.05 * total, total
        assert 0 < free <= total
        host = {k[1]: v for k, v in got.items() if k[0] == "dsv4_host_tier_bytes"}
        pools = {dict(labels)["pool"] for labels in host}
        assert pools == {"pages", "snapshots"}, host
        assert {dict(labels)["node"] for labels in host} <= set(nodes)
        # The host tier's pools are what the HiCache budget bought (within a pool's rounding).
        assert 0.9 * (64 << 20) <= sum(host.values()) <= 64 << 20, host
        time.sleep(1.2)
        idle = samples(engine.prometheus())[("dsv4_seconds_since_last_step", ())]
        assert idle >= 1.0 + got[("dsv4_seconds_since_last_step", ())] - 0.01
        promtool_check(engine.prometheus())  # with HiCache's and the node-health series
        engine.shutdown(dsv4.ShutdownMode.DRAIN)
        assert samples(engine.prometheus())[("dsv4_engine_state", ())] == dsv4.EngineState.STOPPED


def test_labels_the_exposition_carries_are_refused_in_metrics_labels(run):
    """Every label name of a real exposition (HiCache on, so the host-tier series are there),
    and Prometheus's own job and instance, is refused as a metrics.labels name, naming it: a
    series would otherwise carry it twice, which promtool rejects."""
    params = {"model_path": str(FIXTURE), "threads": 2,
              "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 8, "page_size": 128},
              "hicache": {"enabled": True, "size_bytes": "64MiB"}}
    with dsv4.Engine(params) as engine:
        engine.generate(SHORT, max_new_tokens=2, **NO_EOS)
        texts = [run[1], engine.prometheus()]
    names = {"job", "instance"}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                names.update(k for k in s.labels if k not in LABELS)
    assert {"le", "pool", "tier", "node", "finish_reason", "reason"} <= names, names
    for name in sorted(names):
        with pytest.raises(dsv4.ConfigError) as info:
            dsv4.validate_params({"metrics": {"labels": {name: "x"}}})
        assert f'label name "{name}" is reserved' in info.value.message
        assert f'"cluster_{name}"' in info.value.message
        dsv4.validate_params({"metrics": {"labels": {f"cluster_{name}": "x"}}})
