"""The character model for Shakespeare next-character prediction (LEAF; FedAvg paper Section 3):
embedding of 8 dimensions, a 2-layer LSTM with 256 units, the last step's hidden state as the
features z (256), then the linear classifier over the characters."""

from __future__ import annotations

import torch
from torch import nn

from fedskew.models.nets import ModelError, SkewNet


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x.long()))
        return out[:, -1]


def lstm(input_shape, num_classes, bias=True, *, hidden: int = 256) -> SkewNet:
    """Inputs: sequences of character indices ``[N, T]``; the vocabulary is the class set."""
    if len(input_shape) != 1:
        raise ModelError(f"model 'lstm' reads character sequences [T], not input shape {tuple(input_shape)}; "
                         f"use it with dataset=shakespeare.")
    return SkewNet(CharLSTM(num_classes, hidden=hidden), hidden, num_classes, bias)
