"""What every placement of span engines on Ray shares: the per-replica resources an option set
may ask for, and the environment the replicas need from the driver. Loads neither Ray nor vLLM."""

from __future__ import annotations

import os

#: The driver's environment variables a replica needs (model location, offline mode, imports,
#: log levels).
FORWARDED_ENV_NAMES = ("HF_HUB_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "PYTHONPATH",
                       "SPAN_WORKFLOWS_CACHE", "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY")


def forwarded_env() -> dict[str, str]:
    """Those of :data:`FORWARDED_ENV_NAMES` that are set here, for Ray's ``runtime_env``."""
    return {n: os.environ[n] for n in FORWARDED_ENV_NAMES if n in os.environ}


def check_replicas(replicas: int, num_cpus: float, num_gpus: float) -> None:
    """Raise :class:`ValueError` unless there is at least one replica and its Ray resources
    are not negative."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas}")
    if num_cpus < 0 or num_gpus < 0:
        raise ValueError("num_cpus and num_gpus must be >= 0")


__all__ = ["FORWARDED_ENV_NAMES", "check_replicas", "forwarded_env"]
