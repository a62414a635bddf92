"""Perplexity of a model over a text, and the KL divergence of its next-token distributions from a
reference model's, computed the way llama.cpp's `llama-perplexity` computes them:

    tokens = tokenize(text)                      (no BOS: added only where the model's tokenizer does)
    chunks = consecutive windows of n_ctx tokens (the remainder is dropped)
    in each chunk, positions n_ctx/2 .. n_ctx-2 are scored: the first half is context only
    PPL = exp(mean NLL of the scored tokens);  KLD = mean over scored positions of KL(P_ref || P)

so a model quantized by llmserve and the same file run by `llama-perplexity --kl-divergence`
give comparable figures. `top1` is the share of scored positions where both models rank the
same token first (llama.cpp's "Same top p"). Uncertainties are standard errors of the mean.

Does not know HTTP or the scheduler: it runs a `ForwardRunner` directly, one chunk at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from llmserve.layers.attention import KVDtypes
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import LoadedModel


@dataclass(frozen=True, slots=True)
class QualityResult:
    num_chunks: int
    num_scored: int
    ppl: float
    ppl_stderr: float
    """Standard error of PPL (propagated from the mean NLL's)."""
    ref_ppl: float | None = None
    kld: float | None = None
    """Mean KL(P_ref || P) in nats."""
    kld_stderr: float | None = None
    kld_p99: float | None = None
    top1: float | None = None
    """Share of scored positions whose top token agrees with the reference's."""

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    def summary(self) -> str:
        text = f"PPL {self.ppl:.4f} ± {self.ppl_stderr:.4f} over {self.num_scored} tokens ({self.num_chunks} chunks)"
        if self.kld is not None:
            text += (
                f"; reference PPL {self.ref_ppl:.4f}; mean KLD {self.kld:.6f} ± {self.kld_stderr:.6f}, "
                f"99th percentile {self.kld_p99:.6f}; same top token {100 * self.top1:.2f}%"
            )
        return text


def _chunk_logprobs(runner: ForwardRunner, chunk: list[int], first: int) -> torch.Tensor:
    """log-softmax rows first .. n-2 of a chunk run as one prompt: [n - 1 - first, vocab], on the
    host (where the targets are, and where the reference's rows meet these)."""
    blocks = list(range(-(-len(chunk) // runner.block_size)))
    logits = runner.execute([SequenceBatchEntry(chunk, len(chunk), blocks)], all_logits=True)
    return torch.log_softmax(logits[first:-1].double(), dim=-1).cpu()


def _runner(
    loaded: LoadedModel, n_ctx: int, kv_cache_dtype: torch.dtype | KVDtypes | None = None
) -> ForwardRunner:
    return ForwardRunner(
        loaded.model, num_blocks=-(-n_ctx // 16), block_size=16, kv_cache_dtype=kv_cache_dtype
    )


def evaluate(
    model: LoadedModel,
    token_ids: list[int],
    n_ctx: int = 512,
    reference: LoadedModel | None = None,
    progress: Callable[[int, int], None] | None = None,
    kv_cache_dtype: torch.dtype | KVDtypes | None = None,
) -> QualityResult:
    """PPL of `model` over `token_ids` in chunks of `n_ctx` (and the KL divergence from
    `reference`'s distributions, which sees the very same chunks). `kv_cache_dtype`: the model
    under test's KV cache (default: its dtype); the reference keeps its own dtype's."""
    if n_ctx < 4 or n_ctx > model.max_model_len:
        raise ValueError(f"n_ctx must be between 4 and the model's {model.max_model_len} tokens; got {n_ctx}")
    num_chunks = len(token_ids) // n_ctx
    if num_chunks == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens: fewer than one chunk of n_ctx={n_ctx}")
    first = n_ctx // 2
    runner = _runner(model, n_ctx, kv_cache_dtype)
    ref_runner = _runner(reference, n_ctx) if reference is not None else None
    nll: list[torch.Tensor] = []
    ref_nll: list[torch.Tensor] = []
    kld: list[torch.Tensor] = []
    agree: list[torch.Tensor] = []
    for c in range(num_chunks):
        chunk = token_ids[c * n_ctx : (c + 1) * n_ctx]
        targets = torch.tensor(chunk[first + 1 :])
        logp = _chunk_logprobs(runner, chunk, first)
        nll.append(-logp.gather(1, targets[:, None])[:, 0])
        if ref_runner is not None:
            ref = _chunk_logprobs(ref_runner, chunk, first)
            ref_nll.append(-ref.gather(1, targets[:, None])[:, 0])
            kld.append((ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0))
            agree.append((ref.argmax(-1) == logp.argmax(-1)).double())
        if progress is not None:
            progress(c + 1, num_chunks)
    all_nll = torch.cat(nll)
    n = all_nll.numel()
    mean, stderr = float(all_nll.mean()), float(all_nll.std() / math.sqrt(n))
    ppl = math.exp(mean)
    result = QualityResult(num_chunks, n, ppl, ppl * stderr)
    if ref_runner is None:
        return result
    all_kld = torch.cat(kld)
    return QualityResult(
        num_chunks,
        n,
        ppl,
        ppl * stderr,
        ref_ppl=math.exp(float(torch.cat(ref_nll).mean())),
        kld=float(all_kld.mean()),
        kld_stderr=float(all_kld.std() / math.sqrt(n)),
        kld_p99=float(torch.quantile(all_kld, 0.99)),
        top1=float(torch.cat(agree).mean()),
    )
