"""``peerd generate``: sample text from a model file written by ``peerd fetch``."""

from __future__ import annotations

import click

from peerd.cli.options import command


@command("""
  peerd generate out/model.pt --prompt "Once upon a time"
  peerd generate out/ --prompt "To be" --max-new-tokens 50 --temperature 0.8 --top-k 40
  peerd generate out/model.pt --prompt "The " --temperature 0        greedy: always the same text
""")
@click.argument("checkpoint", metavar="CHECKPOINT", type=click.Path(exists=True))
@click.option("--prompt", required=True, help="Text the model continues (UTF-8; peerd's tokens are bytes).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=200, help="Bytes to generate.")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=1.0,
    help="Divide the logits by this before sampling: lower is more conservative, 0 is greedy.",
)
@click.option(
    "--top-k", type=click.IntRange(min=1), default=None, help="Sample only among the K most likely bytes."
)
@click.option("--seed", type=int, default=0, help="Seed of the sampler: the same seed gives the same text.")
def generate(
    checkpoint: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> None:
    """Print PROMPT continued by the model in CHECKPOINT (a ``model.pt`` from ``peerd fetch``, or its directory).

    The text goes to stdout (prompt included); the model runs on the CPU, seeing at most its
    max_seq_len last bytes.
    """
    from peerd.models.checkpoint import open_checkpoint
    from peerd.models.sampling import SamplingConfig, decode, encode, sample

    ck = open_checkpoint(checkpoint)  # ConfigError (exit 2) for a file that is not a model file
    config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    ids = sample(ck.model, encode(prompt), config, context=ck.family.max_seq_len)
    click.echo(decode(ids))
