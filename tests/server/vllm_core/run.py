"""vLLM's own core tests with the span plugin active and inactive: ``make test-vllm``.

Runs ``tests/v1/core/{test_prefix_caching,test_kv_cache_utils,test_scheduler}.py`` from the
``vllm==0.32.0`` source package twice — plugin inactive, then active (``span_vllm.register()``
with :data:`PLUGIN_ENV`) — and compares every test:

* **same** — same outcome (and same error type when both fail): the plugin changed nothing
  for that model kind;
* **refused at start** — the active run failed because span mode refused the configuration
  (``UnsupportedModelError``) while the engine was being built (scheduler / KV cache manager
  construction), never while a request was scheduled;
* anything else **differs**, and the run fails.

Offline: the source package is fetched once with pip (the only network use) into
``$SPAN_WORKFLOWS_CACHE/vllm-core-tests`` (default ``~/.cache/span-workflows``); vLLM's
scheduler tests name ``facebook/opt-125m`` only for its ``config.json``, which is written into
a private Hugging Face cache there, so no hub is contacted at test time. Tests that need other
hub models (the multimodal ones, on ``llava-hf/llava-1.5-7b-hf``) fail alike in both runs and
count as "same"; :data:`DESELECTED` tests are timing-dependent and left out.

Usage: ``python tests/server/vllm_core/run.py [--report PATH] [-k EXPR]``; exit 0 when nothing
differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
TEST_FILES = ("tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_kv_cache_utils.py",
              "tests/v1/core/test_scheduler.py")

#: Left out: spawns a Python subprocess with a 30 s timeout — on a loaded 2-core machine it may
#: time out in one run and not the other; it does not touch anything the plugin patches.
DESELECTED = ("tests/v1/core/test_kv_cache_utils.py::test_is_kv_cache_spec_uniform",)

#: The environment that turns span mode on — the one place to change when the plugin's
#: settings change.
PLUGIN_ENV = {
    "SPAN_VLLM": "1",
    "SPAN_VLLM_LAYOUT_KEY": "vllm-core-suite",
}
#: Environment variables of the plugin removed from the inactive run.
PLUGIN_PREFIX = "SPAN_VLLM"

#: Test-only dependencies of vLLM's test tree that the project's venv lacks.
TEST_DEPS = ("tblib",)
#: What pip needs to read the vLLM source package's metadata (torch comes from the venv).
BUILD_DEPS = ("setuptools>=77,<81", "setuptools-scm", "setuptools-rust")

#: The public architecture config of facebook/opt-125m (the scheduler tests read nothing else).
OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0,
    "activation_function": "relu", "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
    "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
    "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
}
OPT_REVISION = "0" * 40

HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    base = os.environ.get("SPAN_WORKFLOWS_CACHE") or Path.home() / ".cache" / "span-workflows"
    return Path(base) / "vllm-core-tests"


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    """Run pip quietly; show its output only if it fails."""
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"pip {' '.join(args[:2])} failed ({done.returncode})")


def ensure_sources(root: Path) -> Path:
    """vLLM's test tree (``tests/`` + ``pyproject.toml``, not its ``vllm/`` package, so the
    installed vLLM is what runs) under ``root``; fetched once."""
    tree = root / f"vllm-{VLLM_VERSION}"
    if (tree / TEST_FILES[0]).is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        build = Path(tmp) / "build-deps"
        _pip("install", "--target", str(build), *BUILD_DEPS)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(build), os.environ.get("PYTHONPATH", "")]),
            VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=VLLM_VERSION)
        _pip("download", f"vllm=={VLLM_VERSION}", "--no-binary", ":all:", "--no-deps",
             "--no-build-isolation", "-d", tmp, env=env)
        archive = Path(tmp) / f"vllm-{VLLM_VERSION}.tar.gz"
        prefix = f"vllm-{VLLM_VERSION}/"
        staging = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix + "tests/")
                       or m.name == prefix + "pyproject.toml"]
            tar.extractall(staging, members=members, filter="data")
        shutil.rmtree(tree, ignore_errors=True)
        (staging / f"vllm-{VLLM_VERSION}").rename(tree)
    return tree


def ensure_test_deps(root: Path) -> Path:
    deps = root / "deps"
    if not all((deps / name).exists() for name in TEST_DEPS):
        _pip("install", "--target", str(deps), *TEST_DEPS)
    return deps


def ensure_hf_home(root: Path) -> Path:
    """A Hugging Face cache holding only facebook/opt-125m's config.json."""
    home = root / "hf-home"
    repo = home / "hub" / "models--facebook--opt-125m"
    config = repo / "snapshots" / OPT_REVISION / "config.json"
    if not config.is_file():
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(OPT_125M_CONFIG, indent=2))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(OPT_REVISION)
    return home


