#!/usr/bin/env python
"""vlfuse's caption generation and fusion layer beside transformers' and timm's, side by side in one run.

    .venv/bin/python scripts/bench_peers_speed.py --threads 1
    .venv/bin/python scripts/bench_peers_speed.py --threads 1 --images 64 --length 30 --repeats 15
    .venv/bin/python scripts/bench_peers_speed.py --threads 1 --parts layer --repeats 41

Generation: the caption model of configs/shapes_captions.yaml, greedy with vlfuse's
:func:`~vlfuse.captioning.greedy` (its key/value cache), against transformers'
``VisionEncoderDecoderModel.generate`` (greedy, ``use_cache=True``) on the peer of the same size
(:class:`vlfuse.baselines.hf_caption.HFCaptionPeer`); both untrained (seed 0; speed does not depend on
the weights), the same ``--images`` SHAPES scenes, both writing ``--length`` tokens per caption
(``generate`` with ``min_new_tokens = max_new_tokens``; vlfuse's untrained model writes no end
token: the script stops if a caption is shorter), from pixels to caption texts (the image encoder and
the detokenizing included) in both.

Training step: one AdamW step of each caption model (copies in training mode) on the same
``--train-batch`` grammar captions of those scenes, with the loss of
:class:`~vlfuse.captioning.lit.CaptionLitModule` (what one batch of ``compare_caption_peers.py`` costs).

Fusion layer (float32, ``--layer-size`` B Lq Lk D H, default 32 32 197 768 16), forward under
``inference_mode`` and forward + backward (gradients of the weights and of both inputs):

- ``vlfuse``: :class:`vlfuse.layers.CrossAttention`, queries from the text, keys/values from the image;
  q, k, v projections, softmax attention, output projection.
- ``bert cross (same op)``: transformers' ``BertCrossAttention`` (queries from the text,
  keys/values from ``encoder_hidden_states``) and the output projection of its ``BertSelfOutput``
  (``dense``), with vlfuse's weights copied in: the same op (outputs checked equal).
- ``BertAttention (cross)``: the whole module of a ``BertLayer`` with ``add_cross_attention``
  (``BertAttention(is_cross_attention=True)``): the same op plus its residual add and LayerNorm.
- ``vlfuse, one k/v product`` (vlfuse's layer until 6 December 2026; a diagnosis): keys and
  values from one product with the whole of ``kv_proj``, split in two, where the package now runs two
  products with its halves. Its backward concatenates the key and value gradients into one
  ``(B, Lk, 2 x D)`` tensor, and its attention reads keys and values interleaved in memory.
- ``timm Attention (concat)``: timm's ``Attention`` cannot take queries from one sequence and keys
  from another; what a single-stream model (ViLT) does instead is self-attention over the text and
  image tokens together, so it runs over the ``Lq + Lk`` concatenated tokens: a larger op.

Both transformers modules use the attention a ``BertModel`` picks by default (``sdpa``). Every case is
timed once per repetition, in a rotating order (:func:`vlfuse.analysis.timing.time_interleaved`); a
ratio is the other case's time / vlfuse's time in the same repetition (above 1: vlfuse is faster),
reported as the median and the worst (lowest) over repetitions. ``--out`` also writes a CSV.
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import timm.layers
import torch
import torch.nn.functional as F
from _common import add_threads_argument, add_timing_arguments, set_threads
from bench_generate import DEFAULT_CONFIG, GRAMMAR_WORDS, caption_architecture, scene_pixels
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertAttention

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import Timings, time_interleaved
from vlfuse.baselines.hf_caption import HFCaptionPeer
from vlfuse.captioning import CaptionModel, describe, greedy
from vlfuse.data import IGNORE_INDEX
from vlfuse.data.shapes import sample_scenes
from vlfuse.layers import CrossAttention
from vlfuse.layers.attention import ProjectedContext

LAYER_SIZE = (32, 32, 197, 768, 16)
PARTS = ("generation", "training", "layer")
QUICK = {"images": 4, "length": 4, "train_batch": 4, "layer_size": [2, 4, 9, 32, 4], "repeats": 2, "warmup": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config whose model.init_args.caption_model to build")
    parser.add_argument("--images", type=int, default=64, help="SHAPES scenes captioned in one batch (default 64)")
    parser.add_argument("--length", type=int, default=30, help="tokens generated per caption (default 30)")
    parser.add_argument("--train-batch", type=int, default=64, help="captions of the timed training step (default 64, the config's batch)")
    parser.add_argument("--layer-size", type=int, nargs=5, default=list(LAYER_SIZE), metavar=("B", "LQ", "LK", "D", "H"),
                        help="fusion-layer batch, query and key lengths, width, heads (default 32 32 197 768 16)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to time (default all): caption generation, the caption models' training step, the fusion layer")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke test")
    parser.add_argument("--out", type=Path, help="also write the rows to OUT/peers_speed.csv")
    add_threads_argument(parser)
    add_timing_arguments(parser, repeats=11, warmup=2)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    for name in ("images", "length", "train_batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    b, lq, lk, d, h = args.layer_size
    if min(args.layer_size) < 1 or d % h:
        parser.error(f"--layer-size: all sizes must be positive and D divisible by H, got {args.layer_size}")
    return args


# ------------------------------------------------------------------------------------- generation


class CaptionPair(NamedTuple):
    """Both caption models (untrained, seed 0), SHAPES scenes' grammar captions and their images."""

    vlfuse: CaptionModel
    peer: HFCaptionPeer
    captions: list[str]
    pixels: torch.Tensor  # (N, 3, S, S) in [0, 1]


