"""BLEU-4 and CIDEr-D against hand-worked values and coco-caption's, and the torchmetrics wrappers.

The hand-worked values are derived in the comments. Where a value is said to come from
pycocoevalcap, it was computed by pycocoevalcap 1.2's ``Bleu(4)`` / ``Cider()`` (its Java-free
scorers) on the tokenised text; on 300 random corpora of 1-12 images (empty captions included)
the two implementations agreed within 2e-15.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlfuse.captioning.grammar import describe
from vlfuse.captioning.metrics import CaptionScores, SceneCaptionScores, bleu4, cider_d, tokenize_caption

from test_caption_grammar import ISSUE_EXAMPLE, ISSUE_SCENE
from test_shapes import scene_of


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenize_caption_lowercases_splits_clitics_and_drops_coco_punctuation():
    assert tokenize_caption("A man's dog, don't RUN!") == ["a", "man", "'s", "dog", "do", "n't", "run"]
    assert tokenize_caption("(A) T-shirt costs $2.50...") == ["a", "t-shirt", "costs", "$", "2.50"]
    assert tokenize_caption(ISSUE_EXAMPLE) == ISSUE_EXAMPLE.replace(" .", "").split()


# ---------------------------------------------------------------------------------------- BLEU


def test_bleu4_is_corpus_level_on_summed_ngram_counts():
    generated = ["a red square is left of a blue circle", "there is a green triangle"]
    references = [["a red square is left of a blue circle"], ["there is a green circle"]]
    # image 1 matches all its 9 / 8 / 7 / 6 n-grams (n = 1..4); image 2 ("triangle" for "circle")
    # 4 of 5, 3 of 4, 2 of 3, 1 of 2; both have the length of their reference (no brevity penalty)
    expected = (13 / 14 * 11 / 12 * 9 / 10 * 7 / 8) ** (1 / 4)
    assert bleu4(generated, references) == pytest.approx(expected, rel=1e-8)


def test_bleu4_clips_each_ngram_at_its_largest_count_in_any_one_reference():
    # "the" twice in the candidate and twice in the second reference: every n-gram matches; the
    # closest reference is 6 words long, so the score is the brevity penalty alone
    assert bleu4(["the cat on the mat"], [["a cat", "the cat on the mat today"]]) == pytest.approx(
        math.exp(1 - 6 / 5), rel=1e-8
    )
    # "the" is once in each reference: it matches once of the candidate's twice, not twice
    assert bleu4(["the the"], [["the cat", "a the"]]) == pytest.approx(bleu4(["the dog"], [["the cat"]]), rel=1e-8)


def test_bleu4_brevity_penalty_uses_the_reference_closest_in_length_shorter_on_a_tie():
    candidate = ["there is a green"]  # 4 words, every n-gram in the first reference
    assert bleu4(candidate, [["there is a green circle", "there is a green square ."]]) == pytest.approx(
        math.exp(1 - 5 / 4), rel=1e-8  # closest reference: 5 words ("." is dropped by the tokenizer)
    )
    # references of 3 and 5 words are equally close: the shorter is taken, and 4 > 3 has no penalty
    assert bleu4(candidate, [["there is a green circle", "there is a"]]) == pytest.approx(1.0, rel=1e-8)


def test_bleu4_of_an_empty_caption_or_no_images_is_zero():
    assert bleu4([""], [["there is a green circle"]]) == 0.0
    assert bleu4([], []) == 0.0


def test_bleu4_and_cider_d_match_pycocoevalcap_on_a_realistic_example():
    generated = [
        "A man riding a wave on top of a surfboard.",
        "A plate of food, with broccoli and meat.",
        "Two dogs play in the grass",
    ]
    references = [
        ["a man riding a wave on a surfboard", "A surfer rides a large wave in the ocean."],
        ["a plate of food with meat and broccoli", "A white plate topped with food and vegetables."],
        ["Two dogs playing on a lawn.", "a pair of dogs run in the grass", "dogs in the grass"],
    ]
    # pycocoevalcap 1.2 on the tokenised text (lowercase, no punctuation)
    assert bleu4(generated, references) == pytest.approx(0.5322394779, rel=1e-9)
    assert cider_d(generated, references) == pytest.approx(3.2915463752, rel=1e-9)


# -------------------------------------------------------------------------------------- CIDEr-D


def test_cider_d_of_captions_equal_to_their_only_reference():
    # Every n-gram occurs in one of the 2 images: idf = log 2 for all. Orders 1 and 2 have cosine 1;
    # a 2-word caption has no 3- or 4-grams (cosine 0): mean over n = 2/4, times 10 = 5 per image.
    assert cider_d(["red circle", "blue square"], [["red circle"], ["blue square"]]) == pytest.approx(5.0)


def test_cider_d_gives_ngrams_found_in_every_image_no_weight():
    # "a", "red", "a red" occur in the references of both images: idf 0. Image 1 matches its
    # remaining n-grams at orders 1..3 (3/4 x 10 = 7.5); image 2 shares no weighted n-gram: 0.
    generated = ["a red circle", "a blue circle"]
    references = [["a red circle"], ["a red square"]]
    assert cider_d(generated, references) == pytest.approx((7.5 + 0.0) / 2)


def test_cider_d_clips_repeated_words_and_penalises_length_differences():
    # Image 1: "circle" has weight 2 log 2 in the candidate, log 2 in the reference: clipped, the
    # unigram cosine is log2 * log2 / (2 log2 * log2) = 1/2; its bigram is not in the reference (0);
    # mean over n = 1/8, times the penalty exp(-1 / (2 * 6^2)) for the one-word difference, x10.
    # Image 2: unigram cosine 1, mean 1/4, x10 = 2.5.
    generated = ["circle circle", "square"]
    references = [["circle"], ["square"]]
    expected = (1.25 * math.exp(-1 / 72) + 2.5) / 2
    assert cider_d(generated, references) == pytest.approx(expected)


def test_cider_d_averages_over_the_references_of_an_image():
    # Image 1's candidate equals one of its two references and shares nothing weighted with the other
    both = cider_d(["red circle", "blue square"], [["red circle", "green triangle"], ["blue square"]])
    # n-grams now occur in 1 image of 2 as before: 5 for the matching reference, 0 for the other
    assert both == pytest.approx((5.0 / 2 + 5.0) / 2)


def test_cider_d_of_a_single_image_is_zero_since_every_ngram_is_in_every_image():
    assert cider_d(["a red circle"], [["a red circle"]]) == 0.0


def test_caption_metrics_name_the_image_without_references():
    with pytest.raises(ValueError, match="image 1: references must be a non-empty list"):
        cider_d(["a", "b"], [["a"], []])
    with pytest.raises(ValueError, match="2 generated captions but 1 reference lists"):
        bleu4(["a", "b"], [["a"]])


# --------------------------------------------------------------------------------- torchmetrics


def test_caption_scores_over_several_updates_equal_the_functions_on_all_images():
    generated = ["red circle", "a blue square", "there is a green triangle"]
    references = [["red circle", "a red circle"], ["a blue square"], ["there is a green circle", "a green circle"]]
    metric = CaptionScores()
    metric.update(generated[:2], references[:2])
    metric.update(generated[2:], references[2:])
    scores = metric.compute()
    assert scores["bleu4"].item() == pytest.approx(bleu4(generated, references), rel=1e-6)
    assert scores["cider"].item() == pytest.approx(cider_d(generated, references), rel=1e-6)
    assert scores["cider"].item() > 0


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric CaptionScores was called before")
def test_caption_scores_keep_non_ascii_text_and_start_at_zero():
    metric = CaptionScores()
    assert {k: v.item() for k, v in metric.compute().items()} == {"bleu4": 0.0, "cider": 0.0}
    generated, references = ["un café crème", "a dog"], [["un café crème", "café"], ["a dog"]]
    metric.update(generated[:1], references[:1])
    metric.update(generated[1:], references[1:])
    assert metric.compute()["cider"].item() == pytest.approx(cider_d(generated, references), rel=1e-6)
    assert cider_d(generated, references) > 0


def test_scene_caption_scores_micro_average_over_sentences_and_objects():
    half_true = "a red square is left of a blue circle . there is a red circle ."  # 1 of 2 true, 1 of 3 objects
    lone = scene_of(". . .", ". bt .", ". . .")
    metric = SceneCaptionScores()
    metric.update([describe(ISSUE_SCENE), half_true], [ISSUE_SCENE, ISSUE_SCENE])
    metric.update(["there is a blue triangle . there is a blue triangle . there is a pink triangle ."], [lone])
    scores = metric.compute()
    # sentences: 3 + 2 + 3, of which 3 + 1 + 2 true; objects: 3 + 3 + 1, of which 3 + 1 + 1 described
    assert scores["fact_precision"].item() == pytest.approx(6 / 8)
    assert scores["object_recall"].item() == pytest.approx(5 / 7)


def test_caption_scores_check_each_batch_as_it_comes():
    with pytest.raises(ValueError, match="image 0: references must be a non-empty list of captions, got 'a dog'"):
        CaptionScores().update(["a dog"], ["a dog"])
    with pytest.raises(ValueError, match="caption 0 must be a string without NUL characters"):
        CaptionScores().update(["a\0dog"], [["a dog"]])


def test_scene_caption_scores_want_one_caption_per_scene():
    with pytest.raises(ValueError, match="2 generated captions but 1 scenes"):
        SceneCaptionScores().update(["", ""], [ISSUE_SCENE])


# ------------------------------------------------------------------------------------------ DDP

SHARES = [  # (generated, references) of each rank
    (["red circle", "a blue square"], [["red circle"], ["a blue square", "blue square"]]),
    (["there is a green triangle"], [["there is a green triangle", "a green circle"]]),
]


def _ddp_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One process of a 2-process gloo group: update with this rank's share, compute, write the result."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    both, only_rank0, scenes = CaptionScores(), CaptionScores(), SceneCaptionScores()
    generated, references = SHARES[rank]
    both.update(generated, references)
    if rank == 0:
        only_rank0.update(generated, references)
        scenes.update([describe(ISSUE_SCENE)], [ISSUE_SCENE])
    else:
        scenes.update(["there is a pink circle ."], [scene_of("rs . .", ". . .", ". . .")])
    result = {
        "both": {k: v.item() for k, v in both.compute().items()},
        "only_rank0": {k: v.item() for k, v in only_rank0.compute().items()},
        "scenes": {k: v.item() for k, v in scenes.compute().items()},
    }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_caption_metrics_gather_every_process_s_texts_under_ddp(tmp_path):
    mp.spawn(_ddp_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    generated = SHARES[0][0] + SHARES[1][0]
    references = SHARES[0][1] + SHARES[1][1]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["both"]["cider"] == pytest.approx(cider_d(generated, references), rel=1e-6)
        assert result["both"]["bleu4"] == pytest.approx(bleu4(generated, references), rel=1e-6)
        assert result["only_rank0"]["cider"] == pytest.approx(cider_d(*SHARES[0]), rel=1e-6)
        # 3 true of 3 + 1 sentences; 3 of 3 + 1 objects described
        assert result["scenes"] == pytest.approx({"fact_precision": 3 / 4, "object_recall": 3 / 4})
