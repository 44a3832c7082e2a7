"""FiLM (E. Perez, F. Strub, H. de Vries, V. Dumoulin, A. Courville, "FiLM: Visual Reasoning with a
General Conditioning Layer", AAAI 2018): a question GRU predicts a per-channel scale and shift for
each residual block of a CNN over the image.

The layout follows the paper's model from raw pixels: a strided convolutional stem; residual blocks
[coordinates -> conv 1x1 -> ReLU -> conv 3x3 -> BatchNorm without affine -> FiLM -> ReLU -> + the
1x1 output]; a classifier [coordinates -> conv 1x1 -> BatchNorm -> ReLU -> global max pool -> MLP].
The sizes are scaled down for easy-VQA on two CPU cores (the paper: 128 channels, a 4096-unit GRU,
a 512-channel classifier and a 1024-unit MLP, for CLEVR).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence


def coordinate_maps(batch: int, height: int, width: int, *, device=None, dtype=None) -> torch.Tensor:
    """The relative x and y position of each cell, from -1 to 1: (batch, 2, height, width)."""
    ys = torch.linspace(-1.0, 1.0, height, device=device, dtype=dtype)
    xs = torch.linspace(-1.0, 1.0, width, device=device, dtype=dtype)
    grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"))  # (2, H, W): x then y
    return grid.expand(batch, -1, -1, -1)


def with_coordinates(features: torch.Tensor) -> torch.Tensor:
    """``features`` (B, C, H, W) with the two coordinate maps appended: (B, C + 2, H, W)."""
    b, _, h, w = features.shape
    return torch.cat([features, coordinate_maps(b, h, w, device=features.device, dtype=features.dtype)], dim=1)


class FiLM(nn.Module):
    """Feature-wise linear modulation: ``gamma * x + beta``, one scale and shift per channel and example."""

    def forward(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """``x`` (B, C, H, W) modulated by ``gamma`` and ``beta`` (B, C)."""
        return gamma[:, :, None, None] * x + beta[:, :, None, None]


class FiLMedResBlock(nn.Module):
    """The paper's residual block: the question acts through the FiLM after the 3x3 convolution.

    Args:
        channels: feature maps in and out.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels + 2, channels, 1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels, affine=False)  # FiLM supplies the affine part
        self.film = FiLM()

    def forward(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """``x`` (B, C, H, W) -> (B, C, H, W), conditioned by ``gamma`` and ``beta`` (B, C)."""
        shortcut = torch.relu(self.conv1(with_coordinates(x)))
        return shortcut + torch.relu(self.film(self.norm(self.conv2(shortcut)), gamma, beta))


class QuestionGRU(nn.Module):
    """Word embeddings and a GRU; the question is the GRU's state after its last word.

    Args:
        vocab_size: size of the word vocabulary (id 0 is padding).
        embed_dim: size of the word embeddings.
        hidden: size of the GRU state.
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.gru = nn.GRU(embed_dim, hidden, batch_first=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``input_ids`` (Bq, L), right-padded -> the last state (Bq, hidden)."""
        lengths = attention_mask.sum(dim=1).cpu()
        packed = pack_padded_sequence(self.embed(input_ids), lengths, batch_first=True, enforce_sorted=False)
        _, last = self.gru(packed)  # (1, Bq, hidden)
        return last[0]


class FiLMNet(nn.Module):
    """FiLM for VQA from raw pixels (Perez et al. 2018), sized for small images.

    The stem (strided 4x4 convolutions, each halving the side) sees each image once; every question
    then runs the FiLM-ed blocks on its image's stem features. Each block's scale is predicted as
    ``1 + delta`` (our choice: an untrained block starts close to an unconditioned one).

    Args:
        vocab_size: size of the word vocabulary (id 0 is padding).
        num_answers: number of answer classes.
        width: channels of the stem and the residual blocks.
        blocks: number of FiLM-ed residual blocks (4 in the paper).
        stem_layers: strided stem convolutions: a 32x32 image with 2 becomes an 8x8 grid.
        classifier_channels: channels of the classifier's 1x1 convolution.
        hidden: units of the classifier's hidden layer.
        embed_dim: size of the word embeddings.
        gru_hidden: size of the question GRU's state.
    """

    def __init__(
        self,
        vocab_size: int,
        num_answers: int,
        *,
        width: int = 64,
        blocks: int = 4,
        stem_layers: int = 2,
        classifier_channels: int = 256,
        hidden: int = 256,
        embed_dim: int = 64,
        gru_hidden: int = 128,
    ) -> None:
        super().__init__()
        stem: list[nn.Module] = []
        for layer in range(stem_layers):
            stem += [nn.Conv2d(3 if layer == 0 else width, width, 4, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        self.stem = nn.Sequential(*stem)
        self.question = QuestionGRU(vocab_size, embed_dim, gru_hidden)
        self.film_params = nn.Linear(gru_hidden, blocks * 2 * width)  # (gamma delta, beta) of every block
        self.blocks = nn.ModuleList(FiLMedResBlock(width) for _ in range(blocks))
        self.classifier_conv = nn.Sequential(
            nn.Conv2d(width + 2, classifier_channels, 1), nn.BatchNorm2d(classifier_channels), nn.ReLU()
        )
        self.classifier = nn.Sequential(
            nn.Linear(classifier_channels, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, num_answers)
        )

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_index: torch.Tensor
    ) -> torch.Tensor:
        """Answer logits (Bq, num_answers) for images (Bi, 3, S, S) in [0, 1] and questions (Bq, L)."""
        features = self.stem(pixel_values - 0.5)[image_index]  # (Bq, C, h, w)
        params = self.film_params(self.question(input_ids, attention_mask))
        params = params.view(len(params), len(self.blocks), 2, -1)  # (Bq, blocks, 2, C)
        for i, block in enumerate(self.blocks):
            features = block(features, 1.0 + params[:, i, 0], params[:, i, 1])
        pooled = self.classifier_conv(with_coordinates(features)).amax(dim=(2, 3))  # (Bq, classifier_channels)
        return self.classifier(pooled)
