"""When the plugin is active in this process, and the layout key it honours.

``SPAN_VLLM=1`` turns span mode on; ``SPAN_VLLM_LAYOUT_KEY`` is the secret that a request's
span layout must carry (see :mod:`span_vllm.contract`). The client library and the server
launcher set both before they start an engine; engine processes inherit them.
"""

from __future__ import annotations

import os

from span_vllm.contract import ENABLE_ENV, KEY_ENV, enabled


def layout_key() -> str:
    """The layout key of this process; raises a clear error if span mode has none."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise RuntimeError(
            f"span mode is on ({ENABLE_ENV}=1) but {KEY_ENV} is not set; start engines through "
            "span_workflows.Engine or `span-workflows serve`"
        )
    return key


__all__ = ["enabled", "layout_key"]
