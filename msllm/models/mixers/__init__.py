"""Token mixers: how a decoder layer mixes information across positions. One module per kind, each
built from the shared Cells (msllm/models/layers.py), never from the decoder.

Every mixer is a Cell with one interface, so a block takes any of them:

    mixer(x [b*s, h], cos, sin, mask, cache_k=None, cache_v=None, write=None)
        -> (out [b*s, h], cache_k, cache_v)

cache_k / cache_v are the two tensors the mixer keeps per layer for decoding (attention: each KV
head's keys and values; MLA: one latent and one rope key per token), written at the slots `write`
names; `cache_shapes` gives their shapes. Gated DeltaNet (linear attention) keeps its recurrent state
and conv window there instead (two more caches of a hybrid, stacked over its linear layers). Which mixer
a layer takes is data: ModelConfig.mixer_kinds().
Adding one: docs/architecture.md, "Adding a mixer".
"""
from __future__ import annotations

from msllm.config import ModelConfig
from msllm.models.mixers.attention import Attention
from msllm.models.mixers.gated_deltanet import GatedDeltaNet
from msllm.models.mixers.mla import MLA

MIXERS = {"gqa": Attention, "mla": MLA, "gated_deltanet": GatedDeltaNet}


def build_mixer(cfg: ModelConfig, kind: str):
    """The mixer Cell of a layer of kind `kind` (one of MIXERS)."""
    return MIXERS[kind](cfg)
