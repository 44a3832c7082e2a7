"""easy-VQA (the ``easy-vqa`` package on PyPI): 64x64 images of one shape, 13 answers."""

from __future__ import annotations

from collections import defaultdict

from vlfuse.data.records import ImageQuestions


def _import_easy_vqa():
    try:
        import easy_vqa
    except ImportError as err:  # pragma: no cover - it is a declared dependency
        raise ImportError("easy-VQA data needs the 'easy-vqa' package: pip install easy-vqa") from err
    return easy_vqa


def easy_vqa_answers() -> list[str]:
    """The 13 answers of easy-VQA, in the package's order."""
    return list(_import_easy_vqa().get_answers())


def load_easy_vqa(split: str) -> list[ImageQuestions]:
    """The ``train`` (4,000 images) or ``test`` (1,000 images) split, one record per image."""
    easy_vqa = _import_easy_vqa()
    if split == "train":
        questions, answers, image_ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    elif split == "test":
        questions, answers, image_ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    else:
        raise ValueError(f"easy-VQA has splits 'train' and 'test', not {split!r}")
    grouped: dict[int, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for question, answer, image_id in zip(questions, answers, image_ids):
        grouped[image_id][0].append(question)
        grouped[image_id][1].append(answer)
    return [
        ImageQuestions(paths[image_id], qs, ans, image_id=f"{split}/{image_id}")
        for image_id, (qs, ans) in sorted(grouped.items())
    ]


SHAPE_WORDS = ("circle", "rectangle", "triangle")


def question_kind(question: str) -> str:
    """The kind of an easy-VQA question: ``what colour``, ``what shape``, or ``yes/no colour`` /
    ``yes/no shape``, with `` negated`` when the question has "not" or "no"."""
    words = question.rstrip("?").split()
    if words[0] == "what":
        return "what colour" if "color" in words else "what shape"
    subject = "shape" if any(w in SHAPE_WORDS for w in words) else "colour"
    negated = " negated" if "not" in words or "no" in words else ""
    return f"yes/no {subject}{negated}"
