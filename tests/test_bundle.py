"""The bundle reader refuses what it cannot trust; config and memory plan validate."""

from __future__ import annotations

import json
import shutil

import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import ConfigError, DFlashConfig, config_from_dict
from dspark.runtime.bundle.memory_plan import MemoryPlan, plan_memory
from dspark.runtime.errors import BundleError, DSparkError


@pytest.fixture
def bundle_copy(compiled, tmp_path):
    dst = tmp_path / "copy.dsmodel"
    shutil.copytree(compiled[("llama", "classic")], dst)
    return dst


def test_tampered_weights_are_named(bundle_copy):
    weights = bundle_copy / "main" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"main/weights.bin: sha256 does not match"):
        open_bundle(bundle_copy)


def test_a_file_changed_after_its_check_is_hashed_again(bundle_copy, tmp_path, monkeypatch):
    """A second open hashes nothing it checked before (bundle/file_check.py); a byte flipped
    in place afterwards, size and modification time put back, is still found: its change
    time moved. DSPARK_HASH=full hashes every file."""
    import os

    import dspark.runtime.bundle.bundle as bundle_module

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    hashed = []

    def counting(path):
        hashed.append(path.relative_to(bundle_copy).as_posix())
        return bundle_module.sha256_file(path)

    monkeypatch.setattr(bundle_module, "check_files", lambda root, files, hasher, records:
                        _check(root, files, counting, records))
    open_bundle(bundle_copy)
    assert "main/weights.bin" in hashed
    hashed.clear()
    open_bundle(bundle_copy)
    assert hashed == []
    monkeypatch.setenv("DSPARK_HASH", "full")
    open_bundle(bundle_copy)
    assert "main/weights.bin" in hashed and len(hashed) == len(set(hashed))
    monkeypatch.delenv("DSPARK_HASH")
    weights = bundle_copy / "main" / "weights.bin"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(BundleError, match=r"main/weights.bin: sha256 does not match"):
        open_bundle(bundle_copy)


def _check(root, files, hasher, records):
    from dspark.runtime.bundle.file_check import check_files

    return check_files(root, files, hasher, records)


def test_truncated_and_missing_files_are_named(bundle_copy):
    seg = bundle_copy / "draft" / "segment_001.onnx"
    seg.write_bytes(seg.read_bytes()[:-10])
    with pytest.raises(BundleError, match=r"draft/segment_001.onnx: size .* \(truncated\?\)"):
        open_bundle(bundle_copy)
    seg.unlink()
    with pytest.raises(BundleError, match=r"segment_001.onnx: missing from bundle"):
        open_bundle(bundle_copy)


def test_format_version_and_manifest_checked(bundle_copy):
    manifest = bundle_copy / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(BundleError, match="format version 99"):
        open_bundle(bundle_copy)
    manifest.write_text("{")
    with pytest.raises(BundleError, match="unreadable manifest"):
        open_bundle(bundle_copy)
    manifest.unlink()
    with pytest.raises(BundleError, match="not a .dsmodel bundle"):
        open_bundle(bundle_copy)


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd", "main/../../x"])
def test_manifest_paths_outside_the_bundle_are_refused(bundle_copy, entry):
    manifest = bundle_copy / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][entry] = {"size": 1, "sha256": "0" * 64}
    manifest.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="points outside the bundle"):
        open_bundle(bundle_copy, verify=False)


def test_symlinks_in_a_bundle_are_refused(bundle_copy, tmp_path):
    target = bundle_copy / "main" / "weights.bin"
    outside = tmp_path / "elsewhere.bin"
    target.rename(outside)
    target.symlink_to(outside)  # same bytes, so only the link itself is wrong
    with pytest.raises(BundleError, match="weights.bin: a symlink"):
        open_bundle(bundle_copy)


