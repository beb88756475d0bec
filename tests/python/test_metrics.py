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
