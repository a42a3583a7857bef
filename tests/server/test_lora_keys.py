"""Blocks computed under a LoRA adapter are keyed by the adapter's content: never shared
with the base, another adapter, or new weights loaded under the same name, id and path."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from vllm.lora.request import LoRARequest
from vllm.v1.core import kv_cache_utils

from span_vllm import contract
from span_vllm.hashing import hash_blocks, note_adapter, request_extra_keys, weights_key

BLOCK = 4
TOKENS = list(range(100, 112))


def _adapter(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def _request(lora: LoRARequest | None, salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(lora_request=lora, cache_salt=salt, mm_features=[],
                           prompt_embeds=None)


def _hashes(request: SimpleNamespace) -> list[bytes]:
    def sha(obj: object) -> bytes:
        import hashlib
        import pickle

        return hashlib.sha256(pickle.dumps(obj)).digest()

    if not hasattr(kv_cache_utils, "NONE_HASH"):
        kv_cache_utils.init_none_hash(sha)
    return hash_blocks(TOKENS, BLOCK, sha, [[0, contract.ISOLATED], [4, contract.ISOLATED]],
                       salt=request.cache_salt,
                       extra_keys=lambda begin, end: request_extra_keys(request, begin, end))


def test_the_lora_key_names_the_content_not_the_name_or_path(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", b"weights-a")
    b = _adapter(tmp_path / "b", b"weights-b")
    same_as_a = _adapter(tmp_path / "copy", b"weights-a")
    keys = {name: request_extra_keys(_request(LoRARequest(name, i, str(p))), 0, BLOCK)
            for name, i, p in (("x", 1, a), ("x2", 2, b), ("x3", 3, same_as_a))}
    assert keys["x"] == (("lora", contract.adapter_digest(a)),)
    assert keys["x"] == keys["x3"] != keys["x2"]  # same bytes, same key; whatever the name
    assert request_extra_keys(_request(None), 0, BLOCK) is None


def test_base_and_adapter_share_no_block_and_the_salt_still_counts(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", b"weights-a")
    lora = LoRARequest("span", 7, str(a))
    base, tuned = _hashes(_request(None)), _hashes(_request(lora))
    assert len(base) == len(tuned) == 3
    assert not set(base) & set(tuned)
    salted = _hashes(_request(lora, salt="tenant"))
    assert not set(salted) & set(tuned)
    keys = request_extra_keys(_request(lora, salt="tenant"), 0, BLOCK)
    assert keys == (weights_key(7, str(a)), ("cache_salt", "tenant"))


def test_weights_reloaded_in_place_get_a_new_key(tmp_path: Path) -> None:
    """vLLM keys blocks by (name, path) and can reload an adapter in place under the same
    id: the old weights' blocks must not serve the new weights."""
    a = _adapter(tmp_path / "retrained", b"before")
    lora = LoRARequest("span", 11, str(a))
    note_adapter(11, str(a))
    before = _hashes(_request(lora))
    _adapter(tmp_path / "retrained", b"after")
    assert _hashes(_request(lora)) == before  # still the weights loaded: same key
    note_adapter(11, str(a))  # the engine core loads the new weights
    after = _hashes(_request(lora))
    assert not set(before) & set(after)
