"""Worker groups and transfer protocols: pure split planning, then real Ray actors and gloo."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from hybridflow.spec.pool import PoolSpec
from hybridflow.workers.protocols import (
    DISPATCH_ATTR,
    NUM_SAMPLES,
    Dispatch,
    Protocol,
    ShardedRef,
    dispatch_table,
    plan_split,
    register,
    register_protocol,
    resolve,
)

# -- plan_split (pure: strings stand in for object refs) ------------------------------------------


def _global_rows(sharded: ShardedRef, pieces) -> list[int]:
    """The global row indices a rank's pieces of one input cover."""
    offsets = {}
    offset = 0
    for ref, size in zip(sharded.refs, sharded.sizes):
        offsets[ref] = offset
        offset += size
    return [offsets[ref] + i for ref, start, stop in pieces for i in range(start, stop)]


def test_plan_split_two_ranks_crosses_shard_boundaries():
    sharded = ShardedRef(refs=["a", "b", "c"], sizes=[1, 3, 2])
    plan = plan_split([sharded], num_ranks=2, group_size=1)
    assert plan == [
        [[("a", 0, 1), ("b", 0, 2)]],
        [[("b", 2, 3), ("c", 0, 2)]],
    ]


def test_plan_split_three_ranks_keeps_groups_whole():
    sharded = ShardedRef(refs=["a", "b", "c"], sizes=[4, 5, 3])
    plan = plan_split([sharded], num_ranks=3, group_size=2)
    assert plan == [
        [[("a", 0, 4)]],
        [[("b", 0, 4)]],
        [[("b", 4, 5), ("c", 0, 3)]],
    ]
    # Producer shards of odd sizes split a group of 2 between shards; the rank still gets it all.
    for rank, pieces_per_input in enumerate(plan):
        rows = _global_rows(sharded, pieces_per_input[0])
        assert rows == list(range(4 * rank, 4 * rank + 4))


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_plan_split_several_inputs_cover_the_same_rows(num_ranks):
    group_size = 2
    first = ShardedRef(refs=["a0", "a1", "a2", "a3"], sizes=[5, 0, 3, 4])  # empty shard skipped
    second = ShardedRef(refs=["b0", "b1"], sizes=[7, 5])
    plan = plan_split([first, second], num_ranks=num_ranks, group_size=group_size)
    chunk = 12 // num_ranks
    assert len(plan) == num_ranks
    for rank, (pieces_a, pieces_b) in enumerate(plan):
        expected = list(range(rank * chunk, (rank + 1) * chunk))
        assert _global_rows(first, pieces_a) == expected
        assert _global_rows(second, pieces_b) == expected
        assert all(ref != "a1" for ref, _, _ in pieces_a)
        assert expected[0] % group_size == 0 and len(expected) % group_size == 0


def test_plan_split_rejects_groups_not_divisible_by_ranks():
    sharded = ShardedRef(refs=["a", "b"], sizes=[6, 4])  # 5 groups of 2
    with pytest.raises(ValueError, match="5 groups of 2 samples .* across 2 ranks"):
        plan_split([sharded], num_ranks=2, group_size=2)


def test_plan_split_rejects_partial_groups():
    with pytest.raises(ValueError, match="not a whole number of groups of 2"):
        plan_split([ShardedRef(refs=["a"], sizes=[7])], num_ranks=1, group_size=2)


def test_plan_split_rejects_mismatched_totals():
    with pytest.raises(ValueError, match=r"same number of samples, got \[6, 8\]"):
        plan_split(
            [ShardedRef(refs=["a"], sizes=[6]), ShardedRef(refs=["b"], sizes=[8])],
            num_ranks=2,
            group_size=1,
        )


# -- resolve (pure: a dict stands in for the object store) ----------------------------------------


def _batch(values: list[int], texts: list[str]) -> TensorDict:
    return TensorDict(
        {"x": torch.tensor(values, dtype=torch.float32), "text": texts},
        batch_size=[len(values)],
    )


def test_resolve_slices_concatenates_and_merges_with_strings():
    store = {
        "a": _batch([0, 1], ["p0", "p1"]),
        "b": _batch([2, 3, 4], ["p2", "p3", "p4"]),
        "c": TensorDict(
            {"y": torch.arange(10, 15), "x": torch.full((5,), -1.0)}, batch_size=[5]
        ),
    }
    fetched = []

    def fetch(refs):
        fetched.append(list(refs))
        return [store[ref] for ref in refs]

    pieces_per_input = [[("a", 1, 2), ("b", 0, 3)], [("c", 1, 5)]]
    batch = resolve(pieces_per_input, fetch=fetch)
    assert fetched == [["a", "b", "c"]]  # each shard once, in one fetch
    assert batch.batch_size == torch.Size([4])
    assert batch["x"].tolist() == [1.0, 2.0, 3.0, 4.0]  # "x" of the first input wins
    assert batch["y"].tolist() == [11, 12, 13, 14]
    assert batch.get("text").tolist() == ["p1", "p2", "p3", "p4"]


