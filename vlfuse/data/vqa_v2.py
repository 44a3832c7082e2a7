"""VQA v2 in its official layout: questions and annotations JSON files and a folder of COCO images.

- questions: ``{"questions": [{"image_id", "question", "question_id"}, ...]}``;
- annotations: ``{"annotations": [{"question_id", "image_id", "answers": [{"answer",
  "answer_confidence", "answer_id"}, x10], "multiple_choice_answer", "answer_type",
  "question_type"}, ...]}`` (absent for the test splits);
- images: ``COCO_train2014_000000000009.jpg`` and so on (the name pattern is configurable).

Answers are compared after :func:`normalize_answer` (the official evaluation's rules) and scored
with :func:`vqa_accuracy` (the official soft accuracy).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from vlfuse.data.records import ImageQuestions

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ normalisation

_PUNCTUATION = ";/[]\"{}()=+\\_-><@`,?!"
"""Marks the official evaluation strips; apostrophes (contractions) and colons are kept, periods
are handled apart (:data:`_PERIOD`)."""
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD = re.compile(r"\.(?!\d)")
"""A period not followed by a digit is dropped ("yes." -> "yes", but "2.5" stays)."""
_NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {
    word.replace("'", ""): word
    for word in (
        "ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've "
        "hasn't haven't he'd he'd've he's how'd how'll how's i'd've isn't it'd it'd've it'll let's "
        "ma'am mightn't mightn't've might've mustn't must've needn't not've o'clock oughtn't shan't "
        "she'd she'd've she's should've shouldn't shouldn't've somebody'd somebody'd've somebody'll "
        "somebody's someone'd someone'd've someone'll someone's something'd something'd've "
        "something'll that's there'd there'd've there're there's they'd they'd've they'll they're "
        "they've 'twas wasn't we'd we'd've we're we've weren't what'll what're what's what've when's "
        "where'd where's where've who'd who'd've who'll who're who's who've why'll why're why's won't "
        "would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've"
    ).split()
}
"""Contractions written without their apostrophe ("dont") -> with it ("don't")."""


def _strip_punctuation(text: str) -> str:
    """Drop or space out punctuation as the official evaluation does.

    A mark next to a space is dropped ("red, white" -> "red white"), as is every mark when the
    answer holds a digit-comma-digit ("1,000" -> "1000"); a mark inside a word becomes a space
    ("t-shirt" -> "t shirt"). Then periods not followed by a digit are dropped.
    """
    glued_number = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in _PUNCTUATION:
        if glued_number or f"{mark} " in text or f" {mark}" in text:
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return _PERIOD.sub("", out)


def normalize_answer(answer: str) -> str:
    """Normalise an answer by the rules of the official VQA evaluation.

    Whitespace is collapsed, punctuation handled as in :func:`_strip_punctuation`, the text is
    lowercased, number words become digits ("two" -> "2", "none" -> "0"), articles (a, an, the)
    are dropped and apostrophe-less contractions get their apostrophe back ("dont" -> "don't").
    (The official script skips this when all ten human answers agree; vlfuse always applies it,
    so that the answer classes of a vocabulary are normalised alike.)
    """
    text = _strip_punctuation(answer.replace("\n", " ").replace("\t", " ").strip())
    words = []
    for word in text.lower().split():
        word = _NUMBER_WORDS.get(word, word)
        if word not in _ARTICLES:
            words.append(_CONTRACTIONS.get(word, word))
    return " ".join(words)


def vqa_accuracy(prediction: str, human_answers: Sequence[str], *, normalize: bool = True) -> float:
    """The official VQA soft accuracy of one predicted answer.

    ``min(#humans who gave the prediction / 3, 1)``, averaged, as the official evaluation does,
    over the leave-one-out subsets of the human answers (the 10 subsets of 9 of the 10 answers).
    With m of 10 humans agreeing this is 0, 0.3, 0.6, 0.9 and then 1 for m = 0, 1, 2, 3, >= 4.

    Args:
        prediction: the model's answer.
        human_answers: every annotator's answer (ten in VQA v2).
        normalize: apply :func:`normalize_answer` to all answers first (it is idempotent, so
            already normalised answers are safe).
    """
    if not human_answers:
        raise ValueError("vqa_accuracy needs at least one human answer")
    if normalize:
        prediction = normalize_answer(prediction)
        human_answers = [normalize_answer(a) for a in human_answers]
    matches = sum(a == prediction for a in human_answers)
    return soft_accuracy(torch.tensor([matches]), torch.tensor([len(human_answers)])).item()


def soft_accuracy(matches: torch.Tensor, humans: torch.Tensor) -> torch.Tensor:
    """The official VQA soft accuracy from counts: per question, ``min(#matching humans / 3, 1)``
    averaged over the leave-one-out subsets of its ``humans`` answers.

    Leaving out a matching annotator leaves ``matches - 1`` matches, leaving out another leaves
    ``matches``. With m of 10 humans matching: 0, 0.3, 0.6, 0.9, then 1 for m >= 4. A question with
    one human answer scores ``matches`` (there is no subset to leave out).

    Args:
        matches: ``(Bq,)`` humans whose answer equals the prediction.
        humans: ``(Bq,)`` human answers of each question (at least 1).
    """
    matches, humans = matches.double(), humans.double()
    left_out_match = (matches - 1).clamp(min=0).div(3).clamp(max=1)
    left_out_other = matches.div(3).clamp(max=1)
    averaged = (matches * left_out_match + (humans - matches) * left_out_other) / humans
    return torch.where(humans == 1, matches, averaged)


def majority_answer(answers: Sequence[str]) -> str:
    """The most common answer; a tie goes to the answer given first."""
    return Counter(answers).most_common(1)[0][0]


# ------------------------------------------------------------------------------------- loading


class VQAFormatError(ValueError):
    """A VQA v2 file or record that does not follow the official schema; the message says where."""


@dataclass
class VQAv2Data:
    """The records of one VQA v2 split.

    Attributes:
        records: one per image, questions in file order; ``answers`` holds the majority normalised
            human answer and ``human_answers`` the (ten) normalised answers of each question;
            both are empty without an annotations file.
        question_ids: the ``question_id`` of each question, aligned with ``records``.
        skipped: questions left out with ``skip_bad=True``, by reason.
    """

    records: list[ImageQuestions]
    question_ids: list[list[int]]
    skipped: dict[str, int] = field(default_factory=dict)


def _load_json(path: Path, key: str) -> list:
    """The list under ``key`` of a JSON file, or a VQAFormatError naming the file (and line)."""
    if not path.is_file():
        raise FileNotFoundError(f"VQA v2 file not found: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise VQAFormatError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise VQAFormatError(f"{path}: expected a JSON object with a list under {key!r}")
    return data[key]


def _field(record: Any, name: str, kind: type, where: str) -> Any:
    """``record[name]``, checked to be of type ``kind``."""
    if not isinstance(record, dict):
        raise VQAFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise VQAFormatError(f"{where}: {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _record_where(path: Path, index: int, record: Any) -> str:
    """``"file: record 12 (question_id 4005)"`` for error messages."""
    qid = record.get("question_id") if isinstance(record, dict) else None
    return f"{path}: record {index}" + (f" (question_id {qid})" if qid is not None else "")


def _read_annotation(record: Any, where: str) -> tuple[int, int, list[str]]:
    """(question_id, image_id, normalised human answers) of one annotation record."""
    question_id = _field(record, "question_id", int, where)
    image_id = _field(record, "image_id", int, where)
    answers = _field(record, "answers", list, where)
    if not answers:
        raise VQAFormatError(f"{where}: 'answers' is empty")
    humans = [normalize_answer(_field(a, "answer", str, f"{where}, answer {j}")) for j, a in enumerate(answers)]
    return question_id, image_id, humans


class _Skipper:
    """Raise on a bad record, or (with ``skip_bad``) count it by reason."""

    def __init__(self, skip_bad: bool) -> None:
        self.skip_bad = skip_bad
        self.counts: Counter[str] = Counter()

    def __call__(self, reason: str, error: Exception) -> None:
        if not self.skip_bad:
            raise error
        self.counts[reason] += 1


def default_image_pattern(image_dir: str | Path) -> str:
    """The COCO file name pattern of an image folder: ``COCO_<folder name>_<12-digit id>.jpg``."""
    return f"COCO_{Path(image_dir).name}_{{image_id:012d}}.jpg"


def load_vqa_v2(
    questions_file: str | Path,
    annotations_file: str | Path | None,
    image_dir: str | Path,
    *,
    image_pattern: Optional[str] = None,
    skip_bad: bool = False,
) -> VQAv2Data:
    """Read one VQA v2 split in the official layout, one :class:`ImageQuestions` per image.

    Args:
        questions_file: the questions JSON.
        annotations_file: the annotations JSON, or ``None`` for a split without answers.
        image_dir: the image folder.
        image_pattern: file name of an image, formatted with ``image_id``; by default
            :func:`default_image_pattern` (``COCO_train2014_000000000009.jpg`` in ``train2014``).
        skip_bad: leave out and count (see :attr:`VQAv2Data.skipped`, also logged) malformed
            records, questions without annotations and questions whose image is missing, instead
            of raising.

    Raises:
        VQAFormatError: a malformed file or record (names the file, record index and question_id),
            a question without annotation, an annotation that disagrees with its question.
        FileNotFoundError: a missing JSON file, or image (names the file and image_id).
    """
    questions_file, image_dir = Path(questions_file), Path(image_dir)
    pattern = image_pattern or default_image_pattern(image_dir)
    skip = _Skipper(skip_bad)
    annotations = _read_annotations(Path(annotations_file), skip) if annotations_file is not None else None
    by_image: dict[int, list[tuple[int, str, list[str]]]] = defaultdict(list)
    seen: set[int] = set()
    for i, record in enumerate(_load_json(questions_file, "questions")):
        where = _record_where(questions_file, i, record)
        try:
            question_id = _field(record, "question_id", int, where)
            image_id = _field(record, "image_id", int, where)
            question = _field(record, "question", str, where)
        except VQAFormatError as err:
            skip("malformed question records", err)
            continue
        if question_id in seen:
            raise VQAFormatError(f"{where}: question_id {question_id} appears twice")
        seen.add(question_id)
        humans: list[str] = []
        if annotations is not None:
            if question_id not in annotations:
                skip("questions without annotations", VQAFormatError(f"{where}: no annotation in {annotations_file}"))
                continue
            annotated_image, humans = annotations[question_id]
            if annotated_image != image_id:
                raise VQAFormatError(
                    f"{where}: image_id {image_id}, but its annotation in {annotations_file} says {annotated_image}"
                )
        by_image[image_id].append((question_id, question, humans))
    data = _group_by_image(by_image, image_dir, pattern, skip, questions_file, annotated=annotations is not None)
    data.skipped = dict(skip.counts)
    if skip.counts:
        logger.warning("VQA v2 %s: skipped %s", questions_file, ", ".join(f"{n} {r}" for r, n in skip.counts.items()))
    return data


def _read_annotations(path: Path, skip: _Skipper) -> dict[int, tuple[int, list[str]]]:
    """question_id -> (image_id, normalised human answers)."""
    annotations: dict[int, tuple[int, list[str]]] = {}
    for i, record in enumerate(_load_json(path, "annotations")):
        where = _record_where(path, i, record)
        try:
            question_id, image_id, answers = _read_annotation(record, where)
        except VQAFormatError as err:
            skip("malformed annotation records", err)
            continue
        if question_id in annotations:
            raise VQAFormatError(f"{where}: a second annotation for question_id {question_id}")
        annotations[question_id] = (image_id, answers)
    return annotations


def _group_by_image(
    by_image: dict[int, list[tuple[int, str, list[str]]]],
    image_dir: Path,
    pattern: str,
    skip: _Skipper,
    source: Path,
    annotated: bool,
) -> VQAv2Data:
    """One record per image whose file exists, in order of the images' first question.

    ``by_image`` maps an image_id to its (question_id, question, normalised human answers).
    """
    records, question_ids = [], []
    for image_id, questions in by_image.items():
        path = image_dir / pattern.format(image_id=image_id)
        if not path.is_file():
            error = FileNotFoundError(f"image file not found: {path} (image_id {image_id}, asked about in {source})")
            for _ in questions:
                skip("questions whose image is missing", error)
            continue
        humans = [h for _, _, h in questions] if annotated else []
        records.append(
            ImageQuestions(
                image=str(path),
                questions=[q for _, q, _ in questions],
                answers=[majority_answer(h) for h in humans],
                image_id=str(image_id),
                human_answers=humans,
            )
        )
        question_ids.append([qid for qid, _, _ in questions])
    return VQAv2Data(records, question_ids)
