"""Worker groups and transfer protocols: pure split planning, then real Ray actors and gloo."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from hybridflow.spec.pool import PoolSpec
from hybridflow.spec.layout import ParallelLayout
from hybridflow.workers.accounting import controller_get, fetched_tensor_bytes
from hybridflow.workers.protocols import (
    DISPATCH_ATTR,
    Dispatch,
    Protocol,
    dispatch_table,
    register,
    register_protocol,
    text_table,
)
from hybridflow.workers.sharded import NUM_SAMPLES, ShardedRef, plan_padded_split, plan_split, resolve
from hybridflow.workers.wire import from_wire, tensor_bytes, to_wire

# -- the wire format ---------------------------------------------------------------------------


def test_wire_batch_round_trip_and_text_left_out():
    import pickle

    from tensordict import NonTensorStack, TensorDict

    batch = TensorDict(
        {"ids": torch.arange(6).reshape(3, 2), "text": NonTensorStack.from_list(["a", "bb", "c"])},
        batch_size=[3],
    )
    stored = pickle.loads(pickle.dumps(to_wire(batch)))
    back = from_wire(stored)
    assert torch.equal(back["ids"], batch["ids"]) and back["text"].tolist() == ["a", "bb", "c"]
    assert back[1:]["text"].tolist() == ["bb", "c"]  # slices like the original
    assert set(from_wire(stored, with_text=False).keys()) == {"ids"}
    assert tensor_bytes(stored) == tensor_bytes(batch) == 6 * 8
    nested = TensorDict({"inner": TensorDict({"x": torch.zeros(3)}, [3])}, [3])
    assert to_wire(nested) is nested and from_wire(nested) is nested


def _odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors of every kind a shard may hold: dtypes, a scalar, an empty one, a transposed view."""
    return {
        "float": torch.randn(4, 3),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "ids": torch.arange(12).reshape(4, 3),
        "mask": torch.tensor([True, False, True, True]),
        "int8": torch.tensor([-3, 0, 7, 127], dtype=torch.int8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(4, 0),
        "transposed": torch.arange(8.0).reshape(2, 4).t(),
        "grad": torch.ones(4, requires_grad=True) * 2,
    }


def _assert_same_tensors(back: dict, sent: dict) -> None:
    assert list(back) == list(sent)  # field order kept
    for key, tensor in sent.items():
        got = back[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor.detach()), key
        assert not got.requires_grad
        if got.dtype == torch.bool:  # writable, and not the sender's memory
            got.logical_not_()
        else:
            got.add_(1)
    assert torch.equal(sent["ids"], torch.arange(12).reshape(4, 3))


def test_wire_batch_sends_tensors_as_raw_bytes_and_keeps_them_exact():
    import pickle

    from hybridflow.workers.wire import WireBatch

    sent = _odd_tensors()
    stored = pickle.loads(pickle.dumps(WireBatch(sent, {"text": ["a", "b", "c", "d"]}, (4,)), protocol=5))
    _assert_same_tensors(stored.tensors, sent)
    assert stored.lists == {"text": ["a", "b", "c", "d"]} and stored.batch_size == (4,)
    # No tensor goes through torch's own pickling (torch.save per storage).
    payload = pickle.dumps(WireBatch(sent, {}, (4,)), protocol=5)
    assert b"_rebuild_tensor" not in payload and b"_load_from_bytes" not in payload


def test_wire_batch_through_the_object_store_comes_back_writable(ray_session):
    import ray

    from hybridflow.workers.wire import WireBatch

    sent = _odd_tensors()
    sent["big"] = torch.randn(512, 64)  # above Ray's inline limit: a buffer in shared memory
    stored = ray.get(ray.put(WireBatch(sent, {}, (4,))))
    _assert_same_tensors(stored.tensors, sent)


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


def test_padded_split_keeps_groups_whole_and_pads_short_ranks():
    sharded = ShardedRef(refs=["a", "b"], sizes=[6, 4])  # 5 groups of 2
    shares = plan_padded_split([sharded], num_ranks=2, group_size=2)
    assert [share.num_valid for share in shares] == [6, 4]
    rows = [_global_rows(sharded, share.pieces[0]) for share in shares]
    assert rows[0] == [0, 1, 2, 3, 4, 5]
    # Rank 1 has groups 3 and 4 and gets a copy of its own first group (rows 6, 7) appended.
    assert rows[1] == [6, 7, 8, 9, 6, 7]


def test_padded_split_more_ranks_than_groups():
    sharded = ShardedRef(refs=["a"], sizes=[3])  # 1 group of 3
    shares = plan_padded_split([sharded, sharded], num_ranks=3, group_size=3)
    assert [share.num_valid for share in shares] == [3, 0, 0]
    for share in shares:
        assert [_global_rows(sharded, pieces) for pieces in share.pieces] == [[0, 1, 2]] * 2


def test_padded_split_even_batch_has_no_padding():
    sharded = ShardedRef(refs=["a", "b"], sizes=[4, 8])
    shares = plan_padded_split([sharded], num_ranks=3, group_size=2)
    assert [share.num_valid for share in shares] == [4, 4, 4]
    assert [share.pieces for share in shares] == plan_split([sharded], 3, 2)


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


@pytest.mark.parametrize("stored", ["batch", "wire"])  # as a caller's ray.put / a worker's return
def test_resolve_slices_concatenates_and_merges_with_strings(stored):
    store = {
        "a": _batch([0, 1], ["p0", "p1"]),
        "b": _batch([2, 3, 4], ["p2", "p3", "p4"]),
        "c": TensorDict(
            {"y": torch.arange(10, 15), "x": torch.full((5,), -1.0)}, batch_size=[5]
        ),
    }
    if stored == "wire":
        store = {ref: to_wire(batch) for ref, batch in store.items()}
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
    # A partial slice is a copy: it neither keeps nor changes the fetched shard.
    part = resolve([[("c", 1, 3)]], fetch=fetch)
    part["y"].zero_()
    assert from_wire(store["c"])["y"].tolist() == [10, 11, 12, 13, 14]
    assert set(resolve(pieces_per_input, fetch=fetch, with_text=False).keys()) == {"x", "y"}


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


def test_text_table_and_text_false_only_for_dp_protocols():
    class Methods:
        @register(Dispatch.DP_SPLIT, text=False)
        def forward(self, batch):
            return batch, {}

        @register(Dispatch.DP_3D)
        def score(self, batch):
            return batch, {}

    assert text_table(Methods) == {"forward": False, "score": True}
    with pytest.raises(ValueError, match="text=False applies to DP_SPLIT and DP_3D"):
        register(Dispatch.ONE_TO_ALL, text=False)


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

from hybridflow.workers.pools import PoolUnavailableError, ResourcePool  # noqa: E402
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
    def keys_seen(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        return TensorDict({}, batch_size=batch.batch_size), {"keys": sorted(batch.keys())}

    @register(Dispatch.DP_SPLIT, text=False)
    def tensor_keys_seen(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        return TensorDict({}, batch_size=batch.batch_size), {"keys": sorted(batch.keys())}

    @register(Dispatch.DP_SPLIT)
    def broken(self, batch: TensorDict) -> TensorDict:
        return batch

    @register(Dispatch.ALL_TO_ALL)
    def pair(self, value, *, scale):
        return {"rank": self.rank, "value": value * scale}

    @register(Dispatch.DP_3D)
    def stage(self, batch: TensorDict, *, coords) -> tuple[TensorDict, dict]:
        """Tags each row with the rank that computed it; reports the uids it saw."""
        n = batch.batch_size[0]
        out = TensorDict(
            {"uid": batch["uid"], "by_rank": torch.full((n,), self.rank), "pp": torch.full((n,), coords.pp_rank)},
            batch_size=batch.batch_size,
        )
        return out, {"coords": coords, "uids": batch["uid"].tolist()}

    @register("test_first_rank_only")
    def whoami(self):
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def wait_for_flag(self, timeout_s: float) -> bool:
        """Blocks until ``set_flag`` ran (True) or ``timeout_s`` passed (False)."""
        import threading

        self.__dict__.setdefault("flag", threading.Event())
        return self.flag.wait(timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def set_flag(self) -> None:
        import threading

        self.__dict__.setdefault("flag", threading.Event()).set()


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


def test_side_methods_run_beside_the_call_in_progress(ray_session):
    """A method named in side_methods runs on the actor's side thread while a call blocks the
    main one (a standalone rollout receives weights while it generates); without it the same
    call would wait behind the blocking one."""
    pool = ResourcePool("side", PoolSpec(devices_per_node=1, cpus_per_device=1))
    group = WorkerGroup(ToyWorker, pool, {}, name="toy_side", side_methods=("set_flag",))
    try:
        blocked = group.call("wait_for_flag", timeout_s=30.0)
        ray.get(group.call("set_flag"), timeout=20)  # would time out queued behind the wait
        assert ray.get(blocked) == [True]
        assert ray.get(group.call("info", "main"))[0]["tag"] == "main"  # the rest as before
        with pytest.raises(AttributeError, match="not a registered worker method"):
            WorkerGroup(ToyWorker, pool, {}, name="toy_side_bad", side_methods=("nope",))
    finally:
        group.shutdown()
        pool.remove()


def test_text_false_method_gets_no_strings(groups):
    """The registration decides whether the ranks' batches carry the per-sample strings."""
    group_a, _ = groups
    for method, keys in (("keys_seen", ["prompt_text", "uid", "x"]), ("tensor_keys_seen", ["uid", "x"])):
        _, metas = group_a.call(method, [_source([2, 2])], group_size=1).result()
        assert [meta["keys"] for meta in metas] == [keys, keys], method


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


def test_ranks_count_the_tensor_bytes_they_fetch_and_put(groups):
    group_a, _ = groups
    # Shards of 1, 3, 2 prompts (uid int64 + x float32: 12 bytes a row). Rank 0 reads rows 0-2
    # (all of shard 0, part of shard 1), rank 1 rows 3-5: a shard crosses whole once per rank.
    pending = group_a.call("double", [_source([1, 3, 2])], group_size=1)
    _, metas = pending.result(timeout_s=60)
    assert [meta["fetched_bytes"] for meta in metas] == [(1 + 3) * 12, (3 + 2) * 12]
    assert [meta["put_bytes"] for meta in metas] == [3 * 4, 3 * 4]  # x2, float32


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
    with pytest.raises(ValueError, match="not a whole number of groups of 2"):
        group_a.call("double", [_source([3])], group_size=2)
    with pytest.raises(TypeError, match="not a list of 2"):
        group_a.call("pair", [1, 2, 3], scale=[1, 1])
    with pytest.raises(TypeError, match="needs layout="):
        group_a.call("stage", [_source([2])], group_size=1)
    pending = group_a.call("broken", [_source([2])], group_size=1)
    with pytest.raises(TypeError, match=r"must return \(TensorDict, dict\)"):
        pending.result(timeout_s=30)


def test_dp_split_pads_uneven_batches_and_drops_the_padding(groups):
    group_a, _ = groups
    # 3 prompts on 2 ranks: rank 1 gets prompt 2 plus a padded copy, so both all-reduce 2 rows.
    doubled, metas = group_a.double([_source([3])], group_size=1).result(timeout_s=60)
    assert doubled.sizes == [2, 1]
    assert [meta["global_sum"] for meta in metas] == [2 * (0 + 1 + 2 + 2) + 4 * 0.5] * 2
    assert doubled.fetch()["x2"].tolist() == [0.5, 2.5, 4.5]


def test_uneven_prompt_groups_stay_whole_across_groups(groups):
    group_a, group_b = groups
    # 5 prompts on 2 ranks (3 + 2, padded), expanded to 2 samples each.
    expanded, metas_1 = group_a.expand([_source([2, 3])], group_size=1, n=2).result(timeout_s=60)
    assert expanded.sizes == [6, 4]
    doubled, _ = group_a.double([expanded], group_size=2).result(timeout_s=60)
    assert doubled.sizes == [6, 4]
    # 5 groups of 2 on 3 ranks: 2, 2, 1 (+1 padded); every rank sees whole groups.
    combined, metas_3 = group_b.combine([expanded, doubled], group_size=2).result(timeout_s=60)
    assert combined.sizes == [4, 4, 2]
    assert all(meta["groups_whole"] for meta in metas_3)
    result = combined.fetch()
    prompt = [i // 2 for i in range(10)]
    assert result["y"].tolist() == [3 * p + 0.5 for p in prompt]
    assert result.get("text_out").tolist() == [f"p{p}!" for p in prompt]


def test_all_to_all_gives_each_rank_its_item(groups):
    _, group_b = groups
    results = ray.get(group_b.pair([10, 20, 30], scale=[1, 2, 3]))
    assert results == [{"rank": 0, "value": 10}, {"rank": 1, "value": 40}, {"rank": 2, "value": 90}]


def test_custom_protocol_collects_what_it_says(groups):
    _, group_b = groups
    assert ray.get(group_b.whoami()) == 0  # "test_first_rank_only": rank 0's ref, not a list


@pytest.fixture(scope="module")
def group_4(ray_session):
    pool = ResourcePool("four", PoolSpec(devices_per_node=4, cpus_per_device=0.25))
    group = WorkerGroup(ToyWorker, pool, {}, name="toy_4")
    yield group
    group.shutdown()
    pool.remove()


@pytest.mark.parametrize(
    "layout, collected",
    [
        (ParallelLayout(tp=2, pp=1, dp=2), [0, 2]),  # tp rank 0 of each DP group
        (ParallelLayout(tp=1, pp=2, dp=2), [2, 3]),  # the last pipeline stage
        (ParallelLayout(tp=2, pp=2, dp=1), [2]),
        (ParallelLayout(tp=1, pp=1, dp=4), [0, 1, 2, 3]),
    ],
)
def test_3d_same_chunk_per_dp_group_collect_tp0_last_stage(group_4, layout, collected):
    # 5 prompts, 2 samples each: uneven over dp=2 and dp=4, so padding is exercised too.
    uid = torch.arange(5).repeat_interleave(2)
    source = ShardedRef.put(TensorDict({"uid": uid}, batch_size=[10]))
    pending = group_4.stage([source], group_size=2, layout=layout)
    assert len(pending.all_meta_refs) == 4
    all_metas = ray.get(pending.all_meta_refs)
    by_dp: dict[int, list] = {}
    for meta in all_metas:
        assert meta["coords"] == layout.coords(meta["rank"])
        by_dp.setdefault(meta["coords"].dp_rank, []).append(meta["uids"])
    assert len(by_dp) == layout.dp
    for meta in all_metas:  # only the collected ranks put their (equal) output in the store
        assert (meta["put_bytes"] > 0) == (meta["rank"] in collected), meta
    for uids in by_dp.values():  # every TP/PP rank of a DP group got the same chunk
        assert all(u == uids[0] for u in uids)
        assert len(uids[0]) % 2 == 0
    sharded, metas = pending.result(timeout_s=60)
    assert [meta["rank"] for meta in metas] == collected
    out = sharded.fetch()
    assert out["uid"].tolist() == uid.tolist()  # padding dropped, sample order kept
    assert set(out["by_rank"].tolist()) == set(collected)
    assert set(out["pp"].tolist()) == {layout.pp - 1}


def test_controller_fetch_counts_tensor_bytes(ray_session):
    batch = TensorDict({"x": torch.zeros(6, 4), "text": [str(i) for i in range(6)]}, batch_size=[6])
    assert tensor_bytes(batch) == 6 * 4 * 4
    before = fetched_tensor_bytes()
    controller_get(ray.put({"metrics": {"a": 1.0}, "num_samples": 3}))
    assert fetched_tensor_bytes() == before
    sharded = ShardedRef.put(batch)
    assert sharded.fetch()["x"].shape == (6, 4)
    assert fetched_tensor_bytes() - before == 96


def test_pool_that_cannot_fit_names_the_shortage(ray_session):
    pool = ResourcePool("huge", PoolSpec(devices_per_node=2, cpus_per_device=64))
    with pytest.raises(PoolUnavailableError) as info:
        pool.create(timeout_s=0.5)
    message = str(info.value)
    assert "'huge'" in message and "128 CPUs" in message
    assert f"cluster has {ray.cluster_resources()['CPU']:g} CPUs" in message
    assert not pool.created


def test_multi_node_pool_needs_enough_labelled_nodes(ray_session):
    # The session cluster is one node: a pool over two nodes must say so, not half-place.
    pool = ResourcePool("wide", PoolSpec(nodes=2, devices_per_node=1, cpus_per_device=0.25))
    with pytest.raises(PoolUnavailableError, match="spans 2 nodes .* the cluster has 1 such node"):
        pool.create(timeout_s=5)
    labelled = ResourcePool("pinned", PoolSpec(node_labels={"hybridflow-node": "nowhere"}))
    with pytest.raises(PoolUnavailableError, match="'pinned' could not be placed"):
        labelled.create(timeout_s=0.5)
    assert not pool.created and not labelled.created


def test_single_node_pool_records_its_node(ray_session):
    pool = ResourcePool("one", PoolSpec(devices_per_node=2, cpus_per_device=0.25))
    try:
        pool.create()
        node = ray.get_runtime_context().get_node_id()
        assert [pool.node_of(rank) for rank in range(2)] == [node, node]
    finally:
        pool.remove()


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
