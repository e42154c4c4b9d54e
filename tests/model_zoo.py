"""Small, seeded model builders shared by the test suite.

Every builder seeds torch, puts the model in eval mode and returns
``(model, example_inputs)`` where ``example_inputs`` is a tuple, so that tests can call
``model(*inputs)`` or ``tl.trace(model, *inputs)``. Sizes are tiny on purpose: the whole
suite runs on two CPU cores.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "BUILDERS",
    "RepeatedBlock",
    "cnn",
    "gpt2",
    "llama",
    "lstm_model",
    "mlp",
    "repeated_block",
]


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Linear → ReLU → Linear → ReLU → Linear, on a batch of 4 eight-feature rows."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    ).eval()
    x = torch.randn(4, 8)
    return model, (x,)


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, kernel_size=3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.head(x)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Conv/BatchNorm/ReLU/pool twice, then a linear head; eval mode (running stats)."""
    torch.manual_seed(0)
    model = _SmallCNN()
    # Non-trivial running statistics, so eval-mode batch norm does real work.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    return model, (x,)


class _LSTMModel(nn.Module):
    def __init__(self, vocab: int = 20, embed: int = 8, hidden: int = 12, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        out, (_h, _c) = self.lstm(x)
        return self.head(out[:, -1])


def lstm_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Embedding → single-layer LSTM → linear head on the last step; input is token ids."""
    torch.manual_seed(0)
    model = _LSTMModel().eval()
    input_ids = torch.randint(0, 20, (2, 5))
    return model, (input_ids,)


def gpt2(n_layer: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A GPT-2 LM (two layers unless ``n_layer``) with random weights (transformers), SDPA
    attention, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config).eval()
    input_ids = torch.randint(1, 64, (1, 8))
    return model, (input_ids,)


def llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A four-layer LLaMA LM with random weights (transformers), eager attention, eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    return model, (torch.randint(1, 64, (1, 8)),)


class RepeatedBlock(nn.Module):
    """Runs ``block`` ``repeats`` times in a loop (the same weights each time), then a head."""

    def __init__(self, width: int = 8, repeats: int = 3):
        super().__init__()
        self.repeats = repeats
        self.proj = nn.Linear(6, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for _ in range(self.repeats):
            h = self.block(h) + h
        return self.head(torch.relu(h))


def repeated_block() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A model whose forward calls one submodule (``block``) three times, then more ops."""
    torch.manual_seed(0)
    model = RepeatedBlock().eval()
    x = torch.randn(3, 6)
    return model, (x,)


BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    "lstm": lstm_model,
    "gpt2": gpt2,
    "repeated_block": repeated_block,
}
