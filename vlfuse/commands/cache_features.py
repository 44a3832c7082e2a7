"""``vlfuse cache-features --config C``: a frozen image encoder's features of every image of a config's
data, written once to a store on disk (:mod:`vlfuse.encoders.feature_store`) that ``vlfuse fit
--model.feature_store DIR`` reads instead of running the encoder.

    vlfuse cache-features --config configs/easy_vqa.yaml --model.architecture.image.freeze true --out runs/features/easy_vqa
    vlfuse fit --config configs/easy_vqa.yaml --model.architecture.image.freeze true --model.feature_store runs/features/easy_vqa

The model is built as ``vlfuse fit`` builds it from the same config and overrides (the same seed,
hence the same from-scratch weights), or loaded from ``--model.pretrained``. Interrupted, the
command resumes: shards already written and indexed are kept, the rest written as an uninterrupted
run would have.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from vlfuse.commands import SUBCOMMANDS
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads

STORE_DTYPES = ("float32", "float16", "bfloat16")
OVERRIDES = ("--model.", "--data.", "--seed_everything")


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse cache-features``; ``--model.*``, ``--data.*`` and ``--seed_everything``
    options override the config as in ``vlfuse fit``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse cache-features",
        description=SUBCOMMANDS["cache-features"].description,
        epilog="any --model.*, --data.* or --seed_everything option of vlfuse fit overrides the config, e.g.\n"
        "  vlfuse cache-features --config configs/easy_vqa.yaml --model.architecture.image.freeze true --dtype float16\n"
        "then train with the same config and overrides and --model.feature_store DIR.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, required=True, metavar="C", help="a vlfuse fit config with a frozen image encoder")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="the store's folder (default runs/features/<config name>); a store of the same encoder "
                        "is resumed, any other folder refused")
    parser.add_argument("--dtype", choices=STORE_DTYPES, default="float32",
                        help="what the features are stored as (default float32; float16 halves the store, read back "
                        "in the model's dtype)")
    parser.add_argument("--batch-size", type=int, metavar="N", help="images per encoder call (default: the data's batch_size)")
    parser.add_argument("--images-per-shard", type=int, metavar="N",
                        help="images per shard file (default: as many as fit in 1 GiB; a shard is built in memory)")
    parser.add_argument("--verify", action="store_true", help="then check every shard's SHA-256 against the index")
    add_device_argument(parser)
    add_threads_argument(parser)
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own arguments and the config overrides (every ``--model.*``, ``--data.*`` and
    ``--seed_everything`` option with its value)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith(OVERRIDES)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for option, value in (("--batch-size", args.batch_size), ("--images-per-shard", args.images_per_shard)):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    return args, rest


def build_from_config(config: Path, overrides: Sequence[str]) -> tuple[Any, Any, Any]:
    """The Lightning module, the datamodule and ``seed_everything`` of a ``vlfuse fit`` config with
    ``overrides``, as ``vlfuse fit`` parses them (its other sections are left out)."""
    import jsonargparse

    from vlfuse.analysis.data import read_config
    from vlfuse.datamodules import VQADataModule
    from vlfuse.lit import VLFuseLitModule

    content = read_config(config)
    if "data" not in content:
        raise ValueError(f"{config} has no data: section (the datamodule of a vlfuse fit config)")
    model = content.get("model") or {}
    if isinstance(model, dict) and "class_path" in model:
        raise ValueError(f"{config}: cache-features builds the answering model (vlfuse.lit.VLFuseLitModule), not {model['class_path']}")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(VLFuseLitModule, "model")
    parser.add_subclass_arguments(VQADataModule, "data", required=True)
    parser.add_argument("--seed_everything", type=bool | int, default=True)
    given = [f"--model={json.dumps(model)}", f"--data={json.dumps(content['data'])}"]
    if "seed_everything" in content:
        given.append(f"--seed_everything={json.dumps(content['seed_everything'])}")
    try:
        parsed = parser.parse_args([*given, *overrides])
    except argparse.ArgumentError as err:
        raise ValueError(f"{config}: {' '.join(str(err).split())}") from err
    built = parser.instantiate_classes(parsed)
    return built.model, built.data, parsed.seed_everything


def build_model(lit: Any, datamodule: Any, seed: bool | int, config: Path) -> Any:
    """The model ``vlfuse fit`` would train: ``lit``'s pretrained folder, or its architecture built after
    seeding as the fit seeds (the splits loaded first, as the fit loads them)."""
    import lightning as L

    from vlfuse.lit import agree_image_transform
    from vlfuse.model import VLFuseModel

    if lit.hparams.pretrained:
        model = VLFuseModel.from_pretrained(lit.hparams.pretrained)
    else:
        image = lit.architecture.image
        if not image.freeze:
            raise ValueError(
                f"{config}: the image encoder is not frozen (model.architecture.image.freeze is false): only a frozen "
                "encoder's features can be stored; add --model.architecture.image.freeze true (and train with it)"
            )
        if isinstance(seed, bool) and not (image.pretrained or image.weights_file):
            raise ValueError(
                f"{config}: seed_everything is {seed}, not a number: the from-scratch image encoder's weights come from "
                "the seed, so give one (--seed_everything 0) here and to vlfuse fit"
            )
        if not isinstance(seed, bool):
            L.seed_everything(seed, workers=True, verbose=False)
        datamodule.check_splits(["fit", "test"])
        agree_image_transform(datamodule, image)
        model = VLFuseModel.from_config(lit.architecture, datamodule.answers, datamodule.train_questions)
    if not model.config.image.freeze:
        raise ValueError(f"model.pretrained {lit.hparams.pretrained}: its image encoder is not frozen: its features would change as it trains")
    agree_image_transform(datamodule, model.config.image)
    return model


def distinct_images(datamodule: Any) -> tuple[list[tuple[Any, int, str]], int]:
    """Every distinct image file of the train, val and test splits, in that order, as ``(dataset, index,
    key)``; and the count of images held in memory, which have no key to store them by."""
    from vlfuse.datamodules.base import SPLITS

    seen: set[str] = set()
    images, in_memory = [], 0
    for split in SPLITS:
        dataset = datamodule.dataset(split)
        dataset.keep_decoded_bytes = 0  # each image is decoded once here
        for index, key in enumerate(dataset.image_keys):
            if key is None:
                in_memory += 1
            elif key not in seen:
                seen.add(key)
                images.append((dataset, index, key))
    return images, in_memory


class Pixels:
    """The images of ``(dataset, index, key)`` entries as a torch dataset: ``(3, S, S)`` each."""

    def __init__(self, entries: Sequence[tuple[Any, int, str]]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        dataset, index, _ = self.entries[i]
        return dataset.pixels(index)


def main(argv: list[str]) -> int:
    """``vlfuse cache-features``: see :func:`build_parser`."""
    args, overrides = parse(argv)
    set_threads(args.threads)
    import torch
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from vlfuse.encoders.feature_store import DTYPES, DiskFeatureStore, FeatureStoreWriter, rows_per_shard

    lit, datamodule, seed = build_from_config(args.config, overrides)
    model = build_model(lit, datamodule, seed, args.config)
    encoder = model.image_encoder.to(args.device).eval()
    out = args.out or Path("runs") / "features" / args.config.stem
    images, in_memory = distinct_images(datamodule)
    dtype = DTYPES[args.dtype]
    shape = (encoder.num_prefix_tokens + encoder.grid_size[0] * encoder.grid_size[1], encoder.width)
    with FeatureStoreWriter(out, encoder.feature_identity(), dtype, shape) as writer:
        pending = [entry for entry in images if entry[2] not in writer]
        per_shard = args.images_per_shard or rows_per_shard(shape, dtype)
        batch_size = args.batch_size or datamodule.batch_size
        bar = tqdm(total=len(images), initial=len(images) - len(pending), unit="image", desc="vlfuse cache-features")
        for start in range(0, len(pending), per_shard):
            chunk = pending[start : start + per_shard]
            features = torch.empty((len(chunk), *shape), dtype=dtype)
            loader = DataLoader(Pixels(chunk), batch_size=batch_size, num_workers=datamodule.num_workers)
            row = 0
            for pixels in loader:
                with torch.inference_mode():
                    features[row : row + len(pixels)] = encoder(pixels.to(args.device)).to("cpu", dtype)
                row += len(pixels)
                bar.update(len(pixels))
            writer.add_shard([key for _, _, key in chunk], features)
        bar.close()
        shards, stored = writer.shard_count, len(writer)
    size = sum(path.stat().st_size for path in out.glob("shard-*.safetensors"))
    print(
        f"vlfuse: {stored} images' features ({len(pending)} new) in {out}: {shards} shards, {size / 2**30:.2f} GiB of {args.dtype}"
    )
    if in_memory:
        print(f"vlfuse: {in_memory} images held in memory (no file) are not stored: the encoder runs on them in training")
    if args.verify:
        DiskFeatureStore(out).verify()
        print(f"vlfuse: every shard of {out} matches its SHA-256")
    print(f"vlfuse: train with the same config and overrides and --model.feature_store {out}")
    return 0
