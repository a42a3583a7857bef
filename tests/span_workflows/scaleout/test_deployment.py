"""Pieces of the Ray Serve application that need no cluster: options, metrics merging, the
CLI's ``serve --replicas`` arguments."""

from __future__ import annotations

import pytest

from span_workflows.apps.cli import main as cli
from span_workflows.scaleout.deployment import ClusterOptions, app_from_args, relabel_metrics


def test_metrics_of_replicas_are_merged_with_a_replica_label() -> None:
    a = ("# HELP span_hit_blocks_total hits\n# TYPE span_hit_blocks_total counter\n"
         "span_hit_blocks_total 3.0\n"
         'vllm:num_requests_running{model_name="m",engine="0"} 1.0\n')
    b = a.replace("3.0", "5.0")
    merged = relabel_metrics({"r1": a, "r2": b})
    assert merged.count("# TYPE span_hit_blocks_total counter") == 1
    assert 'span_hit_blocks_total{replica="r1"} 3.0' in merged
    assert 'span_hit_blocks_total{replica="r2"} 5.0' in merged
    assert 'vllm:num_requests_running{engine="0",model_name="m",replica="r2"} 1.0' in merged
    # a label value with a space or an escaped quote is labelled too
    odd = relabel_metrics({"r1": 'x{path="a b",q="say \\"hi\\""} 2\n'})
    assert 'x{path="a b",q="say \\"hi\\"",replica="r1"} 2.0' in odd
    # a replica whose text does not parse loses its samples, not the others'
    both = relabel_metrics({"r1": a, "r2": "x{oops 1\n"})
    assert 'span_hit_blocks_total{replica="r1"} 3.0' in both and "# replica r2:" in both


@pytest.mark.parametrize("bad, message", [
    ({"replicas": 0}, "replicas"),
    ({"router": "round-robin"}, "unknown router"),
    ({"num_gpus": -1}, "num_gpus"),
    ({"capacity_tokens": 0}, "capacity_tokens"),
    ({"imbalance_threshold": -1}, "imbalance_threshold"),
    ({"server": {"kv_cache_gib": 0}}, "kv_cache_gib"),
    ({"server": {"span_store": "/tmp/store"}}, "span_store is not available with replicas"),
])
def test_bad_options_are_refused(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterOptions(**bad)


def test_serve_replicas_builds_cluster_options(monkeypatch) -> None:
    seen = {}

    def fake_serve_cluster(options, host, port, address):
        seen.update(options=options, host=host, port=port, address=address)

    import span_workflows.scaleout.deployment as deployment

    monkeypatch.setattr(deployment, "serve_cluster", fake_serve_cluster)
    assert cli.main(["serve", "--replicas", "3", "--num-gpus", "1", "--port", "9000",
                     "--router", "prefix-affinity", "--", "--max-model-len", "4096"]) == 0
    options = seen["options"]
    assert (options.replicas, options.num_gpus, options.router) == (3, 1.0, "prefix-affinity")
    assert options.server.extra_args == ("--max-model-len", "4096") and seen["port"] == 9000


def test_serve_replicas_reports_bad_options(capsys) -> None:
    assert cli.main(["serve", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err


def test_cache_size_is_read_from_whole_label_names() -> None:
    from span_workflows.scaleout.deployment import _label

    text = 'vllm:cache_config_info{hash_block_size="16",block_size="32",num_gpu_blocks="700"} 1'
    assert (_label(text, "block_size"), _label(text, "num_gpu_blocks")) == (32, 700)
    assert _label("nothing", "block_size") is None


def test_the_config_file_builder_checks_its_args() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        app_from_args({"router": "nope"})


def test_the_ingress_loads_its_tokenizer_before_a_replica_answers(monkeypatch) -> None:
    """The tokenizer (seconds to load) is loaded from the ingress's start, while the replicas
    start their engines; the first query waits only for a replica's answer."""
    import asyncio
    import threading

    import span_workflows.scaleout.deployment as deployment

    loaded = threading.Event()

    def fake_tokenizer(options):
        loaded.set()
        return "the tokenizer"

    built = {}

    class FakeKeyer:
        def __init__(self, tokenizer, block, with_prompt=False):
            built.update(tokenizer=tokenizer, block=block)

    class Info:
        block_size, cache_tokens = 16, 0

    class Handle:  # a replica that has not answered yet
        pass

    monkeypatch.setattr(deployment, "_tokenizer", fake_tokenizer)
    monkeypatch.setattr("span_workflows.compiler.keys.QueryKeyer", FakeKeyer)
    core = deployment.SpanIngressCore(Handle(), {"router": "power-of-two"})
    assert loaded.wait(5)  # no replica asked yet

    async def info(*_, **__):
        return Info()

    monkeypatch.setattr(core, "_call", info)
    asyncio.run(core._prepare())
    assert built == {"tokenizer": "the tokenizer", "block": 16}


def test_a_replica_runs_the_servers_options_and_survives_the_trip_as_a_dict() -> None:
    """What each replica's server runs with is ``serve``'s own :class:`ServerOptions`; Ray
    hands a replica its options as a dict (``asdict``), and they come back the same."""
    from dataclasses import asdict

    from span_workflows.serving.launch import ServerOptions

    server = ServerOptions(kv_cache_gib=3, block_size=16, extra_args=("--max-num-seqs", "4"),
                           api_key="k", routing=False)
    options = ClusterOptions(replicas=2, server=server)
    assert ClusterOptions(**asdict(options)) == options
    assert ClusterOptions(server=asdict(server)).server == server  # a Serve config's mapping


def test_the_shipped_serve_config_builds_its_options() -> None:
    """``deploy/ray-serve.yaml``'s ``args`` are :class:`ClusterOptions` fields."""
    from pathlib import Path

    import yaml

    config = Path(__file__).parents[3] / "deploy" / "ray-serve.yaml"
    (app,) = yaml.safe_load(config.read_text(encoding="utf-8"))["applications"]
    options = ClusterOptions(**app["args"])
    assert options.server.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert options.server.extra_args[:2] == ("--max-model-len", "32768")
