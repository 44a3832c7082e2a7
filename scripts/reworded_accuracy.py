"""Accuracy of a saved model on easy-VQA test questions, templated and reworded, by kind of question.

The reworded questions (:mod:`vlfuse.data.easy_vqa_reworded`) ask the same things about the same
test images in words the training templates never use (synonyms, British spelling, other word
orders); their answers are the templated questions' answers.

    .venv/bin/python scripts/reworded_accuracy.py --model runs/easy_vqa_minilm/latest/model
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader

from vlfuse.analysis.grouped_accuracy import accuracy_by_group
from vlfuse.data import AnswerVocab, GroupedVQADataset, collate_grouped
from vlfuse.data.easy_vqa import load_easy_vqa
from vlfuse.data.easy_vqa_reworded import parse_question, reworded_easy_vqa
from vlfuse.model import VLFuseModel


def kind(question: str) -> str:
    asked = parse_question(question)
    about = f" {'shape' if asked.shape else 'colour'}" if asked.kind == "exists" else ""
    return f"{asked.kind}{about}{' negated' if asked.negated else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a directory written by save_pretrained")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rewording (default 0)")
    parser.add_argument("--limit-images", type=int, default=None, help="only the first N test images")
    args = parser.parse_args()

    model = VLFuseModel.from_pretrained(args.model).eval()
    vocab = AnswerVocab(model.answers)
    templated = load_easy_vqa("test")[: args.limit_images]
    kinds = [kind(q) for r in templated for q in r.questions]  # in loader order
    results = {}
    for name, records in (("templated", templated), ("reworded", reworded_easy_vqa("test", args.seed)[: args.limit_images])):
        data = GroupedVQADataset(records, vocab, model.config.image.image_size, interpolation=model.processor.interpolation)
        loader = DataLoader(data, batch_size=64, collate_fn=collate_grouped)
        results[name] = accuracy_by_group(model, loader, lambda row, question: kinds[row])
    print(f"{args.model}; rewording seed {args.seed}\n")
    print("| question kind | questions | templated | reworded |\n|:---|---:|---:|---:|")
    total = results["templated"][1]
    for group in sorted(total):
        cells = " | ".join(f"{results[n][0][group] / total[group]:.1%}" for n in results)
        print(f"| {group} | {total[group]} | {cells} |")
    overall = " | ".join(f"**{sum(c.values()) / sum(t.values()):.2%}**" for c, t in results.values())
    print(f"| all | {sum(total.values())} | {overall} |")


if __name__ == "__main__":
    main()
