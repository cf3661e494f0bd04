"""A sparse autoencoder on an activation dataset: `collect_dataset` writes a corpus' residual stream at one block
to shards, and a small SAE is trained on them with plain PyTorch, the shards read through a DataLoader.

The SAE is the usual one: ``features = relu(W_enc (x - b_dec) + b_enc)``,
``x_hat = W_dec features + b_dec``, trained on the mean squared error plus an
L1 penalty on the features weighted by their decoder columns' norms; inputs
are scaled so their mean squared norm is ``d_in``.

    python examples/train_sae.py                  # the built-in SmolLM2, block 8, 100k tokens of TinyStories from the hub
    python examples/train_sae.py --corpus corpus.jsonl --layer 12 --max-tokens 1000000 --expansion 16
    python examples/train_sae.py --tiny           # a tiny random Llama on a few sentences (needs vlenvoys-testing), as CI runs it

``--corpus`` is anything `vlenvoys.activations.collect_dataset` reads: a text or
.jsonl file, a folder from datasets' save_to_disk, or ``hf:NAME`` (streamed from
the Hugging Face hub; needs the ``datasets`` package). A rerun continues the
collection where it stopped, or finds it complete. Writes ``activations/`` (the
shards), ``sae.safetensors``, ``train_sae.png`` (loss, unexplained variance and
active features per step) and ``train_sae.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import vlenvoys
from matplotlib.figure import Figure
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from vlenvoys.activations import Activations, collect_dataset

#: The corpus of --tiny: a tiny random model reads anything alike, so a few sentences, repeated, do.
SENTENCES = [
    "The sun rose over the quiet village and the birds began to sing.",
    "A small boat drifted slowly across the lake in the morning mist.",
    "She opened the old book and found a letter hidden between its pages.",
    "The children ran to the park to play football with their friends.",
    "After the rain, the streets shone under the yellow lights of the town.",
    "He baked bread every morning before the shop opened its doors.",
    "The train to the city was late again, so they waited on the platform.",
    "In the garden, tomatoes and beans grew tall beside the fence.",
]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="the corpus (default: hf:roneneldan/TinyStories; with --tiny, a few sentences)")
    parser.add_argument("--split", help="the corpus' split, where it has several (default for the hub's TinyStories: train)")
    parser.add_argument("--layer", type=int, help="the block whose layer_output is learnt (default: 8; with --tiny, 1)")
    parser.add_argument("--context-length", type=int, help="tokens per window (default: 128; with --tiny, 32)")
    parser.add_argument("--max-tokens", type=int, help="tokens of windows collected (default: 100000; with --tiny, 4096)")
    parser.add_argument("--expansion", type=int, default=8, help="features per dimension of the stream")
    parser.add_argument("--l1", type=float, default=1e-2, help="the L1 penalty's coefficient")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the shards, the SAE, the plot and the results")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the built-in model (for CI)")
    options = parser.parse_args(argv)
    options.context_length = options.context_length or (32 if options.tiny else 128)
    options.max_tokens = options.max_tokens or (4096 if options.tiny else 100_000)
    return options


def load(tiny: bool, out: Path) -> vlenvoys.StandardizedVLLM:
    """The built-in SmolLM2-135M-Instruct, or with ``tiny`` a tiny random Llama built into ``out``."""
    if not tiny:
        return vlenvoys.load()
    import vlenvoys_testing  # test support: tiny random checkpoints with a tokenizer

    return vlenvoys.load(str(vlenvoys_testing.tiny_model("LlamaForCausalLM", out / "tiny-llama")))


class SparseAutoencoder(torch.nn.Module):
    def __init__(self, d_in: int, d_sae: int) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(d_in, d_sae)
        self.decoder = torch.nn.Linear(d_sae, d_in)
        with torch.no_grad():  # decoder columns of norm 0.1, the encoder their transpose, no biases
            self.decoder.weight *= 0.1 / self.decoder.weight.norm(dim=0, keepdim=True)
            self.encoder.weight.copy_(self.decoder.weight.T)
            self.encoder.bias.zero_()
            self.decoder.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu(self.encoder(x - self.decoder.bias))
        return self.decoder(features), features


def train(data: Activations, key: str, d_in: int, options: argparse.Namespace) -> tuple[SparseAutoencoder, float, dict[str, list[float]]]:
    """The SAE, the inputs' scale and each step's loss, unexplained variance and active features."""
    torch.manual_seed(0)
    loader = DataLoader(data, batch_size=None)  # the dataset gives whole shuffled batches
    first = next(iter(loader))[key].float()
    scale = float((d_in / first.pow(2).sum(-1).mean()).sqrt())
    sae = SparseAutoencoder(d_in, options.expansion * d_in)
    optimizer = torch.optim.Adam(sae.parameters(), lr=options.lr)
    history: dict[str, list[float]] = {"loss": [], "unexplained_variance": [], "active_features": []}
    for epoch in range(options.epochs):
        data.set_epoch(epoch)
        for batch in loader:
            x = batch[key].float() * scale
            reconstruction, features = sae(x)
            error = (reconstruction - x).pow(2).sum(-1)
            sparsity = (features * sae.decoder.weight.norm(dim=0)).sum(-1)
            loss = error.mean() / d_in + options.l1 * sparsity.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history["loss"].append(loss.item())
            history["unexplained_variance"].append((error.sum() / (x - x.mean(0)).pow(2).sum()).item())
            history["active_features"].append((features > 0).float().sum(-1).mean().item())
    return sae, scale, history


def plot(history: dict[str, list[float]], title: str, path: Path) -> Path:
    figure = Figure(figsize=(10, 4), layout="constrained")
    left, right = figure.subplots(1, 2)
    steps = range(1, len(history["loss"]) + 1)
    left.plot(steps, history["loss"], label="loss")
    left.plot(steps, history["unexplained_variance"], label="unexplained variance")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.legend()
    right.plot(steps, history["active_features"], color="tab:purple")
    right.set_xlabel("step")
    right.set_ylabel("active features per token (L0)")
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    options = arguments(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    corpus = options.corpus or (SENTENCES * 40 if options.tiny else "hf:roneneldan/TinyStories")
    split = options.split or ("train" if corpus == "hf:roneneldan/TinyStories" else None)
    model = load(options.tiny, options.out)
    try:
        layer = options.layer if options.layer is not None else (1 if options.tiny else 8)
        # The residual stream at one block of every window, without the BOS tokens (whose stream is unlike
        # every other token's), stored in bfloat16; 1/4 of the windows' tokens a shard.
        shards = collect_dataset(
            model, corpus, options.out / "activations", "layer_output", layer, context_length=options.context_length,
            split=split, positions="no_bos", max_tokens=options.max_tokens, shard_tokens=max(options.max_tokens // 4, options.context_length),
        )
        d_in = model.hidden_size
    finally:
        vlenvoys.shutdown(model)
    (key,) = shards.keys
    data = Activations(shards.folder, batch_size=options.batch_size, shuffle=True, keys=key, drop_last=True)
    sae, scale, history = train(data, key, d_in, options)
    save_file({name: tensor.detach().contiguous() for name, tensor in sae.state_dict().items()}, str(options.out / "sae.safetensors"),
              metadata={"key": key, "input_scale": str(scale)})
    plot(history, f"SAE on {key}: {len(shards)} tokens, {options.expansion * d_in} features", options.out / "train_sae.png")
    results = {
        "key": key,
        "tokens": len(shards),
        "features": options.expansion * d_in,
        "steps": len(history["loss"]),
        "first_loss": history["loss"][0],
        "last_loss": history["loss"][-1],
        "unexplained_variance": history["unexplained_variance"][-1],
        "active_features": history["active_features"][-1],
    }
    (options.out / "train_sae.json").write_text(json.dumps(results, indent=1))
    print(f"{results['steps']} steps on {results['tokens']} tokens of {key}: loss {results['first_loss']:.3g} -> "
          f"{results['last_loss']:.3g}, unexplained variance {results['unexplained_variance']:.3f}, "
          f"{results['active_features']:.1f} active features per token")
    print(f"wrote {options.out / 'train_sae.png'}")
    return results


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
