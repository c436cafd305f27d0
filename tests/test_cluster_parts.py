"""The cluster's Ray-free parts: routing keys and rendezvous ranking, the merged Prometheus
exposition, the spec a Serve config's args become, the ASGI relay, the config inbox, and
`dsrun cluster`'s usage errors (all refused before Ray starts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.cluster.exposition import merge
from dspark.runtime.cluster.forward import Forwarded, Head, serve_forwarded
from dspark.runtime.cluster.routing import rank, route_key
from dspark.runtime.cluster.spec import ClusterSpec, ClusterSpecError
from dspark.runtime.dflash.reload import ConfigInbox
from dspark.runtime.server.metrics import Metrics

from cli_helpers import run_dsrun


def _chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_route_key_prefers_tenant_then_session_then_conversation():
    body = _chat(("user", "hi"))
    assert route_key({"x-tenant-id": "acme", "x-session-id": "s"}, body) == "tenant:acme"
    assert route_key({"x-session-id": "s"}, body) == "session:s"
    first = route_key({}, _chat(("system", "be brief"), ("user", "hi")))
    later = route_key({}, _chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"),
                                ("user", "more")))
    other = route_key({}, _chat(("system", "be brief"), ("user", "bye")))
    assert first == later != other and first.startswith("conversation:")
    assert route_key({}, json.dumps({"prompt": "x" * 2000}).encode()) == route_key(
        {}, json.dumps({"prompt": "x" * 600}).encode())  # the prompt's head names it
    assert route_key({}, b"not json") is None
    assert route_key({}, b"[1, 2]") is None


def test_rank_is_stable_and_moves_only_a_removed_replicas_keys():
    replicas = ["r1", "r2", "r3"]
    keys = [f"tenant:t{i}" for i in range(300)]
    placed = {k: rank(k, replicas, {}, 8)[0][0] for k in keys}
    assert placed == {k: rank(k, list(reversed(replicas)), {}, 8)[0][0] for k in keys}
    assert set(placed.values()) == set(replicas)  # spread over all of them
    after = {k: rank(k, ["r1", "r3"], {}, 8)[0][0] for k in keys}
    moved = [k for k in keys if after[k] != placed[k]]
    assert moved and all(placed[k] == "r2" for k in moved)
    groups = rank("tenant:t0", replicas, {}, 8)
    assert sorted(groups[0] + groups[1]) == replicas and len(groups[0]) == 1


def test_rank_yields_to_the_least_loaded_past_the_imbalance():
    key, replicas = "tenant:busy", ["a", "b"]
    preferred = rank(key, replicas, {}, 4)[0][0]
    other = "b" if preferred == "a" else "a"
    assert rank(key, replicas, {preferred: 4, other: 0}, 4)[0] == [preferred]
    assert rank(key, replicas, {preferred: 5, other: 0}, 4)[0] == [other]
    assert rank(None, replicas, {preferred: 5}, 4) == [replicas]  # no key: least loaded


def _replica_text(replica: str) -> str:
    metrics = Metrics("m", "cpu", replica)
    metrics.request("chat", "ok")
    metrics._c(metrics.ttft, "acme").observe(12.0)
    return metrics.render().decode()


def test_merged_exposition_keeps_every_replica_and_parses():
    text = merge([_replica_text("a"), _replica_text("b")])
    helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dflash_requests", "dflash_ttft_ms"):
        assert {s.labels["replica"] for s in families[name].samples} == {"a", "b"}
    assert merge([]) == ""


def test_spec_from_args_names_the_bad_key():
    spec = ClusterSpec.from_args({"model": "/m.dsmodel", "autoscale": "1:3", "max_batch": 8})
    assert spec.autoscale == (1, 3) and spec.ongoing == 16
    with pytest.raises(ClusterSpecError, match="unknown key.*replica_count"):
        ClusterSpec.from_args({"model": "/m", "replica_count": 2})
    with pytest.raises(ClusterSpecError, match="args.replicas: expected int"):
        ClusterSpec.from_args({"model": "/m", "replicas": "two"})
    with pytest.raises(ClusterSpecError, match="autoscale: MIN:MAX"):
        ClusterSpec.from_args({"model": "/m", "autoscale": "4"})
    with pytest.raises(ClusterSpecError, match="autoscale"):
        ClusterSpec(model="/m", autoscale=(3, 1))
    with pytest.raises(ClusterSpecError, match="device"):
        ClusterSpec(model="/m", device="tpu")


def _relay_app() -> tuple[FastAPI, list[str]]:
    app, seen = FastAPI(), []

    @app.post("/echo")
    async def echo(request: Request):
        return {"got": (await request.body()).decode(), "q": request.url.query}

    @app.get("/events")
    async def events(request: Request):
        async def gen():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen.append("closed")
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app, seen


def test_relay_runs_the_app_and_reports_a_disconnect():
    app, seen = _relay_app()

    async def run():
        fwd = Forwarded("POST", "/echo", b"a=1", ((b"content-type", b"application/json"),),
                        b'{"x": 1}')
        parts = [p async for p in serve_forwarded(app, fwd, "r7")]
        head, body = parts[0], b"".join(parts[1:])
        assert isinstance(head, Head) and head.status == 200 and not head.streaming
        assert (b"x-dspark-replica", b"r7") in head.headers
        assert json.loads(body) == {"got": '{"x": 1}', "q": "a=1"}
        stream = serve_forwarded(app, Forwarded("GET", "/events", b"", (), b""), "r7")
        head = await stream.__anext__()
        assert head.streaming
        assert (await stream.__anext__()).startswith(b"data: 0")
        await stream.aclose()  # what a cancelled Ray stream does
        assert seen == ["closed"]  # the app saw the client go and stopped

    asyncio.run(run())


def test_config_inbox_applies_the_latest_push_once():
    base = DFlashConfig()
    inbox = ConfigInbox(base)
    assert inbox.poll() is None
    inbox.push(base)
    assert inbox.poll() is None and inbox.reloads["ok"] == 1  # same config: nothing to do
    changed = dataclasses.replace(base, cache_resize_grace_period_sec=5.0)
    inbox.push(changed)
    assert inbox.poll() is changed and inbox.poll() is None and inbox.reloads["ok"] == 2


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--autoscale", "3"], "MIN:MAX"),
    (["--autoscale", "2:1"], "autoscale"),
])
def test_cluster_usage_errors_exit_2(capsys, json_bundle, args, message):
    result = run_dsrun(capsys, "cluster", "--model", json_bundle, *args)
    assert result.code == 2 and message in result.err


def test_cluster_refuses_a_bad_bundle_or_config_before_starting_ray(capsys, tmp_path,
                                                                    json_bundle):
    result = run_dsrun(capsys, "cluster", "--model", tmp_path / "missing.dsmodel")
    assert result.code == 2 and "missing.dsmodel" in result.err
    bad = tmp_path / "dflash_config.json"
    bad.write_text('{"window": {"max_window": 0}}')
    result = run_dsrun(capsys, "cluster", "--model", json_bundle, "--config", bad)
    assert result.code == 2 and "max_window" in result.err


def test_the_application_sizes_replicas_from_the_spec():
    from dspark.runtime.cluster.app import ENGINE, INGRESS, application
    from dspark.runtime.cluster.router import TenantAffinityRouter

    spec = ClusterSpec(model="/m.dsmodel", autoscale=(1, 3), cpus_per_replica=2, max_batch=8,
                       max_queue=10, dflash_config={"window": {"policy": "fixed"}})
    ingress = application(spec)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (ingress.name, engine.name) == (INGRESS, ENGINE)
    assert ingress.ray_actor_options["num_cpus"] == 0
    assert engine.ray_actor_options["num_cpus"] == 2
    assert engine.ray_actor_options["runtime_env"]["env_vars"]["DSPARK_THREADS"] == "2"
    assert engine.max_ongoing_requests == 16 and engine.max_queued_requests == 30
    assert engine.user_config == {"dflash_config": {"window": {"policy": "fixed"}}}
    config = engine._deployment_config
    assert (config.autoscaling_config.min_replicas,
            config.autoscaling_config.max_replicas) == (1, 3)
    assert config.request_router_config.request_router_class.endswith(
        TenantAffinityRouter.__name__)


def test_relay_cancels_a_waiting_generation_when_its_client_goes(json_bundle):
    """A non-streamed request relayed to the real app: closing the relay (what Ray does when
    the client leaves the ingress) cancels the sequence in the engine and counts it as
    cancelled. The engine is held once the sequence has a token, until the relay is closed,
    so the answer cannot simply come first."""
    import threading

    from dspark.runtime.server.run import build_app

    app, state = build_app(json_bundle, warmup=False, watch=False)
    handles, submit, engine = [], state.service.submit, state.service.engine

    async def recording_submit(request, retry=None):
        handles.append(await submit(request, retry))
        return handles[-1]

    state.service.submit = recording_submit
    release, step = threading.Event(), engine.step

    def held_step():
        if not release.is_set() and handles and handles[0].seq is not None and \
                handles[0].seq.generated:
            release.wait(30)
        return step()

    engine.step = held_step
    state.service.start(False)
    body = json.dumps({"model": state.model_id, "prompt": "a long answer", "max_tokens": 1000,
                       "temperature": 0, "speculative_decoding": False}).encode()

    async def run():
        relay = serve_forwarded(app, Forwarded("POST", "/v1/completions", b"", (
            (b"content-type", b"application/json"),), body))
        waiting = asyncio.ensure_future(relay.__anext__())
        while not (handles and handles[0].seq is not None and handles[0].seq.generated):
            await asyncio.sleep(0.01)
        assert not waiting.done()  # no answer yet: the engine is generating
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await relay.aclose()
        release.set()
        for _ in range(200):
            if not state.service.snapshot.running and not state.service.handles:
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(run())
        text = state.metrics.render().decode()
        assert 'status="cancelled"} 1.0' in text and 'status="ok"' not in text
        [handle] = handles
        assert handle.seq.finish_reason == "cancelled" and len(handle.seq.generated) < 1000
    finally:
        release.set()
        state.service.stop()


def test_cluster_without_ray_says_which_extra_to_install(capsys, monkeypatch, json_bundle):
    import sys

    for name in [m for m in sys.modules if m == "ray" or m.startswith(("ray.",
                                                                         "dspark.runtime.cluster."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # what a missing package looks like
    result = run_dsrun(capsys, "cluster", "--model", json_bundle)
    assert result.code == 2 and "pip install 'dspark[cluster]'" in result.err