def test_resolve_rejects_mismatched_batch_sizes():
    store = {"a": _batch([0, 1], ["p0", "p1"]), "b": _batch([2], ["p2"])}
    with pytest.raises(ValueError, match="batch size"):
        resolve([[("a", 0, 2)], [("b", 0, 1)]], fetch=lambda refs: [store[r] for r in refs])


# -- declaring methods ----------------------------------------------------------------------------

register_protocol(
    "test_first_rank_only",
    Protocol(split=lambda n, args, kwargs: [(args, kwargs)] * n, collect=lambda refs: refs[0]),
)


def test_dispatch_table_walks_the_mro_without_scanning():
    class Base:
        @register(Dispatch.DP_SPLIT)
        def forward(self, batch):
            return batch, {}

        @register(Dispatch.ONE_TO_ALL)
        def load(self, path):
            return path

        def helper(self):
            return None

    class Child(Base):
        @register("test_first_rank_only")
        def load(self, path):
            return path

        @register("one_to_all")  # a name works as well as the enum
        def save(self, path):
            return path

    assert dispatch_table(Base) == {"forward": Dispatch.DP_SPLIT, "load": Dispatch.ONE_TO_ALL}
    assert dispatch_table(Child) == {
        "forward": Dispatch.DP_SPLIT,
        "load": "test_first_rank_only",
        "save": Dispatch.ONE_TO_ALL,
    }
    # The class holds plain functions carrying their dispatch; the table is per class.
    assert getattr(Child.__dict__["save"], DISPATCH_ATTR) is Dispatch.ONE_TO_ALL
    assert Child().save("p") == "p"
    assert "forward" not in dispatch_table(type("Plain", (), {}))


def test_register_rejects_unknown_protocols_at_definition():
    with pytest.raises(KeyError, match="unknown transfer protocol 'no_such'"):
        register("no_such")
    with pytest.raises(ValueError, match="already registered"):
        register_protocol("dp_split", Protocol(split=lambda *a: [], collect=list))


# -- real Ray: pools, groups, gloo ----------------------------------------------------------------

# Imported here so the pure tests above also document that they need no Ray objects.
import sys  # noqa: E402

import ray  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray import cloudpickle  # noqa: E402

from hybridflow.placement.pools import PoolUnavailableError, ResourcePool  # noqa: E402
from hybridflow.workers.base import Worker  # noqa: E402
from hybridflow.workers.group import WorkerGroup  # noqa: E402


