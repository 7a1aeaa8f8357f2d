"""One rank numbering for every layer: ``ParallelLayout.coords`` against megatron-core's."""

from __future__ import annotations

import pytest

from hybridflow.spec.layout import ParallelLayout, RankCoords


def test_coords_follow_megatron_default_order():
    # megatron-core 0.16 RankGenerator(tp=2, dp=2, pp=2, order="tp-cp-ep-dp-pp") gives
    # tp groups [[0,1],[2,3],[4,5],[6,7]], dp groups [[0,2],[1,3],[4,6],[5,7]],
    # pp groups [[0,4],[1,5],[2,6],[3,7]] (test_coords_match_megatron_parallel_state checks it live).
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    coords = [layout.coords(rank) for rank in range(8)]
    groups = {
        "tp_rank": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp_rank": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp_rank": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    axes = tuple(groups)
    for axis, axis_groups in groups.items():
        for group in axis_groups:
            # Ranks of one group differ only along `axis`, and take its values 0, 1 in order.
            assert [getattr(coords[r], axis) for r in group] == list(range(len(group)))
            fixed = [a for a in axes if a != axis]
            assert len({tuple(getattr(coords[r], a) for a in fixed) for r in group}) == 1
    assert coords[5] == RankCoords(layout, tp_rank=1, pp_rank=1, dp_rank=0)
    assert [c.rank for c in coords] == list(range(8))
    assert [c.is_last_stage for c in coords] == [False] * 4 + [True] * 4
    with pytest.raises(IndexError):
        layout.coords(8)
    with pytest.raises(IndexError):
        RankCoords(layout, tp_rank=2)
    with pytest.raises(ValueError, match="resolve"):
        ParallelLayout(tp=2).coords(0)


@pytest.mark.parametrize("p,t,d", [(2, 2, 2), (2, 4, 1), (1, 2, 4), (4, 1, 2), (2, 2, 3)])
def test_coords_match_megatron_parallel_state(p, t, d):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    generator = parallel_state.RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order="tp-cp-ep-dp-pp")
    layout = ParallelLayout(tp=t, pp=p, dp=d)
    axes = ("tp_rank", "pp_rank", "dp_rank")
    for axis in axes:
        for ranks in generator.get_ranks(axis.removesuffix("_rank")):
            coords = [layout.coords(r) for r in ranks]
            assert [getattr(c, axis) for c in coords] == list(range(len(ranks)))
            others = {tuple(getattr(c, a) for a in axes if a != axis) for c in coords}
            assert len(others) == 1, (axis, ranks)
