"""A served-width Llama with the structure that makes trained LLMs' layers differ, planted into random weights.

    autoprec tune benchmarks/models/structured_llama/model.py --precisions bf16,fp8-rowwise --target h100

Random weights make every layer's FP8 noise cost about the same per byte (benchmarks/models/served_llama: every plan
lies on one curve), so planners cannot part ways on them. Trained LLMs differ layer by layer for reasons that are
known, and this model plants three of them, each in named layers, from a fixed seed (the recipe, :func:`plant`):

1. **Massive activations** (Sun et al., 2024): a few hidden channels carry values about 100x the rest in every token
   from an early layer on, and the norms after them carry small weights on those channels. Planted: residual
   channels ``MASSIVE_CHANNELS`` are written by layer ``MASSIVE_FROM``'s ``down_proj`` from one always-on MLP
   channel (its gate and up rows aligned with the constant direction the embeddings carry), about ``MASSIVE``x the
   typical channel; later norms scale them down by the same factor, as trained models' norms do. Every later
   layer's input then has an outlier channel: per-token FP8 input scales are set by it.
2. **Outlier input columns** in weights (the "super weights" of LLM.int8 / AWQ): a few input columns of
   ``OUTLIER_LAYERS``' ``o_proj`` and ``down_proj`` scaled ``OUTLIER``x, so each output row's FP8 weight scale is
   set by them and the rest of the row is quantized coarser *relative to its own values*. A weight-error planner
   sees these layers first.
3. **Errors the network amplifies**: layer ``SHARP_LAYER``'s attention is made sharp (its q and k rows scaled so
   the attention logits are ``SHARP``x larger: a softmax near one-hot), so small errors in q, k or their inputs
   change which token is attended to. Its weights look ordinary: only a planner that measures the output sees it.

Everything else is transformers' own initialisation from ``SEED``. The metric is output fidelity (the SQNR of the
logits against fp32), the batches random token ids. 4 layers at 2048 wide, MLP 8192, 16 heads over 4 KV heads,
vocabulary 2048: about 0.9 GB in fp32.
"""

import importlib.util
from pathlib import Path

import torch

SERVED = Path(__file__).resolve().parents[1] / "served_llama" / "model.py"
SETTINGS = {"layers": 4, "width": 2048, "mlp": 8192, "heads": 16, "kv_heads": 4, "vocab": 2048}
SEED = 0
SEQ_LEN = 32
BATCH_SIZE = 2
N_BATCHES = 4  # 3 to search on, 1 held out; benchmarks score on the batches after these

MASSIVE = 100.0  # the massive channels' size against a typical residual channel
MASSIVE_CHANNELS = (17, 1401)
MASSIVE_FROM = 1  # the layer whose down_proj writes them
OUTLIER = 40.0
OUTLIER_COLUMNS = 4  # columns per planted weight
OUTLIER_LAYERS = (2,)
SHARP = 60.0  # how much larger the planted layer's attention logits are
SHARP_LAYER = 1


def config():
    from transformers import LlamaConfig

    s = SETTINGS
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["mlp"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=False)


@torch.no_grad()
def plant(model: torch.nn.Module) -> torch.nn.Module:
    """Plant the three structures of the module docstring into ``model`` (a LlamaForCausalLM of :func:`config`)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    _massive(model, gen)
    layers = model.model.layers
    for i in OUTLIER_LAYERS:  # 2. outlier input columns
        for linear in (layers[i].self_attn.o_proj, layers[i].mlp.down_proj):
            cols = torch.randperm(linear.in_features, generator=gen)[:OUTLIER_COLUMNS]
            linear.weight[:, cols] *= OUTLIER
    attn = layers[SHARP_LAYER].self_attn  # 3. sharp attention: q and k each by sqrt(SHARP), the logits by SHARP
    attn.q_proj.weight *= SHARP ** 0.5
    attn.k_proj.weight *= SHARP ** 0.5
    return model


def _massive(model: torch.nn.Module, gen: torch.Generator) -> None:
    """1. A constant direction in every token's embedding keeps one MLP channel of layer MASSIVE_FROM on; its
    down_proj column writes MASSIVE x the typical residual channel into MASSIVE_CHANNELS, measured on a batch."""
    layers, embed = model.model.layers, model.model.embed_tokens.weight
    direction = torch.randn(embed.shape[1], generator=gen)
    direction /= direction.norm()
    embed += 3 * embed.std() * embed.shape[1] ** 0.5 * direction  # as large as the token's own part, 3x
    mlp = layers[MASSIVE_FROM].mlp
    mlp.gate_proj.weight[0] = direction * 8.0  # intermediate channel 0: on for every token
    mlp.up_proj.weight[0] = direction * 8.0
    mlp.down_proj.weight[:, 0] = 0.0
    seen = {}

    def on(module, args):
        seen["on"] = args[0][..., 0].mean()

    def residual(module, args, kwargs):
        seen["residual"] = (args[0] if args else kwargs["hidden_states"]).abs().median()

    hooks = [mlp.down_proj.register_forward_pre_hook(on),
             layers[MASSIVE_FROM].register_forward_pre_hook(residual, with_kwargs=True)]
    try:
        model(**get_batches(1)[0])
    finally:
        for hook in hooks:
            hook.remove()
    for c in MASSIVE_CHANNELS:
        mlp.down_proj.weight[c, 0] = MASSIVE * seen["residual"] / seen["on"]
    for later in layers[MASSIVE_FROM + 1:]:  # trained norms carry small weights on the massive channels
        for norm in (later.input_layernorm, later.post_attention_layernorm):
            norm.weight[list(MASSIVE_CHANNELS)] /= MASSIVE
    model.model.norm.weight[list(MASSIVE_CHANNELS)] /= MASSIVE


def get_model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(SEED)  # the same weights in every process that builds it
    return plant(transformers.LlamaForCausalLM(config()).eval())


def get_batches(n_batches: int = N_BATCHES, batch_size: int = BATCH_SIZE, start: int = 0) -> list:
    """``n_batches`` batches of random token ids, from the ``start``-th on: served_llama's (the same vocabulary and
    length), loaded from its model.py."""
    spec = importlib.util.spec_from_file_location("served_llama_model", SERVED)
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    return served.get_batches(n_batches, batch_size, start)