# Ray workers cannot import this test module: ship ToyWorker by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ToyWorker(Worker):
    def __init__(self, rank, world_size, master_addr, master_port, threads, *, offset=0.0):
        super().__init__(rank, world_size, master_addr, master_port, threads)
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def info(self, tag: str) -> dict:
        import os

        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "dist_world_size": dist.get_world_size(),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "tag": tag,
        }

    @register(Dispatch.DP_SPLIT)
    def expand(self, batch: TensorDict, n: int) -> tuple[TensorDict, dict]:
        """Like generate: n samples per prompt, next to each other."""
        index = torch.arange(batch.batch_size[0]).repeat_interleave(n)
        return batch[index], {"rank": self.rank}

    @register(Dispatch.DP_SPLIT)
    def double(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        x2 = batch["x"] * 2 + self.offset
        total = x2.sum()
        dist.all_reduce(total)  # real gloo across the group's ranks
        out = TensorDict({"x2": x2}, batch_size=batch.batch_size)
        return out, {"rank": self.rank, "global_sum": total.item()}

    @register(Dispatch.DP_SPLIT)
    def combine(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        uids = batch["uid"].view(-1, 2)  # 2 samples per prompt
        groups_whole = bool((uids == uids[:, :1]).all())
        texts = [f"{text}!" for text in batch.get("prompt_text").tolist()]
        out = TensorDict({"y": batch["x"] + batch["x2"], "text_out": texts}, batch.batch_size)
        return out, {"rank": self.rank, "groups_whole": groups_whole}

    @register(Dispatch.DP_SPLIT)
    def broken(self, batch: TensorDict) -> TensorDict:
        return batch


def _source(sizes: list[int]) -> ShardedRef:
    """Prompts 0..N-1 as shards of the given sizes, with uid, value and text per prompt."""
    refs, start = [], 0
    for size in sizes:
        index = torch.arange(start, start + size)
        shard = TensorDict(
            {
                "uid": index,
                "x": index.float(),
                "prompt_text": [f"p{i}" for i in index.tolist()],
            },
            batch_size=[size],
        )
        refs.append(ray.put(shard))
        start += size
    return ShardedRef(refs=refs, sizes=list(sizes))


@pytest.fixture(scope="module")
def groups(ray_session):
    pool_a = ResourcePool("a", PoolSpec(devices_per_node=2, cpus_per_device=1))
    pool_b = ResourcePool("b", PoolSpec(devices_per_node=3, cpus_per_device=1))
    group_a = WorkerGroup(ToyWorker, pool_a, {"offset": 0.5}, name="toy_a")
    group_b = WorkerGroup(ToyWorker, pool_b, {}, name="toy_b")
    yield group_a, group_b
    for group in (group_a, group_b):
        group.shutdown()
        group.pool.remove()


def test_one_to_all_reaches_every_rank(groups):
    group_a, group_b = groups
    infos = ray.get(group_a.call("info", "hello"))
    assert [info["rank"] for info in infos] == [0, 1]
    for info in infos:
        assert info["world_size"] == info["dist_world_size"] == 2
        assert info["threads"] == 1 and info["omp"] == "1" and info["tag"] == "hello"
    assert [info["rank"] for info in ray.get(group_b.info(tag="x"))] == [0, 1, 2]


def test_dp_split_all_reduce_over_gloo(groups):
    group_a, _ = groups
    pending = group_a.call("double", [_source([1, 3, 2])], group_size=1)
    ready, _ = ray.wait(pending.meta_refs, num_returns=2, timeout=30)
    assert len(ready) == 2
    sharded, metas = pending.result()
    assert sharded.sizes == [3, 3] and [meta[NUM_SAMPLES] for meta in metas] == [3, 3]
    expected_sum = sum(2 * i + 0.5 for i in range(6))
    assert [meta["global_sum"] for meta in metas] == [expected_sum, expected_sum]
    assert sharded.fetch()["x2"].tolist() == [2 * i + 0.5 for i in range(6)]


def test_chain_across_groups_moves_refs_not_tensors(groups, monkeypatch):
    group_a, group_b = groups
    source = _source([1, 3, 2])
    fetched = []
    real_get = ray.get

    def spy_get(refs, *args, **kwargs):
        values = real_get(refs, *args, **kwargs)
        fetched.extend(values if isinstance(values, list) else [values])
        return values

    monkeypatch.setattr(ray, "get", spy_get)
    # Stage 1 on 2 ranks: 6 prompts -> 12 samples, 2 per prompt.
    expanded, metas_1 = group_a.expand([source], group_size=1, n=2).result()
    # Stage 2 on 2 ranks reads stage 1's shards.
    doubled, _ = group_a.double([expanded], group_size=2).result()
    # Stage 3 on 3 ranks re-splits both producers' shards and merges their fields.
    combined, metas_3 = group_b.combine([expanded, doubled], group_size=2).result()
    monkeypatch.undo()

    assert fetched and all(isinstance(value, dict) for value in fetched), "controller got data"
    assert all(isinstance(ref, ray.ObjectRef) for ref in combined.refs)
    assert expanded.sizes == [6, 6] and [m[NUM_SAMPLES] for m in metas_1] == [6, 6]
    assert combined.sizes == [4, 4, 4] and [m["rank"] for m in metas_3] == [0, 1, 2]
    assert all(meta["groups_whole"] for meta in metas_3)

    result = combined.fetch()
    prompt = [i // 2 for i in range(12)]
    assert result["y"].tolist() == [3 * p + 0.5 for p in prompt]  # x + (2x + 0.5)
    assert result.get("text_out").tolist() == [f"p{p}!" for p in prompt]
    assert expanded.fetch().get("prompt_text").tolist() == [f"p{p}" for p in prompt]


def test_bad_calls_fail_clearly(groups):
    group_a, _ = groups
    with pytest.raises(AttributeError, match="not a registered worker method"):
        group_a.call("shutdown")
    with pytest.raises(TypeError, match="needs group_size"):
        group_a.call("double", [_source([2])])
    with pytest.raises(ValueError, match="across 2 ranks"):
        group_a.call("double", [_source([3])], group_size=1)
    pending = group_a.call("broken", [_source([2])], group_size=1)
    with pytest.raises(TypeError, match=r"must return \(TensorDict, dict\)"):
        pending.result(timeout_s=30)


def test_pool_that_cannot_fit_names_the_shortage(ray_session):
    pool = ResourcePool("huge", PoolSpec(devices_per_node=2, cpus_per_device=64))
    with pytest.raises(PoolUnavailableError) as info:
        pool.create(timeout_s=0.5)
    message = str(info.value)
    assert "'huge'" in message and "128 CPUs" in message
    assert f"cluster has {ray.cluster_resources()['CPU']:g} CPUs" in message
    assert not pool.created


class FailingWorker(Worker):
    def __init__(self, rank, world_size, master_addr, master_port, threads):
        if rank == 1:
            raise RuntimeError("rank 1 cannot load its model")
        super().__init__(rank, world_size, master_addr, master_port, threads)


def test_a_rank_failing_init_fails_the_group_at_once(ray_session):
    pool = ResourcePool("failing", PoolSpec(devices_per_node=2, cpus_per_device=1))
    try:
        # Rank 0 sits in the gloo rendezvous waiting for rank 1; the error must not wait for it.
        with pytest.raises(ray.exceptions.RayActorError, match="rank 1 cannot load its model"):
            WorkerGroup(FailingWorker, pool, {}, name="failing", ready_timeout_s=60)
    finally:
        pool.remove()