def caption_pair(args: argparse.Namespace) -> CaptionPair:
    """The config's caption model and its transformers peer, with ``max(--images, --train-batch)`` scenes."""
    architecture = caption_architecture(args.config)
    if not 1 <= args.length <= architecture.max_length - 1:
        raise SystemExit(f"error: --length must be in [1, {architecture.max_length - 1}] (the decoder's positions), got {args.length}")
    torch.manual_seed(0)
    vlfuse = CaptionModel.from_config(architecture, [GRAMMAR_WORDS])
    torch.manual_seed(0)
    peer = HFCaptionPeer.from_caption_config(architecture, [GRAMMAR_WORDS])
    rng = np.random.default_rng(0)
    scenes = sample_scenes(max(args.images, args.train_batch), rng)
    pixels = scene_pixels(scenes, rng, architecture.image.image_size)
    return CaptionPair(vlfuse, peer, [describe(scene) for scene in scenes], pixels)


def generation_cases(pair: CaptionPair, args: argparse.Namespace) -> tuple[dict, dict]:
    """``{name: call}`` of both generators on the same images, and ``{name: tokens written per caption (B,)}`` after a call."""
    vlfuse, peer = pair.vlfuse.eval(), pair.peer.eval()
    pixels = pair.pixels[: args.images]
    written: dict[str, torch.Tensor] = {}

    def run_vlfuse():
        captions = greedy(vlfuse, vlfuse.encode_images(pixels), max_length=args.length)
        written["vlfuse greedy"] = torch.tensor([len(c.ids) for c in captions])

    def run_peer():
        ids = peer.generate_ids(pixels, max_new_tokens=args.length, min_new_tokens=args.length)  # (B, 1 + T)
        [peer.detokenize(row[1:]) for row in ids.tolist()]  # texts, as greedy's Captions hold
        written["transformers generate"] = torch.full((len(ids),), ids.shape[1] - 1)

    return {"vlfuse greedy": run_vlfuse, "transformers generate": run_peer}, written


def training_cases(pair: CaptionPair, args: argparse.Namespace) -> dict:
    """``{name: call}``: one AdamW step of each model (copies, in training mode) on the same ``--train-batch``
    captions, with :class:`~vlfuse.captioning.lit.CaptionLitModule`'s loss."""
    cases = {}
    for name, model in (("vlfuse train step", pair.vlfuse), ("transformers train step", pair.peer)):
        model = copy.deepcopy(model).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pixels, captions = pair.pixels[: args.train_batch], pair.captions[: args.train_batch]

        def step(model=model, optimizer=optimizer):
            ids = model.tokenize(captions)  # (B, L): BOS words EOS pad...
            logits = model(pixels, ids[:, :-1])  # (B, L - 1, vocab)
            targets = ids[:, 1:].masked_fill(ids[:, 1:] == model.pad_id, IGNORE_INDEX)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
            optimizer.step()

        cases[name] = step
    return cases


# ------------------------------------------------------------------------------------- the layer


class BertSameOp(torch.nn.Module):
    """``BertCrossAttention`` and the output projection of ``BertSelfOutput``: vlfuse's op, no residual or norm."""

    def __init__(self, attention: BertAttention) -> None:
        super().__init__()
        self.cross, self.dense = attention.self, attention.output.dense

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.dense(self.cross(text, encoder_hidden_states=image)[0])


class _Residual(torch.nn.Module):
    """The whole ``BertAttention``: ``output.LayerNorm(text + dense(cross(text, image)))``."""

    def __init__(self, attention: BertAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.attention(text, encoder_hidden_states=image)[0]


class OneKeyValueProduct(CrossAttention):
    """vlfuse's layer as it was: keys and values from one product with ``kv_proj``, split in two."""

    def project_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None) -> ProjectedContext:
        key, value = self.kv_proj(context).chunk(2, dim=-1)  # each (B, Lk, H * hd), interleaved in memory
        return ProjectedContext(self.split_heads(key), self.split_heads(value), context_mask)  # each (B, H, Lk, hd)