def run_suite(tree: Path, deps: Path, hf_home: Path, record: Path, active: bool,
              keyword: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PLUGIN_PREFIX)}
    if active:
        env.update(PLUGIN_ENV)
    env.update(
        HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        SPAN_CORE_RECORD=str(record), VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(deps), str(HERE), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "recorder",
           "-W", "ignore", "--tb=no", "--no-header", "-o", "addopts=", *TEST_FILES]
    for test in DESELECTED:
        cmd += ["--deselect", test]
    if keyword:
        cmd += ["-k", keyword]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def compare(inactive: dict[str, Any], active: dict[str, Any]) -> dict[str, Any]:
    """Classify every test (see the module doc)."""
    same, refused, differ = [], [], []
    reasons: Counter[str] = Counter()
    for test in sorted(set(inactive) | set(active)):
        off, on = inactive.get(test), active.get(test)
        if off is None or on is None:
            differ.append({"test": test, "inactive": off, "active": on})
            continue
        if (off["outcome"], off.get("error")) == (on["outcome"], on.get("error")):
            same.append(test)
            continue
        refusal = on.get("refusal")
        if on["outcome"] == "failed" and refusal and refusal["at_start"]:
            refused.append(test)
            for problem in refusal["problems"]:
                reasons[problem.split(":")[0][:90]] += 1
            continue
        differ.append({"test": test, "inactive": off, "active": on})
    passed_both = sum(1 for t in same if inactive[t]["outcome"] == "passed")
    return {"same": len(same), "same_passed": passed_both, "refused_at_start": len(refused),
            "differ": differ, "refusal_reasons": dict(reasons.most_common()),
            "refused_tests": refused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="write the comparison as JSON here")
    parser.add_argument("-k", dest="keyword", help="only tests matching (pytest -k)")
    parser.add_argument("--min-passed", type=int, default=250,
                        help="fail if fewer tests pass in both runs (a broken harness)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    root = cache_root()
    tree, deps, hf_home = ensure_sources(root), ensure_test_deps(root), ensure_hf_home(root)
    with tempfile.TemporaryDirectory() as tmp:
        records = {mode: Path(tmp) / f"{mode}.json" for mode in ("inactive", "active")}
        procs = {mode: run_suite(tree, deps, hf_home, records[mode], mode == "active",
                                 args.keyword) for mode in records}
        for proc in procs.values():
            proc.wait()
        missing = [mode for mode, path in records.items() if not path.is_file()]
        if missing:
            print(f"vllm core tests: no results from the {', '.join(missing)} run(s)")
            return 1
        inactive, active = (json.loads(records[m].read_text()) for m in records)
    result = compare(inactive, active)
    result["failed_in_both"] = Counter(
        f"{r.get('error')}: {r.get('message', '')[:100]}" for t, r in inactive.items()
        if r["outcome"] == "failed" and active.get(t, {}).get("outcome") == "failed"
    ).most_common()
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.report:
        args.report.write_text(json.dumps(result, indent=1))
    for entry in result["differ"][:20]:
        print(f"DIFFERS {entry['test']}\n  inactive: {entry['inactive']}\n"
              f"  active:   {entry['active']}")
    for reason, count in result["refusal_reasons"].items():
        print(f"refused at start ({count}): {reason}")
    print(f"vllm core tests ({VLLM_VERSION}, plugin inactive vs active): "
          f"{result['same']} same ({result['same_passed']} passed in both), "
          f"{result['refused_at_start']} refused at start, {len(result['differ'])} differ "
          f"[{result['seconds']} s]")
    too_few = args.keyword is None and result["same_passed"] < args.min_passed
    if too_few:
        print(f"only {result['same_passed']} tests passed in both runs (< {args.min_passed})")
    return 1 if result["differ"] or too_few else 0


if __name__ == "__main__":
    raise SystemExit(main())
