"""What the model folder's safety costs: save and load, checked against unchecked, side by side.

A model of the size users train (timm's ViT-B/16 at 224 px and a BERT-base-sized text encoder,
from scratch: about 200 M parameters, 0.8 GB of weights) is saved and loaded in turn, each case
once per repetition in a rotating order (:func:`vlfuse.analysis.timing.time_interleaved`):

- ``save``: :meth:`VLFuseModel.save_pretrained` (a hidden folder, SHA-256 of every file, fsync,
  an atomic swap) against ``save, unchecked``: the same files written in place, as before;
- ``load``: :meth:`VLFuseModel.from_pretrained` (regular files, digests, config bounds, a meta
  device build compared with the header, non-finite weights) against ``load, unchecked``: build
  the model and load its weights, nothing else.

    .venv/bin/python scripts/bench_model_folder.py --threads 2

The ratio checked : unchecked is the cost of the checks; it is printed as a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from _common import add_threads_argument, add_timing_arguments, set_threads

from vlfuse import model_io
from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import time_interleaved
from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig, load_saved_tokenizer, saved_text_config
from vlfuse.model import VLFuseConfig, VLFuseModel, processor_for


def real_size_config() -> VLFuseConfig:
    """ViT-B/16 at 224 px and a 12-layer text encoder of width 768, fusion width 768 (2 blocks)."""
    return VLFuseConfig(
        image=ImageEncoderConfig(name="vit_base_patch16_224", image_size=224, patch_size=None, width=None, depth=None, num_heads=None),
        text=TextEncoderConfig(width=768, depth=12, num_heads=12, max_length=32),
        fusion_dim=768,
    )


def save_unchecked(model: VLFuseModel, directory: Path) -> None:
    """The files of a model folder written in place, without digests, staging or fsync."""
    model_io.save_weights(model, directory)
    meta = {"format_version": model_io.FORMAT_VERSION, "model_type": model_io.MODEL_TYPE,
            "config": model.config.to_dict(), "text_encoder_config": model.text_encoder.model.config.to_dict()}
    model_io.write_json(directory / model_io.CONFIG_FILE, meta)
    model_io.write_json(directory / model_io.ANSWERS_FILE, model.answers, indent=1)
    model.tokenizer.save_pretrained(directory / model_io.TOKENIZER_DIR)


def load_unchecked(directory: Path) -> VLFuseModel:
    """Build the model a folder describes and load its weights: no digests, bounds, meta build or finite check."""
    meta = model_io.read_json(directory / model_io.CONFIG_FILE)
    config = VLFuseConfig.from_dict(meta["config"])
    answers = model_io.read_json(directory / model_io.ANSWERS_FILE)
    processor = processor_for(config, load_saved_tokenizer(directory / model_io.TOKENIZER_DIR))
    model = VLFuseModel(config, answers, processor, text_hf_config=saved_text_config(meta["text_encoder_config"]), load_pretrained=False)
    model.load_state_dict(load_file(directory / model_io.WEIGHTS_FILE))
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_arguments(parser, repeats=5, warmup=1)
    add_threads_argument(parser)
    parser.add_argument("--dir", type=Path, help="where to write the folders (default: a temporary folder)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    model = VLFuseModel.from_config(real_size_config(), [f"answer {i}" for i in range(1000)], ["what is in the image?"]).eval()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        checked, unchecked = Path(scratch) / "checked", Path(scratch) / "unchecked"
        model.save_pretrained(checked)
        save_unchecked(model, unchecked)
        size = sum(p.stat().st_size for p in checked.rglob("*") if p.is_file())
        timings = time_interleaved(
            {
                "save": lambda: model.save_pretrained(checked),
                "save, unchecked": lambda: save_unchecked(model, unchecked),
                "load": lambda: VLFuseModel.from_pretrained(checked),
                "load, unchecked": lambda: load_unchecked(unchecked),
            },
            repeats=args.repeats,
            warmup=args.warmup,
        )
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters / 1e6:.1f} M parameters, folder {size / 2**30:.2f} GiB, {args.repeats} repetitions, "
          f"{torch.get_num_threads()} threads")
    rows = [
        [step, f"{timings.median(step):.2f}", f"{timings.median(f'{step}, unchecked'):.2f}", f"{timings.ratio(step, f'{step}, unchecked'):.2f}"]
        for step in ("save", "load")
    ]
    print(markdown_table(["step", "checked (s, median)", "unchecked (s, median)", "checked : unchecked"], rows))


if __name__ == "__main__":
    main()
