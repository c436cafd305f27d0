"""`dsrun cluster` end to end: a local Ray Serve with 2 engine replicas of a fixture bundle,
started as users start it (a process), driven by the official openai client and httpx.

One module-scoped cluster (Ray's start-up is the cost), started with --ship-bundle: the
bundle travels as the job's working_dir (no shared filesystem) and each replica checks its
hashes there, so every test below is also a test of a shipped bundle (a path-loaded one
differs only in the directory the replica opens). The replica kill runs last."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.runtime.server.ports import free_port

from cli_helpers import run_dsrun

START_TIMEOUT_S = 120


@dataclass
class LiveCluster:
    url: str
    model: str
    config: Path
    proc: subprocess.Popen
    ray_metrics: str = ""

    def client(self, **headers) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             default_headers=headers or None)

    def post(self, path: str, body: dict, **headers) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={"model": self.model, **body},
                          headers=headers, timeout=60)

    def replica_samples(self, family: str) -> list:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return [s for f in text_string_to_metric_families(text) if f.name == family
                for s in f.samples]

    def replicas(self) -> set[str]:
        return {s.labels["replica"] for s in self.replica_samples("dspar_kv_cache_usage_ratio")}



def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"dsrun cluster exited: {proc.stderr.read()}")
        try:
            if value := predicate():
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    dsrun = os.path.join(os.path.dirname(sys.executable), "dsrun")
    return subprocess.Popen([dsrun, "cluster", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def cluster(json_bundle, tmp_path_factory):
    config = tmp_path_factory.mktemp("cluster") / "dflash_config.json"
    shutil.copy(json_bundle / "dflash_config.json", config)
    port, ray_port = free_port(), free_port()
    proc = _start("--model", str(json_bundle), "--replicas", "2", "--port", str(port),
                  "--ship-bundle", "--config", str(config), "--no-warmup",
                  "--ray-metrics-port", str(ray_port),
                  env={"RAY_AUTH_MODE": "disabled"})  # the test connects to kill a replica
    live = LiveCluster(f"http://127.0.0.1:{port}", "", config, proc,
                       f"http://127.0.0.1:{ray_port}/metrics")
    try:
        _wait(lambda: httpx.get(f"{live.url}/health", timeout=2).status_code == 200,
              START_TIMEOUT_S, "the cluster", proc)
        live.model = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        _wait(lambda: len(live.replicas()) == 2, 30, "both replicas' metrics", proc)
        yield live
    finally:
        _stop(proc)


def test_openai_client_gets_the_tokens_dsrun_generate_gives(cluster, json_bundle, capsys):
    """The shipped bundle answers as `dsrun generate` on the bundle's own path does."""
    assert cluster.model == json_bundle.name.removesuffix(".dsmodel")
    ref = run_dsrun(capsys, "generate", "--model", json_bundle, "--chat", "name three colors",
                    "--max-tokens", "24", "--json")
    assert ref.code == 0, ref.err
    expected = json.loads(ref.out)["text"]
    client = cluster.client()
    messages = [{"role": "user", "content": "name three colors"}]
    chat = client.chat.completions.create(model=cluster.model, messages=messages,
                                          max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=cluster.model, messages=messages, max_tokens=24, temperature=0, stream=True)
        if c.choices)
    assert streamed == expected
    ref = run_dsrun(capsys, "generate", "--model", json_bundle, "--prompt", "once upon",
                    "--max-tokens", "16", "--json")
    text = client.completions.create(model=cluster.model, prompt="once upon", max_tokens=16,
                                     temperature=0).choices[0].text
    assert text == json.loads(ref.out)["text"]


def test_concurrent_requests_all_succeed_on_both_replicas(cluster):
    def one(i: int) -> httpx.Response:
        return cluster.post("/v1/completions", {"prompt": f"request {i} says", "max_tokens": 12,
                                                "temperature": 0})

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(one, range(32)))
    assert [r.status_code for r in responses] == [200] * 32
    assert {r.headers["x-dspark-replica"] for r in responses} == cluster.replicas()


