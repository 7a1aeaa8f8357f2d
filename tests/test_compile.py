"""train.compile: the torch engine's decoder layers under torch.compile (real inductor on CPU)
give the eager engine's log-probs, values and update, and only inside the engine's own calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_packing import EOS, PAD, TINY, VOCAB, _assert_one_sgd_step_equal, _batch, _engines

from hybridflow.controller.preflight import check_engines_installed
from hybridflow.engines.compile import decoder_layers
from hybridflow.engines.models import build_causal_lm
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.graph.dag import load_graph
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import LoraSpec, TrainEngineSpec
from hybridflow.spec.loading import SpecError

pytestmark = pytest.mark.slow  # each compilation takes seconds

BAD_INPUTS = Path(__file__).parent / "bad_inputs"


@pytest.mark.parametrize(
    "kind, key, layout",
    [
        ("policy", "log_probs", {}),
        ("value", "values", {}),
        ("policy", "log_probs", {"share_prompts": True}),  # a 4D mask into the layers
        ("policy", "log_probs", {"compute_dtype": "bfloat16"}),  # under autocast
    ],
)
def test_compiled_layers_equal_eager(kind, key, layout):
    """Forwards and SGD steps over micro-batches of changing shapes (packed rows of ragged
    rollouts, then a second cut: the compiled layers go dynamic) equal the eager engine's."""
    batch = _batch()
    eager, compiled = _engines(kind, "compile", micro_batch_size=5, **layout)
    for size in (5, 3):
        for engine in (eager, compiled):
            engine.spec = engine.spec.model_copy(update={"micro_batch_size": size})
        a, b = eager.forward(batch, temperature=0.8), compiled.forward(batch, temperature=0.8)
        for name in a:
            assert (a[name] - b[name]).abs().max().item() < 1e-5, (size, name)
        _assert_one_sgd_step_equal(eager, compiled, batch, key)
    # Outside the engine's calls the layers are the plain ones: a transformers rollout on the
    # same module generates eagerly.
    layers = decoder_layers(compiled.module)
    assert len(layers) == compiled.module.config.num_hidden_layers
    assert all("forward" not in vars(layer) for layer in layers)
    with compiled._compiled_layers():
        with compiled._compiled_layers():
            pass
        assert all("forward" in vars(layer) for layer in layers)  # the inner exit leaves them compiled
    assert all("forward" not in vars(layer) for layer in layers)


def test_the_layers_share_one_compilation():
    """torch.compile lifts a layer's weights as inputs: the second layer reuses the first's
    compiled code, so the number of compilations does not grow with the depth."""
    from torch._dynamo.utils import counters

    def frames_compiled(layers: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        source = TINY.model_copy(update={"config": {"num_hidden_layers": layers}})
        engine = TorchTrainEngine(build_causal_lm(source, VOCAB, PAD, EOS, seed=2), TorchTrainSpec(compile=True))
        engine.forward(_batch())
        return counters["stats"]["unique_graphs"]

    assert frames_compiled(1) == frames_compiled(3) >= 1


def test_compile_is_refused_where_it_does_not_apply(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="compile is for train.engine 'torch'"):
        TrainEngineSpec(engine="megatron", compile=True)
    with pytest.raises(ValueError, match="compile with lora is not supported"):
        TorchTrainSpec(compile=True, lora=LoraSpec())
    spec = yaml.safe_load((BAD_INPUTS / "base.yaml").read_text())
    spec["resources"] = str(BAD_INPUTS.parent.parent / spec["resources"])
    spec["models"]["actor"]["train"] = {"compile": True}
    graph_file = tmp_path / "g.yaml"
    graph_file.write_text(yaml.safe_dump(spec))
    graph = load_graph(str(graph_file))
    check_engines_installed(graph)  # this machine has a C++ compiler
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SpecError, match=r"g\.yaml.*models\.actor\.train\.compile.*C\+\+ compiler"):
        check_engines_installed(graph)
