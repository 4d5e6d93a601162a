"""Tiny random configs of the decoder architectures onnxruntime-genai's model builder takes, as
Hugging Face config kwargs (no download): what the coverage run (turboquant/coverage.py) builds,
rewrites and runs. Each is the architecture's shape at its smallest (4 layers, 4 query and 2 KV
heads of 64; hybrids 6 layers) with the features that set it apart from Llama kept: sliding
windows, softcaps, sinks, partial or LongRoPE rotary, Q/K norms, conv or recurrent state layers.
"""

from __future__ import annotations

import dataclasses

COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=640, max_position_embeddings=1024,
              tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str  # the coverage table's row
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    architecture: str  # config.architectures[0], which selects genai's builder
    kwargs: dict = dataclasses.field(default_factory=dict)  # over COMMON
    window: bool = False  # some layers attend through a sliding window
    torch_export: bool = True  # exported by torch.onnx too (the coverage's TorchScript and dynamo rows)
    boundary: int = 1  # the rewrite's --boundary (0 where the model has only two attention layers)
    # a vision config's kwargs where genai's builder takes the architecture only as its vision-language
    # class (kwargs then the text config's); the builder builds the text decoder alone
    vision: dict | None = None

    def config_kwargs(self) -> dict:
        kw = {**COMMON, **self.kwargs}
        return {k: v for k, v in kw.items() if v is not None}


def _longrope(head_dim: int, original: int) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(half)],
            "long_factor": [1.0 + 0.1 * i for i in range(half)], "original_max_position_embeddings": original}


ARCHITECTURES = [
    Architecture("Llama", "llama", "LlamaForCausalLM"),
    Architecture("Mistral (no window)", "mistral", "MistralForCausalLM", dict(sliding_window=None)),
    Architecture("Mistral-7B-v0.1 style (window 4096)", "mistral", "MistralForCausalLM",
                 dict(sliding_window=4096, max_position_embeddings=8192), window=True),
    Architecture("Qwen2", "qwen2", "Qwen2ForCausalLM"),
    Architecture("Qwen3", "qwen3", "Qwen3ForCausalLM"),
    Architecture("Phi-3-mini-4k (window 2047)", "phi3", "Phi3ForCausalLM",
                 dict(sliding_window=2047, max_position_embeddings=4096, original_max_position_embeddings=4096,
                      head_dim=None), window=True),
    Architecture("Phi-4-mini (LongRoPE, partial rotary)", "phi3", "Phi3ForCausalLM",
                 dict(max_position_embeddings=4096, original_max_position_embeddings=1024, partial_rotary_factor=0.75,
                      rope_parameters=None, rope_scaling=None, head_dim=None, _longrope=True)),
    Architecture("Phi-2", "phi", "PhiForCausalLM", dict(partial_rotary_factor=0.5, head_dim=None)),
    Architecture("Gemma", "gemma", "GemmaForCausalLM"),
    Architecture("Gemma 2 (softcap, alternating window)", "gemma2", "Gemma2ForCausalLM",
                 dict(sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0), window=True),
    Architecture("Gemma 3 (5 of 6 layers windowed)", "gemma3_text", "Gemma3ForCausalLM",
                 dict(num_hidden_layers=6, sliding_window=16, sliding_window_pattern=6, rope_local_base_freq=10000.0),
                 window=True),
    # granite-3.x's multipliers (the config's defaults of 1.0 attend at scale 1, not the model's 1/64)
    Architecture("Granite", "granite", "GraniteForCausalLM",
                 dict(attention_multiplier=0.015625, embedding_multiplier=12.0, residual_multiplier=0.22,
                      logits_scaling=8.0)),
    Architecture("Olmo", "olmo", "OlmoForCausalLM"),
    Architecture("Nemotron", "nemotron", "NemotronForCausalLM", dict(partial_rotary_factor=0.5)),
    Architecture("Ernie 4.5", "ernie4_5", "Ernie4_5ForCausalLM"),
    Architecture("HunYuan dense", "hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    # not here: SmolLM3 (genai 0.18's builder stops on transformers 5's config: KeyError 'position_ids'),
    # ChatGLM and InternLM2 (remote code), the vision-language and MoE-hybrid classes
    # YaRN at factor 1: the checkpoint's factor 32 (of 4096 positions) on a 1024-position config scales the
    # rotary tables by YaRN's mscale, every score by 1.8, and a random model's attention then rests on
    # single keys, where 4-bit keys move its top-1 (67% teacher-forced, against 89% at factor 1)
    Architecture("gpt-oss (window, sinks, MoE)", "gpt_oss", "GptOssForCausalLM",
                 dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=256,
                      rope_parameters={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "original_max_position_embeddings": 1024, "rope_theta": 150000.0}),
                 window=True, torch_export=False),
    Architecture("LFM2 (conv + attention)", "lfm2", "Lfm2ForCausalLM",
                 dict(num_hidden_layers=6, full_attn_idxs=[2, 5], block_dim=256, block_ff_dim=512, conv_L_cache=3,
                      head_dim=None), torch_export=False, boundary=0),
    # Qwen3.5's text shape: gated DeltaNet (linear attention: conv and recurrent states) with a full
    # attention layer every third (the checkpoints have one every fourth: 6 layers would hold one), partial
    # interleaved MRoPE (a quarter of the head, its sections scaled to 8 frequencies); genai 0.18
    # builds it only from the vision-language class, whose vision tower is made as small as it goes
    Architecture("Qwen3.5 (gated DeltaNet + attention)", "qwen3_5", "Qwen3_5ForConditionalGeneration",
                 dict(num_hidden_layers=6, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                      linear_value_head_dim=64, linear_conv_kernel_dim=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
                 torch_export=False, boundary=0,
                 vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256,
                             num_position_embeddings=16)),
]


def by_name(name: str) -> Architecture:
    for a in ARCHITECTURES:
        if a.name == name:
            return a
    raise KeyError(name)
