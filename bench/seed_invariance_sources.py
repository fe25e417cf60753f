"""Where batch shape moves a row's logits, in process, with and without engine/hf/invariance.py.

For one prompt row, compares its next-token logits computed alone with the same row computed:
- gemm: in a decode step of 16 identical rows (no padding: only GEMM M differs);
- window: in a decode step whose KV window has 40 extra masked columns on the left;
- prefill: left-padded in a prefill group with longer prompts;
- sampling: the sampler's draw for the same logits row alone vs among 15 other rows.
Prints the largest |difference| of each, for plain SDPA / unpadded GEMM ("before") and for the
engine's batch-invariant path ("after": padded GEMM rows, exact attention rows).

Usage: ``python bench/seed_invariance_sources.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf import invariance
from tokenwire.engine.hf.sampling import RowSampler, sample

PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain in a few sentences why the sky is blue, as if to a curious ten-year-old child.",
]
PAD = 40


def forward(model, rows: list[list[int]], cache=None, past: int = 0, exact=()):
    """Left-padded forward of ``rows``; with ``cache`` a one-token decode over ``past`` columns."""
    n, p = len(rows), max(map(len, rows))
    ids = torch.zeros(n, p, dtype=torch.long)
    mask = torch.zeros(n, past + p, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, p - len(row) :] = torch.tensor(row)
        mask[i, past + p - len(row) :] = True
    if cache is not None:
        mask[:, :past] = cache.tokenwire_mask
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    cache = cache if cache is not None else DynamicCache()
    kwargs = {"exact_rows": exact} if exact else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        **kwargs,
    )
    cache.tokenwire_mask = mask
    return out.logits[:, -1], cache


def padded_cache(cache, extra: int):
    """The same KV with ``extra`` masked garbage columns prepended (a longer row elsewhere)."""
    padded = DynamicCache()
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        junk = torch.randn(k.shape[0], k.shape[1], extra, k.shape[3])
        padded.update(torch.cat([junk, k], 2), torch.cat([junk, v], 2), i)
    pad_mask = torch.zeros(cache.tokenwire_mask.shape[0], extra, dtype=torch.bool)
    padded.tokenwire_mask = torch.cat([pad_mask, cache.tokenwire_mask], 1)
    return padded


def measure(model, prompts: list[list[int]], exact: bool) -> dict[str, float]:
    worst = {"gemm": 0.0, "window": 0.0, "prefill": 0.0}
    for prompt in prompts:
        ref_logits, cache = forward(model, [prompt])
        token = [int(ref_logits[0].argmax())]
        n = len(prompt) + 1
        alone, _ = forward(model, [token], padded_cache(cache, 0), len(prompt), ((0, n),) * exact)
        many = [(i, n) for i in range(16)] if exact else ()
        batch = DynamicCache()
        for i, layer in enumerate(cache.layers):
            batch.update(layer.keys.repeat(16, 1, 1, 1), layer.values.repeat(16, 1, 1, 1), i)
        batch.tokenwire_mask = cache.tokenwire_mask.repeat(16, 1)
        gemm, _ = forward(model, [token] * 16, batch, len(prompt), tuple(many))
        window, _ = forward(
            model, [token], padded_cache(cache, PAD), len(prompt) + PAD, ((0, n),) * exact
        )
        worst["gemm"] = max(worst["gemm"], (gemm[0] - alone[0]).abs().max().item())
        worst["window"] = max(worst["window"], (window[0] - alone[0]).abs().max().item())
        if not exact:  # the engine prefills a seeded request alone
            longer = [p for p in prompts if len(p) > len(prompt)]
            if longer:
                group, _ = forward(model, [prompt, *longer])
                worst["prefill"] = max(
                    worst["prefill"], (group[0] - ref_logits[0]).abs().max().item()
                )
    return worst


def sampling_differences(vocab: int, trials: int = 200) -> int:
    """Draws that differ for the same logits row alone vs as row 7 of 16."""
    gen = torch.Generator().manual_seed(0)
    differ = 0
    for seed in range(trials):
        logits = torch.randn(16, vocab, generator=gen) * 3
        params = SamplingParams(max_tokens=1, temperature=1.0, seed=seed)
        alone = sample(
            logits[7:8].clone(), [RowSampler.create(params, [], (), vocab, logits.device)]
        )
        others = [
            RowSampler.create(
                SamplingParams(max_tokens=1, temperature=1.0), [], (), vocab, logits.device
            )
            for _ in range(16)
        ]
        others[7] = RowSampler.create(params, [], (), vocab, logits.device)
        batch = sample(logits, others)
        differ += alone.token_ids[0] != batch.token_ids[7]
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two prompts: does it run")
    args = parser.parse_args()
    model_dir = Path(prepare("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for q in PROMPTS[:2] if args.smoke else PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    invariance.register()
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        before = measure(model, prompts, exact=False)
        model.set_attn_implementation(invariance.ATTENTION)
        block = invariance.gemm_row_block(torch.device("cpu"))
        invariance.pad_linear_rows(model, block)
        after = measure(model, prompts, exact=True)
        draws = sampling_differences(model.config.vocab_size)
    print(f"max |logit difference| vs the row alone (GEMM row block {block}):")
    for name in before:
        print(f"  {name:8s} before {before[name]:.2e}   after {after[name]:.2e}")
    print(f"  sampling: {draws}/200 draws differ for identical logits (alone vs row 7 of 16)")


if __name__ == "__main__":
    main()
