"""``span-workflows serve``: CPU defaults only on CPU, every other vLLM option passed through,
hub model ids allowed when online."""

from __future__ import annotations

import pytest

from span_workflows.apps.cli import main as cli
from span_workflows.errors import ModelNotAvailableError
from span_workflows.serving import launch as serve_module
from span_workflows.serving.launch import ServerOptions, model_reference


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_gets_eager_fp32_and_block_32_by_default() -> None:
    cmd = ServerOptions().command(device="cpu")
    assert "--enforce-eager" in cmd and _flag(cmd, "--dtype") == "float32"
    assert _flag(cmd, "--block-size") == "32"


def test_gpu_gets_only_what_is_asked() -> None:
    cmd = ServerOptions().command(device="cuda")
    assert "--enforce-eager" not in cmd and "--dtype" not in cmd and "--block-size" not in cmd
    assert "--enable-prefix-caching" in cmd
    cmd = ServerOptions(block_size=16, extra_args=(
        "--tensor-parallel-size", "2", "--dtype", "bfloat16")).command(device="cuda")
    assert cmd[-4:] == ["--tensor-parallel-size", "2", "--dtype", "bfloat16"]
    assert _flag(cmd, "--block-size") == "16"


def test_extra_args_come_last_so_they_win_over_cpu_defaults() -> None:
    cmd = ServerOptions(extra_args=("--dtype", "bfloat16")).command(device="cpu")
    assert cmd[-2:] == ["--dtype", "bfloat16"]


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "9000", "--", "--tensor-parallel-size", "2", "--max-num-seqs", "8"],
    ["serve", "--port", "9000", "--tensor-parallel-size", "2", "--max-num-seqs", "8"],
])
def test_cli_passes_unknown_options_to_vllm(argv, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(serve_module, "serve",
                        lambda options, **kw: seen.update(kw, options=options))
    assert cli.main(argv) == 0
    assert seen["port"] == 9000 and seen["options"].block_size is None
    assert seen["options"].extra_args == ("--tensor-parallel-size", "2", "--max-num-seqs", "8")


def test_other_commands_still_reject_unknown_options(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["compile", "q.json", "--tensor-parallel-size", "2"])
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_hub_ids_are_for_vllm_to_fetch_unless_offline(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError):
        model_reference("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ModelNotAvailableError):
        model_reference(str(tmp_path / "missing-dir"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert model_reference("meta-llama/Llama-3.1-8B-Instruct") == (
        "meta-llama/Llama-3.1-8B-Instruct", False)
    cmd = ServerOptions("meta-llama/Llama-3.1-8B-Instruct").command(device="cuda")
    assert _flag(cmd, "--model") == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_hub_model_is_not_forced_offline(monkeypatch, tokenizer) -> None:
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: tokenizer)
    env = ServerOptions("org/model").env(base={})
    assert env["HF_HUB_OFFLINE"] == "0" and env["SPAN_VLLM"] == "1"
    assert ServerOptions().env(base={})["HF_HUB_OFFLINE"] == "1"  # the bundled, local model


def test_a_span_store_is_vllms_kv_transfer_config_with_the_plugins_connector(tmp_path) -> None:
    import json

    from vllm.config import KVTransferConfig

    options = ServerOptions(span_store=tmp_path / "store", span_store_gib=2.5)
    cmd = options.command(device="cpu")
    config = KVTransferConfig(**json.loads(_flag(cmd, "--kv-transfer-config")))
    assert config.kv_connector == "SpanStoreConnector"
    assert config.kv_connector_module_path == "span_vllm.store_connector"
    assert config.kv_role == "kv_both" and config.kv_load_failure_policy == "fail"
    assert config.kv_connector_extra_config == {"path": str(tmp_path / "store"), "write": True,
                                                "max_gib": 2.5}
    assert "--kv-transfer-config" not in ServerOptions().command(device="cpu")


def test_cli_serve_passes_the_span_store_and_checks_its_cap(monkeypatch, tmp_path,
                                                            capsys) -> None:
    seen = {}
    monkeypatch.setattr(serve_module, "serve",
                        lambda options, **kw: seen.update(kw, options=options))
    assert cli.main(["serve", "--span-store", str(tmp_path), "--span-store-gib", "4"]) == 0
    assert seen["options"].span_store == tmp_path and seen["options"].span_store_gib == 4.0
    assert cli.main(["serve", "--span-store-gib", "4"]) == 2
    assert "--span-store-gib: needs --span-store" in capsys.readouterr().err
    assert cli.main(["serve", "--span-store", str(tmp_path), "--span-store-gib", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err


def test_one_set_of_server_options_is_checked_once(monkeypatch, capsys) -> None:
    """The options of ``serve``, its replicas and ``start_server_process`` are one
    :class:`ServerOptions`: checked when made, whichever starts the server."""
    for bad, message in (({"kv_cache_gib": 0}, "kv_cache_gib must be > 0"),
                         ({"block_size": 0}, "block_size must be at least 1"),
                         ({"span_store_gib": 1.0}, "span_store_gib needs span_store")):
        with pytest.raises(ValueError, match=message):
            ServerOptions(**bad)
    monkeypatch.setattr(serve_module, "serve", lambda *a, **k: pytest.fail("started"))
    assert cli.main(["serve", "--kv-cache-gib", "0"]) == 2
    assert "kv_cache_gib must be > 0" in capsys.readouterr().err
    assert ServerOptions.coerce({"kv_cache_gib": 3}) == ServerOptions(kv_cache_gib=3)
    assert ServerOptions.coerce(None) == ServerOptions()


def test_the_api_key_travels_in_the_environment_not_the_command_line() -> None:
    options = ServerOptions(api_key="s3cret")
    assert "s3cret" not in " ".join(options.command(device="cpu"))
    assert options.env(base={})["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in repr(options)
