"""scripts/stall_diagnosis.py: accuracy and attention on the object by kind of question, per epoch's
checkpoint, and a fresh head fitted on a frozen epoch."""

import sys

import pytest
import torch

from vlfuse.cli import main as vlfuse_main

from conftest import REPO, load_script, tiny_cli_args

diagnosis = load_script("stall_diagnosis")


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    """A tiny easy-VQA run of 2 epochs that keeps every epoch's checkpoint."""
    root = tmp_path_factory.mktemp("run")
    args = ["fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(root, 8),
            "--trainer.max_epochs=2", "--test_after_fit=false", "--checkpoint.save_top_k=-1", "--threads=1"]
    assert vlfuse_main(args) == 0
    return root


def test_the_command_tabulates_every_epoch_and_layer_and_the_refit(run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["stall_diagnosis.py", "--run", str(run), "--limit-images", "4",
                                      "--refit-epoch", "1", "--refit-epochs", "2"])
    diagnosis.main()
    out = capsys.readouterr().out
    accuracy, layer0, refit = out.split("\n\n")[1], out.split("\n\n")[3], out.split("\n\n")[-1]
    assert [line.split("|")[1].strip() for line in accuracy.splitlines()[2:]] == ["0", "1"]
    assert "what colour" in accuracy.splitlines()[0] and "yes/no" in accuracy.splitlines()[0]
    assert "Fusion layer 0" in out and "Fusion layer 1" not in out  # the tiny run has one fusion block
    shares = [float(cell.strip().rstrip("%")) for line in layer0.splitlines()[2:] for cell in line.split("|")[2:-1] if cell.strip()]
    assert shares and all(0.0 <= share <= 100.0 for share in shares)
    assert [line.split("|")[1].strip() for line in refit.splitlines()[2:]] == ["the model's own head", "1", "2"]


def test_loading_an_epoch_changes_the_model_to_that_epoch_s_weights(run):
    checkpoints = diagnosis.epoch_checkpoints(run)
    assert sorted(checkpoints) == [0, 1]
    model = diagnosis.load_model(run / "model")
    diagnosis.load_epoch(model, checkpoints[0])
    first = {name: value.clone() for name, value in model.state_dict().items()}
    diagnosis.load_epoch(model, checkpoints[1])
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, first[name])]
    assert any(name.startswith("fuser.") for name in changed) and any(name.startswith("head.") for name in changed)


def test_a_fresh_head_learns_what_the_fused_tokens_carry(run):
    """Fused tokens whose first feature, on every token, names the answer: the refit learns it."""
    model = diagnosis.load_model(run / "model")
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        labels = torch.randint(0, 2, (16,), generator=generator)
        fused = torch.randn(16, 5, model.config.fusion_dim, generator=generator) * 0.1
        fused[:, :, 0] += (labels.float() * 2 - 1)[:, None] * 3  # (Bq, Lt, D): the answer written on every token
        batches.append((fused, torch.ones(16, 5, dtype=torch.bool), labels, ["kind"] * 16))
    scores = diagnosis.refit_head(model, batches[:6], batches[6:], epochs=10, lr=1e-2, seed=0)
    assert scores[10]["kind"] == 1.0
    assert sorted(scores) == list(range(1, 11))


def test_a_run_without_epoch_checkpoints_and_a_missing_epoch_are_named(run, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"--run .*: no checkpoints/epoch=E-step=S.ckpt; train with --checkpoint.save_top_k -1"):
        diagnosis.epoch_checkpoints(tmp_path)
    monkeypatch.setattr(sys, "argv", ["stall_diagnosis.py", "--run", str(run), "--refit-epoch", "7"])
    with pytest.raises(SystemExit, match=r"--refit-epoch 7: the run has checkpoints of epochs \[0, 1\]"):
        diagnosis.main()
