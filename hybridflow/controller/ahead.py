"""Generation ahead of training (``trainer.async.mode: one_step_off | streaming``), still under
the single controller.

``one_step_off`` keeps one generation ahead, ``streaming`` keeps K (``max_staleness``)::

    iteration k:  take gen k (submitted K iterations ago)
                  submit gen k+K on the next prompts  ----.  queued on the rollout's workers
                  old_log_prob k, ref k, reward k,        |  before update k's weights reach
                  advantage k -> update k (-> v k)        |  them: samples from v k-1
    iteration k+K: take gen k+K  <------------------------'  trained at v k+K-1: staleness K

The rollout's workers run their calls in submission order, so generation k+K samples from the
weights before update k whatever the pools; on a pool of its own (``rollout.pool``) it also runs
*during* the updates. Samples carry their version (``weight_version``); pair the modes with an
update's ``rollout_correction``, which weighs by pi_old (recomputed at the trainer's weights)
over the rollout's log-probs.

By default generation is whole batches: new weights load between two generate calls, never
during one, so every sample comes from one weight version. With ``trainer.async.partial_rollout``
a standalone vLLM rollout takes them between two decoding steps of the generation in flight
(``ModelWorker.receive_weights`` on the actors' side thread, ``VLLMRolloutEngine.generate_partial``):
its samples then end on newer weights than they started with (``weight_version_last``), and a
generation queued behind starts on them, so staleness is at most K and often less.

Checkpoints: ``AheadGeneration`` stands in for the dataset among the checkpoint's components
and saves the buffered generations with the dataset's position after their prompts: their
prompts, each generation node's per-rank output and metas (waiting for them to finish; the
controller fetches rollout tensors here and nowhere else). A resumed or recovered run trains
exactly those samples next, sampled from the weights before the checkpoint as in the run that
was not stopped, and the workers' restored RNG streams are where the buffered generations left
them: no prompt is skipped or trained twice, and a transformers rollout's run continues as the
uninterrupted one would, metric for metric. (A checkpoint without them, written by an older
hybridflow, holds the position before the oldest buffered prompts: those are drawn and
generated again.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import ray

from hybridflow.controller.executor import launch, relaunch
from hybridflow.data.datasets import PromptDataset
from hybridflow.graph.dag import Graph, generation_nodes
from hybridflow.workers.sharded import ShardedRef
from hybridflow.workers.wire import from_wire


class AheadGeneration:
    """The prompts and submitted generations of the next ``depth`` iterations at most."""

    def __init__(
        self, graph: Graph, dataset: PromptDataset, put: Callable[[object], ShardedRef], depth: int = 1,
        record: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        """``record``: an iteration's nodes to record -> their directories (``run_nodes``)."""
        self.graph = graph
        self.record = record
        self.dataset = dataset
        self.put = put
        self.depth = depth
        self.nodes = generation_nodes(graph)
        # (prompts, launched nodes) of the next iterations, oldest first
        self._buffered: deque[tuple[ShardedRef, dict]] = deque()

    def _launch(self, groups: dict, iteration: int | None) -> tuple[ShardedRef, dict]:
        prompts = self.put(self.dataset.next_batch())
        record = self.record(iteration) if self.record is not None and iteration is not None else {}
        return prompts, launch(self.graph, self.nodes, groups, prompts, **({"record": record} if record else {}))

    def take(self, groups: dict, remaining: int, iteration: int | None = None) -> tuple[ShardedRef, dict]:
        """This iteration's prompts and launched generation nodes (launched now if none is
        buffered: the first iteration, or after a restore); then the generations of the next
        iterations are submitted, up to ``depth`` of them and no more than the ``remaining``
        iterations after this one, ahead of anything this iteration submits later.
        ``iteration``: this iteration's number, for ``record``."""
        prompts, launched = self._buffered.popleft() if self._buffered else self._launch(groups, iteration)
        while len(self._buffered) < min(self.depth, remaining):
            ahead = None if iteration is None else iteration + len(self._buffered) + 1
            self._buffered.append(self._launch(groups, ahead))
        return prompts, launched

    @property
    def queued(self) -> int:
        """Generations submitted for later iterations."""
        return len(self._buffered)

    def state_dict(self) -> dict:
        """The dataset's position and the buffered generations, finished (waited for)."""
        buffered = []
        for prompts, launched in self._buffered:
            nodes = {}
            for name, pending in launched.items():
                data, metas = pending.handle.result()
                nodes[name] = {
                    "data": [from_wire(shard) for shard in ray.get(list(data.refs))],
                    "metas": metas,
                    "all_metas": ray.get(list(pending.handle.all_meta_refs)) or metas,
                    "group_size": pending.group_size,
                }
            buffered.append({"prompts": prompts.fetch(), "nodes": nodes})
        return {"dataset": self.dataset.state_dict(), "buffered": buffered}

    def load_state_dict(self, state: dict) -> None:
        """Back to ``state``: the buffered generations in it replace those held (of workers that
        may be gone); they are put into the object store again."""
        self._buffered.clear()
        if "buffered" not in state:  # an older checkpoint: the position before the buffered prompts
            self.dataset.load_state_dict(state)
            return
        self.dataset.load_state_dict(state["dataset"])
        for saved in state["buffered"]:
            launched = {name: relaunch(node["data"], node["metas"], node["all_metas"], node["group_size"])
                        for name, node in saved["nodes"].items()}
            self._buffered.append((self.put(saved["prompts"]), launched))
