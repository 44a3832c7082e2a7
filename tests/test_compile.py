"""``torch.compile`` of the whole model: one graph (no graph break), the same loss and gradients as eager.

The compiled model runs the padded layout (docs/attention.md, "Export and compile"), eager calls the
packed one; ``backend="aot_eager"`` captures the forward and backward graphs as inductor would,
without its C++ build (scripts/bench_compile.py times inductor: docs/results.md).
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model

ATOL = 1e-5
DEFAULT_PARTS = {"fuser": {"mlp": "swiglu", "output_gate": True, "self_attention": False, "gated": False},
                 "head": {"type": "bilinear"}}
"""The default model's fuser and head options (``VLFuseConfig()``), on the tiny model."""

pytestmark = pytest.mark.usefixtures("one_thread")


def loss_and_gradients(model, call, inputs: dict, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of ``call(**inputs)`` (``model`` or its compiled module) and the gradients of ``model``'s weights."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(call(**inputs).logits, labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("parts", [DEFAULT_PARTS, {}], ids=["default parts", "self-attention, gates, pooled head"])
def test_the_compiled_model_is_one_graph_with_eagers_loss_and_gradients(parts):
    model, batch = make_model(**parts)
    model.train()
    for module in model.modules():  # the text encoder's dropout (BERT's 0.1) draws other masks when compiled
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    inputs = dict(model.processor.batch(batch))
    assert len(inputs["input_ids"]) > len(inputs["pixel_values"])  # images shared by several questions
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    expected_loss, expected = loss_and_gradients(model, model, inputs, batch["labels"])
    loss, gradients = loss_and_gradients(model, compiled, inputs, batch["labels"])
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=ATOL)
    assert gradients.keys() == expected.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected[name], rtol=0, atol=ATOL, msg=name)
