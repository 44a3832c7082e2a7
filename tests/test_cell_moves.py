"""The cell-moves fuser: the cell-steps fuser whose kept set is shifted by the word, exactly, one
cell at most."""

import pytest
import torch

from vlfuse.fusers import CellMovesConfig, CellMovesFuser
from vlfuse.fusers.cell_moves import LEAST_SHARPNESS, STAY_BIAS
from vlfuse.model import VLFuseModel

from conftest import parameters_without_gradient, reader_config

QUESTIONS = ["is a red shape a square", "is a circle left of a square", "is a circle red"]


def cell_moves_model(**options) -> VLFuseModel:
    config = reader_config("cell_moves", mlp="swiglu", output_gate=True, dropout=0.0, **options)
    torch.manual_seed(0)
    return VLFuseModel.from_config(config, ["false", "true"], QUESTIONS)


def answer(model: VLFuseModel, pixels: torch.Tensor, questions: list[str], index: torch.Tensor):
    tokens = model.processor.tokenize(questions)
    return model(pixels, tokens["input_ids"], tokens["attention_mask"], image_index=index)


def shift_only_to(fuser: CellMovesFuser, step: tuple[int, int]) -> None:
    """Make every word shift the set by ``step`` (rows, cols), with all the weight."""
    with torch.no_grad():
        fuser.shift.weight.zero_()
        fuser.shift.bias.fill_(-1e4)
        fuser.shift.bias[fuser.shift_steps().index(step)] = 0.0


def assert_moves_exactly(fuser: CellMovesFuser, step: tuple[int, int]) -> None:
    """What the gate keeps of a random set is the set moved by ``step`` (rows, cols): what reached the
    edge is gone, and nothing stays behind."""
    rows, cols = fuser.grid_size
    m = torch.rand(2, rows, cols)
    kept = fuser._kept(m.flatten(1).log(), torch.randn(2, 1, fuser.shift.in_features), 0).exp().reshape(2, rows, cols)
    expected = torch.zeros_like(m)
    dr, dc = step
    for r in range(rows):
        for c in range(cols):
            if 0 <= r - dr < rows and 0 <= c - dc < cols:
                expected[:, r, c] = m[:, r - dr, c - dc]
    torch.testing.assert_close(kept, expected, atol=1e-6, rtol=1e-5)


def test_it_is_built_by_type_and_every_parameter_gets_a_gradient():
    model = cell_moves_model()
    assert isinstance(model.fuser, CellMovesFuser)
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1])).logits
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1])).backward()
    missing = parameters_without_gradient(model)
    assert [name for name in missing if "embeddings" not in name or "word_embeddings" in name] == []
    assert model.fuser.shift.weight.grad.abs().sum() > 0


def test_it_starts_by_keeping_most_of_the_set_where_it_is():
    fuser = cell_moves_model().fuser
    shifts = fuser.shifts(torch.randn(5, 1, fuser.shift.in_features) * 0.01)[:, 0]
    stay = fuser.shift_steps().index((0, 0))
    assert shifts.shape == (5, 9)
    torch.testing.assert_close(shifts.sum(-1), torch.ones(5))
    expected = torch.tensor(STAY_BIAS).exp() / (torch.tensor(STAY_BIAS).exp() + 8)
    assert torch.allclose(shifts[:, stay], expected.expand(5), atol=0.02)


@pytest.mark.parametrize("step", [(0, 1), (0, -1), (-1, 0), (1, 0), (0, 0)])
def test_a_word_with_all_its_weight_on_one_shift_moves_the_set_exactly(step):
    """``right of``: the set moves one column right; what reached the edge is gone, nothing stays behind."""
    fuser = cell_moves_model().fuser
    shift_only_to(fuser, step)
    assert_moves_exactly(fuser, step)


def test_two_moves_right_compose_to_two_columns_and_give_up_where_they_started():
    """The double move the cell-steps reader got wrong: green in the first column, two moves right,
    must be in the third column only (the question then asks whether that cell is green)."""
    fuser = cell_moves_model().fuser
    rows, cols = fuser.grid_size
    shift_only_to(fuser, (0, 1))
    start = torch.zeros(1, rows, cols)
    start[0, :, 0] = 1.0
    log_m = start.flatten(1).clamp_min(1e-30).log()
    words = torch.randn(1, 2, fuser.shift.in_features)
    moved = fuser._kept(fuser._kept(log_m, words, 1), words, 0).exp().reshape(rows, cols)
    assert moved[:, 2].min() > 0.999 and moved[:, :2].max() < 1e-6


def test_the_gradient_of_a_set_off_the_grid_is_finite():
    fuser = cell_moves_model().fuser
    log_m = torch.full((1, fuser.grid_size[0] * fuser.grid_size[1]), -50.0, requires_grad=True)
    word = torch.randn(1, 1, fuser.shift.in_features, requires_grad=True)
    fuser._kept(log_m, word, 0).sum().backward()
    assert torch.isfinite(log_m.grad).all() and torch.isfinite(word.grad).all()


