"""Integrations layer: packed rows inside the training stacks users already run.

``hf_model`` registers vlm_pack's attention and mask functions with transformers and switches a model to them
(``enable_packing``); ``trainer`` gives ``transformers.Trainer`` the exact token-mean loss; ``sft_trainer`` is
TRL's ``SFTTrainer`` with packed batches; ``evaluation`` splits packed predictions back per sample; ``sampler``
balances ranks through accelerate; ``token_mean`` guards the loss normalisation across devices; ``torch_loop``
is the same training step for a plain PyTorch loop.

Imports: ``core``, ``attention``, ``models`` and ``data``; transformers, accelerate and TRL are imported where used.
Never the paths (``offline``, ``budget``, ``preference``, ...) or the CLI, which build on this layer.
"""
