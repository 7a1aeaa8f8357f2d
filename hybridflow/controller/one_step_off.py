"""One-step off-policy (``trainer.async.mode: one_step_off``): generation runs one iteration
ahead of training, still under the single controller.

    iteration k:  take gen k (submitted during iteration k-1, done by now)
                  submit gen k+1 on the next prompts  ----.  queued on the actor's workers
                  old_log_prob k, ref k, reward k,        |  before update k: samples from
                  advantage k -> update k (sync: v k)     |  the weights v k-1
    iteration k+1: take gen k+1  <------------------------'  trained at v k: staleness 1

The actor's workers run their calls in submission order, so generation k+1 samples from the
weights before update k whatever the pools; on a pool of its own (not yet: the actor's rollout
shares the actor's pool) it would also run *during* update k. Samples carry their version
(``weight_version``); pair the mode with an update's ``rollout_correction``, which weighs by
pi_old (recomputed at the trainer's weights) over the rollout's log-probs.

Checkpoints: the buffered generation is not saved. ``AheadGeneration`` stands in for the
dataset among the checkpoint's components and reports the dataset's position *before* the
buffered batch's prompts were drawn, so a resumed or recovered run draws them again and
regenerates them (from the restored weights): no prompt is skipped or trained twice.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.controller.executor import launch
from hybridflow.data.datasets import PromptDataset
from hybridflow.graph.dag import Graph, generation_nodes
from hybridflow.workers.sharded import ShardedRef


class AheadGeneration:
    """The prompts and submitted generation of the next iteration, one at most."""

    def __init__(self, graph: Graph, dataset: PromptDataset, put: Callable[[object], ShardedRef]) -> None:
        self.graph = graph
        self.dataset = dataset
        self.put = put
        self.nodes = generation_nodes(graph)
        self._buffered: tuple[ShardedRef, dict] | None = None
        self._state_before: dict | None = None  # the dataset's, before the buffered prompts

    def _launch(self, groups: dict) -> tuple[ShardedRef, dict]:
        prompts = self.put(self.dataset.next_batch())
        return prompts, launch(self.graph, self.nodes, groups, prompts)

    def take(self, groups: dict, launch_next: bool) -> tuple[ShardedRef, dict]:
        """This iteration's prompts and launched generation nodes (launched now if none is
        buffered: the first iteration, or after a restore); then, if ``launch_next``, the next
        iteration's generation is submitted, ahead of anything this iteration submits later."""
        current = self._buffered or self._launch(groups)
        self._buffered = None
        if launch_next:
            self._state_before = self.dataset.state_dict()
            self._buffered = self._launch(groups)
        return current

    def state_dict(self) -> dict:
        return self._state_before if self._buffered is not None else self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Back to ``state``; a buffered generation (of workers that may be gone) is dropped."""
        self._buffered = None
        self.dataset.load_state_dict(state)