def test_saves_and_loads_with_identical_logits(tmp_path):
    model = cell_moves_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model")).eval()
    assert loaded.config.fuser == CellMovesConfig(mlp="swiglu", output_gate=True, dropout=0.0)
    with torch.no_grad():
        torch.testing.assert_close(answer(loaded, pixels, QUESTIONS, index).logits,
                                   answer(model, pixels, QUESTIONS, index).logits, rtol=0, atol=0)


@pytest.mark.parametrize("reads, kernel, atol", [("word_and_previous", "mix", 0),
                                                 ("word_steered_by_previous", "mix", 1e-5),
                                                 ("word_and_previous", "displacement", 0)])
def test_a_shift_that_reads_the_previous_word_starts_as_the_word_alone_and_draws_nothing_more(reads, kernel, atol):
    """A shift that reads the word before starts at zero: the same seed gives the same weights (the
    random generator is not drawn from) and the same logits as ``word``. Adding a zero is exact; a
    steer renormalises the moves (``log_softmax`` then ``+ logsumexp``), equal to them only up to
    rounding, which differs between CPUs' vector units (2.4e-7 seen on CI)."""
    alone = cell_moves_model(shift_kernel=kernel).eval()
    with_previous = cell_moves_model(shift_reads=reads, shift_kernel=kernel).eval()
    assert with_previous.fuser.shift_previous.abs().sum() == 0
    weights = alone.state_dict()
    assert set(with_previous.state_dict()) - set(weights) == {"fuser.shift_previous"}
    for name, value in weights.items():
        assert torch.equal(with_previous.state_dict()[name], value), name
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    with torch.no_grad():
        torch.testing.assert_close(answer(with_previous, pixels, QUESTIONS, index).logits,
                                   answer(alone, pixels, QUESTIONS, index).logits, rtol=0, atol=atol)


def test_a_word_that_reads_the_previous_word_shifts_by_it_and_learns_from_it():
    """"of" after "right" and "of" after "left" can move differently: word t's shift changes with word
    t - 1 and with nothing else; the previous word's weights get a gradient."""
    model = cell_moves_model(shift_reads="word_and_previous")
    fuser = model.fuser
    with torch.no_grad():
        fuser.shift_previous.normal_()
    text = torch.randn(1, 4, fuser.shift.in_features)
    other = text.clone()
    other[:, 1] = torch.randn(fuser.shift.in_features)
    changed = (fuser.shifts(text) - fuser.shifts(other)).abs().amax(-1)[0]  # (4,)
    assert changed[1] > 0 and changed[2] > 1e-3  # word 1 itself, and word 2, which reads it
    assert changed[0] == 0 and changed[3] == 0
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1])).logits
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1])).backward()
    assert fuser.shift_previous.grad.abs().sum() > 0


def test_a_steering_word_before_changes_where_a_word_moves_never_how_much():
    """``word_steered_by_previous``: "shape" before "above" cannot hold "above" still. Word t's
    weight on no move is its own shift's, whatever word t - 1; the split of the rest among the
    eight moves changes with word t - 1; the shifts stay distributions and the steering weights learn."""
    model = cell_moves_model(shift_reads="word_steered_by_previous")
    fuser = model.fuser
    with torch.no_grad():
        fuser.shift_previous.normal_(std=3.0)
    text = torch.randn(2, 4, fuser.shift.in_features)
    other = text.clone()
    other[:, 1] = torch.randn(fuser.shift.in_features)
    shifts, changed = fuser.shifts(text), fuser.shifts(other)
    torch.testing.assert_close(shifts.sum(-1), torch.ones(2, 4))
    stay = fuser.shift_steps().index((0, 0))
    own = fuser.shift(text).softmax(-1)  # (2, 4, 9): each word alone
    torch.testing.assert_close(shifts[..., stay], own[..., stay])
    torch.testing.assert_close(changed[:, 2, stay], shifts[:, 2, stay])
    assert (changed[:, 2] - shifts[:, 2]).abs().amax() > 1e-3  # the moves of word 2 follow word 1
    torch.testing.assert_close(shifts[:, 0], own[:, 0])  # the first word has no word before it
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1])).logits
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1])).backward()
    assert fuser.shift_previous.grad.abs().sum() > 0


@pytest.mark.parametrize("reads", ["word_and_previous", "word_steered_by_previous"])
def test_a_shift_reading_the_previous_word_saves_and_loads_with_identical_logits(tmp_path, reads):
    model = cell_moves_model(shift_reads=reads).eval()
    with torch.no_grad():
        model.fuser.shift_previous.normal_()
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model")).eval()
    assert loaded.config.fuser.shift_reads == reads
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    with torch.no_grad():
        torch.testing.assert_close(answer(loaded, pixels, QUESTIONS, index).logits,
                                   answer(model, pixels, QUESTIONS, index).logits, rtol=0, atol=0)


def test_an_unknown_shift_reading_is_refused_by_name():
    with pytest.raises(ValueError, match="shift_reads"):
        reader_config("cell_moves", shift_reads="sentence")


# ------------------------------------------------------------------ shift_kernel: displacement


