"""Scaling out: span-affinity routing over several span-engine replicas.

* :mod:`~span_workflows.scaleout.affinity` — the routing policy (plain Python);
* :mod:`~span_workflows.compiler.keys` — a query's span keys, from the compiler's token form;
* :mod:`~span_workflows.scaleout.simulate` — a trace-driven simulator of the routers;
* :mod:`~span_workflows.scaleout.ray_router` and :mod:`~span_workflows.scaleout.deployment` —
  the Ray Serve request router, replicas and ingress (need ``ray[serve]``).

Importing this package loads neither Ray nor vLLM.
"""

from span_workflows.scaleout.affinity import (
    AffinityOptions,
    ReplicaSpanCache,
    SpanAffinityPolicy,
    SpanKey,
)

__all__ = ["AffinityOptions", "ReplicaSpanCache", "SpanAffinityPolicy", "SpanKey"]
