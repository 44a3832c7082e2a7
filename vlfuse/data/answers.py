"""The answer vocabulary: the classes of the answer classifier."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


class AnswerVocab:
    """An ordered list of answers with a fast answer -> index lookup."""

    def __init__(self, answers: Iterable[str]) -> None:
        self.answers = list(answers)
        self._index = {a: i for i, a in enumerate(self.answers)}
        if len(self._index) != len(self.answers):
            raise ValueError("answer vocabulary has duplicates")
        if not self.answers:
            raise ValueError("answer vocabulary is empty")

    @classmethod
    def most_common(cls, answers: Iterable[str], top_k: int | None = None) -> "AnswerVocab":
        """The ``top_k`` most frequent answers (ties broken alphabetically), or all of them."""
        counts = Counter(answers)
        ranked = sorted(counts, key=lambda a: (-counts[a], a))
        return cls(ranked[:top_k] if top_k else ranked)

    def __len__(self) -> int:
        return len(self.answers)

    def __contains__(self, answer: str) -> bool:
        return answer in self._index

    def index(self, answer: str) -> int:
        try:
            return self._index[answer]
        except KeyError:
            raise KeyError(f"answer {answer!r} is not in the answer vocabulary of {len(self)} answers") from None

    def unknown(self, answers: Iterable[str]) -> list[str]:
        """The distinct ``answers`` that are not in this vocabulary, in the order they first come."""
        return list(dict.fromkeys(a for a in answers if a not in self._index))

    def extended(self, answers: Iterable[str]) -> "AnswerVocab":
        """This vocabulary followed by the ``answers`` it lacks: every index of this one is kept."""
        return AnswerVocab([*self.answers, *self.unknown(answers)])


def quoted(answers: Sequence[str], shown: int = 5) -> str:
    """``answers`` quoted and comma-separated for a message: the first ``shown``, then how many in all."""
    return ", ".join(map(repr, answers[:shown])) + (f", ... ({len(answers)} in all)" if len(answers) > shown else "")
