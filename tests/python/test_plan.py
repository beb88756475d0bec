"""The Python binding over the real library: versions, params, plans and errors.

Expected numbers are literals from docs/model.md §3.2 (V4-Flash), not planner output."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dsv4

ROOT = Path(__file__).resolve().parents[2]
FLASH = str(ROOT / "configs" / "deepseek-v4-flash")


def flash_params(**hicache):
    return {
        "model_path": FLASH,
        "backend": "cuda",
        "role": "prefill",
        "kv": {"dtype": "fp8", "indexer_dtype": "fp8", "device_memory_bytes": "4GiB",
               "max_running_requests": 8},
        "hicache": {"enabled": True, **hicache},
    }


def test_version_is_cargo_toml_version():
    cargo = (ROOT / "Cargo.toml").read_text()
    expected = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    assert dsv4.version() == expected


def test_default_params_has_every_section_and_documented_defaults():
    params = dsv4.default_params()
    for section in ("parallel", "model", "kv", "hicache", "admission", "scheduler", "numerics",
                    "metrics"):
        assert isinstance(params[section], dict), section
    assert params["backend"] == "cpu"
    assert params["kv"]["page_size"] == 256
    assert params["hicache"]["ratio"] is None and params["hicache"]["size_bytes"] is None
    # Every key in the defaults is documented in docs/params.md.
    doc = (ROOT / "docs" / "params.md").read_text()
    for section, value in params.items():
        keys = [f"{section}.{k}" for k in value] if isinstance(value, dict) else [section]
        for key in keys:
            assert f"`{key}`" in doc, key


def test_validate_resolves_units_to_bytes():
    resolved = dsv4.validate_params({"hicache": {"size_bytes": "150GB"},
                                     "kv": {"device_memory_bytes": "140GiB"}})
    assert resolved["hicache"]["size_bytes"] == 150_000_000_000
    assert resolved["kv"]["device_memory_bytes"] == 140 * 2**30
    assert resolved["kv"]["page_size"] == 256  # merged over the defaults
    assert dsv4.validate_params('{"threads": 4}')["threads"] == 4


def test_config_errors_list_every_problem_with_a_fix():
    with pytest.raises(dsv4.ConfigError) as info:
        dsv4.validate_params({"hicache": {"write_polcy": "write_back", "ratio": -1},
                              "kv": {"page_size": 300}})
    err = info.value
    assert err.status == -2
    assert isinstance(err, dsv4.Error)
    assert "3 problems in params" in err.message
    assert "did you mean `hicache.write_policy`?" in err.message
    assert "use 256 or 384" in err.message
    with pytest.raises(dsv4.ConfigError, match="not valid UTF-8"):
        dsv4.validate_params(b'{"model_path": "\xff"}')
    with pytest.raises(dsv4.ConfigError, match="not valid JSON"):
        dsv4.validate_params("{")


def test_missing_model_is_a_file_error_not_a_builtin():
    with pytest.raises(dsv4.FileError) as info:
        dsv4.plan({"model_path": "/nonexistent/model"})
    assert info.value.status == -3
    assert "does not exist" in info.value.message
    assert not issubclass(dsv4.FileError, OSError)


def test_every_status_has_its_exception_class():
    expected = {
        "DSV4_ERR_INVALID_ARGUMENT": dsv4.InvalidArgument,
        "DSV4_ERR_CONFIG": dsv4.ConfigError,
        "DSV4_ERR_IO": dsv4.FileError,
        "DSV4_ERR_MODEL_FORMAT": dsv4.ModelFormatError,
        "DSV4_ERR_CAPACITY": dsv4.CapacityError,
        "DSV4_ERR_QUEUE_FULL": dsv4.QueueFull,
        "DSV4_ERR_TIMEOUT": dsv4.Timeout,
        "DSV4_ERR_ABORTED": dsv4.Aborted,
        "DSV4_ERR_KV_TRANSFER": dsv4.KVTransferError,
        "DSV4_ERR_BUFFER_TOO_SMALL": dsv4.BufferTooSmall,
        "DSV4_ERR_UNSUPPORTED": dsv4.Unsupported,
        "DSV4_ERR_SHUTDOWN": dsv4.ShutDown,
        "DSV4_ERR_NOT_FOUND": dsv4.NotFound,
        "DSV4_ERR_INTERNAL": dsv4.InternalError,
    }
    for name, cls in expected.items():
        assert dsv4.status_name(cls.status) == name
        err = dsv4.from_status(cls.status, "m")
        assert type(err) is cls and err.status == cls.status and err.message == "m"


def test_flash_plan_matches_the_model_reference():
    plan = dsv4.plan(flash_params(ratio=2.0))
    pools = plan["pools"]
    assert list(pools) == ["c4_kv", "c4_indexer", "c128_kv", "swa", "c4_state",
                           "c4_indexer_state", "c128_state", "snapshots"]
    assert pools["c4_kv"]["row_bytes"] == 584 and pools["c4_kv"]["layers"] == 21
    assert pools["c4_indexer"]["row_bytes"] == 132
    assert pools["c128_kv"]["layers"] == 20
    page = plan["deployment"]["page_size"]
    assert pools["c4_kv"]["unit_bytes"] / (page * 21) == 146
    assert pools["c4_indexer"]["unit_bytes"] / (page * 21) == 33
    assert abs(pools["c128_kv"]["unit_bytes"] / (page * 20) - 4.56) < 0.01
    for name in ("c4_kv", "c4_indexer", "c128_kv", "snapshots"):
        assert pools[name]["host"]["units"] == 2 * pools[name]["device"]["units"]
    assert plan["hicache"] == {**plan["hicache"], "mode": "ratio", "budget_bytes": None,
                               "effective_ratio": 2.0}


def test_size_gives_what_the_operator_asked_for():
    by_ratio = dsv4.plan(flash_params(ratio=2.0))
    by_size = dsv4.plan(flash_params(size_bytes="150GB"))
    assert by_ratio["totals"]["host_bytes"] < 10e9
    host = by_size["totals"]["host_bytes"]
    assert 149e9 < host <= 150e9
    assert by_size["hicache"]["budget_bytes"] == 150_000_000_000
    assert by_size["numa"]["required_bytes"] == host
    assert isinstance(by_size["numa"]["fits"], bool) and by_size["numa"]["reason"]


def test_plan_text_is_the_same_plan():
    text = dsv4.plan_text(json.dumps(flash_params(size_bytes="150GB")))
    assert "\nsummary\n" in text
    assert "hicache: size 150,000,000,000 B" in text
    assert "c4_kv" in text and "snapshots" in text


def test_concurrent_calls_from_threads():
    with ThreadPoolExecutor(max_workers=4) as pool:
        plans = list(pool.map(lambda _: dsv4.plan(flash_params(ratio=1.5)), range(16)))
    units = {p["pools"]["c4_kv"]["host"]["units"] for p in plans}
    assert len(units) == 1


def smallest_size_for_one_host_unit(params):
    """The documented split (docs/plan.md): a pool's share of size_bytes B is in proportion to
    its device bytes, so it holds floor(B * device units / mirrored device bytes) host units and
    gets one once B >= mirrored device bytes / its device units. Device units do not depend on
    the host tier, so they come from a plan with a roomy one."""
    pools = dsv4.plan(params)["pools"]
    mirrored = ("c4_kv", "c4_indexer", "c128_kv", "snapshots")
    device = sum(pools[name]["device"]["bytes"] for name in mirrored)
    return max(-(-device // pools[name]["device"]["units"]) for name in ("c4_kv", "snapshots"))


def test_a_size_too_small_for_one_host_unit_per_pool_is_refused():
    smallest = smallest_size_for_one_host_unit(flash_params(size_bytes="150GB"))
    plan = dsv4.plan(flash_params(size_bytes=smallest))
    assert min(plan["pools"][p]["host"]["units"] for p in ("c4_kv", "snapshots")) == 1
    with pytest.raises(dsv4.ConfigError) as info:
        dsv4.plan(flash_params(size_bytes=smallest - 1))
    assert f"is {smallest:,} B (" in info.value.message
    assert "did you mean" not in info.value.message
    # SGLang's `--hicache-size 150` (GB) carried over as a bare number: 150 bytes.
    with pytest.raises(dsv4.ConfigError) as info:
        dsv4.plan_text(json.dumps(flash_params(size_bytes=150)))
    assert info.value.status == -2
    assert "HiCache would be enabled with no host tier" in info.value.message
    assert 'did you mean "150GB"?' in info.value.message
    assert f"is {smallest:,} B (" in info.value.message


TINY = str(ROOT / "tests" / "fixtures" / "flash-like" / "hf-f32-text")


def installed(tool):
    """An installed tool next to the library under test (make test-python: the staged prefix's
    bin/, beside lib/)."""
    from dsv4 import _native

    path = Path(_native.lib._name).resolve().parent.parent / "bin" / tool
    assert path.is_file(), f"{path} is missing: run the tests on an installed prefix " \
                           "(make install PREFIX=..., DSV4_LIBRARY=PREFIX/lib/libdsv4.so.0)"
    return str(path)


def run_tool(tool, *args):
    import subprocess

    return subprocess.run([installed(tool), *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_dsv4_plan_exit_status_tells_fits_refused_and_usage_apart(tmp_path):
    def params_file(name, doc):
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return path

    base = {"model_path": TINY, "backend": "cpu",
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128}}
    fits = params_file("fits.json", base)
    # 64 TB of host tier on the CPU backend: planned, and more than any machine here has.
    too_big = params_file("too-big.json", {**base, "hicache": {"enabled": True,
                                                              "size_bytes": "64TB"}})
    refused = params_file("refused.json", {**base, "kv": {"page_size": 300}})

    run = run_tool("dsv4-plan", fits)
    assert run.returncode == 0, run.stderr
    assert "fits NUMA node: yes" in run.stdout
    run = run_tool("dsv4-plan", too_big)
    assert run.returncode == 3, run.stderr
    assert "fits NUMA node: no" in run.stdout
    run = run_tool("dsv4-plan", "--json", too_big)
    assert run.returncode == 3 and json.loads(run.stdout)["numa"]["fits"] is False
    assert run_tool("dsv4-plan", "--json", fits).returncode == 0
    run = run_tool("dsv4-plan", refused)
    assert run.returncode == 1
    assert "DSV4_ERR_CONFIG" in run.stderr and "use 256 or 384" in run.stderr
    assert run_tool("dsv4-plan", tmp_path / "missing.json").returncode == 1
    # Several files: a refusal outranks a plan that does not fit.
    assert run_tool("dsv4-plan", fits, too_big).returncode == 3
    assert run_tool("dsv4-plan", too_big, refused, fits).returncode == 1
    assert run_tool("dsv4-plan", fits, fits).returncode == 0
    for args in ([], ["--jsn", fits], [fits] * 9):
        run = run_tool("dsv4-plan", *args)
        assert run.returncode == 2, args
        assert run.stderr.count("usage: ") == 1 and not run.stdout, args
    for flag in ("--help", "-h"):
        run = run_tool("dsv4-plan", flag)
        assert run.returncode == 0 and not run.stderr
        assert run.stdout.startswith("usage: ")
        for line in ("  1  dsv4 refused", "  2  usage error", "  3  every plan was computed"):
            assert line in run.stdout, run.stdout


def test_dsv4_serve_demo_help_and_usage():
    for flag in ("--help", "-h"):
        run = run_tool("dsv4-serve-demo", flag)
        assert run.returncode == 0 and not run.stderr
        assert run.stdout.startswith("usage: ") and "  2  usage error" in run.stdout
    for args in ([], ["a", "b"], ["--verbose"]):
        run = run_tool("dsv4-serve-demo", *args)
        assert run.returncode == 2 and "usage: " in run.stderr and not run.stdout, args


def test_the_installed_example_params_plan_from_any_directory(tmp_path):
    """share/dsv4/examples/params name their checkpoint relative to themselves
    (../../configs/...): dsv4-plan finds it from a working directory that has no configs/, and
    a copy of a params file elsewhere, whose relative path exists only from the repository,
    still plans from there (the working directory comes second)."""
    import subprocess

    prefix = Path(installed("dsv4-plan")).parent.parent
    examples = sorted((prefix / "share" / "dsv4" / "examples" / "params").glob("*.json"))
    assert [p.name for p in examples] == ["flash-prefill-ratio.json", "flash-prefill-size.json"]
    for params in examples:
        run = subprocess.run([installed("dsv4-plan"), str(params)], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        # 3: planned, but this machine's NUMA node may be too small for the 150 GB host tier.
        assert run.returncode in (0, 3), run.stderr
        assert "deepseek-v4-flash" in run.stdout and "effective ratio" in run.stdout, run.stdout
    # Beside the file first: a params file whose model_path exists both next to it and from the
    # working directory takes the one next to it.
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "model").symlink_to(ROOT / "configs" / "deepseek-v4-pro")
    (tmp_path / "model").symlink_to(ROOT / "configs" / "deepseek-v4-flash")
    conf = tmp_path / "conf" / "p.json"
    conf.write_text(json.dumps({"model_path": "model", "backend": "cuda", "kv": {"device_memory_bytes": "4GiB"}}))
    run = subprocess.run([installed("dsv4-plan"), str(conf)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode in (0, 3) and "61 layers" in run.stdout, run.stdout + run.stderr  # V4-Pro
    (tmp_path / "conf" / "model").unlink()
    run = subprocess.run([installed("dsv4-plan"), str(conf)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode in (0, 3) and "43 layers" in run.stdout, run.stdout + run.stderr  # V4-Flash