def displace_by(fuser: CellMovesFuser, displacement: tuple[float, float], sharpness: float) -> None:
    """Make every word move the set by a Gaussian of ``sharpness`` around ``displacement`` (rows, cols)."""
    with torch.no_grad():
        fuser.shift.weight.zero_()
        v = torch.tensor(sharpness - LEAST_SHARPNESS).expm1().log()  # softplus(v) = sharpness - least
        fuser.shift.bias.copy_(torch.tensor([2 * sharpness * displacement[0], 2 * sharpness * displacement[1], v]))


def displacement_weights(fuser: CellMovesFuser) -> dict[tuple[int, int], float]:
    return dict(zip(fuser.shift_steps(), fuser.shifts(torch.randn(1, 1, fuser.shift.in_features))[0, 0].tolist()))


def test_a_displacement_starts_by_keeping_most_of_the_set_where_it_is():
    fuser = cell_moves_model(shift_kernel="displacement").fuser
    assert fuser.shift.out_features == 3
    shifts = fuser.shifts(fuser.word_norm(torch.randn(200, 1, fuser.shift.in_features)))[:, 0]  # (200, 9)
    torch.testing.assert_close(shifts.sum(-1), torch.ones(200))
    stay = fuser.shift_steps().index((0, 0))
    assert 0.8 < shifts[:, stay].median() < 0.9
    assert shifts[:, stay].std() > 0.01  # each word leaks its own way


def test_a_displacement_weights_the_steps_as_a_gaussian_around_it():
    """``p_k`` proportional to ``exp(-c |step_k - mu|^2)``, over the nine steps."""
    fuser = cell_moves_model(shift_kernel="displacement").fuser
    mu, c = torch.tensor([-0.3, 0.6]), 4.0
    displace_by(fuser, tuple(mu.tolist()), c)
    steps = torch.tensor(fuser.shift_steps(), dtype=torch.float32)
    expected = (-c * (steps - mu).square().sum(-1)).softmax(0)
    for (step, weight), want in zip(displacement_weights(fuser).items(), expected.tolist()):
        assert weight == pytest.approx(want, rel=1e-4), step


@pytest.mark.parametrize("step", [(0, 1), (0, -1), (-1, 0), (1, 0), (0, 0)])
def test_a_sharp_displacement_of_one_cell_moves_the_set_exactly(step):
    fuser = cell_moves_model(shift_kernel="displacement").fuser
    displace_by(fuser, step, sharpness=30.0)
    assert_moves_exactly(fuser, step)


def test_a_displacement_cannot_spread_the_set_wider_than_it_starts():
    """However low its sharpness's logit, a word keeps at least 0.77 of the set where it is; a mix can keep nothing."""
    fuser = cell_moves_model(shift_kernel="displacement").fuser
    with torch.no_grad():
        fuser.shift.weight.zero_()
        fuser.shift.bias.copy_(torch.tensor([0.0, 0.0, -1e4]))
    stay = displacement_weights(fuser)[(0, 0)]
    assert stay == pytest.approx((1 + 2 * torch.tensor(-LEAST_SHARPNESS).exp().item()) ** -2, rel=1e-5)
    assert stay > 0.76


def test_opposite_pulls_cancel_on_a_displacement_and_add_on_a_mix():
    """The cause of seed 5's stall (docs/results.md): "of" is asked to move left in "left of" and right in
    "right of". On a mix both lower its weight on "no shift" and each raises one move; on a displacement
    the two pulls on ``mu`` cancel, and only the sharpness, which has a floor, is pulled down."""
    left, right = (0, -1), (0, 1)
    pulls = {}
    for kernel in ("mix", "displacement"):
        fuser = cell_moves_model(shift_kernel=kernel).fuser
        with torch.no_grad():
            fuser.shift.weight.zero_()
        weights = fuser.shifts(torch.zeros(1, 1, fuser.shift.in_features))[0, 0]
        index = fuser.shift_steps().index
        (-(weights[index(left)].log() + weights[index(right)].log())).backward()  # "left of" + "right of"
        pulls[kernel] = fuser.shift.bias.grad
    mix, displacement = pulls["mix"], pulls["displacement"]
    assert mix[index((0, 0))] > 0.5  # gradient descent lowers "no shift"
    assert mix[index(left)] < 0 and mix[index(right)] < 0
    assert displacement[:2].abs().max() < 1e-6  # mu: left and right cancel
    assert displacement[2] > 0  # the sharpness is pulled down, toward its floor


def test_a_displacement_saves_and_loads_with_identical_logits(tmp_path):
    model = cell_moves_model(shift_kernel="displacement").eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model")).eval()
    assert loaded.config.fuser.shift_kernel == "displacement"
    with torch.no_grad():
        torch.testing.assert_close(answer(loaded, pixels, QUESTIONS, index).logits,
                                   answer(model, pixels, QUESTIONS, index).logits, rtol=0, atol=0)


def test_a_displacement_is_not_steered_by_the_word_before():
    with pytest.raises(ValueError, match="word_steered_by_previous"):
        reader_config("cell_moves", shift_kernel="displacement", shift_reads="word_steered_by_previous")
