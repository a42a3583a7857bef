"""The runtime layer: compiled queries run on vLLM in this process.

:mod:`~span_workflows.runtime.engine` (``Engine``), the plan of engine steps
(:mod:`~span_workflows.runtime.plan`), what crosses into vLLM
(:mod:`~span_workflows.runtime.vllm_io`), results and streams
(:mod:`~span_workflows.runtime.result`, :mod:`~span_workflows.runtime.streaming`), bulk runs
(:mod:`~span_workflows.runtime.bulk`), per-request weights
(:mod:`~span_workflows.runtime.routing`), the backend interface
(:mod:`~span_workflows.runtime.backend`), block-sized chunking, vector search and filling a
span store (:mod:`~span_workflows.runtime.store_index`). Serving, scale-out and tuning stand
above it.
"""
