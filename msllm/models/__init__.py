"""The model as MindSpore Cells, plain maths described by the family spec (ModelConfig):

layers.py   the shared Cells: linear, embedding, norms, RoPE kinds, attention core, MLP kinds, losses
mixers/     one module per token mixer (attention, MLA), chosen per layer by the spec
moe.py      routers, stacked experts, dispatchers, shared experts, routing statistics
decoder.py  Block and Decoder, composed per layer from the spec: the only decoder
"""
