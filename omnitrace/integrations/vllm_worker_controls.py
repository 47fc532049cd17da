"""omnitrace's run-time switches as methods of vLLM's workers, so ``collective_rpc`` reaches
them by name (``vllm serve --worker-extension-cls``; docs/vllm.md, "Switching graphs off and
on in a running server")."""

from __future__ import annotations

from omnitrace._validate import check_flag
from omnitrace.integrations.vllm_plugin import (
    graphs_paused,
    items_split,
    pause_graphs,
    split_items,
    time_requests,
)

#: The value of ``--worker-extension-cls`` that adds these methods to vLLM's workers.
QUALNAME = "omnitrace.integrations.vllm_worker_controls.WorkerControls"


class WorkerControls:
    """Methods vLLM mixes into each worker when started with
    ``--worker-extension-cls omnitrace.integrations.vllm_worker_controls.WorkerControls``;
    with ``VLLM_SERVER_DEV_MODE=1`` its ``POST /collective_rpc`` calls them by name, e.g.
    ``{"method": "omnitrace_pause_graphs", "args": [true]}``."""

    def omnitrace_pause_graphs(self, paused: object = True) -> int:
        """Pause (``true``) or resume (``false``) the graphs of every adapter in this worker;
        return how many adapters that was. Paused calls run eagerly as ``ineligible`` misses,
        detail ``paused``; graphs, history and pools are kept.

        Raises:
            ConfigError: ``paused`` is neither true nor false.
        """
        return pause_graphs(self, check_flag("paused", paused))

    def omnitrace_graphs_paused(self) -> dict[str, bool]:
        """Whether each adapter attached in this worker has its graphs paused, by name."""
        return graphs_paused(self)

    def omnitrace_split_items(self, split: object = True) -> int:
        """Serve a call's images or clips one call each (``true``) or as one batch
        (``false``) in every adapter of this worker, as ``encoder_cuda_graph_split_items``
        does at start-up; return how many adapters that was.

        Raises:
            ConfigError: ``split`` is neither true nor false.
        """
        return split_items(self, check_flag("split", split))

    def omnitrace_items_split(self) -> dict[str, bool]:
        """Whether each adapter attached in this worker splits a call's items, by name."""
        return items_split(self)

    def omnitrace_time_requests(self, enabled: object = True) -> bool:
        """Switch this worker's per-request timing (its encoder-step hooks) on or off; return
        whether it was on. The API server's hooks are switched by ``OMNITRACE_REQUESTS`` at
        start-up only.

        Raises:
            ConfigError: ``enabled`` is neither true nor false.
        """
        return time_requests(self, check_flag("enabled", enabled))