def test_config_is_mutable_but_validated(bundle_copy):
    path = bundle_copy / "dflash_config.json"
    cfg = json.loads(path.read_text())
    cfg["window"]["initial"] = 6
    path.write_text(json.dumps(cfg))
    assert open_bundle(bundle_copy).config.window.initial == 6  # edits pass the hash check
    cfg["window"]["initial"] = 60
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"dflash_config.json: window.initial: must lie in"):
        open_bundle(bundle_copy)


def test_config_defaults_round_trip_and_errors_name_the_field():
    cfg = DFlashConfig()
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.window.policy == "dflash" and cfg.cache_health.kdr_min == 0.75
    cases = [
        ({"window": {"polcy": "fixed"}}, "window.polcy: unknown field"),
        ({"window": {"max_window": "8"}}, "window.max_window: expected an integer"),
        ({"verify_balance": {"low_utilisation": 0.9}}, "verify_balance.high_utilisation"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenant names must be unique"),
        ({"resources": {"table": [{"match": "cpu", "window": 0}]}}, r"resources.table\[0\].window"),
        ({"cache_health": {"zero_rejected_slots": 1}}, "expected true/false"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(data)


def test_memory_plan_arithmetic(compiled):
    bundle = open_bundle(compiled[("gpt2", "classic")])
    main, draft = bundle.model("main"), bundle.model("draft")
    assert main.kv_bytes_per_token == 2 * 3 * 4 * 16 * 4
    plan = plan_memory([main, draft], 1 << 20, 16, 100)
    assert plan.bytes_per_block == 16 * (main.kv_bytes_per_token + draft.kv_bytes_per_token)
    assert plan.num_blocks == (1 << 20) // plan.bytes_per_block
    assert plan.total_bytes <= 1 << 20
    assert plan.pool("draft").offset == plan.pool("main").nbytes
    assert plan.max_seqs == plan.num_blocks // 7
    assert MemoryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(DSparkError, match="--block-size must be one of"):
        plan_memory([main], 1 << 20, 24, 100)


def test_config_schema_ships_in_the_bundle(compiled):
    import jsonschema

    from dspark.runtime.bundle.config import CONFIG_SCHEMA_FILE

    bundle = open_bundle(compiled[("llama", "classic")])
    schema = json.loads(bundle.path(CONFIG_SCHEMA_FILE).read_text())
    jsonschema.validate(json.loads(json.dumps(DFlashConfig().to_dict())), schema)
    for bad in ({"window": {"polcy": "x"}}, {"window": {"policy": "warp"}},
                {"cache_health": {"interval_ms": "fast"}}, {"tenants": [{"weight": "1"}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_monitoring_samples_are_valid():
    """The alert fires only on high reject rate AND low accept throughput; the dashboard
    queries metrics the server exposes."""
    import yaml
    from conftest import ROOT

    rules = yaml.safe_load((ROOT / "samples/monitoring/dflash_alerts.yml").read_text())
    [alert] = [r for g in rules["groups"] for r in g["rules"]
               if r["alert"] == "DFlashSpeculationIneffective"]
    expr = " ".join(alert["expr"].split())
    assert "dflash_reject_rate_1m) > 0.3" in expr and " and " in expr
    assert "dflash_accept_throughput_tps) < 50" in expr
    [cores] = [r for g in rules["groups"] for r in g["rules"]
               if r["alert"] == "DSparkCoresTakenByOtherWork"]
    assert "dspar_host_other_cores) > 0.5" in cores["expr"]
    dash = json.loads((ROOT / "samples/monitoring/grafana_dflash.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", ()))
    for name in ("dflash_window_size_current", "dflash_reject_rate_1m",
                 "dspar_verify_latency_p99_ms", "dspar_kv_cache_hit_rate", "dflash_ttft_ms"):
        assert name in exprs
    assert "sum by (replica)" in exprs  # the replica row (dsrun cluster)
    assert "replica" in {v["name"] for v in dash["templating"]["list"]}
