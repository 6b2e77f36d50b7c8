"""Synthetic RL training: consecutive FP32 master versions as AdamW makes them, at any size.

Every compression number rollpatch publishes is measured on versions from this module, so the
choices below are the ones a reviewer should check. Nothing here is fitted to a particular
checkpoint; the constants are round numbers typical of public 0.1B-7B Llama-family models.

**Layout.** A Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP, untied ``lm_head``)
sized to hit ``n_params``: depth follows the TinyLlama / Llama-2 aspect ratio
(layers ≈ 0.5·√hidden), ``intermediate ≈ 8/3·hidden`` rounded as Llama does, head_dim 64
(128 above hidden 2048), kv heads = heads/4, vocabulary 32000 unless given. 1B → hidden
1792, 26 layers, ff 4864, 28 heads / 7 kv heads (1.003B).

**Weights.** Linear weights are ``σ_t · a_i · b_j · z`` with ``σ_t`` per role (q/k ~0.025-0.03
and larger in early layers, v/o ~0.012, MLP ~0.016-0.02, embeddings ~0.018, lm_head 0.02)
times a per-tensor lognormal(0, 0.15); row and column scales ``a, b`` lognormal (0.2, 0.25);
``z`` a standard normal pushed to heavier tails (``z + 0.03·z³``, kurtosis ≈ 3.9 before the
row/column mixing). Norm weights are ``μ_t · exp(0.1·z)``, ``μ_t`` lognormal(0, 0.15)
around 1. All per-element draws (weights, warm state, gradient noise) go through 65,536-entry
quantile tables indexed by uniform 16-bit integers: 4-8x faster than numpy's normal sampler,
and the products with continuous row/column scales hide the quantisation.

**Gradients** (fresh every step, generated per tensor and per chunk, never materialised for
the whole model)::

    g_ij = s_t · ρ_i · γ_j · (ε_ij + P_ij + L_t,ij)

``s_t``: per-tensor scale with step-to-step lognormal(0, 0.2) jitter; ``ρ_i`` per-row
lognormal(0, 0.4); ``γ_j`` per input channel: tensors reading the residual stream share one
hidden-channel profile (lognormal(0, 0.3) plus 0.5% outlier channels ×3-6, like the massive
activations of real LLMs); ``ε``: i.i.d. heavy-tailed unit noise (``q + 0.1·q³``, kurtosis
≈ 6.6, tails cut at ≈ 10σ by the table); ``P``: a persistent rank-2 direction with RMS
0.15 (what gives ``m`` a mean, i.e. consistent progress); ``L_t``: a fresh rank-4 component
with RMS 0.5 (batch structure). The noise dominates, as it does at RL batch sizes, so
``|update|/lr`` has RMS ≈ 0.25 (pure noise would give √((1-β1)/(1+β1)) ≈ 0.23).

**Calibration.** The one public anchor is the share of BF16 values that change per step:
PULSE reports ~1% at RL learning rates for 0.5B-7B models. This model gives ~1.2% at
lr 1e-6, ~3% at 3e-6 and ~8% at 1e-5 (100M-1B sizes); the share grows about linearly with
lr and falls with |w| (halving per binade), as rounding arithmetic says it must.

**Embedding rows are touched sparsely.** Each step draws a batch of ``batch_tokens`` tokens
from a Zipf-Mandelbrot law (exponent 1.1, 30% of the vocabulary "out of domain" at 1e-3 of
its frequency, frequency rank correlated with token id as in BPE vocabularies); row ``i``
gets gradient only if its token occurs, scaled by √count. Untouched rows still move by
momentum, as under real AdamW with a dense optimizer. ``lm_head`` gets dense gradient
(the softmax touches every row).

**Adam state is pre-warmed analytically** so that step 1 of the simulator is step
``warm_steps + 1`` of a run in its stationary regime, with the bias corrections torch would
use at that step: ``m`` is the EMA's stationary law (mean ``(1-β1^T)·E[g]``, Gaussian noise of
variance ``(1-β1)/(1+β1)·Var[g]``), ``v = (1-β2^T)·E[g²]`` times a chi-square-like jitter of
the right size for the EMA's effective sample count. The last 64 steps are sampled
explicitly per tensor (its gradient-scale jitter) and, for embedding rows, per row (which
steps touched the token: a rare token touched now gets the large Adam update it gets in
reality); older touches enter as a Binomial count with a Gamma-distributed weight sum, so a
token never seen has ``m = v = 0``. ``warm_steps=0`` gives a cold start (``m = v = 0``) instead.

**Arithmetic** is torch's single-tensor AdamW, in float32, in place, in chunks of at most
4 Mi elements (16 MiB): ``w *= 1-lr·wd; m += (1-β1)(g-m); v = β2·v + ((1-β2)·g)·g;
w += (-lr/bc1)·m / (√v/√bc2 + eps)``. It matches ``torch.optim.AdamW`` to float32 rounding
(bitwise on most elements; torch fuses its ``lerp`` with an FMA, numpy cannot).

**Determinism.** Every random draw comes from a PCG64 generator seeded by
``(seed, tensor, purpose, step, chunk)``, with chunk boundaries fixed by the tensor's shape,
so results do not depend on the thread count or on the order tensors are processed in.
They are bitwise reproducible on one numpy/BLAS build; other CPUs may differ in the last bit
of the low-rank products and of ``exp``.

**Mixture of experts** (``SimConfig.moe``, :mod:`rollpatch.sim.moe`): Qwen3-MoE tensor names,
a router per MoE layer updated every step, and per-step Poisson token counts per expert from a
skewed routing law (or a measured load); an expert's gradient scales with √count and is zero on
steps that route nothing to it. Dense tensors do not depend on the routing at all.

Memory is the 12 bytes/parameter of FP32 ``w, m, v`` plus a few chunk temporaries per thread
(experts included: there is no cheaper state for rarely routed experts).
"""

from .adam import AdamSim, simulate
from .config import ModelDims, SimConfig, llama_dims
from .moe import MoEConfig, expert_shares, moe_dims

__all__ = [
    "AdamSim",
    "MoEConfig",
    "ModelDims",
    "SimConfig",
    "expert_shares",
    "llama_dims",
    "moe_dims",
    "simulate",
]