def test_a_tenant_stays_on_one_replica(cluster):
    served: dict[str, set[str]] = {}
    for round_ in range(4):
        for tenant in ("acme", "globex", "initech", "umbrella", "hooli", "wayne"):
            r = cluster.post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"turn {round_}"}], "max_tokens": 6},
                **{"X-Tenant-ID": tenant})
            assert r.status_code == 200
            served.setdefault(tenant, set()).add(r.headers["x-dspark-replica"])
    assert all(len(replicas) == 1 for replicas in served.values()), served
    # the tenant's metrics live on the replica that served it, labelled with it (replicas
    # report once a second: wait for the last requests to show, then compare)
    want = {(t, next(iter(r))) for t, r in served.items()}

    def by_tenant() -> set:
        return {(s.labels["tenant"], s.labels["replica"])
                for s in cluster.replica_samples("dflash_ttft_ms")
                if s.name == "dflash_ttft_ms_count" and s.labels["tenant"] in served}

    _wait(lambda: by_tenant() >= want, 10, "every tenant's metrics")
    assert by_tenant() == want


def test_ray_keeps_exporting_its_own_metrics(cluster):
    _wait(lambda: "ray_serve_deployment_request_counter" in httpx.get(cluster.ray_metrics,
                                                                       timeout=5).text,
          30, "Ray Serve's own request counter")


def _reloads(cluster: LiveCluster) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in cluster.replica_samples(
        "dflash_config_reloads") if s.labels["result"] == "ok"}


def test_a_config_change_reaches_every_replica_without_restarts(cluster):
    before, replicas = _reloads(cluster), cluster.replicas()
    config = json.loads(cluster.config.read_text())
    cluster.config.write_text("{ not json")  # rejected once, by dsrun cluster
    time.sleep(2)
    assert _reloads(cluster) == before
    config.setdefault("drafting", {})["method"] = "lookup"
    cluster.config.write_text(json.dumps(config))
    _wait(lambda: all(n > before[r] for r, n in _reloads(cluster).items()), 60,
          "the config on every replica")
    assert cluster.replicas() == replicas  # reconfigured in place
    for tenant in ("acme", "globex", "initech", "umbrella"):
        stats = cluster.post("/v1/completions", {"prompt": "a b a b a b a b", "max_tokens": 16,
                                                 "temperature": 0},
                             **{"X-Tenant-ID": tenant}).json()["speculative_decoding_stats"]
        assert "draft" not in stats["methods"], stats


def _cancelled(cluster: LiveCluster) -> float:
    return sum(s.value for s in cluster.replica_samples("dflash_requests")
               if s.name == "dflash_requests_total" and s.labels["status"] == "cancelled")


def test_a_stream_whose_client_goes_away_is_cancelled_on_the_replica(cluster):
    """The whole path: proxy -> ingress -> Ray stream cancel -> replica -> engine. (A
    non-streamed request's cancel is tested on the relay itself, deterministically: with a
    model this small its answer can beat the cancel through three processes.)"""
    before = _cancelled(cluster)
    body = {"model": cluster.model, "prompt": "a long answer", "max_tokens": 1000,
            "temperature": 0, "speculative_decoding": False, "stream": True}
    for i in range(3):
        with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=30,
                          json={**body, "prompt": f"{i} long"}) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
    _wait(lambda: _cancelled(cluster) >= before + 3, 30, "every stream cancelled")


def test_a_killed_replica_fails_its_stream_cleanly_and_the_rest_serve_on(cluster):
    import ray

    ray.init(address="auto", namespace="dspark", log_to_driver=False)
    try:
        body = {"model": cluster.model, "prompt": "tell a long story", "max_tokens": 900,
                "temperature": 0, "stream": True, "speculative_decoding": False}
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60,
                          headers={"X-Tenant-ID": "victim"}) as r:
            victim = r.headers["x-dspark-replica"]
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            ray.kill(ray.get_actor(f"SERVE_REPLICA::dspark#EngineReplica#{victim}",
                                   namespace="serve"), no_restart=True)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
        for i in range(20):
            r = cluster.post("/v1/completions", {"prompt": f"after {i}", "max_tokens": 8},
                             **{"X-Tenant-ID": "victim"})
            assert r.status_code == 200, r.text
            assert r.headers["x-dspark-replica"] != victim
        _wait(lambda: len(cluster.replicas() - {victim}) == 2, 90, "a replacement replica")
    finally:
        ray.shutdown()