def layer_modules(d: int, h: int) -> dict[str, tuple[torch.nn.Module, bool]]:
    """``{name: (module, takes (text, image) apart)}``; the BERT modules carry vlfuse's weights."""
    torch.manual_seed(0)
    ours = CrossAttention(d, h).eval()
    config = BertConfig(hidden_size=d, num_attention_heads=h, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    config._attn_implementation = "sdpa"  # what BertModel picks by default
    bert = BertAttention(config, is_cross_attention=True).eval()
    q_weight, q_bias = ours.q_proj.weight.detach(), ours.q_proj.bias.detach()
    k_weight, v_weight = ours.kv_proj.weight.detach().chunk(2)  # (2D, D) -> keys, values
    k_bias, v_bias = ours.kv_proj.bias.detach().chunk(2)
    with torch.no_grad():
        for target, weight, bias in ((bert.self.query, q_weight, q_bias), (bert.self.key, k_weight, k_bias),
                                     (bert.self.value, v_weight, v_bias), (bert.output.dense, ours.out_proj.weight, ours.out_proj.bias)):
            target.weight.copy_(weight)
            target.bias.copy_(bias)
    one_product = OneKeyValueProduct(d, h).eval()
    one_product.load_state_dict(ours.state_dict())
    timm_attention = timm.layers.Attention(d, num_heads=h, qkv_bias=True).eval()
    return {
        "vlfuse CrossAttention": (ours, True),
        "vlfuse, one k/v product": (one_product, True),
        "bert cross (same op)": (BertSameOp(bert), True),
        "BertAttention (cross)": (_Residual(bert), True),
        "timm Attention (concat)": (timm_attention, False),
    }


def layer_cases(args: argparse.Namespace) -> dict[tuple[str, str], Callable[[], None]]:
    """``{(pass, name): call}`` for every module, forward and forward + backward, on the same inputs."""
    b, lq, lk, d, h = args.layer_size
    modules = layer_modules(d, h)
    text, image = torch.randn(b, lq, d), torch.randn(b, lk, d)
    with torch.inference_mode():
        ours = modules["vlfuse CrossAttention"][0](text, image)
        same = modules["bert cross (same op)"][0](text, image)
    if not torch.allclose(ours, same, atol=1e-5, rtol=1e-4):
        raise SystemExit(f"error: vlfuse's CrossAttention and BERT's cross-attention with the same weights differ by {(ours - same).abs().max():.2e}")
    cases = {}
    for name, (module, apart) in modules.items():
        inputs = (text, image) if apart else (torch.cat([text, image], dim=1),)  # (B, Lq + Lk, D) for self-attention

        def forward(module=module, inputs=inputs):
            with torch.inference_mode():
                module(*inputs)

        def forward_backward(module=module, inputs=inputs):
            leaves = [x.detach().requires_grad_() for x in inputs]
            module(*leaves).sum().backward()
            module.zero_grad(set_to_none=True)

        cases["forward", name] = forward
        cases["forward + backward", name] = forward_backward
    return cases


# ------------------------------------------------------------------------------------- report


def against(timings: Timings, case, reference) -> tuple[float, float]:
    """``case``'s time / ``reference``'s in the same repetition: the median and the worst (lowest) over repetitions."""
    ratios = [t / r for t, r in zip(timings.samples[case], timings.samples[reference])]
    return statistics.median(ratios), min(ratios)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    generate, written, train, layers = {}, {}, {}, {}
    if {"generation", "training"} & set(args.parts):
        pair = caption_pair(args)
        if "generation" in args.parts:
            generate, written = generation_cases(pair, args)
        if "training" in args.parts:
            train = training_cases(pair, args)
    if "layer" in args.parts:
        layers = layer_cases(args)
    timings = time_interleaved({**generate, **train, **layers}, args.repeats, args.warmup)
    lengths = {name: set(ids.tolist()) for name, ids in written.items()}
    if any(found != {args.length} for found in lengths.values()):
        raise SystemExit(f"error: the captions' lengths differ from --length {args.length}: {lengths}")
    rows = [["generation", name, timings.median(name) * 1e3, args.images / timings.median(name), *against(timings, name, "vlfuse greedy")]
            for name in generate]
    rows += [["training step", name, timings.median(name) * 1e3, args.train_batch / timings.median(name),
              *against(timings, name, "vlfuse train step")] for name in train]
    rows += [[step, name, timings.median((step, name)) * 1e3, None, *against(timings, (step, name), (step, "vlfuse CrossAttention"))]
             for step in ("forward", "forward + backward") for s, name in layers if s == step]
    b, lq, lk, d, h = args.layer_size
    sizes = {"generation": f"generation: {args.images} captions of {args.length} tokens",
             "training": f"training step: {args.train_batch} captions",
             "layer": f"layer: B={b} Lq={lq} Lk={lk} D={d} H={h}, float32"}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repetitions side by side "
          f"({args.warmup} untimed first); " + "; ".join(sizes[part] for part in PARTS if part in args.parts))
    print(markdown_table(["what", "case", "ms (median)", "captions/s", "time / vlfuse's (median)", "worst"], rows,
                         formats=[None, None, "{:.2f}", "{:.1f}", "{:.3f}", "{:.3f}"]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "peers_speed.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["what", "case", "ms_median", "captions_per_s", "ratio_to_vlfuse_median", "ratio_to_vlfuse_worst"])
            writer.writerows([[what, case, round(ms, 3), None if per_s is None else round(per_s, 1), round(median, 4), round(worst, 4)]
                              for what, case, ms, per_s, median, worst in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
